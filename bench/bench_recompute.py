"""Activation recompute: saved-activation bytes per block (ledger) and step-time overhead, per mode.

For each mode (none / selective / full) it builds the model at two depths,
runs one forward, and reads the ledger's live ``activations`` after forward
(what is kept for backward): the difference between the depths divided by
the layer difference is the bytes one block keeps. Beside it: the formula for
minizero's Functions in 4-byte floats, derived from Korthikanti et al. 2022
(section 4, eq. 1: sbh(34 + 5as/h) bytes per layer with 16-bit activations and
1-byte dropout masks): doubling every activation and keeping the masks at one
byte gives sbh(66 + 9as/h) with dropout, sbh(64 + 4as/h) without; selective
recompute drops the as^2b terms; full recompute keeps only the block input, 4sbh.
Then it times forward+backward (median of ``--repeats``) per mode.

usage: python bench/bench_recompute.py [--model default] [--batch 4] [--dropout 0.1]
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.autograd import manual_seed  # noqa: E402
from minizero.ledger import MemoryLedger, set_ledger  # noqa: E402
from minizero.memory.recompute import MODES, apply_recompute  # noqa: E402
from minizero.nn import GPT, get_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402


def saved_after_forward(cfg, mode, batch):
    """Live activation bytes after one forward (before backward), and the peak over forward+backward."""
    ledger = set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    apply_recompute(model, mode, 1)
    manual_seed(0)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.block_size))
    ledger.reset_peaks()
    loss = model(x, x)[1]
    saved = ledger.current["activations"]
    loss.backward()
    return saved, ledger.peak["activations"]


def step_time(cfg, mode, batch, repeats):
    set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    apply_recompute(model, mode, 1)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.block_size))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model(x, x)[1].backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad()
    return statistics.median(times[1:])


def formula(cfg, mode, batch):
    s, b, h, a = cfg.block_size, batch, cfg.n_embd, cfg.n_head
    drop = cfg.dropout > 0
    if mode == "full":
        return 4 * s * b * h
    linear_part = (66 if drop else 64) * s * b * h
    if mode == "selective":
        return linear_part
    return linear_part + (9 if drop else 4) * a * s * s * b


def main():
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default="default")
    p.add_argument("--batch", type=_args.micro_batch, default=4)
    p.add_argument("--dropout", type=_args.probability, default=0.1)
    p.add_argument("--repeats", type=_args.count, default=5)
    p.add_argument("--threads", type=_args.threads, default=1, help="BLAS threads")
    args = p.parse_args()
    print(_machine.header(_machine.count(args.threads, "thread")), flush=True)  # the runs' threads (it said 2: its own)
    base = get_config(args.model, dropout=args.dropout)
    deep = dataclasses.replace(base, n_layer=2 * base.n_layer)
    print(f"model {args.model}: s={base.block_size} b={args.batch} h={base.n_embd} a={base.n_head} "
          f"L={base.n_layer}, float32, dropout {args.dropout}")
    print("| mode | saved bytes/block (ledger) | formula (4-byte floats) | peak activations, whole model | "
          "step time (s) | vs none |")
    print("|---|---:|---:|---:|---:|---:|")
    t_none = None
    with threadpool_limits(limits=args.threads):
        for mode in MODES:
            s1, peak = saved_after_forward(base, mode, args.batch)
            s2, _ = saved_after_forward(deep, mode, args.batch)
            per_block = (s2 - s1) // base.n_layer
            t = step_time(base, mode, args.batch, args.repeats)
            t_none = t_none or t
            print(f"| {mode} | {per_block:,} | {formula(base, mode, args.batch):,} | {peak:,} | {t:.4f} | "
                  f"{t / t_none:.2f}x |", flush=True)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
