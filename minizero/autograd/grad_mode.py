"""Grad mode and saved-tensor hooks: the per-thread switches every Function consults.

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
    """Route every array a Function saves through ``pack``; backward calls ``unpack`` (the pair active at save time).

    What ``pack`` returns stays alive (counted as ``activations`` if an array). Mirrors
    ``torch.autograd.graph.saved_tensors_hooks``.
    """
    stack = _hooks_stack()
    stack.append((pack, unpack))
    try:
        yield
    finally:
        stack.pop()


def current_saved_tensors_hooks():
    """The innermost active ``(pack, unpack)`` pair of this thread, or None (a new pair may hand arrays on to it)."""
    stack = _hooks_stack()
    return stack[-1] if stack else None
