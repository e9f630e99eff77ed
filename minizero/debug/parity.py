"""``python -m minizero.debug parity "--dp 2" "--tp 2"``: two layouts, one seed and global batch, in float64.

Runs the main job per layout (N ranks from ``-n K`` or the product of ``--dp/--tp/--pp/--cp``) and prints the
first step (1-based, as the progress log) whose loss or gradient norm differ beyond ``--tol`` (relative to
max(1, |value|)) and the first final parameter that does; exit 0 same, 1 differ, 2 a run failed. Correct layouts
agree to ~1e-15 per step. Mirrors torchtitan's loss-comparison script, made exact by float64.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
import tempfile

import numpy as np

from minizero.files import mpiexec_path
from minizero.interrupts import run_group
from minizero.numerals import counted, error_lines, is_count, unwrapped, wrapped

SIZE_FLAGS = ("--dp", "--tp", "--pp", "--cp", "--ulysses")
#: refused in a layout: what parity sets for both runs (its own flags) and what would write outside its temporary
#: folder (--seed or --dtype in one layout are allowed: a difference parity should find)
CONTROLLED = ("--out", "--json", "--save-dir", "--save-every", "--resume", "--trace", "--no-save", "--model",
              "--steps", "--batch-size")
MAX_RANKS = 64  #: ranks one layout may start (-n or the product of its sizes)
#: train's own argument check of one layout, in a process of its own (minizero.args is a layer above this package)
_CHECK = ("import sys; from minizero.args import UsageError, parse_args\n"
          "try: parse_args(sys.argv[2:], int(sys.argv[1]), quiet=True)\n"
          "except UsageError as e: sys.exit(str(e))")


def ranks_of(words: list[str]) -> tuple[int, list[str]]:
    """``(N, train flags)`` of a layout's words: ``-n K`` taken out, else N = the product of its size flags.

    Raises:
        ValueError: a flag of :data:`CONTROLLED`, ``-n`` without a number in [1, MAX_RANKS], more ranks.
    """
    given = [w.split("=")[0] for w in words if w.split("=")[0] in CONTROLLED]
    own = [w for w in given if w in CONTROLLED[-3:]]  # parity's --model/--steps/--batch-size: both runs'
    if own:
        raise ValueError(f"layout {' '.join(words)!r}: {', '.join(own)} is parity's own flag (one value for both "
                         "runs); give it to parity, outside the layouts' quotes")
    if given:
        raise ValueError(f"layout {' '.join(words)!r}: {', '.join(given)} sets what a run writes or reads; parity "
                         "runs each layout in a temporary folder of its own and removes it; give layout flags only")
    if words[:1] == ["-n"]:
        if len(words) < 2 or not is_count(words[1]) or not 1 <= int(words[1]) <= MAX_RANKS:
            raise ValueError(f"layout {' '.join(words)!r}: -n needs a number of ranks in [1, {MAX_RANKS}] "
                             "(ASCII digits)")
        return int(words[1]), words[2:]
    sizes = {}  # "--dp 2" or "--dp=2"; --ulysses N is --cp N
    for i, w in enumerate(words):
        flag, _, value = w.partition("=") if w.startswith("--") else (w, "", "")
        value = value or (words[i + 1] if i + 1 < len(words) else "")
        if flag in SIZE_FLAGS and is_count(value):
            sizes[{"--ulysses": "--cp"}.get(flag, flag)] = int(value)
    n = math.prod(sizes.values())
    if n > MAX_RANKS:
        raise ValueError(f"layout {' '.join(words)!r} starts {n} ranks; allowed: at most {MAX_RANKS}")
    return n, words


def layout_words(layout: str) -> tuple[int, list[str]]:
    """:func:`ranks_of` a layout's text. Raises ValueError: an unclosed quote, or as :func:`ranks_of`."""
    try:
        words = shlex.split(layout)
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"layout {layout!r}: {e}") from None
    return ranks_of(words)


