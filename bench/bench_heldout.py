"""Is the held-out end of the built-in text easier to predict than the part trained on? Loss by slice, measured.

    nice python bench/bench_heldout.py                          # the default model, the main job's 300 steps
    nice python bench/bench_heldout.py --model small --steps 100  # a quicker look

Trains as ``python -m minizero.train`` would with every other flag at its default, in one process (the library's
own ``parse_args`` + ``train``, as bench_defaults.py: the default 8-rank job's global batch of 16 sequences as one
micro-batch of 16), then takes, with the trained weights and the job's own ``evaluate``, the mean loss (nats/byte)
of ``--batches`` x 16 random (context + 1)-byte windows drawn from each of: the training split cut into
``--slices`` contiguous slices, the held-out end (the last 10%, the job's validation split); and the loss of the
job's own validation batches (``--eval-batches`` x 16 windows of the held-out end, its seed). ``s.e.``: the standard
error over a row's batches. ``zlib``: the slice's bytes compressed by zlib (level 9), in nats/byte: how predictable
they are with no model at all (the "all slices" row: the slices' mean). The report's note that the built-in
text's held-out end is easier to predict than the rest (``minizero/report.py``) rests on this table. BLAS runs one
thread.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
import zlib

from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _args  # noqa: E402
import _machine  # noqa: E402

from minizero.args import MAX_EVAL_BATCHES  # noqa: E402
from minizero.comm import run_in_threads  # noqa: E402
from minizero.data import eval_batches, load_tokens, train_val_split  # noqa: E402
from minizero.interrupts import refuse_several_ranks  # noqa: E402
from minizero.train import model_config, parse_args, train  # noqa: E402

BATCH = 16  # sequences per batch: the job's validation batches' size (minizero.loop.train)


def train_argv(a) -> list[str]:
    """The trainer's flags: the model, the steps, the 8-rank job's global batch as one process; the rest default."""
    return ["--model", a.model, "--steps", str(a.steps), "--micro-batch-size", "16", "--batch-size", "16",
            "--eval-every", "0", "--no-progress", "--no-save"]


def slices(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous (start, end) byte ranges covering [0, n), as equal as integers allow."""
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def zlib_nats(data) -> float:
    """Size of ``data`` (bytes) compressed by zlib at level 9, in nats per byte of ``data``."""
    raw = bytes(data)
    return len(zlib.compress(raw, 9)) * 8 * math.log(2) / len(raw)


def measure(a) -> dict:
    """Train per :func:`train_argv`; return the job's result figures and, per row, (label, (start, end), batch
    means, zlib nats/byte) measured with the trained weights."""
    args = parse_args(train_argv(a), 1)
    cfg = model_config(args)
    train_tok, val_tok = train_val_split(load_tokens(args.data))
    pad = args.documents == "pad"  # the job's rule for its sampler and its validation

    def rank(comm):
        t = time.perf_counter()
        r = train(args, comm, log=lambda s: None)
        wall, s, rows = time.perf_counter() - t, r.strategy, []
        for i, (lo, hi) in enumerate(slices(len(train_tok), a.slices)):
            batches = eval_batches(train_tok[lo:hi], cfg.block_size, a.batches, BATCH, seed=a.seed, pad=pad)
            rows.append((f"trained on: slice {i + 1} of {a.slices}", (lo, hi), [s.evaluate([b]) for b in batches],
                         zlib_nats(train_tok[lo:hi])))
        end = (len(train_tok), len(train_tok) + len(val_tok))
        held = eval_batches(val_tok, cfg.block_size, a.batches, BATCH, seed=a.seed, pad=pad)
        rows.append(("held out: the end (last 10%)", end, [s.evaluate([b]) for b in held], zlib_nats(val_tok)))
        job = eval_batches(val_tok, cfg.block_size, args.eval_batches, BATCH, seed=args.seed + 1, pad=pad)  # loop's
        rows.append((f"the job's validation batches ({args.eval_batches} x {BATCH}, seed {args.seed + 1})", end,
                     [s.evaluate([b]) for b in job], zlib_nats(val_tok)))
        return {"rows": rows, "job_val": r.val_history[-1][1], "again": s.evaluate(job), "wall_s": wall,
                "train_losses": r.train_losses, "warmup": args.warmup, "block": cfg.block_size,
                "eval_batches": args.eval_batches}

    return run_in_threads(1, rank, timeout=7200)[0]


