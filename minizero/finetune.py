"""Fine-tune trained weights: full, LoRA on the stored base, or QLoRA on an NF4 base (one process).

    python -m minizero.finetune --weights out/model.npz --data more.txt --method qlora --steps 200
    python -m minizero.finetune --weights out/model.npz --table        # full vs lora vs qlora, same data

``--method full`` trains every weight (AdamW); ``lora`` freezes them and trains rank-r adapters on the
``--targets`` projections; ``qlora`` also stores the frozen targets in NF4 with double-quantized
absmax (``minizero/memory/qlora.py``). Optimizer state exists for what trains only. The adapters are
merged (W + (alpha/r) B A) into ``--out`` (``OUT/model.npz`` and its ``model.json``), which
``python -m minizero.sample`` reads. ``--table`` runs the three methods from the same weights, data
and seed and prints, per method, the bytes per model parameter of the weights kept at the end (frozen
base included) and of the gradients and Adam state at their peak (from the memory ledger), and the
validation loss before and after. One process, no parallelism.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from minizero import backend
from minizero.autograd import no_grad
from minizero.data import eval_batches, global_batch, load_tokens, train_val_split
from minizero.files import atomic_write
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.qlora import LoRALinear, apply_lora
from minizero.optim import AdamW
from minizero.weights import SIDECAR, load_gpt, read_weights

METHODS = ("full", "lora", "qlora")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minizero.finetune", description=__doc__.splitlines()[0])
    p.add_argument("--weights", required=True, help="a model.npz written by python -m minizero.train")
    p.add_argument("--data", default=None, help="continuation text (default: the built-in corpus)")
    p.add_argument("--method", default="qlora", choices=METHODS)
    p.add_argument("--lora-rank", type=int, default=8, help="r")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="alpha (the update is scaled by alpha / r)")
    p.add_argument("--targets", default="c_attn,c_fc,c_proj", help="comma-separated Linear names to adapt")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--out", default="out/finetuned", help="folder for the merged model.npz")
    p.add_argument("--table", action="store_true", help="compare full, lora and qlora; write nothing")
    return p


def check_args(args, parser) -> None:
    """Every value checked before any work (parser.error names the flag and what is allowed)."""
    for flag, v in (("--lora-rank", args.lora_rank), ("--steps", args.steps), ("--batch-size", args.batch_size),
                    ("--eval-batches", args.eval_batches)):
        if v < 1:
            parser.error(f"{flag} must be >= 1, got {v}")
    if not args.lora_alpha > 0 or not args.lr > 0:
        parser.error(f"--lora-alpha and --lr must be > 0, got {args.lora_alpha} and {args.lr}")
    if not os.path.isfile(args.weights):
        parser.error(f"--weights {args.weights!r}: no such file")


def run(args, method: str) -> dict:
    """Fine-tune ``args.weights`` by ``method``; {"model", "val_before", "val_after", "bytes", "params"}."""
    ledger = set_ledger(MemoryLedger())
    model = load_gpt(args.weights)
    if model.config.dtype != "float32":
        raise ValueError(f"--weights {args.weights!r} holds {model.config.dtype}; fine-tuning takes float32")
    params = model.config.num_parameters()
    if method != "full":
        apply_lora(model, args.lora_rank, args.lora_alpha, tuple(args.targets.split(",")), quantize=method == "qlora")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = AdamW(trainable, lr=args.lr, weight_decay=0.0)
    train_tokens, val_tokens = train_val_split(load_tokens(args.data))
    t = model.config.block_size
    val = eval_batches(val_tokens, t, args.eval_batches, args.batch_size)
    before = _val_loss(model, val)
    for step in range(args.steps):
        x, y = global_batch(train_tokens, step, args.batch_size, t, args.seed)
        _, loss = model(backend.to_device(x), backend.to_device(y))
        loss.backward()
        opt.step()
        model.zero_grad()
    return {"model": model, "val_before": before, "val_after": _val_loss(model, val), "params": params,
            "bytes": {"parameters": ledger.current["parameters"], "gradients": ledger.peak["gradients"],
                      "optimizer_state": ledger.peak["optimizer_state"]}}


def _val_loss(model, batches) -> float:
    with no_grad():
        losses = [float(backend.to_host(model(backend.to_device(x), backend.to_device(y))[1].data)) for x, y in batches]
    return float(np.mean(losses))


def merged_state(model, weights: str) -> dict:
    """The stored state with every adapted weight replaced by its merged weight (the whole model for full)."""
    state = read_weights(weights)
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            state[f"{name}.weight"] = backend.to_host(m.merged_weight()).astype(state[f"{name}.weight"].dtype)
    if not any(isinstance(m, LoRALinear) for _, m in model.named_modules()):
        state = {k: v for k, v in model.state_dict().items() if k in state}
    return state


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    if args.table:
        print("| method | weights B/param | gradients B/param | Adam state B/param | val loss before | after |")
        print("|---|---:|---:|---:|---:|---:|")
        for method in METHODS:
            r = run(args, method)
            b = {k: v / r["params"] for k, v in r["bytes"].items()}
            print(f"| {method} | {b['parameters']:.3f} | {b['gradients']:.3f} | {b['optimizer_state']:.3f} | "
                  f"{r['val_before']:.4f} | {r['val_after']:.4f} |", flush=True)
        return 0
    r = run(args, args.method)
    os.makedirs(args.out, exist_ok=True)
    state = merged_state(r["model"], args.weights)
    atomic_write(os.path.join(args.out, "model.npz"), lambda f: np.savez(f, **state))
    cfg = dataclasses.asdict(r["model"].config)
    atomic_write(os.path.join(args.out, SIDECAR), lambda f: f.write(json.dumps(cfg, indent=1) + "\n"), mode="w")
    print(f"{args.method}: validation loss {r['val_before']:.4f} -> {r['val_after']:.4f} after {args.steps} steps; "
          f"wrote {os.path.join(args.out, 'model.npz')} (adapters merged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
