"""Overlap of gradient communication with backward: step time and exposed communication, on and off.

For each world size N and each strategy (``dp``: data parallelism's bucket all-reduce; ``zero2``:
ZeRO-2's per-unit reduce-scatter, double-buffered), runs ``mpiexec -n N python -m minizero.train
--trace T`` twice (``--no-overlap``, then overlap on, the default), reads the timeline
(:func:`minizero.trace.summarize`, per rank, averaged over ranks) and prints a Markdown table:

  ranks | strategy | overlap | ms/step | exposed comm ms/step | backward ms/step | collective in flight during backward

The anchor of each pair is its ``--no-overlap`` row (the ratio column: step time / that row's).

*Exposed communication* is the union of the blocking-communication lane: the time a rank sat
waiting on messages (gradient buckets still in flight at the optimizer step, the norm, metrics).
Timelines include tracing's own cost (a few microseconds per span).

usage: python bench/bench_overlap.py [--ranks 2,4] [--steps 5] [--model default] [--bucket-mb 1]
                                    [--strategies dp,zero2]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero import trace  # noqa: E402
from minizero.files import mpiexec_path  # noqa: E402
from minizero.interrupts import run_group  # noqa: E402
from minizero.plots import plot_timelines  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from _args import (check_output_path, check_train_flags, count, file_path, parser, positive_real,  # noqa: E402
                   preset, world_sizes)


STRATEGIES = {"dp": [], "zero2": ["--zero", "2"]}  #: strategy name -> its train flags


def run(n: int, overlap: bool, args, strategy: str = "dp") -> tuple[dict, list]:
    """One traced run on ``n`` ranks; returns (:func:`minizero.trace.summarize` averaged over ranks, the events)."""
    path = mpiexec_path()
    if path is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    with tempfile.TemporaryDirectory() as d:
        t = os.path.join(d, "t.json")
        cmd = [path, "-n", str(n), sys.executable, "-m", "minizero.train", *train_flags(args, strategy, overlap),
               "--out", d, "--trace", t]
        run_group(cmd, check=True)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
        with open(t) as f:
            events = json.load(f)["traceEvents"]
    per_rank = [trace.summarize(events, r) for r in range(n)]
    return {k: sum(s[k] for s in per_rank) / n for k in per_rank[0]}, events


def train_flags(args, strategy: str, overlap: bool) -> list[str]:
    """The trainer's flags of one run, less ``--out`` and ``--trace``."""
    return ["--model", args.model, "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--no-tracemalloc", "--no-save", "--bucket-mb",
            str(args.bucket_mb), *STRATEGIES[strategy], *([] if overlap else ["--no-overlap"])]


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=world_sizes, default=[2, 4], help="comma-separated world sizes")
    p.add_argument("--steps", type=count, default=5)
    p.add_argument("--model", type=preset, default="default")
    p.add_argument("--bucket-mb", type=positive_real, default=1.0)
    p.add_argument("--figure", default=None, type=file_path,
                   help="PNG: the last step at the first world size, overlap off and on")
    p.add_argument("--strategies", default="dp,zero2", help=f"comma-separated, from: {', '.join(STRATEGIES)}")
    args = p.parse_args()
    strategies = args.strategies.split(",")
    bad = [x for x in strategies if x not in STRATEGIES]
    if bad:
        p.error(f"--strategies: {bad} not in {list(STRATEGIES)}")
    if args.figure and args.steps < 2:
        p.error(f"--figure draws the last step from the end of the one before: needs --steps >= 2, got {args.steps}")
    if args.figure:
        check_output_path(p, "--figure", args.figure)
    for strategy in strategies:
        for overlap in (False, True):
            check_train_flags(p, train_flags(args, strategy, overlap), args.ranks)
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    print(f"| ranks | strategy | overlap | ms/step | vs --no-overlap | exposed comm ms/step | backward ms/step | "
          f"collective in flight during backward |  ({args.model}, {args.steps} steps, {_machine.cores()} cores)")
    print("|---:|:---|:---|---:|---:|---:|---:|---:|")
    panels = []
    for n in args.ranks:
        for strategy in strategies:
            anchor = None
            for overlap in (False, True):
                s, events = run(n, overlap, args, strategy)
                anchor = anchor or s["step_us"]
                if args.figure and len(panels) < 2 and strategy == strategies[0]:
                    panels.append((f"{n} ranks, {'overlap (default)' if overlap else '--no-overlap'}: the last step",
                                   last_step(events)))
                print(f"| {n} | {strategy} | {'on' if overlap else 'off'} | {s['step_us'] / 1e3:.1f} | "
                      f"{s['step_us'] / anchor:.2f}x | {s['exposed_comm_us'] / 1e3:.1f} | "
                      f"{s['backward_us'] / 1e3:.1f} | {100 * s['overlap_fraction']:.0f}% |", flush=True)
    if args.figure:
        print(plot_timelines(args.figure, panels, f"{args.model} model: gradient all-reduce, blocking vs overlapped"))


def last_step(events) -> list:
    """The ``"X"`` events of the last optimizer step: from the end of the one before to the end of the last."""
    xs = [e for e in events if e.get("ph") == "X"]
    ends = sorted({e["ts"] + e["dur"] for e in xs if e["cat"] == "optimizer" and e["pid"] == 0})
    start, end = ends[-2], ends[-1]
    return [e for e in xs if e["ts"] >= start and e["ts"] + e["dur"] <= end]


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
