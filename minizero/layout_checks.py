"""Layouts the command line refuses, in the flags' words (called by :func:`minizero.args.resolve_parallel_args`).

Each check reads a :class:`~minizero.config.TrainConfig` whose dp/tp/pp are resolved and the preset's
GPTConfig ``cfg``; it raises ValueError naming the flags (the techniques' own errors name no flag).
"""
from __future__ import annotations

from minizero.flags import UsageError


def check_sequence_parallel(args, cfg) -> None:
    """``--sequence-parallel`` needs tp > 1, ZeRO 0-1 (ZeRO 2-3 reduce gradients inside backward, before the
    tensor group sums the norms' sequence slices) and a context length T divisible by tp."""
    if not args.sequence_parallel:
        return
    if args.tp == 1:
        raise ValueError("--sequence-parallel splits the sequence over the tensor group: it needs --tp > 1")
    zero = args.zero
    if zero >= 2:
        raise ValueError(f"--sequence-parallel with --zero {zero} is not supported: ZeRO-{zero} reduces gradients "
                         "inside backward, before the tensor group sums the layer norms' sequence slices; use --zero 1")
    t = args.block_size or cfg.block_size
    if t % args.tp:
        raise ValueError(f"--sequence-parallel needs the context length {t} divisible by --tp {args.tp}")


def check_context_parallel(args, cfg) -> None:
    """``--cp`` needs T divisible by 2 cp (two chunks per rank), no dropout (ring attention has none) and,
    with --sequence-parallel, T / cp divisible by tp."""
    cp = args.cp
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if cp == 1:
        return
    t = args.block_size or cfg.block_size
    dropout = args.dropout if args.dropout is not None else cfg.dropout
    if t % (2 * cp):
        raise ValueError(f"--cp {cp} needs the context length {t} divisible by 2 x cp = {2 * cp} (two chunks per rank)")
    if dropout:
        raise ValueError(f"--cp {cp} with --dropout {dropout} is not supported: ring attention has no attention dropout")
    if args.sequence_parallel and (t // cp) % args.tp:
        raise ValueError(f"--cp {cp} with --sequence-parallel --tp {args.tp} needs the local length T / cp = "
                         f"{t // cp} divisible by --tp {args.tp} (sequence parallelism splits each rank's chunks)")


def check_attention(args) -> None:
    """``--attention-block`` must be a positive integer; ``--attention flash`` does not combine with ``--cp``."""
    if args.attention_block < 1:
        raise ValueError(f"--attention-block must be a positive integer (rows per query and key/value block), "
                         f"got {args.attention_block}")
    if args.attention == "flash" and args.cp > 1:
        raise ValueError(f"--attention flash with --cp {args.cp} is not supported: ring attention already runs the "
                         "flash recurrence across ranks, one (T/cp)-row block each (the same block kernel), and does "
                         "not tile that block further; use --attention dense with --cp")


def check_bf16(args) -> None:
    """``--precision bf16 / fp8`` (memory/bf16.py, fp8.py) keep float32 weights and convert plain Linear layers:
    they need --dtype float32 and --tp 1; fp8's delayed scaling also refuses --recompute (a recomputed forward
    would cast again and move the amax history)."""
    p = args.precision
    if p not in ("bf16", "fp8"):
        return
    if args.dtype != "float32":
        raise ValueError(f"--precision {p} keeps float32 weights and Adam state; --dtype must be float32, "
                         f"got {args.dtype}")
    if args.tp > 1:
        raise ValueError(f"--precision {p} with --tp {args.tp} is not supported: it rounds the products of plain "
                         "Linear layers, and tensor-parallel layers are not converted; use --tp 1")
    if p == "fp8" and args.fp8_scaling == "delayed" and args.recompute != "none":
        raise ValueError(f"--precision fp8 --fp8-scaling delayed with --recompute {args.recompute} is not supported: "
                         "the recomputed forward would cast again and advance the amax history; use "
                         "--fp8-scaling current")


def check_zero_bubble(args) -> None:
    """Refuse ``--schedule zb-h1 / zb-v`` where they do not run (parallel/schedule.py, autograd/split_backward.py)."""
    if args.schedule == "zb-v":
        raise UsageError("--schedule zb-v is simulated only (parallel/schedule.py): running it needs rank r to hold "
                         "virtual stages r and 2p-1-r, which stage building, the tied embedding's group and "
                         "gather_full_model do not do yet; use --schedule zb-h1")
    if args.schedule != "zb-h1":
        return
    if args.pp < 2:
        raise UsageError(f"--schedule zb-h1 needs --pp >= 2, got --pp {args.pp}")
    why = {"--sequence-parallel": (args.sequence_parallel,
                                   "its gathered linear all-gathers and reduce-scatters in one backward, which a "
                                   "split backward would run twice"),
           f"--cp {args.cp}": (args.cp > 1, "ring attention with a split backward is not tested"),
           f"--offload-activations {args.offload_activations}": (
               args.offload_activations != "none", "a split backward unpacks saved arrays twice (B and W), "
               "which offload's hooks are not tested for")}
    for flag, (bad, reason) in why.items():
        if bad:
            raise UsageError(f"--schedule zb-h1 with {flag} is not supported: {reason}")
