"""FP16 mixed precision vs FP32: training loss of the same run, step by step, on the embedded corpus.

Trains one rank (in-process) for ``--steps`` steps in FP32 and in FP16 (FP32
master weights, dynamic loss scaling) from the same seed and data, and prints a
table of the mean training loss over windows of steps, the difference, the final
validation losses, the loss scale at the end and the skipped steps. A skipped step drops its batch,
so from there on the two runs follow different trajectories (lesson 04, section 7): when FP16
skipped any, a third run, FP32 with no update at those steps, is the like-for-like reference.

usage: python bench/bench_precision.py [--model small] [--steps 200] [--micro-batch-size 8] [--initial-loss-scale S]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minizero.comm import run_in_threads  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402

import _args  # noqa: E402
import _machine  # noqa: E402


def main():
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default="small")
    p.add_argument("--steps", type=_args.count, default=200)
    p.add_argument("--micro-batch-size", type=_args.count, default=8)
    p.add_argument("--window", type=_args.count, default=20)
    p.add_argument("--initial-loss-scale", type=_args.positive_real, default=None,
                   help="fp16's starting scale (default 2^16); a lower one that never overflows skips no batch")
    a = p.parse_args()
    _args.check_window(p, a.window, a.steps)
    common = ["--model", a.model, "--steps", str(a.steps), "--micro-batch-size", str(a.micro_batch_size),
              "--eval-every", "0", "--eval-batches", "4", "--no-progress", "--no-save"]
    scale = ["--initial-loss-scale", str(a.initial_loss_scale)] if a.initial_loss_scale else []
    for flags in (["--precision", "fp32"], ["--precision", "fp16", *scale]):  # both runs', before either trains
        _args.check_train_flags(p, common + flags, [1])

    def run(comm, precision, drop=()):
        extra = []
        if precision == "fp16" and a.initial_loss_scale:
            extra = ["--initial-loss-scale", str(a.initial_loss_scale)]

        def skip_dropped(step, params, opt):  # FP32 reference: no update at the steps FP16 skipped
            opt.__dict__.pop("step", None)  # (its learning-rate schedule still advances there)
            if step in drop:
                opt.step = lambda *args, **kwargs: None

        return train(parse_args(common + ["--precision", precision] + extra, 1), comm, log=lambda s: None,
                     after_grads=skip_dropped if drop else None)

    r32 = run_in_threads(1, run, "fp32", timeout=3600)[0]
    r16 = run_in_threads(1, run, "fp16", timeout=3600)[0]
    drop = tuple(r16["skipped_at"])  # a skipped step drops its batch: compare with FP32 dropping the same
    r32d = run_in_threads(1, run, "fp32", drop, timeout=3600)[0] if drop else r32
    print(_machine.header())
    print(f"model {a.model}, {a.steps} steps, micro-batch {a.micro_batch_size}, 1 rank; mean training loss (nats/byte)")
    print("| steps | fp32 | fp16 | fp16 - fp32 | fp32, fp16's skipped batches dropped | fp16 - that |")
    print("|---|---:|---:|---:|---:|---:|")
    for lo in range(0, a.steps, a.window):
        l32, l16, l32d = (np.mean(r["train_losses"][lo:lo + a.window]) for r in (r32, r16, r32d))
        print(f"| {lo}-{min(lo + a.window, a.steps) - 1} | {l32:.4f} | {l16:.4f} | {l16 - l32:+.4f} | {l32d:.4f} "
              f"| {l16 - l32d:+.4f} |")
    v32, v16, v32d = (r["val_history"][-1][1] for r in (r32, r16, r32d))
    print(f"\nvalidation loss: fp32 {v32:.4f}, fp16 {v16:.4f} (difference {v16 - v32:+.4f}), fp32 with fp16's "
          f"skipped batches dropped {v32d:.4f} (fp16 - that {v16 - v32d:+.4f}); fp16 loss scale at the end "
          f"{r16['loss_scales'][-1]:g}, skipped steps {r16['skipped_steps']}"
          + (f" (at step{'s' * (len(drop) > 1)} {', '.join(map(str, drop))}: FP32 applied those batches, "
             f"FP16 dropped them)" if drop else ""))

if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
