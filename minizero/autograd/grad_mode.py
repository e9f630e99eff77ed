"""Grad mode and saved-tensor hooks: the per-thread switches every Function consults.

``no_grad`` / ``enable_grad`` decide whether ``Function.apply`` records a graph;
``saved_tensors_hooks(pack, unpack)`` decides what happens to every array a Function
saves for backward (the seam recompute, offload and quantization plug into). Both are
thread-local, so ranks can run as threads of one process.

Mirrors ``torch.no_grad``, ``torch.enable_grad`` and ``torch.autograd.graph.saved_tensors_hooks``.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def _hooks_stack() -> list:
    stack = getattr(_state, "hooks", None)
    if stack is None:
        stack = _state.hooks = []
    return stack


def is_grad_enabled() -> bool:
    """True unless inside :func:`no_grad` (per thread)."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Context manager: ops record no graph and save nothing (like ``torch.no_grad``)."""
    prev = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = prev


@contextlib.contextmanager
def enable_grad():
    """Context manager: re-enable graph recording inside :func:`no_grad`."""
    prev = is_grad_enabled()
    _state.grad_enabled = True
    try:
        yield
    finally:
        _state.grad_enabled = prev


@contextlib.contextmanager
def saved_tensors_hooks(pack, unpack):
    """Route every array a Function saves through ``pack``; backward calls ``unpack``.

    ``pack(array) -> anything`` runs when ``ctx.save_for_backward`` is called;
    ``unpack(packed) -> array`` runs when backward reads ``ctx.saved_tensors``.
    The innermost active pair wins, and the pair active at *save* time is the
    one used to unpack (as in PyTorch). What ``pack`` returns is what stays
    alive: the ledger counts it as ``activations`` if it is an array.

    Mirrors ``torch.autograd.graph.saved_tensors_hooks``.
    """
    stack = _hooks_stack()
    stack.append((pack, unpack))
    try:
        yield
    finally:
        stack.pop()


def current_saved_tensors_hooks():
    """The innermost active ``(pack, unpack)`` pair of this thread, or None.

    A new pair can hand what it does not handle on to the pair it shadows, so
    techniques compose (ZeRO-3 turns gathered parameters into handles and passes
    activations on to an enclosing offload pair).
    """
    stack = _hooks_stack()
    return stack[-1] if stack else None
