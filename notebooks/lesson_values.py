"""The figures a lesson's prose quotes, recorded by its notebook (lessons/build.py renders them).

A notebook calls ``record(name, value, fmt)`` for every measured figure its lesson quotes and ends
with ``finish(lesson)``. Under ``python lessons/build.py`` (which sets ``MINIZERO_LESSON_BUILD=1``)
``finish`` writes ``lessons/values/<lesson>.json`` and ``figure_path`` points into ``lessons/img/``;
everywhere else (the test suite's nbmake run, a reader's Jupyter) ``finish`` asserts that the figures
just measured equal the committed ones, so a lesson whose figures went stale fails the suite, and
pictures go to a temporary folder. Exact figures are recorded exactly; a rounding-level figure is
recorded as the bound it is asserted against (``record_bound``), so that it holds on every BLAS kernel.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
VALUES = ROOT / "lessons" / "values"
IMG = ROOT / "lessons" / "img"
BUILDING = os.environ.get("MINIZERO_LESSON_BUILD") == "1"

_values: dict[str, str] = {}


def record(name: str, value, fmt: str = "{}") -> None:
    """Record ``fmt.format(value)`` as the lesson's field ``name``. Returns None, so a cell that ends with it
    shows only what it printed, not the recorded text again."""
    text = fmt.format(value)
    if _values.get(name, text) != text:
        raise ValueError(f"lesson field {name!r} recorded twice with different text: {_values[name]!r}, {text!r}")
    _values[name] = text


def record_bound(name: str, value: float, bound: float, fmt: str = "{:.0e}") -> None:
    """Assert ``abs(value) < bound`` and record the bound (a rounding-level figure moves with the BLAS kernel)."""
    assert abs(value) < bound, f"{name}: {value!r} is not below {bound!r}"
    record(name, bound, fmt)


def source_constant(path: str, name: str) -> str:
    """The literal a module-level ``NAME = ...`` (or ``A, NAME = ..., ...``) in ``path`` (from the repository root)
    assigns, as typed: a tolerance a test holds, quoted from its source. Read, not imported: importing a test
    module would run tests/conftest.py, which sets the suite's switches (MINIZERO_DEBUG_COLLECTIVES)."""
    text, found = (ROOT / path).read_text(), []
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                else [(target, value)]
            for t, v in pairs:
                if isinstance(t, ast.Name) and t.id == name:
                    ast.literal_eval(v)  # a literal, not an expression
                    return ast.get_source_segment(text, v)
                found += [t.id] if isinstance(t, ast.Name) else []
    raise LookupError(f"{path} assigns no module-level constant {name}; it assigns {', '.join(found) or 'none'}")


def figure_path(filename: str) -> pathlib.Path:
    """Where a picture goes: ``lessons/img/filename`` under the build, a temporary folder otherwise."""
    folder = IMG if BUILDING else pathlib.Path(tempfile.gettempdir()) / "minizero_lesson_img"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / filename


def shown(text, **folders) -> str:
    """``text`` (a path, or a line naming one) with the repository root left off and each folder given as
    ``NAME=path`` (a temporary one) written ``$NAME``, so that a stored output names ``lessons/img/...`` and
    ``$WORK/...``, not the folders of the machine that built it."""
    text = str(text)
    for name, path in folders.items():
        for form in sorted({str(path), os.path.realpath(path)}, key=len, reverse=True):
            text = text.replace(form, f"${name}")
    return text.replace(f"{ROOT}{os.sep}", "")


def finish(lesson: str) -> None:
    """Write (build) or check (everywhere else) ``lessons/values/<lesson>.json`` against what was recorded."""
    path = VALUES / f"{lesson}.json"
    if BUILDING:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_values, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        print(f"wrote {len(_values)} figures to {path.relative_to(ROOT)}")
        return
    committed = json.loads(path.read_text())
    stale = {k: (committed.get(k), v) for k, v in _values.items() if committed.get(k) != v}
    missing = sorted(set(committed) - set(_values))
    assert not stale and not missing, (
        f"lessons/{lesson}.md quotes figures this notebook no longer produces; run `python lessons/build.py "
        f"{lesson}` and commit. (committed, now): {stale}; no longer recorded: {missing}")
    print(f"all {len(_values)} figures of lessons/{lesson}.md are what this run measured")
