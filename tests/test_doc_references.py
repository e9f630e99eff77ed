"""Code the prose names still exists: every backticked reference in README.md, ARCHITECTURE.md, docs/*.md and
lessons/templates/*.md that points into this project (a file path, a ``minizero.x.Name``, a ``module.name`` or
``Class.method`` of minizero, a ``--flag`` of one of its programs) resolves against the current code.

In-process and fast: modules are imported, parsers built with their ``build_parser()``; the programs that build
their parser inside ``main`` (bench scripts, the debug and checkpoint commands) are read for their
``add_argument("--x")`` calls. Names of other projects (``torch.*``, DeepSpeed paths) are not checked."""
from __future__ import annotations

import ast
import glob
import importlib
import inspect
import os
import pkgutil
import re
import textwrap
from functools import lru_cache

import pytest

import minizero
from tests.conftest import REPO_ROOT

PROSE = ("README.md", "ARCHITECTURE.md", "docs/*.md", "lessons/templates/*.md")
TOP = ("minizero", "bench", "tests", "notebooks", "lessons", "docs", "mpi_examples")

# a reference that names something real outside the code, or a placeholder; each with why it cannot resolve
ALLOWED = {
    "python -m minizero.X": "a placeholder for any of the programs",
    "model.py": "nanoGPT's model.py (lesson 00 compares with it)",
    "ds_to_universal.py": "DeepSpeed's checkpoint converter",
    "docs/_pages/config-json.md": "DeepSpeed's documentation page on its config",
    "bf16.enabled": "a DeepSpeed config key",
    "nn.GELU()": "PyTorch's torch.nn.GELU",
    'nn.GELU(approximate="tanh")': "PyTorch's torch.nn.GELU",
}
# words the prose uses as a variable (an instance), not as the minizero module of that name
INSTANCES = {
    "comm": "a Communicator (comm.sendrecv, comm.split, comm.traffic)",
    "traffic": "a TrafficLedger (comm.traffic.op)",
    "strategy": "a Strategy instance (strategy.reduce_gradients())",
    "config": "summary.json's config object (config.model)",
}
# classes of other projects named in the prose (Class.method of a class minizero does not define)
FOREIGN_CLASSES = {
    "MPI": "mpi4py's MPI (MPI.COMM_WORLD)",
    "Variable": "PyTorch's autograd Variable (Variable._execution_engine.queue_callback)",
    "MoEAuxLossAutoScaler": "Megatron-LM's MoE auxiliary-loss scaler",
}
# flags of other programs named in backticks on their own (the comparison tables and notes on Megatron-LM)
FOREIGN_FLAGS = {
    "--overlap-grad-reduce": "Megatron-LM", "--recompute-method": "Megatron-LM",
    "--recompute-num-layers": "Megatron-LM", "--fp8-format": "Megatron-LM (Transformer Engine)",
    "--fp8-amax-history-len": "Megatron-LM (Transformer Engine)",
    "--fp8-amax-compute-algo": "Megatron-LM (Transformer Engine)",
    "--num-layers-per-virtual-pipeline-stage": "Megatron-LM",
    "--accumulate-allreduce-grads-in-fp32": "Megatron-LM",
    "--data-parallel-sharding-strategy": "Megatron-LM (Megatron-FSDP)", "--ddp-bucket-size": "Megatron-LM",
    "--fp8-recipe": "Megatron-LM (Transformer Engine)", "--num-virtual-stages-per-pipeline-rank": "Megatron-LM",
}

PROGRAMS = {"minizero.train": "minizero.flags", "minizero.plan": "minizero.plan",
            "minizero.quantize": "minizero.quantize", "minizero.finetune": "minizero.finetune",
            "minizero.compare": "minizero.compare", "minizero.sample": "minizero.sample"}
FORWARDS_TO_TRAIN = {"bench/bench_setup_peak.py"}  # parses its own flags, hands every other one to train's parser
SCRIPTED = {"minizero.debug": "minizero/debug/__main__.py", "minizero.checkpoint": "minizero/checkpoint/cli.py"}


def _prose() -> list[str]:
    return [p for pattern in PROSE for p in sorted(glob.glob(os.path.join(REPO_ROOT, pattern)))]


def references(text: str):
    """(line, span, in_fence) for each inline backticked span (one may go on over a line break, as Markdown
    allows), and each command line of a fenced block."""
    in_fence, command, prose = False, "", []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            yield from _inline(prose)
            prose = []
            continue
        if in_fence:  # a command may go on over lines ending in a backslash
            command += " " + line.rstrip().rstrip("\\")
            if not line.rstrip().endswith("\\"):
                if "python " in command:
                    yield n, command, True
                command = ""
            continue
        prose.append((n, line))
    yield from _inline(prose)


