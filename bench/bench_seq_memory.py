"""Saved activation bytes per layer against sequence length s, per recompute mode, and what attribution costs.

For s in 64, 128, 256, 512 and each recompute mode (none / selective / full) it builds the
``default`` model (h = 128, a = 4, float32, no dropout) with context s, runs one training
step's forward with per-module attribution on (``minizero.memory.attribution``), and reads
what block 0 saved for backward, split into the attention scores (the (b, a, s, s) arrays,
``attn:scores``) and the rest. Beside it: the formula (``saved_per_layer``, accounting
"minizero": 64sbh + 4as^2b + 16sb bytes per block in fp32; Korthikanti et al. 2022,
section 4.1). It prints the table and plots bytes per layer against s (log-log) with the
formula's curves and the a*s^2*b term alone, to ``--png``.

Then it times forward + backward of the model at s = 128 with attribution (the hooks on
every module and the ledger's per-module tables) and without (no hooks, and a ledger
subclass that keeps only the per-category totals, as before attribution): median of
``--repeats`` alternating runs, one BLAS thread, and prints the ratio.

``--attention``: instead, dense vs flash attention (``--attention flash``, ``nn/flash_attention.py``) for
s = 256 ... 8192: the ``small`` model's shape with one layer, b = 1, float16 activations (e = 2 bytes)
and dropout 0.1, so the dense core's (s, s) rows are exactly Korthikanti et al.'s 5as^2b (probabilities
2as^2b, dropout mask as^2b, dropout output 2as^2b). It prints what block 0 saved (ledger) beside the
estimator's formula for each core, and the difference beside 5as^2b; the plot goes to ``--png``.

usage: python bench/bench_seq_memory.py [--batch 4] [--png seq_memory.png]
       python bench/bench_seq_memory.py --attention [--png flash_memory.png]

(lesson 03's seq_memory.png is drawn by notebook 03, from the same sweep.)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.ledger import MemoryLedger, set_ledger  # noqa: E402
from minizero.memory.attribution import attach, attention_split, layer_bytes, saved_by_module  # noqa: E402
from minizero.memory.estimator import layer_activation_bytes  # noqa: E402
from minizero.memory.plots import INSTALL_HINT, have_matplotlib, plot_seq_sweep  # noqa: E402
from minizero.memory.recompute import MODES, apply_recompute  # noqa: E402
from minizero.nn import GPT, get_config  # noqa: E402
from minizero.nn.flash_attention import use_flash_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

SEQ_LENS = (64, 128, 256, 512)


def measure(model_name: str, s: int, b: int, mode: str) -> tuple[int, int, int]:
    """(bytes block 0 saved, of which attention scores, the formula's bytes) for one forward."""
    cfg = get_config(model_name, block_size=s)
    set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    apply_recompute(model, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s))
    got = saved_by_module(model, x, x)
    scores, _rest = attention_split(got, "transformer.h.0.attn")
    formula = layer_activation_bytes(cfg, s, b, recompute=mode, accounting="minizero", precision="fp32")
    return layer_bytes(got, "transformer.h.0"), scores, formula


def sweep(model_name: str, b: int, seq_lens=SEQ_LENS) -> dict:
    """``{mode: [(s, ledger bytes, scores bytes, formula bytes)]}`` for block 0."""
    return {mode: [(s, *measure(model_name, s, b, mode)) for s in seq_lens] for mode in MODES}


ATTENTION_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192)


def attention_measure(s: int, attention: str, block: int = 256) -> tuple[int, int]:
    """(bytes block 0 saved, the formula's bytes): one layer of the ``small`` shape, b = 1, float16, dropout 0.1."""
    cfg = get_config("small", n_layer=1, block_size=s, dtype="float16", dropout=0.1)
    set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    if attention == "flash":
        use_flash_attention(model, block)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, s))
    got = layer_bytes(saved_by_module(model, x, x), "transformer.h.0")
    return got, layer_activation_bytes(cfg, s, 1, accounting="minizero", precision="mixed", attention=attention)


