"""Does the main job's default run train smoothly? A small grid of (peak lr, warmup, clip), measured.

    nice python bench/bench_defaults.py                       # the grid below, the default marked
    nice python bench/bench_defaults.py --settings 2e-3,30,1.0 --fp16-all

Each setting runs the main job's training as ``python -m minizero.train`` would with that
``--lr --warmup --grad-clip`` and every other flag at its default, in one process (in-process, the
library's own ``parse_args`` + ``train``): the default 8-rank job's global batch of 16 sequences
as one micro-batch of 16 (the batch rule ``B = b x dp x k`` makes the layouts the same training,
to rounding). Per setting it prints:

* ``worst jump``: over the steps after warmup, the largest (loss of a step) - (mean of the
  previous 20 steps' losses, fewer at the start), in nats/byte, and the step where it happens;
* ``val``: the validation loss at the end of the default number of steps (nats/byte);
* ``fp16 - fp32``: mean training loss of the last 20 of 200 steps, ``--precision fp16`` at the
  default initial loss scale minus FP32 (a 200-step run of each, the same setting); measured
  only for settings that pass the first two checks (``--fp16-all``: for every setting).

The goals (issue 28): worst jump <= 0.5 nats, val <= 2.2 nats/byte, |fp16 - fp32| <= 0.03.
BLAS runs one thread (the machine is shared; the numbers do not depend on speed).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_machine.py
import _args  # noqa: E402
import _machine  # noqa: E402

from minizero.comm import run_in_threads  # noqa: E402
from minizero.flags import UsageError, build_parser  # noqa: E402
from minizero.numerals import integer, real  # noqa: E402
from minizero.train import model_config, parse_args, train  # noqa: E402

GRID = "3e-3,15,1.0;3e-3,auto,1.0;2e-3,30,1.0"  # the old default (warmup 15 at 300 steps), the default, a lower lr
JUMP_MAX, VAL_MAX, FP16_MAX, WINDOW, FP16_STEPS = 0.5, 2.2, 0.03, 20, 200


def worst_jump(losses, warmup: int) -> tuple[float, int]:
    """max over steps i >= warmup of losses[i] - mean(losses[i-20:i]); returns (jump, step)."""
    best = (-np.inf, -1)
    for i in range(max(warmup, 1), len(losses)):
        jump = losses[i] - float(np.mean(losses[max(0, i - WINDOW):i]))
        best = max(best, (jump, i))
    return best


def train_argv(lr: float, warmup: str, clip: float, extra: list[str]) -> list[str]:
    argv = ["--lr", repr(lr), "--grad-clip", repr(clip), "--micro-batch-size", "16", "--batch-size", "16",
            "--eval-every", "0", "--no-progress", "--no-save"] + extra
    return argv + ([] if warmup == "auto" else ["--warmup", warmup])


def run(lr: float, warmup: str, clip: float, extra: list[str]):
    # (train's TrainResult, the parsed flags); before, it assigned into the result: a TypeError after the run
    args = parse_args(train_argv(lr, warmup, clip, extra), 1)
    return run_in_threads(1, lambda comm: train(args, comm, log=lambda s: None), timeout=7200)[0], args


def triples(text: str) -> list[tuple[float, str, float]]:
    """``type=``: ';'-separated lr,warmup,clip triples; warmup an integer or 'auto'."""
    out = []
    for item in text.split(";"):
        parts = [x.strip() for x in item.split(",")]
        try:
            if len(parts) != 3 or not (parts[1] == "auto" or integer(parts[1]) is not None):
                raise ValueError
            out.append((real(parts[0]), parts[1], real(parts[2])))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: allowed: ';'-separated lr,warmup,clip triples, "
                                             "warmup an integer or auto, e.g. 3e-3,auto,1.0") from None
    return out


def main():
    p = _args.parser(__doc__)
    p.add_argument("--settings", type=triples, default=None,
                   help=f"';'-separated lr,warmup,clip triples (warmup 'auto': the default rule); default: {GRID} "
                   "and the current default")
    p.add_argument("--fp16-all", action="store_true", help="measure fp16 - fp32 for every setting")
    a = p.parse_args()
    threadpool_limits(1)
    d = build_parser().parse_args([])
    default = (d.lr, "auto" if d.warmup is None else str(d.warmup), d.grad_clip)
    settings = a.settings or triples(GRID)
    for lr, warmup, clip in settings:  # the trainer's own checks (lr, warmup, clip), before any run
        try:
            parse_args(train_argv(lr, warmup, clip, []), 1)
        except UsageError as e:
            p.error(f"--settings {lr!r},{warmup},{clip!r}: {e}")
    if a.settings is None and default not in settings:
        settings.append(default)
    print(f"{_machine.header()} | load average {os.getloadavg()[0]:.1f}")
    print(f"default model, global batch 16 x {model_config(parse_args(['--no-save'], 1)).block_size} as one process, "
          f"--steps {d.steps}, seed {d.seed}; goals: worst jump <= {JUMP_MAX}, val <= {VAL_MAX}, "
          f"|fp16 - fp32| <= {FP16_MAX} (nats/byte)\n", flush=True)
    print("| lr | warmup | clip | worst jump after warmup (step) | max grad norm after warmup | val | "
          "fp16 - fp32 (last 20 of 200) | meets goals |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
    for lr, warmup, clip in settings:
        r, args = run(lr, warmup, clip, [])
        w = args.warmup
        jump, at = worst_jump(r["train_losses"], w)
        val = r["val_history"][-1][1]
        ok = jump <= JUMP_MAX and val <= VAL_MAX
        gap = None
        if ok or a.fp16_all:
            tails = [np.mean(run(lr, warmup, clip, ["--steps", str(FP16_STEPS), "--precision", prec])[0]
                             .train_losses[-WINDOW:]) for prec in ("fp32", "fp16")]
            gap = tails[1] - tails[0]
            ok = ok and abs(gap) <= FP16_MAX
        mark = " (default)" if (lr, warmup, clip) == default else ""
        print(f"| {lr:g}{mark} | {w}{' (auto)' if warmup == 'auto' else ''} | {clip:g} | {jump:+.3f} ({at}) | "
              f"{np.nanmax(r['grad_norms'][w:]):.2f} | {val:.4f} | "
              f"{'not run' if gap is None else f'{gap:+.4f}'} | {'yes' if ok else 'no'} |", flush=True)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
