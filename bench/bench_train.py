"""Training throughput of the main job: tokens/s of the default model at 1 process and at N ranks.

Launches ``mpiexec -n N python -m minizero.train`` for each world size with the
same per-rank micro-batch, reads the JSON summary, and prints a Markdown table.
Tokens/s counts every token of every rank's micro-batches (global batch x
context) divided by the wall-clock time of the training loop (evaluation,
start-up and the final sample excluded).

usage: python bench/bench_train.py [--ranks 1,8] [--steps 30] [--model default]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from minizero.files import mpiexec_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402


def mpiexec() -> str:
    """``mpiexec`` beside this Python (the mpich wheel), else on PATH; exits with a hint when missing."""
    path = mpiexec_path()
    if path is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    return path

def run(n: int, args) -> dict:
    """Run the main job on ``n`` ranks; return its JSON summary."""
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "summary.json")
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "minizero.train", "--model", args.model,
               "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size), "--eval-every", "0",
               "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--no-tracemalloc",
               "--out", d, "--json", js]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        with open(js) as f:
            return json.load(f)


def main() -> None:
    print(_machine.header(), flush=True)  # date, CPU, BLAS library, kernel, threads
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,8", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--model", default="default")
    args = p.parse_args()
    print(f"| ranks | global batch (seqs) | tokens/s | s/step | BLAS threads/rank |  ({args.model}, {args.steps} steps, "
          f"{os.cpu_count()} cores)")
    print("|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.ranks.split(",")]:
        s = run(n, args)
        step_s = s["elapsed_s"] / args.steps
        print(f"| {n} | {s['config']['train']['batch_size']} | {s['tokens_per_s']:,.0f} | {step_s:.3f} | "
              f"{s['blas_threads_per_rank']} |", flush=True)


if __name__ == "__main__":
    main()