def attention_sweep(seq_lens=ATTENTION_SEQ_LENS) -> list[tuple]:
    """Rows (s, dense ledger, dense formula, flash ledger, flash formula, 5as^2b) in bytes."""
    a = get_config("small").n_head
    return [(s, *attention_measure(s, "dense"), *attention_measure(s, "flash"), 5 * a * s * s) for s in seq_lens]


def attention_main(png: str) -> None:
    """Print the dense-vs-flash table and plot it (see the module docstring)."""
    cfg = get_config("small")
    print(f"one layer of the small model: h={cfg.n_embd} a={cfg.n_head} b=1, float16 activations, dropout 0.1; "
          "flash blocks of 256 rows")
    print("| s | dense (ledger) | dense (formula) | flash (ledger) | flash (formula) | dense - flash | 5as²b "
          "| equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    with threadpool_limits(limits=1):
        rows = attention_sweep()
    for s, d, df, f, ff, term in rows:
        print(f"| {s} | {d:,} | {df:,} | {f:,} | {ff:,} | {d - f:,} | {term:,} | {d == df and f == ff} |", flush=True)
    if not have_matplotlib():
        print(INSTALL_HINT)
        return
    seq = [r[0] for r in rows]
    plot_seq_sweep(png, seq, {"dense": [r[1] for r in rows], "flash": [r[3] for r in rows]},
                   {"dense": [r[2] for r in rows], "flash": [r[4] for r in rows]}, {"5as²b": [r[5] for r in rows]},
                   title="one layer, b=1, fp16, dropout 0.1: dense vs flash attention")
    print(f"wrote {png}")


class PlainLedger(MemoryLedger):
    """The ledger as it was before attribution: totals per category only, no per-module tables."""

    def _add(self, category, nbytes, keys):
        self.current[category] += nbytes
        if self.current[category] > self.peak[category]:
            self.peak[category] = self.current[category]
        total = sum(self.current.values())
        if total > self.peak_total:
            self.peak_total = total

    def _release(self, key):
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current[entry[0]] -= entry[1]


def attribution_overhead(model_name: str, b: int, s: int, repeats: int) -> tuple[float, float]:
    """Median forward+backward seconds (plain ledger without hooks, attributing ledger with hooks), alternating."""
    cfg = get_config(model_name, block_size=s)
    model = GPT(cfg, seed=0)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s))
    plain, hooked = [], []
    for i in range(2 * repeats + 2):
        on = i % 2 == 1
        set_ledger(MemoryLedger() if on else PlainLedger())
        detach = attach(model) if on else None
        t0 = time.process_time()  # CPU seconds: less sensitive to other processes than wall time
        model(x, x)[1].backward()
        dt = time.process_time() - t0
        model.zero_grad()
        if detach:
            detach()
        if i >= 2:  # the first pair warms up
            (hooked if on else plain).append(dt)
    return statistics.median(plain), statistics.median(hooked)


def attribution_calls(model_name: str, b: int, s: int, reps: int = 2000) -> tuple[int, int, float]:
    """(hook calls, ledger tracks per forward+backward, CPU seconds of that many calls in isolation).

    The isolated cost: ``hooks`` push/pop pairs and ``tracks`` track calls of a small array
    inside a scope, on an attributing ledger, minus the same tracks on a :class:`PlainLedger`.
    """
    cfg = get_config(model_name, block_size=s)
    led = set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s))
    calls = [0]
    detach = attach(model)
    removers = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
                for _, m in model.named_modules()]
    n_live = [0]
    orig = led.track

    def counting(a, c):
        n_live[0] += 1
        return orig(a, c)
    led.track = counting
    model(x, x)[1].backward()
    detach()
    for r in removers:
        r()
    hooks, tracks = calls[0], n_live[0]
    arrays = [np.zeros((4, 4)) for _ in range(tracks)]

    def run(ledger, scoped):
        t0 = time.process_time()
        for _ in range(reps):
            if scoped:
                for _ in range(hooks):
                    ledger.push_scope("transformer.h.0.attn")
                    ledger.pop_scope()
                ledger.push_scope("transformer.h.0.attn")
            for a in arrays:
                ledger.track(a, "activations")
            for a in arrays:
                ledger.untrack(a)
            if scoped:
                ledger.pop_scope()
        return (time.process_time() - t0) / reps
    return hooks, tracks, run(MemoryLedger(), True) - run(PlainLedger(), False)


