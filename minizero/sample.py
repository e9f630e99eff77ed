"""``python -m minizero.sample``: generate text from a trained GPT's saved weights.

The shape comes from the file (:mod:`minizero.weights`), the weights keep their stored dtype. One byte at a time:
last position's logits (float64) / temperature; with top-k, logits below the k-th largest become -inf; softmax;
one draw from ``default_rng(seed)``; context the last ``block_size`` tokens (nanoGPT's ``sample.py``). Temperature 0
is greedy decoding: the most likely byte every time (argmax, the first of ties), no draw. Bad input
exits with status 2 and one line naming the value and what is allowed. Two lines on stderr name the weights and
the settings (:func:`settings_line`); stdout holds the sample alone, so ``> file`` or ``| head`` gets only text.
"""
from __future__ import annotations

import argparse
import math
import sys
import unicodedata

import numpy as np
from threadpoolctl import threadpool_limits

from minizero import backend
from minizero.autograd import no_grad
from minizero.data import decode, encode, prompt_problem
from minizero.numerals import (DefaultsOnce, OneLineParser, description, error_lines, integer,
                               negative_values_reach_checks, real_as_typed, wrapped)
from minizero.weights import MoEWeights, load_gpt
from minizero.interrupts import NOTHING, interruptible, refuse_several_ranks

#: the most tokens one call generates (as the main job's --sample-tokens)
MAX_TOKENS = 100_000


def printable(text: str, width: int | None = None) -> str:
    """``text`` with control characters (a barely trained model emits them) as U+FFFD; lines cut at ``width``
    terminal columns (a wide character takes 2, a tab up to 8)."""
    shown = "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)
    if width is None:
        return shown
    out = []
    for line in shown.split("\n"):
        out.append("")
        at = 0  # the columns out[-1] takes
        for c in line:
            cols = 8 - at % 8 if c == "\t" else 2 if unicodedata.east_asian_width(c) in "WF" else 1
            if at + cols > width and out[-1]:
                out.append("")
                at, cols = 0, 8 if c == "\t" else cols
            out[-1], at = out[-1] + c, at + cols
    return "\n".join(out)


def next_token_probs(logits, temperature: float, top_k: int | None = None):
    """Sampling distribution from last-position logits. logits: (B, V) float -> (B, V) float64, rows sum to 1.

    ``temperature`` > 0 divides the logits, 0 puts all the mass on each row's largest (the first of ties: greedy);
    ``top_k`` (>= 1, or None for all V) keeps the k largest logits of each row (ties at the k-th value are all kept)
    and zeroes the rest.
    Raises:
        ValueError: temperature < 0 or not finite, top_k < 1.
    """
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be 0 (greedy) or a positive number, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return np.eye(z.shape[-1])[z.argmax(axis=-1)]
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]  # the k-th largest of each row
        z = np.where(z < kth, -np.inf, z)
    with np.errstate(over="ignore"):  # a tiny temperature sends every logit but the largest to -inf: greedy
        p = np.exp((z - z.max(axis=-1, keepdims=True)) / temperature)
    return p / p.sum(axis=-1, keepdims=True)


def sample(model, idx, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = None, rng=None):
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (no grad, eval mode). idx: (B, T) ints -> (B, T + new) int64.

    ``rng``: a NumPy Generator (default ``default_rng(0)``); one draw per row and token.
    With ``top_k=None`` this draws exactly as :meth:`minizero.nn.GPT.generate` does.
    Raises:
        ValueError: as :func:`next_token_probs`; an empty prompt (T = 0).
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    idx = np.asarray(backend.to_host(idx)).astype(np.int64)
    if idx.ndim != 2 or idx.shape[1] == 0:
        raise ValueError(f"the prompt must hold at least one token per row, got shape {idx.shape}")
    next_token_probs(np.zeros((1, 1)), temperature, top_k)  # check the arguments before any work
    was_training = model.training
    model.eval()
    try:  # one BLAS thread: a row of <= block_size tokens is too small to split, and on cores shared with other
        # jobs a second thread waiting for a busy one made sampling an order of magnitude slower (tests/test_sample.py)
        with no_grad(), threadpool_limits(limits=1, user_api="blas"):
            for _ in range(max_new_tokens):
                ctx = idx[:, -model.config.block_size:]
                logits = backend.to_host(model(backend.to_device(ctx)).data[:, -1, :])
                p = next_token_probs(logits, temperature, top_k)
                nxt = p.argmax(axis=-1) if temperature == 0 else np.array([rng.choice(p.shape[-1], p=row) for row in p])
                idx = np.concatenate([idx, nxt[:, None]], axis=1)
    finally:
        model.train(was_training)
    return idx


