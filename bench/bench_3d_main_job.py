"""The main job in 3D against data parallelism, in float32: prints lesson 06's table "The main job in 3D".

    python bench/bench_3d_main_job.py                       # 4 runs of 8 ranks: ~8 minutes on 2 cores
    python bench/bench_3d_main_job.py --keep runs/          # keep each run's summary.json ...
    python bench/bench_3d_main_job.py --reuse runs/         # ... and print the table again from them

Launches, each with its own ``--out`` (and ``--tracemalloc`` in the 300-step runs, for the process
peak row; the 30-step runs go without it, so their tokens/s are the trainer's)::

    mpiexec -n 8 python -m minizero.train --dp 8                                   [--steps 30]
    mpiexec -n 8 python -m minizero.train --dp 2 --tp 2 --pp 2 --micro-batches 4   [--steps 30]

(the default 300 steps, and ``--steps 30``; both layouts train on the same global batches), reads
each JSON summary and prints a Markdown table: training losses at some steps and the largest
per-step difference between the layouts (with the step and both gradient norms there), the final
validation loss, the ledger's peaks per rank by category (for 3D per pipeline stage: ranks
``stage * dp * tp`` .. ``(stage + 1) * dp * tp - 1``, ``minizero/parallel/topology.py``), the
process peak measured by tracemalloc, and the bytes each rank sent. Memory and bytes come from the
300-step runs. A value shown as ``a–b`` ranges over the ranks it covers. MiB = 2**20 bytes,
GiB = 2**30 bytes.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.files import mpiexec_path  # noqa: E402
from minizero.interrupts import run_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

LAYOUTS = {"dp8": ["--dp", "8"], "3d": ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "4"]}
MiB, GiB = 2 ** 20, 2 ** 30


def run(name: str, layout: str, steps: int, folder: str, tracemalloc: bool) -> dict:
    """Run the main job in ``layout`` for ``steps`` steps into ``folder/name``; return its summary."""
    out = os.path.join(folder, name)
    mpiexec = mpiexec_path()
    if mpiexec is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    cmd = [mpiexec, "-n", "8", sys.executable, "-m", "minizero.train", *LAYOUTS[layout], "--steps", str(steps),
           "--tracemalloc" if tracemalloc else "--no-tracemalloc",
           "--sample-tokens", "0", "--no-progress", "--out", out]
    print("running:", " ".join(cmd[3:]), file=sys.stderr, flush=True)
    run_group(cmd, check=True)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
    return load(out)


def load(out: str) -> dict:
    """The summary.json of one run folder."""
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def span(values, unit: float, fmt: str = "{:.2f}", suffix: str = " MiB") -> str:
    """``a`` when all values print equal, else ``min–max``, in ``unit``."""
    lo, hi = fmt.format(min(values) / unit), fmt.format(max(values) / unit)
    return (lo if lo == hi else f"{lo}–{hi}") + suffix


def per_stage(s: dict, get) -> str:
    """``get(rank)`` over each pipeline stage's ranks: one span for pp = 1, else one per stage."""
    return ", ".join(span([get(r) for r in ranks], MiB) + label for ranks, label in stage_ranks(s))


def diffs(a: dict, b: dict) -> list[float]:
    """|training loss of a - training loss of b| at every step."""
    return [abs(x - y) for x, y in zip(a["train_loss"], b["train_loss"])]


def first_over(a: dict, b: dict, tol: float) -> str:
    """The first step whose losses differ by more than ``tol`` ("none" if no step does)."""
    return next((str(i) for i, x in enumerate(diffs(a, b)) if x > tol), "none")


def largest_diff(a: dict, b: dict, upto: int) -> str:
    """Largest |loss difference| over the first ``upto`` steps, its step, and both gradient norms there."""
    d = [abs(x - y) for x, y in zip(a["train_loss"][:upto], b["train_loss"][:upto])]
    i = max(range(len(d)), key=d.__getitem__)
    return (f"{d[i]:.1e} (step {i}; loss {a['train_loss'][i]:.4f}, grad norm {a['grad_norm'][i]:.1f} / "
            f"{b['grad_norm'][i]:.1f})")


def table(r: dict, short: int, long: int) -> list[str]:
    """The Markdown rows of lesson 06's table from the four summaries in ``r``."""
    d8, t3, d8s, t3s = r["dp8_long"], r["3d_long"], r["dp8_short"], r["3d_short"]
    at = sorted({0, 10, 20, short - 1})  # --short-steps 21: step 20 once
    losses = lambda s: " / ".join(f"{s['train_loss'][i]:.4f}" for i in at)  # noqa: E731
    peak = lambda s, c: per_stage(s, lambda k: s["ledger_peak_bytes"][k][c])  # noqa: E731
    cats = lambda s: (", ".join(  # noqa: E731
        " / ".join(span([s["ledger_peak_bytes"][k][c] for k in ranks], MiB, suffix="")
                   for c in ("parameters", "gradients", "optimizer_state")) + " MiB" + label
        for ranks, label in stage_ranks(s)))
    rows = ["| | dp 8 | dp 2 × tp 2 × pp 2 |", "|---|---|---|",
            f"| `--steps {short}`: train loss at steps {' / '.join(map(str, at))} | {losses(d8s)} | {losses(t3s)} |",
            f"| `--steps {short}`: largest loss difference | | {largest_diff(d8s, t3s, short)} |",
            f"| {long} steps: largest loss difference, first {short} steps | | {largest_diff(d8, t3, short)} |",
            f"| {long} steps: largest loss difference, all {long} steps | | {largest_diff(d8, t3, long)} |",
            f"| {long} steps: first step whose losses differ by more than 1e-4 / 1e-3 | | "
            f"{first_over(d8, t3, 1e-4)} / {first_over(d8, t3, 1e-3)} |",
            f"| {long} steps: median loss difference, steps {short}–{long - 1} | | "
            f"{statistics.median(diffs(d8, t3)[short:]):.1e} |",
            f"| {long} steps: validation loss at the end | {d8['val_loss']:.4f} | {t3['val_loss']:.4f} |",
            f"| ledger peak per rank (all categories) | {per_stage(d8, lambda k: d8['ledger_peak_total_bytes'][k])} | "
            f"{per_stage(t3, lambda k: t3['ledger_peak_total_bytes'][k])} |",
            f"| parameters / gradients / Adam state per rank | {cats(d8)} | {cats(t3)} |",
            f"| activation peak per rank | {peak(d8, 'activations')} | {peak(t3, 'activations')} |",
            f"| process peak (tracemalloc) | {per_stage(d8, lambda k: d8['process_peak_bytes'][k])} | "
            f"{per_stage(t3, lambda k: t3['process_peak_bytes'][k])} |",
            f"| bytes sent per rank, {long} steps | {span(d8['bytes_sent'], GiB, suffix=' GiB')} | "
            f"{span(t3['bytes_sent'], GiB, suffix=' GiB')} |"]
    return rows


