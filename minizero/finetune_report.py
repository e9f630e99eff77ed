"""What ``python -m minizero.finetune`` prints: the header before its runs, then the table of methods and the note
on a loss that rose."""
from __future__ import annotations

from minizero.ledger import wrap


EVAL_SEQUENCES = 16  #: sequences per validation batch (--eval-batches counts these)


def header(args, cfg, n_params: int, world_size: int) -> list[str]:
    """Rank 0's wrapped lines before any work: what is trained, on what, how long, and on which ranks (the first
    step comes only after the validation passes the line's end names); none with ``--progress none``."""
    if args.progress == "none":
        return []
    methods = ("full", "lora", "qlora") if args.table else (args.method,)
    what = "--table: full, lora, qlora in turn" if args.table else f"--method {args.method}"
    targets = args.targets.replace(",", ", ")
    adapters = f"; adapters of rank {args.lora_rank}, alpha {args.lora_alpha:g} on {targets}"
    data = "the embedded corpus" if args.data is None else repr(args.data)
    nf4 = ", then of the NF4 copy" if "qlora" in methods else ""
    return wrap(f"python -m minizero.finetune: {what} on {args.weights} ({n_params:,} parameters; {cfg.n_layer} "
                f"layers, width {cfg.n_embd}, context {cfg.block_size}); data: {data}; {args.steps} step(s) x "
                f"{args.batch_size} sequences x {cfg.block_size} tokens, lr {args.lr:g} (constant)"
                f"{adapters if methods != ('full',) else ''}; {world_size} rank(s): dp {world_size // args.tp} x tp "
                f"{args.tp}, {f'ZeRO-{args.zero}' if args.zero else 'no ZeRO'}; before the first step, the validation "
                f"loss ({args.eval_batches} batch(es) of {EVAL_SEQUENCES} sequences) of the loaded weights{nf4}")


def format_table(rows: list) -> str:
    lines = [f"{'method':<7} {'trainable':>10} {'frozen B':>12} {'trainable B':>12} {'optimizer B':>12} "
             f"{'B/param':>8}  {'val before':>10} {'val base':>9} {'val after':>10}"]
    for r in rows:
        per = (r["frozen_bytes"] + r["trainable_bytes"] + r["optimizer_bytes"]) / r["num_parameters"]
        lines.append(f"{r['method']:<7} {r['trainable_parameters']:>10,} {r['frozen_bytes']:>12,} "
                     f"{r['trainable_bytes']:>12,} {r['optimizer_bytes']:>12,} {per:>8.3f}  "
                     f"{r['val_before']:>10.4f} {r['val_base']:>9.4f} {r['val_after']:>10.4f}")
    lines += ["trainable: parameters trained; B: bytes per rank (the ledger) of the frozen weights, the trained",
              "  weights and Adam's state; B/param: their sum over the model's "
              f"{rows[0]['num_parameters']:,} parameters",
              "val: validation loss (nats per byte) of the loaded weights (before), of the weights training starts",
              "  from (base: qlora's NF4 copy, the others' the loaded weights) and of the fine-tuned model (after);",
              "  NF4's rounding is noise: qlora's base may end a little below before as well as above"]
    return "\n".join(lines)


def rose_note(rows: list, lr: float, steps: int) -> list[str]:
    """The note (wrapped lines; [] when none) naming the methods that ended above the validation loss they started
    from (``val_after > val_base``), and why: a constant ``--lr`` with no warmup moves every trained weight by
    about lr in Adam's first steps (m / sqrt(v) is about +-1 there), and a few steps do not make up for it."""
    rose = [f"{r['method']} ({r['val_base']:.4f} -> {r['val_after']:.4f})" for r in rows
            if not r["val_after"] <= r["val_base"]]  # NaN too: diverged
    if not rose:
        return []
    return wrap(f"note: {', '.join(rose)} ended above the loss training started from: the constant --lr {lr:g} "
                f"(no warmup) moves every trained weight by about lr in Adam's first steps, and {steps} step(s) do "
                "not make up for it; give more --steps (the loss comes back down) or a smaller --lr")