def sample_text(model, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = None,
                seed: int = 0) -> str:
    """The prompt (UTF-8 bytes) and ``max_new_tokens`` sampled bytes after it, decoded (invalid UTF-8 -> U+FFFD)."""
    out = sample(model, encode(prompt)[None, :], max_new_tokens, temperature, top_k, np.random.default_rng(seed))
    return decode(out[0])


#: Hugging Face's generate and Megatron-LM's names -> a flag here, or what minizero has instead (numerals.unrecognized)
SYNONYMS = {"--max-new-tokens": "--tokens", "--tokens-to-generate": "--tokens", "--temp": "--temperature",
            "--greedy": "--temperature 0", "--load": "--weights", "--model": "--weights",
            "--top-p": "minizero has no nucleus (top-p) sampling; it has --top-k and --temperature"}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m minizero.sample``."""
    p = negative_values_reach_checks(OneLineParser(
        prog="python -m minizero.sample", description=description(__doc__),
        formatter_class=DefaultsOnce,
        epilog="A \ufffd in the sample is a byte (or a run of them) that is not valid UTF-8, or a control character: "
               "the model writes bytes, not characters."))
    p.synonyms = SYNONYMS
    p.add_argument("--weights", default="out/model.npz", help="model.npz written by python -m minizero.train")
    p.add_argument("--prompt", default="The ", help="text the sample continues (UTF-8; at least one byte)")
    p.add_argument("--tokens", type=integer, default=200, help="bytes to generate (1..100,000)")
    p.add_argument("--temperature", type=real_as_typed, default="0.8",
                   help="> 0: lower is more predictable; 0: greedy (always the most likely byte, no randomness)")
    p.add_argument("--top-k", type=integer, default=None,
                   help="draw only among the K most likely bytes (default: all 256, as --top-k 256); "
                        "refused with --temperature 0, where it would have no effect")
    p.add_argument("--seed", type=integer, default=0,
                   help="seed of the sampling generator (the main job uses its --seed)")
    p.add_argument("--device", default="cpu", choices=list(backend.DEVICES),
                   help="where the model runs: cpu (NumPy), cuda (CuPy, GPU LOCAL_RANK %% count), "
                        "strict (host leaks raise)")
    return p


def check(args) -> str | None:
    """The first bad value of ``args`` as one message, or None."""
    if not 1 <= args.tokens <= MAX_TOKENS:
        return f"--tokens must be in 1..{MAX_TOKENS:,}, got {args.tokens}"
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        typed = getattr(args.temperature, "text", args.temperature)  # the text as typed, or a plain number
        return f"--temperature must be 0 (greedy) or a positive finite number, got {typed!r}"
    if args.top_k is not None and not 1 <= args.top_k <= 256:
        return f"--top-k must be in [1, 256] (the byte vocabulary; 256 keeps every byte), got {args.top_k}"
    if args.top_k is not None and args.temperature == 0:
        typed = getattr(args.temperature, "text", args.temperature)
        return f"--top-k {args.top_k} has no effect under greedy --temperature {typed}: drop one of the two"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    return prompt_problem(args.prompt)


def settings_line(args, model) -> str:
    """What ran: ``...sample: out/model.npz (4 layers, ...)``, then ``  200 tokens, temperature 0.8, ...``."""
    c = model.config
    return (f"python -m minizero.sample: {args.weights} ({c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, "
            f"context {c.block_size}, {model.num_parameters():,} parameters, {c.dtype})\n  {args.tokens:,} tokens, "
            f"temperature {args.temperature:g}, top-k {args.top_k or 'all'}, seed {args.seed}, device {args.device}")


def main(argv=None) -> int:
    """Entry point; returns the exit status (2: a bad value or an unusable weights file, one line on stderr)."""
    parser = build_parser()
    refuse_several_ranks(parser)
    args = parser.parse_args(argv)
    err = check(args)
    if err is None:
        try:
            backend.set_device(args.device, backend.local_rank())
        except backend.DeviceError as e:
            err = str(e)
    if err is None:
        try:
            model = load_gpt(args.weights)
        except MoEWeights as e:  # the advice only sample can give
            err = f"{e} (an MoE run's text is the sample its main job prints at its end)"
        except (FileNotFoundError, ValueError) as e:
            err = str(e)
    if err is not None:
        print(error_lines(parser.prog, err), file=sys.stderr)
        return 2
    print(wrapped(settings_line(args, model)), file=sys.stderr, flush=True)
    text = sample_text(model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(printable(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(interruptible("minizero.sample", NOTHING, main))
