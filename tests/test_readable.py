"""No method or class is replaced on an instance anywhere in minizero/ (techniques compose through seams).

The rule, checked on the source's syntax tree (``ast``), is kept simple:

* ``object.__setattr__(x, "name", ...)`` or ``setattr(x, "name", ...)`` where ``"name"`` is a string
  constant naming a method: ``forward``, ``backward``, or any name defined with ``def`` in a class of
  minizero/ (data attributes such as ``"training"`` or ``"_modules"`` are allowed);
* any assignment to ``x.__class__`` (or the string ``"__class__"`` in the calls above);
* any assignment to an attribute named ``forward`` or ``backward`` (``x.forward = ...``).
"""
import argparse
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "minizero"
ALWAYS = {"forward", "backward", "__class__"}


def is_property(node) -> bool:
    """``@property`` or ``@name.setter``: a data attribute (``CheckpointWrapper.training``), not a method."""
    return any((isinstance(d, ast.Name) and d.id == "property") or (isinstance(d, ast.Attribute) and d.attr == "setter")
               for d in node.decorator_list)


def method_names(trees) -> set:
    """Every name defined with ``def`` directly in a class body (properties aside), over ``trees``."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= {n.name for n in node.body
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_property(n)}
    return names


def violations(tree, methods: set, filename: str = "<source>") -> list:
    """``"file:line: what"`` for every place in ``tree`` that replaces a method or class on an instance."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            is_setattr = (isinstance(f, ast.Name) and f.id == "setattr") or (
                isinstance(f, ast.Attribute) and f.attr == "__setattr__"
                and isinstance(f.value, ast.Name) and f.value.id == "object")
            if is_setattr and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) \
                        and (name.value in ALWAYS or name.value in methods):
                    found.append(f"{filename}:{node.lineno}: sets {name.value!r} on an instance")
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):  # tuple targets too
                if isinstance(sub, ast.Attribute) and sub.attr in ALWAYS:
                    found.append(f"{filename}:{node.lineno}: assigns .{sub.attr}")
    return found


def test_no_method_or_class_is_replaced_on_an_instance_in_minizero():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 20
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in files}
    methods = method_names(trees.values())
    assert {"forward", "attention_core", "state_dict"} <= methods
    found = [v for f, tree in trees.items() for v in violations(tree, methods, str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", [
    'object.__setattr__(block, "forward", fn)',
    'object.__setattr__(attn, "attention_core", fn)',
    'setattr(block, "forward", fn)',
    'attn.__class__ = Other',
    'wpe.forward = fn',
    'a, m.backward = 1, fn',
])
def test_the_checker_catches_an_injected_violation(line):
    source = "class A:\n    def attention_core(self):\n        pass\n\ndef install(block, attn, wpe, m, fn, Other):\n"
    tree = ast.parse(source + "    " + line + "\n")
    found = violations(tree, method_names([tree]))
    assert len(found) == 1 and ":6:" in found[0], found


def test_the_checker_allows_data_attributes_and_self_forward_calls():
    source = ("class M:\n    def __init__(self):\n        object.__setattr__(self, 'training', True)\n"
              "        setattr(self, name, 3)\n        self.core = 1\n    def forward(self, x):\n"
              "        return self.core(x)\n")
    tree = ast.parse(source)
    assert violations(tree, method_names([tree])) == []


def test_the_checker_allows_setting_a_property():
    source = ("class W:\n    @property\n    def training(self):\n        return True\n\n"
              "    @training.setter\n    def training(self, mode):\n        pass\n\n"
              "def f(m):\n    object.__setattr__(m, 'training', False)\n")
    tree = ast.parse(source)
    assert method_names([tree]) == set() and violations(tree, method_names([tree])) == []


#: techniques: the planner's analytic estimator is above them (it models them; they never ask it)
TECHNIQUE_DIRS = ("parallel", "nn", "optim", "comm", "autograd")