def reused_note(folder: str, names) -> str:
    """The line under the header with ``--reuse``: when the runs were written (summary.json records no date or
    commit: its file times), since the header's date and source are this machine and checkout now."""
    times = sorted(os.path.getmtime(os.path.join(folder, n, "summary.json")) for n in names)
    when = [f"{datetime.datetime.fromtimestamp(t, datetime.timezone.utc):%Y-%m-%d %H:%M} UTC" for t in times]
    made = when[0] if when[0] == when[-1] else f"{when[0]} to {when[-1]}"
    return (f"runs re-read from {folder}, made {made} (their summary.json files' times; summary.json records no "
            f"commit): the line above is this machine and checkout now, not the runs'")


def stage_ranks(s: dict) -> list[tuple[range, str]]:
    """(ranks, label) per pipeline stage; one unlabelled entry when pp = 1."""
    per = s["dp"] * s["tp"]
    if s["pp"] == 1:
        return [(range(s["world_size"]), "")]
    return [(range(p * per, (p + 1) * per), f" (stage {p})") for p in range(s["pp"])]


def main() -> None:
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=_args.count, default=300, help="the long runs (the trainer's default)")
    p.add_argument("--short-steps", type=_args.count, default=30)
    p.add_argument("--keep", default=None, help="folder to keep the four runs in (default: a temporary one)")
    p.add_argument("--reuse", default=None, help="print from the runs already in this folder instead of running")
    a = p.parse_args()
    if a.short_steps < 21 or a.steps <= a.short_steps:  # equal: no steps after the short runs' for the median row
        p.error(f"--short-steps {a.short_steps} with --steps {a.steps}; allowed: --short-steps >= 21 (losses at "
                "steps 0/10/20) and --steps > --short-steps")
    names = {"dp8_short": ("dp8", a.short_steps), "3d_short": ("3d", a.short_steps),
             "dp8_long": ("dp8", a.steps), "3d_long": ("3d", a.steps)}
    if a.reuse and a.keep:
        p.error("--keep keeps the runs this script makes; with --reuse it makes none: give one of them")
    lacking = [n for n in names if a.reuse and not os.path.isfile(os.path.join(a.reuse, n, "summary.json"))]
    if lacking:
        p.error(f"--reuse {a.reuse!r} holds no {lacking[0]}/summary.json; allowed: the --keep folder of an earlier "
                f"run, with {', '.join(names)}")
    if a.keep and os.path.exists(a.keep) and not os.path.isdir(a.keep):
        p.error(f"--keep {a.keep!r} exists and is not a folder")
    for n, (lay, steps) in [] if a.reuse else names.items():  # the runs' flags and --keep's folders, before any run
        _args.check_train_flags(p, [*LAYOUTS[lay], "--steps", str(steps)], [8], a.keep and os.path.join(a.keep, n))
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    if a.reuse:
        print(reused_note(a.reuse, names), flush=True)
        r = {n: load(os.path.join(a.reuse, n)) for n in names}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            folder = a.keep or tmp
            r = {n: run(n, lay, steps, folder, tracemalloc=n.endswith("_long")) for n, (lay, steps) in names.items()}
    for n, (lay, steps) in names.items():
        if len(r[n]["train_loss"]) != steps:
            sys.exit(f"{n}: {len(r[n]['train_loss'])} steps in its summary, expected {steps}")
    print("\n".join(table(r, a.short_steps, a.steps)))
    g = r["dp8_long"]["grad_norm"]
    top = sorted(range(len(g)), key=lambda i: -g[i])[:4]
    print(f"\nlargest gradient norms of the {a.steps}-step dp 8 run (the loss spikes): " + ", ".join(
        f"step {i} {g[i]:.1f} (loss {r['dp8_long']['train_loss'][i - 1]:.4f} -> {r['dp8_long']['train_loss'][i]:.4f})"
        for i in sorted(top) if i > 0))
    d8, t3 = r["dp8_short"], r["3d_short"]
    print(f"\ntokens/s of the --steps {a.short_steps} runs (tracemalloc off; one run each, {_machine.cores()} cores): "
          f"dp 8 {d8['tokens_per_s']:,.0f}, 3D {t3['tokens_per_s']:,.0f}, 3D / dp 8 = "
          f"{t3['tokens_per_s'] / d8['tokens_per_s']:.2f}")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
