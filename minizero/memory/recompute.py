"""Activation recompute (gradient checkpointing): keep a segment's inputs, redo its forward in backward.

::

    no recompute:   forward saves every intermediate of every block        memory ~ L x (all of a block)
    full:           forward saves only each block's input x (B, T, C)      memory ~ L x input + 1 block
                    backward: re-run the block's forward with the tape on,
                    back-propagate through it, drop it, go to the next block
    selective:      only the attention core (scores, softmax, dropout, @v) is recomputed;
                    the linear layers' inputs stay saved (Korthikanti et al. 2022, section 5)

``checkpoint(fn, *inputs)`` is one autograd Function: its forward runs ``fn``
under ``no_grad`` (nothing inside is saved) and saves only ``inputs`` — through
``ctx.save_for_backward``, so activation offload composes with it. Its backward
restores the dropout generator to the state it had at forward time, re-runs
``fn`` with the tape on, and calls backward on that small graph. Parameters
used inside ``fn`` are leaves, so their gradients accumulate exactly as
without recompute, and in float64 the results are bitwise equal.

``apply_recompute(model, mode, every)`` installs it on a GPT without touching
the model's code: it replaces the ``forward`` of every ``every``-th block
(full) or the ``attention_core`` of every block (selective) on the instance.

Mirrors ``torch.utils.checkpoint.checkpoint`` (use_reentrant style, RNG state
preserved); Chen et al. 2016 ("Training Deep Nets with Sublinear Memory
Cost"); selective recompute from Korthikanti et al. 2022.
"""
from __future__ import annotations

from minizero.autograd import Function, Tensor, enable_grad, no_grad
from minizero.autograd.functional import fork_rng, get_rng_state, set_rng_state

MODES = ("none", "full", "selective")


class Checkpoint(Function):
    """forward: run ``run_fn`` without recording, save only the inputs; backward: recompute, then backprop.

    Inputs: ``run_fn`` (callable Tensors -> one Tensor) followed by the input
    arrays; output: ``run_fn``'s output array. Saves the inputs (and the
    dropout generator's state, a few bytes).
    """

    @staticmethod
    def forward(ctx, run_fn, *arrays):
        ctx.run_fn = run_fn
        ctx.rng_state = get_rng_state()
        ctx.save_for_backward(*arrays)
        with no_grad():
            out = run_fn(*[Tensor(a) for a in arrays])
        if not isinstance(out, Tensor):
            raise TypeError(f"checkpoint: the function must return one Tensor, got {type(out).__name__}")
        return out.data

    @staticmethod
    def backward(ctx, grad):
        arrays = ctx.saved_tensors
        inputs = [Tensor(a, requires_grad=need) for a, need in zip(arrays, ctx.needs_input_grad[1:])]
        for t in inputs:
            t.grad_category = None  # an activation gradient, not a parameter gradient: not in the ledger
        with fork_rng():  # the generator is put back afterwards: recompute consumes no randomness
            set_rng_state(ctx.rng_state)
            with enable_grad():
                out = ctx.run_fn(*inputs)
        out.backward(grad)
        return (None, *[t.grad if t.requires_grad else None for t in inputs])


def checkpoint(fn, *inputs: Tensor) -> Tensor:
    """Run ``fn(*inputs)`` keeping only ``inputs`` for backward; recompute ``fn`` in backward.

    Args:
        fn: callable taking Tensors and returning one Tensor. Parameters it
            uses must be leaves (module parameters); it must not close over
            other Tensors that require grad (their gradient would be lost).
        inputs: Tensors, e.g. x (B, T, C) for a transformer block.
    Returns:
        ``fn(*inputs)``, with a graph node whose backward recomputes ``fn``.
    Raises:
        TypeError: an input is not a Tensor, or ``fn`` does not return one Tensor.
    """
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise TypeError(f"checkpoint: input {i} is a {type(t).__name__}, expected a Tensor")
    return Checkpoint.apply(fn, *inputs)


def _checkpointed(fn):
    def run(*inputs):
        return checkpoint(fn, *inputs)

    run.__wrapped__ = fn
    return run


def apply_recompute(model, mode: str = "full", every: int = 1) -> list[str]:
    """Install recompute on a GPT's blocks, in place; returns the names of what is recomputed.

    Args:
        model: a :class:`minizero.nn.GPT` (anything with ``transformer["h"]``
            blocks having ``forward`` and ``attn.attention_core``).
        mode: ``"none"``, ``"full"`` (every ``every``-th block, counting from
            block 0) or ``"selective"`` (the attention core of every
            ``every``-th block).
        every: K >= 1.
    Raises:
        ValueError: unknown mode or ``every`` < 1 (the value and what is allowed).
    """
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {MODES}")
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"recompute every K blocks needs K >= 1, got {every!r}")
    done = []
    if mode == "none":
        return done
    for i, block in enumerate(model.transformer["h"]):
        if i % every:
            continue
        if mode == "full":
            object.__setattr__(block, "forward", _checkpointed(type(block).forward.__get__(block)))
            done.append(f"transformer.h.{i}")
        else:
            attn = block.attn
            object.__setattr__(attn, "attention_core", _checkpointed(type(attn).attention_core.__get__(attn)))
            done.append(f"transformer.h.{i}.attn.attention_core")
    return done