def train_argv(flags: list[str], common: list[str], out: str) -> list[str]:
    """The main job's arguments for one layout's ``flags``, writing into folder ``out``."""
    return ["--dtype", "float64", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", *common, "--out", out, *flags]


def check(layout: str, common: list[str], out: str) -> None:
    """Refuse a layout the main job would refuse (its flags, sizes, batch), without starting it.

    Raises:
        ValueError: as :func:`layout_words`, or the main job's own message.
    """
    n, flags = layout_words(layout)
    proc = run_group([sys.executable, "-c", _CHECK, str(n), *train_argv(flags, common, out)])
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        own = said.startswith(tuple(f"{flag} must be " for flag in CONTROLLED[-3:]))  # a range: parity's own flag
        raise ValueError(said if own else f"layout {layout!r}: {said}")


def run(layout: str, common: list[str], out: str) -> dict:
    """Run one layout into folder ``out``; returns ``{"loss", "norm", "params", "n"}`` or ``{"error": text}``."""
    n, flags = layout_words(layout)
    cmd = [mpiexec_path() or "mpiexec", "-n", str(n), sys.executable, "-m", "minizero.train",
           *train_argv(flags, common, out)]
    proc = run_group(cmd)  # Ctrl-C: mpiexec and its ranks killed
    if proc.returncode != 0:
        lines = unwrapped(proc.stderr)  # a long line printed over several, whole
        said = [ln for ln in lines if "error" in ln or "failed" in ln] or lines
        return {"error": f"{layout!r} failed (exit {proc.returncode}): {(said or ['no message'])[0]}"}
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with np.load(os.path.join(out, "model.npz")) as z:
        params = {k: z[k] for k in z.files}
    return {"loss": summary["train_loss"], "norm": summary["grad_norm"], "params": params, "n": n}


def _rel(a: float, b: float) -> float:
    """|a - b| / max(1, |a|); 0 for equal values (inf, NaN on both sides too), inf where one side is not finite
    and the other differs (a run that diverged to NaN or inf against one that did not)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(1.0, abs(a))


def _difference(pa: np.ndarray, pb: np.ndarray) -> tuple[float, tuple]:
    """(largest elementwise difference relative to max(1, |pa|'s finite largest), its index), by :func:`_rel`'s
    rule: equal and NaN-against-NaN elements 0, a non-finite element against another value inf."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, set below (no RuntimeWarning printed)
        diff = np.abs(pa - pb).astype(np.float64)
    diff[(pa == pb) | (np.isnan(pa) & np.isnan(pb))] = 0.0
    diff[np.isnan(diff)] = np.inf
    at = np.unravel_index(int(np.argmax(diff)), pa.shape)
    return float(diff[at]) / max(1.0, float(np.max(np.abs(pa[np.isfinite(pa)]), initial=0.0))), at


def compare(a: dict, b: dict, names=("A", "B"), tol: float = 1e-10) -> list[str]:
    """The verdict lines for two :func:`run` results; the first line starts with ``same:`` or ``differ:``."""
    lines = []
    for step, (la, lb, na, nb) in enumerate(zip(a["loss"], b["loss"], a["norm"], b["norm"])):
        worst = max(_rel(la, lb), _rel(na, nb))
        if worst > tol:
            lines.append(f"differ: first at step {step + 1}: training loss {la!r} ({names[0]}) vs {lb!r} ({names[1]}), "
                         f"gradient norm {na!r} vs {nb!r} (relative difference {worst:.3g} > {tol:g})")
            break
    n_steps = counted(len(a["loss"]), "step")
    first, largest = None, (0.0, None)
    for name, pa in a["params"].items():
        pb = b["params"].get(name)
        if pb is None or pb.shape != pa.shape:
            lines.append(f"differ: parameter {name!r} is {pa.shape} in {names[0]}, "
                         f"{None if pb is None else pb.shape} in {names[1]}")
            continue
        d, at = _difference(pa, pb) if pa.size else (0.0, ())
        largest = (d, name) if largest[1] is None or d > largest[0] else largest  # all equal: the first, not None
        if d > tol and first is None:
            first = (name, d, at)
    if first is not None:
        name, d, at = first
        lines.append(f"differ: after {n_steps} the first parameter beyond {tol:g} is {name!r} "
                     f"{a['params'][name].shape}: relative difference {d:.3g} at index {tuple(int(i) for i in at)}")
    if not lines:
        lines.append(f"same: {n_steps}, every loss, gradient norm and parameter within {tol:g} "
                     f"(largest parameter difference {largest[0]:.3g}, {largest[1]!r})")
    return lines


def main(layout_a: str, layout_b: str, common: list[str], tol: float) -> int:
    """Run both layouts, print the verdict; 0 same, 1 differ, 2 a run failed."""
    results = []
    with tempfile.TemporaryDirectory(prefix="parity_") as d:
        for i, layout in enumerate((layout_a, layout_b)):  # both checked before either runs
            check(layout, common, os.path.join(d, str(i)))
        for i, layout in enumerate((layout_a, layout_b)):
            results.append(run(layout, common, os.path.join(d, str(i))))
            if "error" in results[-1]:
                print(error_lines("python -m minizero.debug parity", results[-1]["error"]), file=sys.stderr)
                return 2
    lines = compare(*results, names=(layout_a, layout_b), tol=tol)
    for line in lines:
        print(wrapped(line))
    return 0 if lines[0].startswith("same:") else 1
