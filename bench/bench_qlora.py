"""Full fine-tuning vs LoRA vs QLoRA on the same data: bytes per parameter and the loss reached.

    python bench/bench_qlora.py                               # trains the default model first (200 steps)
    python bench/bench_qlora.py --weights out/model.npz       # fine-tunes these weights

The base is trained on the embedded corpus (the main job's recipe, one process); the
continuation data is a different text: the source of Python's ``argparse`` module (code, docstrings
and comments) as shipped with this interpreter (``--data`` overrides). Each method
starts from the same weights and takes ``--steps`` AdamW steps on the same batches
(``python -m minizero.finetune --table``). Bytes come from the ledger: frozen weights (float32 or
NF4 with double quantization), trainable weights, optimizer state (Adam's m and v).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

from minizero.args import MAX_STEPS  # noqa: E402
from minizero.data import load_tokens, min_data_bytes  # noqa: E402
from minizero.finetune import main as finetune_main  # noqa: E402
from minizero.nn import PRESETS  # noqa: E402
from minizero.weights import load_trained  # noqa: E402


def base_refusal(args) -> str | None:
    """What fine-tuning would refuse, said before the header and the base's training (minutes): --steps, --weights
    (the default model when None), --lora-rank, --data."""
    if args.steps > MAX_STEPS:
        return f"--steps {args.steps:,} is above fine-tune's {MAX_STEPS:,}; allowed: 1..{MAX_STEPS:,}"
    base = PRESETS["default"]  # what train_base trains
    if args.weights is not None:
        try:
            base = load_trained(args.weights)[0].config
        except (OSError, ValueError) as e:
            return str(e)
    if args.lora_rank > base.n_embd:
        width = (f"the default model's width {base.n_embd}" if args.weights is None else
                 f"the width {base.n_embd} of --weights {args.weights!r}")
        return f"--lora-rank {args.lora_rank} is above {width}; allowed: 1..{base.n_embd}"
    try:
        n = len(load_tokens(args.data))
    except (OSError, ValueError) as e:
        return str(e)
    if n < min_data_bytes(base.block_size):
        return f"--data {args.data!r} has {n:,} bytes; needs at least {min_data_bytes(base.block_size):,}"
    return None


def train_base(steps: int, out: str) -> None:
    """The default model, ``steps`` steps on the embedded corpus, written into folder ``out``."""
    subprocess.run([sys.executable, "-m", "minizero.train", "--steps", str(steps), "--out", out,
                    "--progress", "none", "--sample-tokens", "1"], check=True, capture_output=True)


def main() -> int:
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=None, help="model.npz to fine-tune (default: train the default model)")
    p.add_argument("--data", default=argparse.__file__, help="continuation text")
    p.add_argument("--steps", type=_args.count, default=100)
    p.add_argument("--base-steps", type=_args.count, default=200)
    p.add_argument("--lora-rank", type=_args.count, default=8)
    args = p.parse_args()
    if args.weights is None:
        _args.check_train_flags(p, ["--steps", str(args.base_steps)], [1])
    if refused := base_refusal(args):
        p.error(refused)
    print(_machine.header())
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights
        if weights is None:
            out = os.path.join(tmp, "base")
            train_base(args.base_steps, out)
            weights = os.path.join(out, "model.npz")
        print(f"base: {weights if args.weights else f'default model, {args.base_steps} steps on the embedded corpus'}; "
              f"continuation data: {args.data}; {args.steps} steps, batch 8, lr 1e-3, LoRA rank {args.lora_rank} "
              "alpha 16 on c_attn, c_proj, c_fc\n")
        return finetune_main(["--weights", weights, "--data", args.data, "--table", "--steps", str(args.steps),
                              "--lora-rank", str(args.lora_rank), "--progress", "none"])  # the table only


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
