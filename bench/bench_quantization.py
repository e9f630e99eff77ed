"""Quantization and sparsity, measured: prints the tables of lesson 07.

    python bench/bench_quantization.py                                  # small model, 200 steps
    python bench/bench_quantization.py --weights out/model.npz          # + weight quantization / pruning
    python bench/bench_quantization.py --model default --steps 200      # the lesson's 8-bit Adam run

Tables (every run through ``minizero.train.train``, ranks as threads of this process, one
BLAS thread each; losses in nats per byte on the validation split):

1. weight quantization of a trained model (``python -m minizero.quantize --table``);
2. 8-bit Adam vs FP32 AdamW over ``--steps`` steps (the main job's recipe on one process):
   losses, optimizer-state bytes per parameter from the ledger, the paper's 2048-element
   blocks, the linear code, and embeddings kept in FP32 (bitsandbytes' StableEmbedding);
3. code books: the error of the state kept by the dynamic vs the linear code;
4. quantized communication (ZeRO++ style) at ``--ranks`` ranks, ZeRO-2 and ZeRO-3: bytes sent
   per step by the ledger and the loss reached;
5. pruning: one-shot magnitude pruning of the trained model (global vs per layer), and
   sparse training from the start; bytes dense / CSR / bitmap.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from threadpoolctl import threadpool_limits  # noqa: E402

from minizero.comm import run_in_threads  # noqa: E402
from minizero.ledger import get_ledger  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402


def run(argv, ranks=1):
    """Train in-process on ``ranks`` thread ranks; every rank's :class:`minizero.loop.TrainResult`."""
    def job(comm):
        args = parse_args(argv + ["--no-progress", "--no-save"], comm.world_size)
        return train(args, comm, log=lambda s: None)
    return run_in_threads(ranks, job, timeout=3600)


