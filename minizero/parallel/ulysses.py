"""DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): attention over a split sequence by two all-to-alls.

Context parallelism's layout (rank r holds chunks r and 2c-1-r) with another attention core::

    q, k, v   (b, H, 2n, D)   this rank's 2 chunks, every head
       │ all-to-all: head group j (H/c heads) to rank j; time blocks reordered to the sequence's order
    q, k, v   (b, H/c, T, D)  every token, this rank's heads ──> causal attention (the inner core: dense or flash)
       │ reorder back, all-to-all: time block i to rank i
    y         (b, H, 2n, D)

Traffic per rank, layer and step: 8 (c-1)/c * b*H*2n*D*itemsize (:func:`ulysses_bytes`), against ring
attention's 6c-4 such blocks: about 4/(3c) of the ring's at large c, falling as 1/c (Jacobs et al., section
3.2). c must divide H/tp. The attention dropout of head group j is the unsplit model's mask at those heads
(:func:`head_group_dropout`).
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd import Function
from minizero.comm.all_to_all import all_to_all
from minizero.nn.gpt import DenseAttentionCore
from minizero.nn.module import Dropout, Module
from minizero.parallel.tensor_parallel import HeadParallelDropout


def sequence_order(cp: int, n: int) -> np.ndarray:
    """``order`` (2cn,): ``gathered[..., order, :]`` puts the ranks' rows (rank i: chunks i, 2c-1-i) in sequence
    order."""
    pos = np.concatenate([np.concatenate([np.arange(n) + c * n for c in (i, 2 * cp - 1 - i)]) for i in range(cp)])
    return np.argsort(pos)


def _seq_to_heads(comm, x, order):
    """(b, H, 2n, D) sequence shard -> (b, H/c, T, D) head shard, time in the sequence's order."""
    c = comm.world_size
    b, h, t, d = x.shape
    pieces = backend.xp.ascontiguousarray(x.reshape(b, c, h // c, t, d).transpose(1, 0, 2, 3, 4))
    got = all_to_all(comm, pieces)  # (c, b, H/c, 2n, D): index i = rank i's rows
    return got.transpose(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)[:, :, order]


def _heads_to_seq(comm, y, inverse):
    """The inverse of :func:`_seq_to_heads`: (b, H/c, T, D) -> (b, H, 2n, D)."""
    c = comm.world_size
    b, hc, tt, d = y.shape
    pieces = backend.xp.ascontiguousarray(y[:, :, inverse].reshape(b, hc, c, tt // c, d).transpose(2, 0, 1, 3, 4))
    got = all_to_all(comm, pieces)  # (c, b, H/c, 2n, D): index j = head group j
    return got.transpose(1, 0, 2, 3, 4).reshape(b, c * hc, tt // c, d)


class _SeqToHeads(Function):
    """forward: all-to-all sequence -> heads; backward: heads -> sequence."""

    @staticmethod
    def forward(ctx, x, comm, order, inverse):
        ctx.comm, ctx.inverse = comm, inverse
        return _seq_to_heads(comm, x, order)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(ctx.comm, g, ctx.inverse), None, None, None


class _HeadsToSeq(Function):
    """forward: all-to-all heads -> sequence; backward: sequence -> heads."""

    @staticmethod
    def forward(ctx, y, comm, order, inverse):
        ctx.comm, ctx.order = comm, order
        return _heads_to_seq(comm, y, inverse)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(ctx.comm, g, ctx.order), None, None, None


def head_group_dropout(dropout, heads: int, comm):
    """The attention dropout for this rank's head group, heads [r h/c, (r+1) h/c) of the ``heads`` (h) the
    attention holds: a :class:`HeadParallelDropout` addressing the unsplit model's (b, H, T, T) mask (H: every
    head of the model, the tensor rank's offset kept). Anything else, or an inactive dropout: returned as it is."""
    if not isinstance(dropout, (Dropout, HeadParallelDropout)) or not dropout.training or dropout.p == 0.0:
        return dropout
    total, lo = (dropout.n_head_total, dropout.lo) if isinstance(dropout, HeadParallelDropout) else (heads, 0)
    return HeadParallelDropout(dropout.p, total, lo + comm.rank * (heads // comm.world_size), dropout.site)


class UlyssesAttentionCore(Module):
    """An attention core: q, k, v (b, H, 2n, D) this rank's chunks -> (b, H, 2n, D), over ``comm`` (c ranks).

    ``inner``: the core run on (b, H/c, T, D) head shards (default dense causal). Forward: three all-to-alls in
    (q, k, v), one out; backward: the same four, reversed. Raises ValueError (in forward): c does not divide the
    local head count.
    """

    def __init__(self, comm, inner=None):
        super().__init__()
        self.comm, self.inner = comm, inner if inner is not None else DenseAttentionCore()
        self._orders = {}

    def forward(self, q, k, v, dropout=None):
        c, (_, h, t, _) = self.comm.world_size, q.shape
        if h % c:
            raise ValueError(f"Ulysses needs the {h} local attention heads divisible by the {c} ranks of the group")
        if t not in self._orders:  # index arrays on the device, once per length
            order = sequence_order(c, t // 2)
            self._orders[t] = (backend.xp.asarray(order), backend.xp.asarray(np.argsort(order)))
        order, inverse = self._orders[t]
        q, k, v = (_SeqToHeads.apply(z, self.comm, order, inverse) for z in (q, k, v))
        y = self.inner(q, k, v, head_group_dropout(dropout, h, self.comm))
        return _HeadsToSeq.apply(y, self.comm, order, inverse)


def ulysses_bytes(b: int, h: int, s: int, d: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends per layer for a sequence of s tokens: {"forward", "backward"} (4 all-to-alls each).

    ``h``: the heads the attention holds (H/tp under tensor parallelism), ``d``: the head size, ``cp``: c; each
    all-to-all sends (c-1)/c of the rank's (b, h, s/c, d) array.
    """
    local = b * h * (s // cp) * d * itemsize
    each = (cp - 1) * local // cp
    return {"forward": 4 * each, "backward": 4 * each}
