"""Vocabulary parallelism (Megatron-LM): the (V, C) embedding, the tied LM head and the loss split by vocabulary rows.

Rank r holds rows [r V/tp, (r+1) V/tp) of wte; logits (b, T, V/tp) are never gathered. Source: Shoeybi et al.,
arXiv:1909.08053, section 3; Megatron-LM ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.autograd import functional as F
from minizero.comm.collectives import all_gather
from minizero.nn.module import Module, Parameter
from minizero.parallel.interleaved import refuse_interleaved
from minizero.parallel.tensor_parallel import (mark_shard, tp_all_reduce, copy_to_tensor_parallel_region,
                                               reduce_from_tensor_parallel_region, shard_array)


class _MaskedEmbedding(Function):
    """Rows ``weight[idx]`` where ``keep``, zero rows elsewhere. weight (V/tp, C), idx and keep (b, T)."""

    @staticmethod
    def forward(ctx, weight, idx, keep):
        ctx.weight_shape = weight.shape
        ctx.save_for_backward(idx, keep)
        out = weight[idx]
        out[~keep] = 0
        return out

    @staticmethod
    def backward(ctx, g):
        idx, keep = ctx.saved_tensors
        dw = backend.xp.zeros(ctx.weight_shape, g.dtype)
        backend.xp.add.at(dw, idx[keep], g[keep])
        return dw, None, None


class VocabParallelEmbedding(Module):
    """Token embedding, rows [lo, lo + V/tp) here (zeros elsewhere). idx (b, T) int -> (b, T, C) on every rank.

    weight (V/tp, C), ``partition_dim`` 0. Forward: one all-reduce of (b, T, C) (g); backward: none. (Sequence
    parallelism sums :meth:`partial` by a reduce-scatter instead: ``sequence_parallel.SequenceParallelEmbedding``.)
    """

    def __init__(self, weight, comm, vocab_start: int):
        super().__init__()
        self.weight = mark_shard(Parameter(weight), 0, 1)
        self.comm, self.vocab_start = comm, vocab_start

    @classmethod
    def from_embedding(cls, emb, comm) -> "VocabParallelEmbedding":
        """This rank's rows of an existing :class:`minizero.nn.Embedding` (its init, not a new one)."""
        w = shard_array(emb.weight.data, 0, comm.rank, comm.world_size)
        return cls(w, comm, comm.rank * w.shape[0])

    def partial(self, idx):
        """This rank's term of the sum, idx (b, T) -> (b, T, C): its tokens' rows, zero rows for the others'."""
        local = idx - self.vocab_start
        keep = (local >= 0) & (local < self.weight.shape[0])
        return _MaskedEmbedding.apply(self.weight, backend.xp.where(keep, local, 0), keep)

    def forward(self, idx):
        return reduce_from_tensor_parallel_region(self.partial(idx), self.comm)


class ParallelLMHead(Module):
    """Logits of this rank's tokens: f(x) W_r^T. x (b, T, C) -> (b, T, V/tp); backward one all-reduce of dL/dx (f)."""

    def __init__(self, weight, comm):
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel_region(x, self.comm), self.weight)


class _VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from logits split by vocabulary, from z - m (m the global row maximum), in at least float32.

    Saves logits, the local target index and mask, and log(sum exp(z - m)) + (m - m_r) (N,).
    """

    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, ignore_index=F.IGNORE_INDEX):
        xp = backend.xp
        n, v = logits.shape
        ls = backend.to_dtype(logits, np.promote_types(logits.dtype, np.float32))
        local_max = ls.max(axis=-1)
        maxima = all_gather(comm, xp.ascontiguousarray(local_max))  # (tp * N,), rank by rank
        m = maxima.reshape(comm.world_size, n).max(axis=0)
        shifted = ls - m[:, None]
        logsum = xp.log(tp_all_reduce(comm, xp.exp(shifted).sum(axis=-1)))
        keep = targets != ignore_index
        local = targets - vocab_start
        mine = (local >= 0) & (local < v) & keep
        local = xp.where(mine, local, 0)
        picked = tp_all_reduce(comm, xp.where(mine, shifted[xp.arange(n), local], 0.0).astype(ls.dtype, copy=False))
        # an ignored row's local index is -1: backward tells it from ``local`` (no (N,) mask saved beside it)
        ctx.save_for_backward(logits, xp.where(keep, local, -1), mine, logsum + (m - local_max))
        return F.mean_over_kept(logsum - picked, keep)

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        logits, local, mine, logsum_r = ctx.saved_tensors
        keep = local >= 0
        ls = backend.to_dtype(logits, logsum_r.dtype)
        p = xp.exp((ls - ls.max(axis=-1, keepdims=True)) - logsum_r[:, None])
        p[xp.arange(logits.shape[0]), xp.where(keep, local, 0)] -= mine.astype(p.dtype)
        p[~keep] = 0  # ignored rows: exactly zero
        n = xp.maximum(keep.sum(), 1).astype(p.dtype)
        return backend.to_dtype(p * (g / n), logits.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_start: int, ignore_index: int = F.IGNORE_INDEX):
    """Mean cross-entropy of ``logits`` (N, V/tp), tokens [vocab_start, +V/tp), against ``targets`` (N,).

    The same loss on every tensor rank (float32 for float16/32 logits); ``ignore_index`` rows left out (NaN if all).
    Forward: an all-gather and two all-reduces of (N,); backward: none (softmax_r - onehot_r).
    Raises ValueError (every rank): logits not 2-D, a target outside [0, V) and not ``ignore_index``.
    """
    t = targets.data if isinstance(targets, Tensor) else targets
    if logits.ndim != 2:
        raise ValueError(f"vocab_parallel_cross_entropy expects logits (N, V/tp), got {logits.shape}")
    F.check_targets(t, logits.shape[0], logits.shape[1] * comm.world_size, "vocab_parallel_cross_entropy",
                    ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, t, comm, vocab_start, ignore_index)


class VocabParallelCrossEntropyLoss(Module):
    """:func:`vocab_parallel_cross_entropy` over ``comm``: logits (N, V/tp), tokens [vocab_start, +V/tp) -> ()."""

    def __init__(self, comm, vocab_start: int):
        super().__init__()
        self.comm, self.vocab_start = comm, vocab_start

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.vocab_start)


def vocab_parallelize(stage, comm) -> list[str]:
    """Split a stage's ``wte``, tied ``lm_head`` and ``loss`` over the tensor group, in place; returns the names.

    Raises ValueError: the group size does not divide the vocabulary; TypeError: a built InterleavedStage.
    """
    refuse_interleaved(stage, "vocab_parallelize")
    tp, cfg = comm.world_size, stage.config
    if tp == 1:
        return []
    if cfg.vocab_size % tp:
        raise ValueError(f"tensor parallel size {tp} must divide vocab_size={cfg.vocab_size}")
    start = comm.rank * (cfg.vocab_size // tp)
    done = []
    if stage.is_first:
        stage.transformer.wte = VocabParallelEmbedding.from_embedding(stage.transformer["wte"], comm)
        done.append("transformer.wte")
    if stage.is_last:
        if stage.is_first:
            w = stage.transformer["wte"].weight
        else:
            w = mark_shard(Parameter(shard_array(stage.lm_head.weight.data, 0, comm.rank, tp)), 0, 1)
            w.shared_embedding_copy = True  # the last stage's copy of the first's wte (as PipelineStage marks it)
        stage.lm_head = ParallelLMHead(w, comm)
        stage.loss = VocabParallelCrossEntropyLoss(comm, start)
        done += ["lm_head", "loss"]
    return done
