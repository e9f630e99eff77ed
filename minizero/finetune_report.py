"""What ``python -m minizero.finetune`` prints after its runs: the table of methods and the note on a loss that rose."""
from __future__ import annotations

from minizero.ledger import wrap


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
              "  from (base: qlora's NF4 copy, the others' the loaded weights) and of the fine-tuned model (after)"]
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
