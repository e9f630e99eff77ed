"""Layouts the command line refuses, in the flags' words (called by :func:`minizero.args.resolve_parallel_args`).

Each check reads a :class:`~minizero.config.TrainConfig` whose dp/tp/pp are resolved and the preset's
GPTConfig ``cfg``; it raises ValueError naming the flags (the techniques' own errors name no flag).
"""
from __future__ import annotations


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