def estimator_imports(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every import of ``minizero.memory.estimator`` (any form) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if any(n == "minizero.memory.estimator" or n.startswith("minizero.memory.estimator.") for n in names):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_no_technique_imports_the_estimator():
    files = [f for d in TECHNIQUE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20
    found = [v for f in files for v in estimator_imports(ast.parse(f.read_text()), str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["from minizero.memory.estimator import ring_attention_bytes",
                                  "from minizero.memory import estimator",
                                  "import minizero.memory.estimator.traffic as t"])
def test_the_estimator_check_catches_an_injected_import(line):
    assert len(estimator_imports(ast.parse("import math\n" + line + "\n"))) == 1


def args_getattr_calls(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every ``getattr(args, ...)`` or ``getattr(self.args, ...)`` (a default repeated
    beside the one table of flags, or a config read by name instead of by its typed field)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            target = node.args[0]
            if (isinstance(target, ast.Name) and target.id == "args") or (
                    isinstance(target, ast.Attribute) and target.attr == "args"):
                found.append(f"{filename}:{node.lineno}")
    return found


def test_no_getattr_on_args_in_minizero():
    files = sorted(ROOT.rglob("*.py"))
    found = [v for f in files for v in args_getattr_calls(ast.parse(f.read_text()), str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ['x = getattr(args, "overlap", True)', 'n = getattr(self.args, "steps")',
                                  'v = getattr(args, name)'])
def test_the_getattr_check_catches_an_injected_call(line):
    assert len(args_getattr_calls(ast.parse("def f(self, args, name):\n    " + line + "\n"))) == 1


def test_every_flag_is_one_typed_config_field_with_the_tables_default():
    """Adding a flag = one parser entry + one TrainConfig field; parse_args returns a TrainConfig."""
    import dataclasses

    from minizero.args import parse_args
    from minizero.config import TrainConfig
    from minizero.flags import LATE_DEFAULTS, build_parser

    actions = {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert fields == dict(actions, **LATE_DEFAULTS, world_size=1, derived=())  # late default: None to the parser
    assert all(actions[name] is None for name in LATE_DEFAULTS)
    args = parse_args(["--model", "tiny", "--zero", "1"], world_size=2)
    assert isinstance(args, TrainConfig) and (args.zero, args.dp, args.world_size) == (1, 2, 2)
    with pytest.raises(TypeError, match="'new_flag'.*no TrainConfig field"):  # a flag added without its field
        TrainConfig.from_namespace(argparse.Namespace(**vars(build_parser().parse_args([])), new_flag=True))


TECHNIQUES = ("parallel", "memory", "comm", "nn", "autograd", "optim", "zero")  # the CLI maps flags, not these
FLAG = __import__("re").compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


def flag_strings(tree) -> list:
    """(line, text) of every string literal in ``tree`` naming a ``--flag``, docstrings left out."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)  # another program's flags ("python -m tool --x") are fine
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and FLAG.search(n.value)
            and "python -m " not in n.value]


def test_no_technique_error_names_a_command_line_flag():
    """Techniques raise in their own arguments' words (``tp=3``); the command line (args.py, layout_checks.py) names flags."""
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {text!r}"
             for pkg in TECHNIQUES if (ROOT / pkg).is_dir() for path in sorted((ROOT / pkg).rglob("*.py"))
             for line, text in flag_strings(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", ['raise ValueError("use --no-overlap")', 'x = f"--tp {tp} does not divide"'])
def test_the_flag_check_catches_an_injected_string(line):
    assert flag_strings(ast.parse(line))


def test_the_flag_check_leaves_docstrings_and_negative_numbers():
    assert not flag_strings(ast.parse('def f():\n    """``--pp`` stages."""\n    return "x --1 y", "a-b--c"'))


#: a Module's own tables: read through named_children / named_parameters(recurse=False, remove_duplicate=False)
MODULE_TABLES = {"_modules", "_parameters", "_named_parameters_all"}
#: CheckpointWrapper shares its inner module's tables on purpose (inner's children are the wrapper's, same names)
SHARES_TABLES = {"minizero/nn/module.py", "minizero/memory/recompute.py"}


def module_table_reads(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every ``x._modules`` / ``x._parameters`` / ``x._named_parameters_all`` with ``x`` not
    ``self``: a technique reaching into another module's private tables instead of its public traversal."""
    return [f"{filename}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in MODULE_TABLES
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


def test_no_module_reads_another_modules_tables():
    files = [f for f in sorted(ROOT.rglob("*.py")) if str(f.relative_to(ROOT.parent)) not in SHARES_TABLES]
    found = [v for f in files for v in module_table_reads(ast.parse(f.read_text()), str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["for n, c in m._modules.items(): pass", "ps = list(m._parameters.values())",
                                  "names = dict(model._named_parameters_all())", "x = blocks[0]._modules"])
def test_the_table_check_catches_an_injected_read(line):
    assert len(module_table_reads(ast.parse("def f(m, model, blocks):\n    " + line + "\n"))) == 1


def test_the_table_check_allows_self():
    assert module_table_reads(ast.parse("class M:\n    def f(self):\n        return self._modules\n")) == []


#: the one loop and the strategy it talks to: they ask a technique through its seams, never its type
ASKS_NO_TYPE = ("loop.py", "parallel/strategy.py")


def isinstance_calls(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every ``isinstance(...)`` call in ``tree``."""
    return [f"{filename}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "isinstance"]


def test_the_loop_and_the_strategy_never_ask_a_techniques_type():
    found = [v for name in ASKS_NO_TYPE for v in isinstance_calls(ast.parse((ROOT / name).read_text()), name)]
    assert found == []


def test_the_type_check_catches_an_injected_call():
    tree = ast.parse("def f(sync, DataParallel):\n    return sync if isinstance(sync, DataParallel) else None\n")
    assert len(isinstance_calls(tree)) == 1


def outside_writes(tree, attrs, filename: str = "<source>") -> list:
    """``"file:line"`` for every ``x.a = ...`` (or ``+=``, ``*=``) with ``a`` in ``attrs`` and ``x`` not ``self``."""
    targets = [t for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return [f"{filename}:{t.lineno}" for t in targets for sub in ast.walk(t)
            if isinstance(sub, ast.Attribute) and sub.attr in attrs
            and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")]


def step_count_writes(tree, filename: str = "<source>") -> list:
    """``x.step_count = ...`` from outside: Adam's t is set from outside only through the optimizer's ``set_step``
    (a resumed checkpoint's applied steps)."""
    return outside_writes(tree, {"step_count"}, filename)


def test_no_one_writes_an_optimizers_step_count_from_outside():
    found = [v for f in sorted(ROOT.rglob("*.py"))
             for v in step_count_writes(ast.parse(f.read_text()), str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["strategy.opt.step_count = 3", "opt.step_count += 1",
                                  "a.step_count = b.step_count = 2"])
def test_the_step_count_check_catches_an_injected_write(line):
    assert len(step_count_writes(ast.parse("def f(strategy, opt, a, b):\n    " + line + "\n"))) >= 1


def _zero_set_step(comm, stage):
    from minizero.nn import GPT, get_config
    from minizero.zero import zero_optimizer
    opt = zero_optimizer(GPT(get_config("tiny")), comm, stage, lr=1e-3)
    opt.set_step(7)
    return opt.step_count


def _expert_zero_set_step(comm, stage):
    from minizero.nn import GPT, get_config
    from minizero.parallel.expert_parallel import ExpertZero, MoEConfig, expert_groups, use_moe
    model = GPT(get_config("tiny"), seed=1)
    ep_comm, edp_comm = expert_groups(comm, 2)
    use_moe(model, MoEConfig(4, top_k=2), 0, ep_comm)
    opt = ExpertZero(model, comm, edp_comm, 2, stage, lr=1e-3)
    opt.set_step(7)
    return [part.step_count for part in opt.parts]  # both parts: Adam's t of the dense and the expert states


def test_every_optimizer_kind_sets_its_step():
    from minizero.comm import run_in_threads
    from minizero.nn import GPT, get_config
    from minizero.optim import AdamW
    from minizero.optim.adam8bit import Adam8bit
    for kind in (AdamW, Adam8bit):
        opt = kind(GPT(get_config("tiny")).parameters(), lr=1e-3)
        opt.set_step(7)
        assert opt.step_count == 7
    assert [run_in_threads(1, _zero_set_step, s)[0] for s in (1, 2, 3)] == [7, 7, 7]
    assert run_in_threads(2, _expert_zero_set_step, 1) == [[7, 7], [7, 7]]


def precision_tests(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every comparison with the string ``"fp16"``: the loop keys on the loss scaler's presence
    (memory/precision.py's ``loss_scaler`` decides which precision needs one), never on the precision's name."""
    return [f"{filename}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Compare)
            for c in [n.left, *n.comparators] if isinstance(c, ast.Constant) and c.value == "fp16"]


def test_the_loop_does_not_name_the_precision():
    found = [v for name in ("loop.py", "instrumentation.py")
             for v in precision_tests(ast.parse((ROOT / name).read_text()), name)]
    assert found == []


@pytest.mark.parametrize("line", ['fp16 = args.precision == "fp16"', 'x = 1 if "fp16" != p else 2'])
def test_the_precision_check_catches_an_injected_test(line):
    assert len(precision_tests(ast.parse("def f(args, p):\n    " + line + "\n"))) == 1


def zero_stage_tests(tree, filename: str = "<source>") -> list:
    """``"file:line"`` for every comparison with ``args.zero`` and every ``x[args.zero]``: the header, the report and
    the strategy's build ask the stage's class what it does (minizero.zero's ``stage_class`` / ``shards_parameters``:
    what it shards, whether it holds the full parameters, what INT8 comm carries); only ZeRO or no ZeRO
    (``if args.zero``) is theirs to test."""
    def is_stage(n):
        return (isinstance(n, ast.Attribute) and n.attr == "zero" and isinstance(n.value, ast.Name)
                and n.value.id == "args")
    return [f"{filename}:{n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.Compare) and any(map(is_stage, [n.left, *n.comparators])))
            or (isinstance(n, ast.Subscript) and is_stage(n.slice))]


def test_the_header_and_the_report_do_not_compare_the_zero_stage():
    found = [v for name in ("report.py", "header.py", "parallel/strategy.py")
             for v in zero_stage_tests(ast.parse((ROOT / name).read_text()), name)]
    assert found == []


@pytest.mark.parametrize("line", ["x = args.zero == 3", "x = 0 < args.zero < 3", "x = args.zero in (1, 2)",
                                  'x = {1: "a", 2: "b"}[args.zero]', "x = 3 != args.zero"])
def test_the_zero_stage_check_catches_an_injected_test(line):
    assert len(zero_stage_tests(ast.parse("def f(args):\n    " + line + "\n"))) == 1


def test_the_zero_stage_check_allows_zero_or_not():
    assert zero_stage_tests(ast.parse("def f(args):\n    return 1 if args.zero else f'ZeRO-{args.zero}'\n")) == []


#: where the gradient synchronisers are built: each ``sync = X(...)`` there calls one of :func:`synchronisers`' keys
BUILDS_SYNC = ("parallel/strategy.py", "finetune.py")


def sync_builders(tree) -> set:
    """The names called on the right of every ``sync = ...`` (or ``sync = opt = ...``, ``self.sync = ...``)
    assignment in ``tree``, either branch of a conditional (``sync = X(...) if ... else None``) included."""
    is_sync = lambda t: (isinstance(t, ast.Name) and t.id == "sync") or (  # noqa: E731
        isinstance(t, ast.Attribute) and t.attr == "sync")
    values = [v for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(is_sync(t) for t in n.targets)
              for v in ([n.value.body, n.value.orelse] if isinstance(n.value, ast.IfExp) else [n.value])]
    return {v.func.id for v in values if isinstance(v, ast.Call) and isinstance(v.func, ast.Name)}


def synchronisers() -> dict:
    """``{builder name: [the classes it builds]}`` for every synchroniser the code builds."""
    from minizero.parallel.data_parallel import DataParallel
    from minizero.parallel.expert_parallel import ExpertDataParallel, ExpertZero
    from minizero.parallel.overlap import OverlappedReducer
    from minizero.zero import STAGES
    return {"DataParallel": [DataParallel], "ExpertDataParallel": [ExpertDataParallel], "ExpertZero": [ExpertZero],
            "zero_optimizer": list(STAGES.values()), "OverlappedReducer": [OverlappedReducer]}


def protocol_gaps(protocol, cls) -> list:
    """The members of ``protocol`` that ``cls`` lacks, takes other parameters for (names, ``self`` included) or
    gives no docstring (its contract: shapes, what it returns)."""
    import inspect
    members = [n for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")]
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    return [f"{cls.__name__}.{n}" for n in members if not callable(getattr(cls, n, None))
            or params(getattr(cls, n)) != params(vars(protocol)[n]) or not getattr(cls, n).__doc__]


def test_every_synchroniser_the_code_builds_has_every_member_of_the_protocol():
    from minizero.parallel.strategy import Synchroniser
    built = set().union(*(sync_builders(ast.parse((ROOT / name).read_text())) for name in BUILDS_SYNC))
    known = synchronisers()
    assert built == set(known), f"synchronisers built by {sorted(built ^ set(known))}: add them to synchronisers()"
    assert [gap for classes in known.values() for cls in classes for gap in protocol_gaps(Synchroniser, cls)] == []


def test_the_builder_check_sees_a_synchroniser_assigned_to_an_attribute():
    assert sync_builders(ast.parse("def f(self, dp):\n    self.sync = self.reducer = Reducer(dp)\n")) == {"Reducer"}


def test_no_class_writes_another_ones_bytes_sent_counter():
    """Each synchroniser counts its own bytes (``bytes_per_step``): the overlapped reducer has its own counter and
    does not add to its DataParallel's (``self.dp.bytes_sent += ...``); the report reads whichever one ran."""
    found = [v for f in sorted((ROOT / "parallel").rglob("*.py"))
             for v in outside_writes(ast.parse(f.read_text()), {"bytes_sent"}, str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["self.dp.bytes_sent += n", "dp.bytes_sent = 0", "c.bytes_sent['grads'] += n"])
def test_the_counter_check_catches_an_injected_write(line):
    assert len(outside_writes(ast.parse("def f(self, dp, c, n):\n    " + line + "\n"), {"bytes_sent"})) == 1


def test_the_protocol_check_catches_a_missing_member_and_other_parameters():
    from typing import Protocol

    class Wider(Protocol):
        def reduce_gradients(self) -> None:
            """..."""

        def gather(self, x) -> None:
            """..."""

    class Lacks:
        def reduce_gradients(self):
            """Documented."""

    class Differs(Lacks):
        def gather(self, y):
            """Documented."""

    class Undocumented(Lacks):
        def gather(self, x):
            pass
    assert protocol_gaps(Wider, Lacks) == ["Lacks.gather"] and protocol_gaps(Wider, Differs) == ["Differs.gather"]
    assert protocol_gaps(Wider, Undocumented) == ["Undocumented.gather"]
    assert sync_builders(ast.parse("sync = opt = Mine(x)\nsync = dp = DataParallel(p)\nother = Y()\n")) \
        == {"Mine", "DataParallel"}
    both = ast.parse("sync = Mine(x) if a else None\nsync = None if a else Yours(x)\n")
    assert sync_builders(both) == {"Mine", "Yours"}
    finetune = sync_builders(ast.parse((ROOT / "finetune.py").read_text()))
    assert finetune == {"zero_optimizer", "DataParallel"}, finetune  # before: its builders were found by nothing


def private_methods(tree, cls: str) -> set:
    """The ``_name`` (not dunder) methods defined in class ``cls`` of ``tree``."""
    return {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")}


def private_calls(tree, names: set, filename: str = "<source>") -> list:
    """``"file:line"`` for every ``x._m(...)`` with ``_m`` in ``names`` and ``x`` not ``self``: a checkpoint's
    ShardReader is read through its public methods (``gather``, ``pruning_masks``, ...), not its ``_tensor``."""
    return [f"{filename}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in names
            and not (isinstance(n.func.value, ast.Name) and n.func.value.id == "self")]


def test_no_one_calls_the_checkpoint_readers_private_methods():
    names = private_methods(ast.parse((ROOT / "checkpoint/load.py").read_text()), "ShardReader")
    assert "_tensor" in names
    found = [v for f in sorted(ROOT.rglob("*.py"))
             for v in private_calls(ast.parse(f.read_text()), names, str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ['packed = {k: reader._tensor(f, "mask/" + k) for k in ks}',
                                  'x = ShardReader(p)._fetch(pc, "values", d)'])
def test_the_private_call_check_catches_an_injected_call(line):
    names = private_methods(ast.parse("class ShardReader:\n    def _tensor(self): pass\n    def _fetch(self): pass\n"
                                      "    def __init__(self): pass\n    def gather(self): pass\n"), "ShardReader")
    assert names == {"_tensor", "_fetch"}
    assert len(private_calls(ast.parse(f"def f(reader, ShardReader, p, pc, d, f, ks):\n    {line}\n"), names)) == 1
    assert private_calls(ast.parse("def f(self):\n    return self._tensor(1, 2)\n"), names) == []


#: a pipeline stage's own fields, never written from outside: a technique gives the stage a child module
#: (vocab_parallel.py: ``stage.loss``) or declares through its methods (``add_sequence_split``: sequence and context
#: parallelism each their own factor, in either order)
STAGE_FIELDS = {"loss_fn", "sequence_shards", "sequence_splits"}


def test_no_technique_writes_a_stages_fields():
    found = [v for f in sorted(ROOT.rglob("*.py"))
             for v in outside_writes(ast.parse(f.read_text()), STAGE_FIELDS, str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["stage.loss_fn = functools.partial(f, comm=comm)",
                                  "stage.sequence_shards = comm.world_size", "stage.sequence_shards *= 2",
                                  "stage.sequence_splits['cp'] = 2", "stage.sequence_splits = {}"])
def test_the_stage_field_check_catches_an_injected_write(line):
    assert len(outside_writes(ast.parse("def f(stage, comm):\n    " + line + "\n"), STAGE_FIELDS)) == 1


#: a class only its own technique names; another technique reaches what it wraps through Module.map_wrapped
OWN_CLASSES = {"CheckpointWrapper": "minizero/memory/recompute.py"}


def class_mentions(tree, name: str, filename: str = "<source>") -> list:
    """``"file:line"`` for every use of ``name`` in code (a name, an attribute, an import), strings left out."""
    return [f"{filename}:{n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
            or (isinstance(n, ast.ImportFrom) and any(a.name == name for a in n.names))]


def test_no_technique_names_another_ones_wrapper():
    found = [v for name, home in OWN_CLASSES.items() for f in sorted(ROOT.rglob("*.py"))
             if str(f.relative_to(ROOT.parent)) != home
             for v in class_mentions(ast.parse(f.read_text()), name, str(f.relative_to(ROOT.parent)))]
    assert found == []


@pytest.mark.parametrize("line", ["from minizero.memory.recompute import CheckpointWrapper",
                                  "ok = isinstance(core, CheckpointWrapper)", "w = recompute.CheckpointWrapper(core)"])
def test_the_wrapper_check_catches_an_injected_mention(line):
    tree = ast.parse("def f(core, recompute):\n    " + line + "\n    return '''CheckpointWrapper'''\n")
    assert len(class_mentions(tree, "CheckpointWrapper")) == 1
