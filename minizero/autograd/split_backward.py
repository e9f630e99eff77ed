"""The backward split into B (input gradients, now) and W (weight gradients, later): zero-bubble pipelines' seam.

Under ``WeightGradients(params).deferring()`` nodes with a weight input are kept; ``run()`` later computes their
weight gradients, in order, bitwise the unsplit backward's. Source: Qi et al., arXiv:2401.10241, section 2.
"""
from __future__ import annotations

import contextlib

from minizero.autograd.engine import Tensor, _accumulate_leaf, _contribution_done, _running, call_backward
from minizero.ledger import get_ledger


class WeightGradients:
    """The W work of one backward: the weight gradients of ``weights`` (leaf Tensors), deferred.

    Use :meth:`deferring` around ``backward(...)`` (B), then :meth:`run` once (W).
    """

    def __init__(self, weights):
        self._ids = {id(w) for w in weights}
        self._work = []  # (node, output gradients, weight input indices, the backward's pending counts, retain)

    @contextlib.contextmanager
    def deferring(self):
        """Within: every backward (nested ones too) leaves the weights' gradients to :meth:`run`."""
        outer = getattr(_running, "split", None)
        _running.split = self
        try:
            yield self
        finally:
            _running.split = outer

    def deferred_inputs(self, node) -> frozenset:
        """Indices of ``node``'s inputs that are weights of this W (called by the engine per node)."""
        return frozenset(i for i, e in enumerate(node.edges) if isinstance(e, Tensor) and id(e) in self._ids)

    def defer(self, node, outs, inputs, pending, retain_graph) -> None:
        """Keep ``node`` (saved arrays and output gradients ``outs``) for :meth:`run` (called by the engine)."""
        for g in outs:
            get_ledger().track(g, "activations")
        self._work.append((node, outs, inputs, pending, retain_graph))

    def run(self) -> None:
        """W: the weight gradients, node by node in B's order, accumulated into ``.grad``; nodes freed."""
        work, self._work = self._work, []
        for node, outs, inputs, pending, retain_graph in work:
            in_grads = call_backward(node, outs, skip=frozenset(range(len(node.edges))) - inputs)
            for i in sorted(inputs):
                leaf, g = node.edges[i], in_grads[i]
                if g is not None:
                    if g.shape != leaf.shape:
                        raise RuntimeError(f"{node.fn.__name__}.backward gave a gradient of shape {g.shape} "
                                           f"for a weight of shape {leaf.shape}")
                    _accumulate_leaf(leaf, g)
                _contribution_done(leaf, pending)
            if not retain_graph:
                node.release()
