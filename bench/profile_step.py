"""Where minizero's training step spends its time, beside PyTorch's whole step (what limits the ratio).

    python bench/profile_step.py --batch 8,32

The step of ``bench/bench_vs_torch.py`` (default model, float32, AdamW), run ``--steps`` times under
``cProfile`` after a warm-up; each function's own time is put in one of four parts:

    matmul        minizero/backend.py's BLAS call (NumPy's ``matmul`` on OpenBLAS)
    elementwise   NumPy's ufuncs, reductions, copies and casts, and the own time of the kernels in
                  minizero/autograd/ (kernels.py, functional.py, ops.py): cProfile does not see ``a + b``
                  on arrays as a call, so a kernel's array arithmetic is its own time
    optimizer     AdamW's update (its NumPy calls are counted here, not under elementwise)
    python        everything else: the tape, modules, hooks, argument checks

Printed per batch: seconds per step of each part, minizero's step without the profiler, PyTorch's step
(when installed) and the ratio PyTorch would need minizero's matmuls alone to beat. cProfile slows the
Python part, so the parts are shares of the profiled step, scaled to the unprofiled step time.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _machine  # noqa: E402
from bench_vs_torch import MinizeroSide, torch, torch_side  # noqa: E402

from minizero.nn import get_config  # noqa: E402

PARTS = ("matmul", "elementwise", "optimizer", "python")


def part_of(filename: str, name: str, under_adamw: bool) -> str:
    """The part a profiled function's own time belongs to."""
    if filename.endswith("minizero/backend.py") and name == "_blas_matmul":
        return "matmul"
    if under_adamw:
        return "optimizer"
    if filename == "~" and ("numpy" in name or "ufunc" in name or "ndarray" in name):
        return "elementwise"
    if any(filename.endswith(f"minizero/autograd/{k}.py") for k in ("kernels", "functional", "ops")):
        return "elementwise"
    return "python"


def step_seconds(fn, batches, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``fn`` on the batches in turn."""
    times = []
    for s in range(steps):
        t = time.perf_counter()
        fn(*batches[s % len(batches)])
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def profile(batch: int, steps: int) -> dict:
    cfg = get_config("default")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (batch, cfg.block_size)), rng.integers(0, 256, (batch, cfg.block_size)))
               for _ in range(4)]
    side = MinizeroSide(cfg)
    for s in range(3):  # warm-up
        side.step(*batches[s % 4])
    plain = step_seconds(side.step, batches, steps)
    pr = cProfile.Profile()
    pr.enable()
    for s in range(steps):
        side.step(*batches[s % 4])
    pr.disable()
    stats = pstats.Stats(pr).stats
    adamw = {key for key in stats if key[0].endswith("minizero/optim/adamw.py")}
    parts = dict.fromkeys(PARTS, 0.0)
    for key, (_, _, own, _, callers) in stats.items():
        under = key in adamw or any(c in adamw for c in callers)
        parts[part_of(key[0], key[2], under)] += own
    total = sum(parts.values())
    out = {p: plain * v / total for p, v in parts.items()}  # shares of the profiled step, scaled to the plain one
    out["minizero"] = plain
    tstep = torch_side(cfg)
    if tstep is not None:
        for s in range(6):  # PyTorch's first steps warm its allocator and kernels
            tstep(*batches[s % 4])
        out["pytorch"] = step_seconds(tstep, batches, steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="8,32", help="comma-separated batch sizes (sequences of 128 bytes)")
    p.add_argument("--steps", type=int, default=6, help="profiled steps (and timed steps of each side)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / torch intra-op threads")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (default: keep freed memory, as the main job does)")
    args = p.parse_args()
    malloc = _machine.set_malloc(args.default_malloc)
    if args.steps < 1 or args.threads < 1:
        p.error(f"--steps and --threads must be >= 1, got {args.steps} and {args.threads}")
    if torch is not None:
        torch.set_num_threads(args.threads)
    with threadpool_limits(args.threads):
        rows = [(int(b), profile(int(b), args.steps)) for b in args.batch.split(",")]
        print(_machine.header() + " | " + malloc)
    print("| batch | matmul, s | elementwise, s | optimizer, s | python, s | minizero step, s | PyTorch step, s | "
          "matmul / PyTorch step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for b, r in rows:
        torch_cell = f"{r['pytorch']:.3f}" if "pytorch" in r else "-"
        ratio = f"{r['matmul'] / r['pytorch']:.2f}" if "pytorch" in r else "-"
        print(f"| {b} | " + " | ".join(f"{r[k]:.3f}" for k in PARTS) + f" | {r['minizero']:.3f} | {torch_cell} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
