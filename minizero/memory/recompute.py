"""Activation recompute (gradient checkpointing): keep a segment's inputs, redo its forward in backward.

Backward restores the dropout generator's state and re-runs the segment (float64 bitwise equal).
Mirrors: ``torch.utils.checkpoint.checkpoint``; Chen et al. 2016; selective recompute, Korthikanti et al.,
arXiv:2205.05198, section 5.
"""
from __future__ import annotations

import numbers

from minizero.autograd import Function, Tensor, enable_grad, no_grad
from minizero.autograd.functional import fork_rng, get_rng_state, set_rng_state
from minizero.nn.module import Module

MODES = ("none", "full", "selective")  #: full: whole blocks; selective: only attention's core (Korthikanti et al.)


class Checkpoint(Function):
    """forward: run ``run_fn`` without recording, save only the inputs (and the generator state); backward:
    recompute."""

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
    """Run ``fn(*inputs)`` keeping only ``inputs`` (Tensors) for backward; recompute ``fn`` in backward.

    ``fn`` returns one Tensor; it may use parameters (the recompute's backward adds to their ``.grad``), but no other
    non-leaf Tensor that requires grad (that backward would run, and free, the part of the graph that made it).
    Raises TypeError: an input is not a Tensor, or ``fn`` does not return one Tensor.
    """
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise TypeError(f"checkpoint: input {i} is a {type(t).__name__}, expected a Tensor")
    return Checkpoint.apply(fn, *inputs)


class CheckpointWrapper(Module):
    """A module running ``checkpoint(inner, *tensors)``; shares ``inner``'s parameter names (no ``inner.`` prefix).

    Hooks on the wrapper run around the checkpointed call, not on recompute.
    """

    def __init__(self, inner: Module):
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a child: its children are ours (same names)
        object.__setattr__(self, "_parameters", inner._parameters)
        object.__setattr__(self, "_modules", inner._modules)

    @property
    def training(self) -> bool:  # inner's: Module.train() reaches the wrapper in inner's place, never inner
        return self.inner.training

    @training.setter
    def training(self, mode: bool) -> None:
        if "inner" in vars(self):  # Module.__init__ sets a default before inner exists: skipped
            self.inner.training = mode

    def __getattr__(self, name):  # only called when normal lookup fails
        if name == "inner":  # not set yet (copy and pickle build the object first): raise, not recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name == "inner":  # its tables are inner's: a new inner is a new wrapper (Module.swap_modules)
            raise AttributeError("a CheckpointWrapper's inner module is fixed; swap the wrapper instead")
        setattr(self.inner, name, value)

    def map_wrapped(self, fn) -> Module:  # Module.map_wrapped: this wrapper, around fn's replacement of the inner
        return CheckpointWrapper(self.inner.map_wrapped(fn))

    def forward(self, *args):
        pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        inner = self.inner

        def run(*tensors):
            full = list(args)
            for i, t in zip(pos, tensors):
                full[i] = t
            return inner(*full)

        return checkpoint(run, *[args[i] for i in pos])


def apply_recompute(model, mode: str = "full", every: int = 1) -> list[str]:
    """Put a :class:`CheckpointWrapper` around every ``every``-th block (``"full"``) or its ``attn.core``
    (``"selective"``), by ``model.swap_modules`` (an interleaved stage's chunks get the same wrappers).

    In place on a GPT or (interleaved) stage; returns what is recomputed. Raises ValueError (before any change):
    unknown mode, ``every`` < 1, or recompute already applied.
    """
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {MODES}")
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:  # np.int64 too; not True for 1
        raise ValueError(f"recompute every K blocks needs K >= 1, got {every!r}")
    if mode == "none":
        return []
    for name, block in model.transformer["h"].named_children():
        if isinstance(block, CheckpointWrapper) or isinstance(block.attn.core, CheckpointWrapper):
            raise ValueError(f"recompute is already applied to transformer.h.{name}")
    chosen = {id(b if mode == "full" else b.attn.core) for b in list(model.transformer["h"])[::every]}
    return model.swap_modules(lambda m: CheckpointWrapper(m) if id(m) in chosen else None)


def recomputed_blocks(n_blocks: int, every: int) -> str:
    """Which of a stage's ``n_blocks`` :func:`apply_recompute` wraps: ``block 0``, ``blocks 0, 7, 14, ..., 63``."""
    ks = list(range(0, n_blocks, every))
    return f"block{'s' * (len(ks) > 1)} {', '.join(map(str, ks if len(ks) <= 5 else [*ks[:3], '...', ks[-1]]))}"
