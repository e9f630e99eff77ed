"""The architecture, enforced: import-linter's contracts (pyproject.toml) and the size of every module.

Layers (ARCHITECTURE.md): a module imports only from layers below its own, and no two
modules import each other, directly or through others, lazily inside a function or not.
"""
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 400
MAX_COLUMNS = 120
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_import_contracts_are_kept():
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout


def test_architecture_md_names_every_layer_in_order():
    """Before: its diagram lacked debug/, compare_report, quantized_model and interrupts, which pyproject.toml's
    layers hold, and had lines 130-180 columns wide."""
    import re

    pyproject = (REPO / "pyproject.toml").read_text()  # tomllib is Python >= 3.11; the project runs on 3.10
    layers = re.findall(r'^    "(minizero\.[^"]+)",$', pyproject.split("layers = [")[1].split("]")[0], re.M)
    text = (REPO / "ARCHITECTURE.md").read_text()
    block = text.split("## Layers")[1].split("```")[1]
    assert max(len(line) for line in block.splitlines()) <= MAX_COLUMNS
    names = re.findall(r"(?:^|\| )([a-z0-9_]+)/?(?= |$)", "\n".join(line[:43] for line in block.splitlines()), re.M)
    expected = [m.strip().removeprefix("minizero.") for layer in layers for m in layer.split("|")]
    assert names == expected, (names, expected)


@pytest.mark.parametrize("module,line,contract", [
    ("backend.py", "import minizero.train", "layers"),                       # the core importing a program
    ("optim/adamw.py", "import minizero.memory.offload", "layers"),          # optim reaching up into memory
    ("comm/collectives.py",                                                  # a lazy cycle inside comm/
     "def _lazy():\n    from minizero.comm import communicator\n", "cycles"),
])
def test_a_violation_breaks_the_contracts(tmp_path, module, line, contract):
    """The check can fail: the same contracts on a copy with one bad import added."""
    shutil.copytree(REPO / "minizero", tmp_path / "minizero", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "minizero" / module, "a") as f:
        f.write("\n" + line + "\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith("BROKEN")]
    # an upward import also closes a cycle; a lazy cycle inside one layer breaks only the cycle contract
    assert any(("layers" in ln) == (contract == "layers") for ln in broken), proc.stdout


def test_every_module_is_readable_in_one_sitting():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / "minizero").rglob("*.py")}
    too_long = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def test_no_line_is_wider_than_max_columns():
    """Every line of minizero/ and bench/ fits in MAX_COLUMNS characters (what a side-by-side reader shows)."""
    wide = [f"{p.relative_to(REPO)}:{i}: {len(line)} columns"
            for folder in ("minizero", "bench") for p in sorted((REPO / folder).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not wide, f"lines over {MAX_COLUMNS} columns: {wide}"


def test_tensor_operators_are_defined_where_tensor_is():
    """Issue 10: ``a + b`` is readable in the Tensor class, not attached by importing ops.py."""
    from minizero.autograd import engine, ops

    for name in ("__add__", "__radd__", "__sub__", "__mul__", "__truediv__", "__neg__", "__pow__", "__matmul__",
                 "__getitem__", "sum", "mean", "reshape", "transpose", "T", "exp", "log", "tanh"):
        assert name in engine.Tensor.__dict__, name
    assert "Tensor." not in (REPO / "minizero" / "autograd" / "ops.py").read_text().replace("Tensor.ops", "")
    assert engine.Tensor.ops is ops  # bound explicitly by minizero/autograd/__init__.py


def test_every_module_is_in_a_layer():
    """Before: nf4.py and strict_rules.py were in no layer, so import-linter checked nothing about them."""
    import re

    pyproject = (REPO / "pyproject.toml").read_text()
    layers = pyproject.split("layers = [")[1].split("]")[0]
    named = {m.strip() for m in re.findall(r'"([^"]+)"', layers) for m in m.split("|")}
    root = REPO / "minizero"
    modules = {f"minizero.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    modules |= {f"minizero.{p.parent.name}" for p in root.glob("*/__init__.py")}
    assert modules - named == set()
