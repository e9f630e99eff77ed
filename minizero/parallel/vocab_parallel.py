"""Vocabulary parallelism (Megatron-LM): the (V, C) embedding, the tied LM head and the loss split by tokens.

Rank r holds rows [r V/tp, (r+1) V/tp) of wte. Embedding: local rows, zeros elsewhere, then g (forward
all-reduce of (b, T, C)). LM head: f (backward all-reduce of dL/dx), logits (b, T, V/tp), never gathered.
Loss: an all-gather of the (N,) row maxima and two all-reduces of (N,); backward softmax_r - onehot_r with no
message; rows whose target is ``ignore_index`` count zero.

Source: Shoeybi et al., arXiv:1909.08053, section 3; Megatron-LM ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``.
"""
from __future__ import annotations

import functools

import numpy as np

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.autograd import functional as F
from minizero.comm.collectives import all_gather
from minizero.nn.module import Module, Parameter
from minizero.parallel.tensor_parallel import (_mark, _reduce, copy_to_tensor_parallel_region,
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
    """Token embedding with rows [lo, lo + V/tp) on this rank. idx (b, T) int -> (b, T, C) on every rank.

    weight (V/tp, C), ``tensor_model_parallel``, ``partition_dim`` 0.
    Collectives: forward one all-reduce of (b, T, C) (g); backward none.
    """

    def __init__(self, weight, comm, vocab_start: int):
        super().__init__()
        self.weight = _mark(Parameter(weight), 0, 1)
        self.comm, self.vocab_start = comm, vocab_start

    @classmethod
    def from_embedding(cls, emb, comm) -> "VocabParallelEmbedding":
        """This rank's rows of an existing :class:`minizero.nn.Embedding` (its init, not a new one)."""
        w = shard_array(emb.weight.data, 0, comm.rank, comm.world_size)
        return cls(w, comm, comm.rank * w.shape[0])

    def forward(self, idx):
        local = idx - self.vocab_start
        keep = (local >= 0) & (local < self.weight.shape[0])
        out = _MaskedEmbedding.apply(self.weight, backend.xp.where(keep, local, 0), keep)
        return reduce_from_tensor_parallel_region(out, self.comm)


class ParallelLMHead(Module):
    """Logits of this rank's tokens: f(x) W_r^T. x (b, T, C) on every rank -> (b, T, V/tp).

    ``weight``: the embedding's shard Parameter (tied), or the last stage's copy of it.
    Collectives: forward none; backward one all-reduce of dL/dx (b, T, C) (f).
    """

    def __init__(self, weight, comm):
        super().__init__()
        self.weight, self.comm = weight, comm

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel_region(x, self.comm), self.weight)


class _VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from logits split by vocabulary; see the module docstring.

    As :class:`minizero.autograd.functional.CrossEntropy`: in at least float32, from the
    shifted logits z - m (m the global row maximum), so m cancels exactly; the loss is float32
    for float16 logits (a float16 loss would round and its backward seed S/m overflow).
    Saves logits, the local target index and its mask, and log(sum exp(z - m)) + (m - m_r) (N,),
    m_r this rank's own row maximum, which backward recomputes: softmax_r = exp((z - m_r) - that),
    where m - m_r is a small difference of two nearby numbers (exact for close ones, Sterbenz).
    """

    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, ignore_index=F.IGNORE_INDEX):
        xp = backend.xp
        n, v = logits.shape
        ls = logits.astype(np.promote_types(logits.dtype, np.float32), copy=False)
        local_max = ls.max(axis=-1)
        maxima = all_gather(comm, xp.ascontiguousarray(local_max))  # (tp * N,), rank by rank
        m = maxima.reshape(comm.world_size, n).max(axis=0)
        shifted = ls - m[:, None]
        logsum = xp.log(_reduce(comm, xp.exp(shifted).sum(axis=-1)))
        keep = targets != ignore_index
        local = targets - vocab_start
        mine = (local >= 0) & (local < v) & keep
        local = xp.where(mine, local, 0)
        picked = _reduce(comm, xp.where(mine, shifted[xp.arange(n), local], 0.0).astype(ls.dtype, copy=False))
        # an ignored row's local index is -1: backward tells it from ``local`` (no (N,) mask saved beside it)
        ctx.save_for_backward(logits, xp.where(keep, local, -1), mine, logsum + (m - local_max))
        return F.mean_over_kept(logsum - picked, keep)

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        logits, local, mine, logsum_r = ctx.saved_tensors
        keep = local >= 0
        ls = logits.astype(logsum_r.dtype, copy=False)
        p = xp.exp((ls - ls.max(axis=-1, keepdims=True)) - logsum_r[:, None])
        p[xp.arange(logits.shape[0]), xp.where(keep, local, 0)] -= mine.astype(p.dtype)
        p[~keep] = 0  # ignored rows: exactly zero
        n = xp.maximum(keep.sum(), 1).astype(p.dtype)
        return (p * (g / n)).astype(logits.dtype, copy=False), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_start: int, ignore_index: int = F.IGNORE_INDEX):
    """Mean cross-entropy of ``logits`` (N, V/tp), this rank's tokens [vocab_start, +V/tp), against ``targets`` (N,).

    Rows whose target is ``ignore_index`` are left out as by the plain cross-entropy (NaN when all are).

    Every rank of the tensor group calls it with its own logits; all get the same loss
    (float32 for float16/float32 logits, float64 for float64).
    Collectives: forward an all-gather and two all-reduces of (N,) values; backward none.
    Raises:
        ValueError: logits not 2-D, or a target outside [0, V) and not ``ignore_index``, V = tp * V/tp (the same check
        as the plain :func:`~minizero.autograd.functional.cross_entropy`, on every rank).
    """
    t = targets.data if isinstance(targets, Tensor) else targets
    if logits.ndim != 2:
        raise ValueError(f"vocab_parallel_cross_entropy expects logits (N, V/tp), got {logits.shape}")
    F.check_targets(t, logits.shape[0], logits.shape[1] * comm.world_size, "vocab_parallel_cross_entropy",
                    ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, t, comm, vocab_start, ignore_index)


def vocab_parallelize(stage, comm) -> list[str]:
    """Split a pipeline stage's embedding, tied LM head and loss over the tensor group, in place.

    ``stage``: a :class:`minizero.parallel.pipeline.PipelineStage`. On the first stage ``wte``
    becomes a :class:`VocabParallelEmbedding`; on the last, ``lm_head`` a
    :class:`ParallelLMHead` on the same shard (or on the last stage's copy of it) and
    ``stage.loss_fn`` :func:`vocab_parallel_cross_entropy`. Returns the converted names.
    Raises:
        ValueError: the group size does not divide the vocabulary.
    """
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
            w = _mark(Parameter(shard_array(stage.lm_head.weight.data, 0, comm.rank, tp)), 0, 1)
            w.shared_embedding_copy = True
        stage.lm_head = ParallelLMHead(w, comm)
        stage.loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=comm, vocab_start=start)
        done.append("lm_head")
    return done