def common(a, ranks=1):
    """The main job's recipe: global batch 16 (micro-batch 16 / ranks), lr 3e-3, cosine schedule, clip 1."""
    return ["--model", a.model, "--steps", str(a.steps), "--eval-every", "0", "--eval-batches", str(a.eval_batches),
            "--seed", "0", "--micro-batch-size", str(16 // ranks)]


def tail(result, k=20):
    return float(np.mean(result["train_losses"][-k:]))


def train_loop(model_name, steps, make_opt, eval_batches_n):
    """The main job's recipe on one process (global batch 16, AdamW defaults, cosine schedule, clip 1.0)
    with the optimizer ``make_opt(model)`` builds; returns (val loss, mean train loss of the last 20
    steps, optimizer-state bytes from the ledger, seconds, model, optimizer)."""
    from minizero.data import eval_batches, global_batch, load_tokens, train_val_split
    from minizero.nn import GPT, get_config
    from minizero.optim import clip_grad_norm_, cosine_lr
    from minizero.quantize import evaluate_loss

    cfg = get_config(model_name)
    train_tok, val_tok = train_val_split(load_tokens())
    val = eval_batches(val_tok, cfg.block_size, eval_batches_n, 16, seed=1)
    model = GPT(cfg)
    ledger = get_ledger()
    before = ledger.current["optimizer_state"]
    opt = make_opt(model)
    state = ledger.current["optimizer_state"] - before
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        x, y = global_batch(train_tok, step, 16, cfg.block_size, 0)
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        clip_grad_norm_(model.parameters(), 1.0)
        opt.set_lr(cosine_lr(step, 3e-3, max(1, steps // 20), steps, 3e-4))
        opt.step()
        opt.zero_grad()
    return evaluate_loss(model, val), float(np.mean(losses[-20:])), state, time.perf_counter() - t0, model, opt


def table_adam(a):
    from minizero.optim import AdamW
    from minizero.optim.adam8bit import Adam8bit

    def emb(m):
        return [m.transformer["wte"].weight, m.transformer["wpe"].weight]

    variants = [("AdamW (FP32 state)", lambda m: AdamW(m.parameters(), lr=3e-3)),
                ("Adam8bit B=256", lambda m: Adam8bit(m.parameters(), lr=3e-3)),
                ("Adam8bit B=2048", lambda m: Adam8bit(m.parameters(), lr=3e-3, block_size=2048)),
                ("Adam8bit B=256 linear", lambda m: Adam8bit(m.parameters(), lr=3e-3, code="linear")),
                ("Adam8bit B=256 emb FP32", lambda m: Adam8bit(m.parameters(), lr=3e-3, fp32_params=emb(m)))]
    rows = []
    for name, make in variants:
        val, tl, sb, sec, model, _ = train_loop(a.model, a.steps, make, a.eval_batches)
        rows.append((name, sb, tl, val, sec))
    n = model.num_parameters()
    print(f"\n2. 8-bit Adam vs AdamW: model {a.model!r} ({n:,} parameters), {a.steps} steps, global batch 16, "
          "one process")
    print(f"{'optimizer':<25}{'state bytes':>12}{'per param':>10}{'train (last 20)':>16}{'val loss':>10}"
          f"{'vs AdamW':>10}{'s/step':>8}")
    for name, sb, tl, vl, sec in rows:
        print(f"{name:<25}{sb:>12,}{sb / n:>10.3f}{tl:>16.4f}{vl:>10.4f}{vl - rows[0][3]:>+10.4f}"
              f"{sec / a.steps:>8.3f}")


def table_codes(a):
    """State error of the dynamic vs the linear code on a real Adam state (AdamW, after training)."""
    from minizero.quantization import dequantize_blockwise, quantize_blockwise
    from minizero.optim.adam8bit import make_codes

    from minizero.optim import AdamW

    opt = train_loop(a.model, a.steps, lambda m: AdamW(m.parameters(), lr=3e-3), a.eval_batches)[-1]
    big = [i for i, p in enumerate(opt.params) if p.size >= 4096]
    m = np.concatenate([opt.m[i].reshape(-1) for i in big]).astype(np.float64)
    v = np.concatenate([opt.v[i].reshape(-1) for i in big]).astype(np.float64)
    print(f"\n3. code books on the FP32 AdamW state after {a.steps} steps ({m.size:,} elements of 8-bit-sized tensors)")
    print(f"{'code':<9}{'block':>6}{'state':>6}{'median rel err':>16}{'p99 rel err':>13}{'zeroed':>9}"
          f"{'v=0 but m!=0':>18}")
    for code in ("dynamic", "linear"):
        for block in (256, 2048):
            cm, cv = make_codes(code)
            md = dequantize_blockwise(*quantize_blockwise(m, cm, block), cm, block, dtype=np.float64)
            vd = dequantize_blockwise(*quantize_blockwise(v, cv, block), cv, block, dtype=np.float64)
            for name, x, d in (("m", m, md), ("v", v, vd)):
                nz = x != 0
                rel = np.abs(d[nz] - x[nz]) / np.abs(x[nz])
                bad = int(((vd == 0) & (md != 0)).sum()) if name == "v" else ""
                print(f"{code:<9}{block:>6}{name:>6}{np.median(rel):>16.4f}{np.quantile(rel, 0.99):>13.4f}"
                      f"{int((d[nz] == 0).sum()):>9,}{bad:>18}")


def table_comm(a):
    print(f"\n4. quantized communication: {a.ranks} ranks, model {a.model!r}, {a.steps} steps "
          "(bytes per rank per optimizer step, from the traffic ledger)")
    print(f"{'run':<26}{'bytes/step':>13}{'ratio':>7}{'val loss':>10}{'delta':>9}{'train (last 20)':>17}")
    for stage in (2, 3):
        base = None
        for q in (False, True):
            res = run(common(a, a.ranks) + ["--zero", str(stage)] + (["--quantized-comm"] if q else []), ranks=a.ranks)
            per_step = res[0]["opt"].bytes_per_step()
            val = res[0]["val_history"][-1][1]
            base = base or (per_step, val)
            name = f"ZeRO-{stage}" + (" + INT8 comm" if q else "")
            print(f"{name:<26}{per_step:>13,.0f}{per_step / base[0]:>7.3f}{val:>10.4f}{val - base[1]:>+9.4f}"
                  f"{tail(res[0]):>17.4f}")


def table_weights(a):
    from minizero.quantize import build_parser, format_table, run as qrun

    print("\n1. weight quantization of the trained model")
    print(format_table(qrun(build_parser().parse_args(["--weights", a.weights, "--table", "--eval-batches",
                                                        str(a.eval_batches), "--outlier-threshold", "3.0"]))))


def table_prune_one_shot(a):
    from minizero.data import eval_batches, load_tokens, train_val_split
    from minizero.memory.sparsity import Pruner
    from minizero.quantize import evaluate_loss, load_trained

    if a.weights:
        model, _ = load_trained(a.weights)
        _, val_tok = train_val_split(load_tokens())
        val = eval_batches(val_tok, model.config.block_size, a.eval_batches, 16, seed=1)
        base = evaluate_loss(model, val)
        print(f"\n5a. one-shot magnitude pruning of the trained model's linear weights (no retraining; "
              f"dense val loss {base:.4f})")
        print(f"{'sparsity':>9}{'scope':>8}{'val loss':>10}{'delta':>9}{'dense B':>11}{'CSR B':>11}{'bitmap B':>11}")
        for s in (0.25, 0.5, 0.75, 0.9):
            for scope in ("global", "layer"):
                model, _ = load_trained(a.weights)
                pr = Pruner(model, s, scope)
                pr.prune_()
                rep = pr.report()
                loss = evaluate_loss(model, val)
                print(f"{s:>9.2f}{scope:>8}{loss:>10.4f}{loss - base:>+9.4f}{rep['dense']:>11,}{rep['csr']:>11,}"
                      f"{rep['bitmap']:>11,}")
                if scope == "global":
                    by_kind = {}
                    for name, layer in rep["layers"].items():
                        kind = ".".join(name.split(".")[-3:-1])  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
                        by_kind.setdefault(kind, []).append(layer["sparsity"])
                    print(" " * 17 + "global, pruned per matrix: " + ", ".join(
                        f"{k} {min(v):.0%}-{max(v):.0%}" for k, v in by_kind.items()))


def table_sparse_training(a):
    print(f"\n5b. sparse training from step 0 (model {a.model!r}, {a.steps} steps, one rank, per-layer masks)")
    print(f"{'sparsity':>9}{'val loss':>10}{'train (last 20)':>17}")
    for s in (0.0, 0.5, 0.75):
        r = run(common(a) + (["--prune-sparsity", str(s)] if s else []))[0]
        print(f"{s:>9.2f}{r['val_history'][-1][1]:>10.4f}{tail(r):>17.4f}")


TABLES = ("1", "2", "3", "4", "5", "5a", "5b")  #: --only: table 5 is 5a and 5b


def main():
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_args.preset, default="small")
    p.add_argument("--steps", type=_args.count, default=200)
    p.add_argument("--ranks", type=_args.world_size, default=2,
                   help="thread ranks for the quantized-communication runs")
    p.add_argument("--eval-batches", type=_args.count, default=8)
    p.add_argument("--weights", default=None, help="a trained model.npz (tables 1 and 5a)")
    p.add_argument("--only", default="1,2,3,4,5", help="comma-separated table numbers")
    a = p.parse_args()
    only = set(a.only.split(","))
    if not only <= set(TABLES):
        p.error(f"--only {a.only!r}: allowed: comma-separated table numbers from {', '.join(TABLES)}")
    if a.weights and not only & {"1", "5", "5a"}:
        p.error(f"--weights is read by tables 1 and 5a only; --only {a.only!r} runs neither: drop --weights")
    if a.weights:  # before any table: a bad file would otherwise end the script after the earlier tables
        from minizero.weights import read_weights
        try:
            read_weights(a.weights)
        except (ValueError, OSError) as e:
            p.error(str(e))
    if a.ranks == 1 and "4" in only:  # before: a ZeroDivisionError after tables 2 and 3 (one rank sends nothing)
        p.error("--ranks 1: table 4 compares the bytes ranks send each other; allowed: --ranks >= 2, or --only "
                "without 4")
    threadpool_limits(1)  # before the header: it said this process's 2 threads, the runs had one
    print(_machine.header(), flush=True)  # date, CPU, BLAS library, kernel, threads
    if "1" in only and a.weights:
        table_weights(a)
    if "2" in only:
        table_adam(a)
    if "3" in only:
        table_codes(a)
    if "4" in only:
        table_comm(a)
    if "5" in only or "5a" in only:
        table_prune_one_shot(a)
    if "5" in only or "5b" in only:
        table_sparse_training(a)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
