"""FP16 mixed precision against FP32: tokens/s of the main job's path, one process, alternated in one run.

    python bench/bench_fp16.py --micro-batch-size 8 --steps 4 --rounds 3

Each round trains ``--steps`` steps with ``--precision fp32`` and then with ``--precision fp16``
(``minizero.train.train``, 1 rank, no evaluation, no progress, no save) from the same seed; the
first round is a warm-up and is not counted. Printed: the machine header, the load average, the
median tokens/s of each precision over the counted rounds and the median of the per-round
FP16/FP32 ratios (alternation: a loaded machine slows both alike).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402
from minizero.comm import run_in_threads  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; the first is a warm-up")
    a = p.parse_args()
    print(_machine.header(), flush=True)
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    common = ["--model", a.model, "--steps", str(a.steps), "--micro-batch-size", str(a.micro_batch_size),
              "--eval-every", "0", "--no-progress", "--no-save"]

    def run(comm, precision):
        return train(parse_args(common + ["--precision", precision], 1), comm, log=lambda s: None)

    tps = {"fp32": [], "fp16": []}
    for r in range(a.rounds):
        for prec in ("fp32", "fp16"):
            out = run_in_threads(1, run, prec, timeout=3600)[0]
            if r:
                tps[prec].append(out["tokens_per_s"] if isinstance(out, dict) else out.tokens_per_s)
    ratios = [h / s for h, s in zip(tps["fp16"], tps["fp32"])]
    print(f"model {a.model}, micro-batch {a.micro_batch_size}, 1 process, {a.steps} steps x {a.rounds - 1} rounds")
    print("| fp32 tokens/s | fp16 tokens/s | fp16/fp32 (median of rounds) | range |")
    print("|---:|---:|---:|---:|")
    print(f"| {statistics.median(tps['fp32']):.0f} | {statistics.median(tps['fp16']):.0f} | "
          f"{statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
