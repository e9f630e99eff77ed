"""BF16 and FP8 against FP32: training loss of the same run, and FP8's saturated and underflowed elements.

Trains one rank (in-process) for ``--steps`` steps in FP32, BF16 (``--precision bf16``) and FP8 with
delayed and with current scaling (``--precision fp8 --fp8-scaling ...``), from the same seed and data,
and prints the mean training loss over windows of steps for each, the largest per-step gap to FP32,
the final validation losses, and, per tensor kind of every FP8 Linear (x, W: E4M3; gradient: E5M2),
the fraction of elements that saturated at the format's max and of nonzero elements that became 0.
No loss scale anywhere (none is needed: the scales are per tensor).

usage: python bench/bench_low_precision.py [--model default] [--steps 200] [--micro-batch-size 8]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.comm import run_in_threads  # noqa: E402
from minizero.memory.fp8 import FP8Linear  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

RUNS = {"fp32": [], "bf16": ["--precision", "bf16"], "fp8 delayed": ["--precision", "fp8", "--fp8-scaling", "delayed"],
        "fp8 current": ["--precision", "fp8", "--fp8-scaling", "current"]}


def fp8_stats(stage) -> dict:
    """{"x" | "w" | "g": (elements, saturated, underflowed)} summed over every FP8Linear of ``stage``."""
    out = {}
    for _, m in stage.named_modules():
        if isinstance(m, FP8Linear):
            for kind, cast in m.casts.items():
                st = cast.stats()
                e, s, u = out.get(kind, (0, 0, 0))
                out[kind] = (e + st["elements"], s + st["saturated"], u + st["underflowed"])
    return out


def main():
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default="default")
    p.add_argument("--steps", type=_args.count, default=200)
    p.add_argument("--micro-batch-size", type=_args.count, default=8)
    p.add_argument("--window", type=_args.count, default=40)
    a = p.parse_args()
    _args.check_window(p, a.window, a.steps)
    common = ["--model", a.model, "--steps", str(a.steps), "--micro-batch-size", str(a.micro_batch_size),
              "--eval-every", "0", "--eval-batches", "4", "--no-progress", "--no-save"]
    for extra in RUNS.values():  # every run's flags, before the first one trains
        _args.check_train_flags(p, common + extra, [1])
    print(_machine.header(), flush=True)

    def run(comm, extra):
        res = train(parse_args(common + extra, comm.world_size), comm, log=lambda s: None)
        return res.train_losses, res.val_history[-1][1], fp8_stats(res.strategy.stage)

    results = {}
    for name, extra in RUNS.items():
        results[name] = run_in_threads(1, run, extra)[0]
        print(f"{name}: done, validation loss {results[name][1]:.4f}", flush=True)
    ref = np.array(results["fp32"][0])
    print(f"\nmodel {a.model}, {a.steps} steps, micro-batch {a.micro_batch_size}, 1 rank; "
          "mean training loss per window")
    print("| steps | " + " | ".join(RUNS) + " |")
    print("|---|" + "---:|" * len(RUNS))
    for lo in range(0, a.steps, a.window):
        hi = min(lo + a.window, a.steps)
        print(f"| {lo}-{hi - 1} | " + " | ".join(f"{np.mean(results[n][0][lo:hi]):.4f}" for n in RUNS) + " |")
    print("| largest per-step gap to fp32 | " + " | ".join(
        f"{np.abs(np.array(results[n][0]) - ref).max():.4f}" for n in RUNS) + " |")
    print("| final validation loss | " + " | ".join(f"{results[n][1]:.4f}" for n in RUNS) + " |")
    print("\nFP8 casts over the whole run, per tensor kind (fraction of elements)")
    print("| run | tensor | format | elements | saturated | underflowed to 0 |")
    print("|---|---|---|---:|---:|---:|")
    for name in ("fp8 delayed", "fp8 current"):
        for kind, (e, s, u) in results[name][2].items():
            fmt = "E5M2" if kind == "g" else "E4M3"
            label = {"x": "x (Linear input)", "w": "W", "g": "gradient of the output"}[kind]
            print(f"| {name} | {label} | {fmt} | {e:,} | {s / e:.2e} | {u / e:.2e} |")
    diverged = [n for n in RUNS if not np.isfinite(results[n][0]).all()]
    print("\nno run diverged" if not diverged else f"\nDIVERGED: {diverged}")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