def row(label: str, span, means: list[float], z: float) -> str:
    """One table row: the label, the byte range, sequences, mean loss, its standard error, zlib nats/byte."""
    se = f"{statistics.stdev(means) / math.sqrt(len(means)):.4f}" if len(means) > 1 else "-"  # 'nan' before
    return (f"| {label} | {span[0]:,}-{span[1]:,} | {len(means) * BATCH:,} | {statistics.fmean(means):.4f} | "
            f"{se} | {z:.3f} |")


def main():
    p = _args.parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default="default")
    p.add_argument("--steps", type=_args.count, default=parse_args(["--no-save"], 1).steps,
                   help="training steps (default: the main job's)")
    p.add_argument("--slices", type=_args.count, default=9,
                   help="contiguous slices of the training split (9: each about the held-out end's length)")
    p.add_argument("--batches", type=_args.between(1, MAX_EVAL_BATCHES), default=16,  # the trainer's --eval-batches'
                   help=f"batches of {BATCH} windows drawn per slice")
    p.add_argument("--seed", type=_args.at_least(0), default=2,
                   help="seed of the windows drawn (the job's validation batches use its --seed + 1 = 1)")
    refuse_several_ranks(p)  # under mpiexec -n 2 each rank trained and printed the whole table
    a = p.parse_args()
    _args.check_train_flags(p, train_argv(a), [1])
    block = model_config(parse_args(train_argv(a), 1)).block_size
    train_bytes = len(train_val_split(load_tokens(None))[0])
    if train_bytes // a.slices < block + 2:
        p.error(f"--slices {a.slices} cuts the training split ({train_bytes:,} bytes) into slices below the "
                f"{block + 2} bytes that drawing a {block + 1}-byte window of model {a.model!r} needs; allowed: "
                f"1..{train_bytes // (block + 2):,}")
    threadpool_limits(1)
    print(f"{_machine.header()} | load average {os.getloadavg()[0]:.1f}", flush=True)
    r = measure(a)
    if r["again"] != r["job_val"]:
        sys.exit(f"the job's validation batches gave {r['again']!r} here, {r['job_val']!r} in the job: not the same")
    print(f"model {a.model}, {a.steps} steps, global batch 16 x {r['block']} as one process, trained in "
          f"{r['wall_s']:.0f} s; windows of {r['block'] + 1} bytes, seed {a.seed}; losses in nats/byte\n")
    print("| text | bytes | sequences | mean loss | s.e. | zlib |")
    print("|---|---:|---:|---:|---:|---:|")
    trained = [x for x in r["rows"] if x[0].startswith("trained on")]
    for label, span, means, z in trained:
        print(row(label, span, means, z))
    pooled = [m for x in trained for m in x[2]]
    print(row(f"trained on: all {a.slices} slices", (0, trained[-1][1][1]), pooled,
              statistics.fmean(x[3] for x in trained)))
    for label, span, means, z in r["rows"][len(trained):]:
        print(row(label, span, means, z))
    held = statistics.fmean(r["rows"][len(trained)][2])
    below = sum(statistics.fmean(x[2]) < held for x in trained)
    recent = r["train_losses"][r["warmup"]:][-20:]
    print(f"\nheld-out end minus all trained-on slices: {held - statistics.fmean(pooled):+.4f}; trained-on slices "
          f"with a lower loss than the held-out end: {below} of {a.slices}")
    median = f"{statistics.median(recent):.4f}" if recent else f"none (no step after warmup {r['warmup']})"
    print(f"training loss, median of the last {len(recent)} steps after warmup (what the report compares "
          f"validation with): {median}; the job's validation loss: {r['job_val']:.4f}")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
