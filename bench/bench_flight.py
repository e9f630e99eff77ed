"""What the flight recorder costs: the main job's tokens/s with it on and off, alternated, and per operation.

Runs ``mpiexec -n N python -m minizero.train --json J`` ``--rounds`` times with ``--flight-records 0`` and with
the default, alternating (off, on, off, on, ...) so that a machine's drift hits both alike, and prints a
Markdown table of the median tokens/s of each and their ratio. A shared machine's noise is larger than the
recorder's cost: read the per-operation line too, which times ``TrafficLedger.op`` blocks with and without a
recorder in one process, and the operations per step rank 0 records (thread ranks, the same job), whose
product estimates the recorder's share of a step.

usage: python bench/bench_flight.py [--ranks 2] [--steps 20] [--rounds 3] [--model tiny] [--zero 0]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.comm.flight import FlightRecorder  # noqa: E402
from minizero.comm.traffic import TrafficLedger  # noqa: E402
from minizero.files import mpiexec_path  # noqa: E402
from minizero.interrupts import run_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402


def job(n: int, args, records: int | None) -> tuple[float, float]:
    """(tokens/s, seconds per step) of one run (``records``: --flight-records, None for the default)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m", "minizero.train", "--model", args.model,
               "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
               "--no-progress", "--zero", str(args.zero), "--out", d, "--json", os.path.join(d, "s.json"),
               *([] if records is None else ["--flight-records", str(records)])]
        run_group(cmd, check=True)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
        with open(os.path.join(d, "s.json")) as f:
            summary = json.load(f)
        return summary["tokens_per_s"], summary["elapsed_s"] / args.steps


def per_op_us(recorder: bool, reps: int = 20000) -> float:
    """Microseconds of one ``with ledger.op("all_reduce", buf)`` block (no messages) with or without a recorder."""
    import numpy as np
    ledger, buf = TrafficLedger(), np.zeros(4)
    ledger.recorder = FlightRecorder() if recorder else None
    t0 = time.perf_counter()
    for _ in range(reps):
        with ledger.op("all_reduce", buf):
            pass
    return (time.perf_counter() - t0) / reps * 1e6


def ops_per_step(n: int, args) -> float:
    """Flight entries per rank per optimizer step of the same job on ``n`` thread ranks (rank 0's count)."""
    from minizero.comm import run_in_threads
    from minizero.train import parse_args, train

    def body(comm):
        flags = ["--model", args.model, "--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
                 "--zero", str(args.zero)]
        train(parse_args(flags, comm.world_size), comm, log=lambda line: None, callbacks=[])
        return comm.traffic.recorder.groups

    groups = run_in_threads(n, body, timeout=600)[0]
    return sum(g.seq for g in groups.values()) / 4  # set-up and validation included: an upper bound


def main() -> None:
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=_args.world_size, default=2)
    p.add_argument("--steps", type=_args.count, default=20)
    p.add_argument("--rounds", type=_args.count, default=3)
    p.add_argument("--model", type=_args.preset, default="tiny")
    p.add_argument("--zero", type=_args.stage, default=0)
    args = p.parse_args()
    _args.check_train_flags(p, ["--model", args.model, "--steps", str(args.steps), "--zero", str(args.zero)],
                            [args.ranks])  # the runs' flags, before the first one starts
    if mpiexec_path() is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    off, on = [], []
    for _ in range(args.rounds):
        off.append(job(args.ranks, args, 0))
        on.append(job(args.ranks, args, None))
    m_off, m_on = statistics.median(t for t, _ in off), statistics.median(t for t, _ in on)
    step_s = statistics.median(s for _, s in off)
    print(f"| ranks | model | --zero | flight recorder | tokens/s (median of {args.rounds}) | vs off |")
    print("|---:|:---|---:|:---|---:|---:|")
    print(f"| {args.ranks} | {args.model} | {args.zero} | off | {m_off:,.0f} | 1.000 |")
    print(f"| {args.ranks} | {args.model} | {args.zero} | on | {m_on:,.0f} | {m_on / m_off:.3f} |")
    bare, kept = min(per_op_us(False) for _ in range(3)), min(per_op_us(True) for _ in range(3))
    per_step = ops_per_step(args.ranks, args)
    print(f"\none labelled block (traffic.op, no messages): {bare:.2f} us without a recorder, {kept:.2f} us with "
          f"one: {kept - bare:.2f} us per collective recorded (shared machine: timings are noisy)")
    print(f"entries per rank per step (rank 0, set-up and validation included): {per_step:.0f}, so about "
          f"{per_step * max(kept - bare, 0):.0f} us of recording per step of {step_s * 1e3:.1f} ms "
          f"({100 * per_step * max(kept - bare, 0) / 1e6 / step_s:.2f}%)")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