def main():
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default=None, help="(default: default; not with --attention)")
    p.add_argument("--batch", type=_args.micro_batch, default=None, help="(default: 4; not with --attention)")
    p.add_argument("--repeats", type=_args.count, default=None, help="(default: 15; not with --attention)")
    p.add_argument("--png", default=None, type=_args.file_path,
                   help="default seq_memory.png (flash_memory.png with --attention) in the current folder")
    p.add_argument("--attention", action="store_true", help="dense vs flash attention, s = 256 ... 8192")
    args = p.parse_args()
    given = [f"--{k}" for k in ("model", "batch", "repeats") if getattr(args, k) is not None]
    if args.attention and given:  # before: ignored, the small model's one layer at b = 1 measured
        p.error(f"{' and '.join(given)}: --attention measures one layer of the small model at b = 1 and takes none "
                "of --model, --batch, --repeats; drop them or --attention")
    args.model, args.batch, args.repeats = args.model or "default", args.batch or 4, args.repeats or 15
    args.png = args.png or ("flash_memory.png" if args.attention else "seq_memory.png")
    _args.check_output_path(p, "--png", args.png)
    print(_machine.header(_machine.count(1, "thread")), flush=True)  # the runs' one BLAS thread (it said its own)
    if args.attention:
        return attention_main(args.png)
    cfg = get_config(args.model)
    print(f"model {args.model}: h={cfg.n_embd} a={cfg.n_head} b={args.batch}, float32, no dropout; block 0")
    print("| recompute | s | saved by the layer (ledger) | of which a·s²·b scores | formula | equal |")
    print("|---|---:|---:|---:|---:|---|")
    with threadpool_limits(limits=1):
        res = sweep(args.model, args.batch)
        for mode, rows in res.items():
            for s, got, scores, formula in rows:
                print(f"| {mode} | {s} | {got:,} | {scores:,} | {formula:,} | {got == formula} |", flush=True)
        plain, hooked = attribution_overhead(args.model, args.batch, cfg.block_size, args.repeats)
        hooks, tracks, cost = attribution_calls(args.model, args.batch, cfg.block_size)
    print(f"attribution per forward+backward: {hooks} module calls (a push and a pop each), {tracks} ledger "
          f"tracks; in isolation they cost {cost * 1e6:.0f} us of CPU more than a plain ledger's tracks, "
          f"{cost / plain:.2%} of the step")
    print(f"A/B, CPU time of forward+backward at s={cfg.block_size}, b={args.batch}, median of {args.repeats} "
          f"alternating runs, 1 BLAS thread: {plain * 1e3:.1f} ms without, {hooked * 1e3:.1f} ms with "
          f"({hooked / plain:.3f}x)")
    if not have_matplotlib():
        print(INSTALL_HINT)
        return
    s = [r[0] for r in res["none"]]
    scores = {f"a·s²·b term alone (4as²b = {4 * cfg.n_head * args.batch}·s² bytes)":
              [4 * cfg.n_head * args.batch * x * x for x in s]}
    plot_seq_sweep(args.png, s, {m: [r[1] for r in rows] for m, rows in res.items()},
                   {m: [r[3] for r in rows] for m, rows in res.items()}, scores,
                   title=f"{args.model} model, b={args.batch}: activations saved by one layer")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