def _inline(lines: list):
    if not lines:
        return
    text = "\n".join(line for _, line in lines)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        if "\n\n" not in m.group(1):
            yield lines[text.count("\n", 0, m.start())][0], " ".join(m.group(1).split("\n")), False


@lru_cache(maxsize=None)
def _modules() -> dict:
    """Every importable minizero module by its full name."""
    mods = {"minizero": minizero}
    for info in pkgutil.walk_packages(minizero.__path__, "minizero."):
        if not info.name.endswith("__main__"):
            mods[info.name] = importlib.import_module(info.name)
    return mods


@lru_cache(maxsize=None)
def _classes() -> dict:
    """Class name -> the minizero classes of that name."""
    found: dict = {}
    for mod in _modules().values():
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and getattr(obj, "__module__", "").startswith("minizero"):
                found.setdefault(name, set()).add(obj)
    return found


def _has(obj, chain: list[str]) -> bool:
    for part in chain:
        if not hasattr(obj, part) and not (inspect.isclass(obj) and part in _fields(obj)):
            return False
        obj = getattr(obj, part, None)
    return True


@lru_cache(maxsize=None)
def _fields(cls) -> set:
    """Instance attributes a class (or a base) sets in its methods (self.x = ..., self.x, self.y = ...) or declares
    (dataclass fields)."""
    names = set()
    for klass in inspect.getmro(cls):
        names |= set(getattr(klass, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return names


def _resolve_dotted(ref: str) -> str | None:
    """None if a minizero.x.y[.Name...] reference resolves, else what is missing."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name in _modules():
            return None if _has(_modules()[name], parts[cut:]) else f"{name} has no {'.'.join(parts[cut:])}"
    return "no such module"


@lru_cache(maxsize=None)
def _leaf_modules() -> dict:
    """'stage3' -> ['minizero.zero.stage3'], 'loop' -> ['minizero.loop'], ..."""
    leaves: dict = {}
    for name in _modules():
        leaves.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return leaves


@lru_cache(maxsize=None)
def _package_dirs() -> set:
    return {os.path.basename(d) for d, _, files in os.walk(os.path.join(REPO_ROOT, "minizero"))
            if "__init__.py" in files} - {"minizero"}


@lru_cache(maxsize=None)
def _files() -> list[str]:
    out = []
    for d, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("__pycache__", "out")]
        rel = os.path.relpath(d, REPO_ROOT)
        out += [os.path.normpath(os.path.join(rel, f)) for f in files]
        out += [os.path.normpath(os.path.join(rel, x)) + "/" for x in dirs]
    return out


def _scripted_flags(path: str) -> set:
    tree = ast.parse(open(os.path.join(REPO_ROOT, path)).read())
    return {arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")}


@lru_cache(maxsize=None)
def program_flags(program: str) -> frozenset:
    """The option strings of a program: 'minizero.train', 'bench/bench_train.py', 'lessons/build.py', ..."""
    if program in PROGRAMS:
        return frozenset(importlib.import_module(PROGRAMS[program]).build_parser()._option_string_actions)
    return frozenset(_scripted_flags(SCRIPTED.get(program, program)) | {"-h", "--help"})


@lru_cache(maxsize=None)
def all_flags() -> frozenset:
    scripts = [f for f in _files()
               if re.fullmatch(r"(bench/\w+|mpi_examples/\w+|lessons/build|docs/build_readme_excerpt)\.py", f)]
    return frozenset().union(*(program_flags(p) for p in [*PROGRAMS, *SCRIPTED, *scripts]))


COMMAND = re.compile(r"python3? (?:-m (?P<module>minizero(?:\.\w+)*)"
                     r"|(?P<script>(?:bench|lessons|docs|mpi_examples)/\w+\.py))"
                     r"|^\s*(?P<short>train|plan|quantize|finetune|compare|sample)(?= --)"  # "plan --finetune --tp"
                     r"|^\s*(?P<launcher>mpi(?:run|exec) -n \S+)(?= --)"  # "mpiexec -n 2 --dp 2": train's flags
                     r"|^\s*(?P<bare>(?:bench|mpi_examples)/\w+\.py)(?= --)")  # "bench/bench_speedup.py --malloc"


def _command_problems(span: str) -> list[str]:
    """The programs a command line runs exist and have the --flags it gives them."""
    problems = []
    for part in re.split(r"\||&&|;", span):
        m = COMMAND.search(part)
        if not m:
            continue
        script = m["script"] or m["bare"]
        program = script or m["module"] or "minizero." + (m["short"] or "train")
        if script and not os.path.exists(os.path.join(REPO_ROOT, script)):
            problems.append(f"{script}: no such file")
            continue
        if m["module"] and program not in PROGRAMS and program not in SCRIPTED:
            if program not in _modules():
                problems.append(f"{program}: no such module")
            continue
        known = program_flags(program) | (program_flags("minizero.train") if program in FORWARDS_TO_TRAIN else set())
        rest = part[m.end():]
        if program == "minizero.debug":  # parity "--dp 2" "--tp 2": each quoted layout is train's flags
            problems += [p for layout in re.findall(r'"([^"]*)"', rest)
                         for p in _command_problems("python -m minizero.train " + layout)]
        rest = re.sub(r'"[^"]*"', "", rest)
        for flag, value in re.findall(r"(?<![\w-])(--[a-z][\w-]*)(?:[ =]([\w.][\w.-]*))?", rest):
            if flag not in known and not (flag.endswith("-") and any(k.startswith(flag) for k in known)):
                problems.append(f"{program} has no {flag}")
            choices = _choices(program).get(flag)
            if choices and value and not value.isupper() and value not in choices:  # FLAG N: a placeholder
                problems.append(f"{program} {flag}: {value!r} is not one of {sorted(choices)}")
    return problems


@lru_cache(maxsize=None)
def _choices(program: str) -> dict:
    """--flag -> its allowed values (as typed), for the programs whose parser is built here."""
    if program not in PROGRAMS:
        return {}
    actions = importlib.import_module(PROGRAMS[program]).build_parser()._actions
    return {o: {str(c) for c in a.choices} for a in actions if a.choices for o in a.option_strings}


def problems_in(span: str, in_fence: bool = False) -> list[str]:
    """What a backticked span names that does not exist (empty when it resolves or is not a project reference)."""
    span = span.strip()
    if span in ALLOWED:
        return []
    if "python" in span or COMMAND.search(span):
        return _command_problems(span)
    if in_fence:
        return []
    if re.fullmatch(r"--[a-z][\w-]*\*?(?:[ =/].*)?", span):
        from minizero.flags import SYNONYMS  # Megatron-LM's, DeepSpeed's, ... names of train's flags (techniques.md)
        known, problems = all_flags() | set(SYNONYMS), []
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*\*?", span):
            ok = any(k.startswith(flag[:-1]) for k in known) if flag.endswith("*") else flag in known
            problems += [] if ok or flag in FOREIGN_FLAGS else [f"no program has {flag}"]
        return problems
    word = span.split()[0] if span.split() else ""
    if re.fullmatch(r"[\w-]+\.py", word):  # a bare file name: some file of the project has it
        return [] if any(os.path.basename(f) == word for f in _files()) else [f"{word}: no such file"]
    if re.fullmatch(r"[\w-]+\.(json|npz|png|md|txt|toml|csv)", word):  # an output file or a file elsewhere
        return []
    path = re.fullmatch(r"(?:\./)?([\w.-]+(?:/[\w.-]*)+)(?:::(\w+))?", word)
    if path:
        rel, test = path.group(1), path.group(2)
        first = rel.split("/")[0]
        if first in TOP:
            if not os.path.exists(os.path.join(REPO_ROOT, rel)):
                return [f"{rel}: no such file"]
            if test and not re.search(rf"^\s*def {test}\(", open(os.path.join(REPO_ROOT, rel)).read(), re.M):
                return [f"{rel} has no {test}"]
            return []
        if first in _package_dirs():  # autograd/ops.py, estimator/lora.py: a path inside minizero/
            hits = [f for f in _files() if f.startswith("minizero/") and ("/" + f).endswith("/" + rel)]
            if hits:
                return []
            module = re.fullmatch(r"([\w/]+)\.(\w+)", rel)  # checkpoint/layout.tp_of: a module's attribute
            if module and not module.group(2) == "py":
                return [f"{rel}: {m}" for m in [_resolve_dotted("minizero." + rel.replace("/", "."))] if m]
            return [f"minizero/**/{rel}: no such file"]
        return []
    dotted = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?", span)
    if not dotted:
        return []
    ref = dotted.group(1)
    first, rest = ref.split(".", 1)
    if first == "minizero":
        missing = _resolve_dotted(ref)
        return [f"{ref}: {missing}"] if missing else []
    if first[0].isupper():
        if first in FOREIGN_CLASSES:
            return []
        if first not in _classes():
            return [f"{ref}: minizero has no class {first}"]
        return [] if any(_has(c, rest.split(".")) for c in _classes()[first]) else [f"{ref}: {first} has no {rest}"]
    if first in _leaf_modules() and first not in INSTANCES:
        if any(_resolve_dotted(f"{m}.{rest}") is None for m in _leaf_modules()[first]):
            return []
        return [f"{ref}: {' / '.join(_leaf_modules()[first])} has no {rest}"]
    return []


def test_every_code_reference_in_the_prose_resolves():
    stale = []
    for path in _prose():
        for n, span, fenced in references(open(path).read()):
            where = f"{os.path.relpath(path, REPO_ROOT)}:{n}: `{span.strip()}`"
            stale += [f"{where}: {p}" for p in problems_in(span, fenced)]
    assert not stale, "stale references (fix the prose, or add to ALLOWED with a reason):\n" + "\n".join(stale)


def table_problems(row: str) -> list[str]:
    """In a table row's cell such as "`minizero/zero/stage3.py`: `ZeroStage3` (`_gather_hook`, `full_parameters`)",
    each bare name after a path (up to a ';') occurs in that file (a base name: in any file of that name)."""
    problems = []
    for part in re.split(r"[|;]", row):
        files = []
        for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", part):
            span = m.group(1).strip().rstrip(":")
            if re.fullmatch(r"[\w/]+\.py", span):
                files = [f for f in _files() if ("/" + f).endswith("/" + span)]
                continue
            name = re.fullmatch(r"([A-Za-z_]\w*)(?:\(.*\))?", span)
            if files and name and not any(re.search(rf"\b{name.group(1)}\b", _text(f)) for f in files):
                problems.append(f"{name.group(1)} is not in {' / '.join(files)}")
    return problems


@lru_cache(maxsize=None)
def _text(path: str) -> str:
    return open(os.path.join(REPO_ROOT, path)).read()


def test_names_listed_after_a_file_in_a_table_are_in_that_file():
    stale = [f"{os.path.relpath(path, REPO_ROOT)}:{n}: {p}" for path in _prose()
             for n, line in enumerate(open(path).read().splitlines(), 1) if line.startswith("|")
             for p in table_problems(line)]
    assert not stale, "stale names in the tables (fix the prose):\n" + "\n".join(stale)


def test_every_allowed_entry_is_still_used():
    spans = {span.strip() for path in _prose() for _, span, _ in references(open(path).read())}
    assert not set(ALLOWED) - spans, set(ALLOWED) - spans


CODE = ("minizero/**/*.py", "bench/*.py", "mpi_examples/*.py", "lessons/*.py", "docs/*.py")


def test_every_path_in_the_code_comments_and_docstrings_exists():
    """A ``dir/file.py`` a comment or docstring of the code names (``parallel/data_parallel.py``) exists; names with
    a placeholder (``notebooks/NN_name.ipynb``) are not checked."""
    stale = []
    for path in (p for pattern in CODE for p in sorted(glob.glob(os.path.join(REPO_ROOT, pattern), recursive=True))):
        for n, line in enumerate(open(path).read().splitlines(), 1):
            for m in re.finditer(r"(?<![\w/.-])((?:\w+/)+\w+\.(?:py|ipynb|md))\b", line):
                if not re.search(r"\bNN_|\bNAME\b|/name\.", m.group(1)):
                    stale += [f"{os.path.relpath(path, REPO_ROOT)}:{n}: {p}" for p in problems_in(m.group(1))]
    assert not stale, "stale paths in the code's comments or docstrings:\n" + "\n".join(stale)


@pytest.mark.parametrize("span", ["minizero.zero.stage9", "minizero.loop.no_such_function", "minizero/zero/stage9.py",
                                  "zero/stage9.py", "stage3.no_such_name", "Strategy.no_such_method", "NoSuchClass.x",
                                  "python -m minizero.train --no-such-flag", "--no-such-flag", "bench/bench_nope.py",
                                  "tests/test_zero.py::test_no_such_test", "python bench/bench_train.py --no-such",
                                  "plan --finetune --no-such", "mpiexec -n 2 --no-such", "bench/bench_speedup.py --no",
                                  "--dp/--no-such", "python -m minizero.nosuch",
                                  "python -m minizero.train --recompute sometimes",
                                  'python -m minizero.debug parity "--dp 2" "--no-such 2"',
                                  "python bench/bench_setup_peak.py --no-such",
                                  "python -m minizero.train --zero-stage 3"])
def test_a_stale_name_is_caught(span):
    assert problems_in(span)


def test_a_name_missing_from_the_file_a_table_names_is_caught():
    row = "| stage 3 | `minizero/zero/stage3.py`: `ZeroStage3` (`_gather_hook`, `_no_such_hook`); `Topology` |"
    assert table_problems(row) == ["_no_such_hook is not in minizero/zero/stage3.py"]


@pytest.mark.parametrize("span", ["minizero.zero.stage3", "minizero/zero/stage3.py", "zero/stage3.py",
                                  "python -m minizero.train --dp 2 --zero 3", "--zero 3", "torch.autograd.Function",
                                  "deepspeed/runtime/engine.py", "Strategy.forward_backward", "loop.train",
                                  'python -m minizero.debug parity "--dp 2" "--tp 2" --steps 3',
                                  "python bench/bench_setup_peak.py --zero 3 --check", "--zero-stage"])
def test_a_current_or_foreign_name_passes(span):
    assert not problems_in(span)
