"""Sequence parallelism: the layer norms, dropouts and residuals of a tensor-parallel block split along s.

Rank r of t holds rows [r s/t, (r+1) s/t) of x (b, s/t, h). f becomes g, an all-gather along s (backward:
reduce-scatter), fused with the column-parallel GEMM; g becomes ḡ, a reduce-scatter along s (backward:
all-gather). Forward bytes equal tensor parallelism's on the ring (an all-reduce is a reduce-scatter plus an
all-gather, Korthikanti et al.'s count); backward adds one all-gather per column-parallel layer, which gathers x
again for dW instead of saving the gathered (b, s, h). Activations outside the tensor region shrink by t.
The embedding leaves by a reduce-scatter too: the vocabulary-parallel partial sums plus wpe, added on tensor
rank 0 only (Megatron-core's ``LanguageModelEmbedding`` reduce-scatters only without learned positions).
Source: Korthikanti et al., arXiv:2205.05198, section 4.2.2, figure 5, Table 2; Megatron-LM
``core/tensor_parallel/mappings.py``, ``finalize_model_grads``, ``VocabParallelEmbedding(reduce_scatter_embeddings)``.
"""
from __future__ import annotations

import zlib

import numpy as np

from minizero import backend
from minizero.autograd import Function, Tensor, split
from minizero.autograd import functional as F
from minizero.autograd.rng import MaskStream
from minizero.comm.collectives import all_gather, all_reduce, reduce_scatter
from minizero.nn.module import Embedding, Module
from minizero.parallel.interleaved import refuse_interleaved
from minizero.parallel.tensor_parallel import ColumnParallelLinear, ParallelCausalSelfAttention, RowParallelLinear
from minizero.parallel.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

TRAFFIC_LABEL = "sequence_parallel_grads"  #: traffic label of the layer-norm / bias gradient all-reduce


# --------------------------------------------------------------------------- primitives (sequence = axis 1)
def _check_seq(s: int, t: int) -> None:
    if s % t:
        raise ValueError(f"sequence parallelism needs the sequence length {s} divisible by the tensor size {t}")


def _split_along_seq(comm, x):
    """(b, s, h) -> this rank's rows (b, s/t, h), a new contiguous array. Raises ValueError if t does not divide s."""
    t, r = comm.world_size, comm.rank
    _check_seq(x.shape[1], t)
    n = x.shape[1] // t
    return backend.xp.ascontiguousarray(x[:, r * n:(r + 1) * n])


def _gather_along_seq(comm, x):
    """(b, s/t, h) on every rank -> (b, s, h), the ranks' rows in rank order (ring all-gather)."""
    xp, t = backend.xp, comm.world_size
    b, n, h = x.shape
    flat = all_gather(comm, xp.ascontiguousarray(x.transpose(1, 0, 2)))  # (t * n * b * h,): seq-major
    return xp.ascontiguousarray(flat.reshape(t * n, b, h).transpose(1, 0, 2))


def _reduce_scatter_along_seq(comm, x):
    """(b, s, h) partial sums -> rows [r s/t, (r+1) s/t) of their sum over the group,
    (b, s/t, h) (ring reduce-scatter)."""
    xp, t = backend.xp, comm.world_size
    b, s, h = x.shape
    _check_seq(s, t)
    mine = reduce_scatter(comm, xp.ascontiguousarray(x.transpose(1, 0, 2)))  # rank r's s/t rows, seq-major
    return xp.ascontiguousarray(mine.reshape(s // t, b, h).transpose(1, 0, 2))


# --------------------------------------------------------------------------- autograd classes
class _ScatterToSequenceParallelRegion(Function):
    """forward: keep this rank's rows, backward: all-gather along the sequence."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_along_seq(comm, x)

    @staticmethod
    def backward(ctx, g):
        return _gather_along_seq(ctx.comm, g), None


class _GatherFromSequenceParallelRegion(Function):
    """g: forward all-gather along the sequence, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_along_seq(comm, x)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_along_seq(ctx.comm, g), None


class _ReduceScatterToSequenceParallelRegion(Function):
    """ḡ: forward reduce-scatter along the sequence, backward all-gather."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_along_seq(comm, x)

    @staticmethod
    def backward(ctx, g):
        return _gather_along_seq(ctx.comm, g), None


class _OnceOverTensorGroup(Function):
    """forward: x on tensor rank 0, zeros elsewhere (a sum over the group counts it once); backward: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return x if comm.rank == 0 else backend.xp.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatheredLinear(Function):
    """g fused with a column-parallel GEMM: y = all_gather_s(x) W^T + b, saving only x's slice.

    x (b, s/t, in), W (out/t, in), b (out/t,) or None -> y (b, s, out/t). Backward: all-gather x again for dW;
    dx reduce-scattered along s to (b, s/t, in).
    """

    @staticmethod
    def forward(ctx, x, weight, comm, bias=None):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        y = backend.matmul(_gather_along_seq(comm, x), weight.T)  # the gathered (b, s, in) is freed here
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        full = _gather_along_seq(ctx.comm, x)
        g2 = g.reshape(-1, g.shape[-1])
        dw = backend.matmul(g2.T, full.reshape(-1, full.shape[-1]))
        dx = _reduce_scatter_along_seq(ctx.comm, backend.matmul(g, w))
        return (dx, dw, None, g2.sum(axis=0)) if ctx.has_bias else (dx, dw, None)


# --------------------------------------------------------------------------- wrappers
def scatter_to_sequence_parallel_region(x: Tensor, comm) -> Tensor:
    """forward: keep this rank's rows (b, s, h) -> (b, s/t, h), backward: all-gather along s."""
    return _ScatterToSequenceParallelRegion.apply(x, comm) if comm.world_size > 1 else x


def gather_from_sequence_parallel_region(x: Tensor, comm) -> Tensor:
    """g — forward: all-gather along s (b, s/t, h) -> (b, s, h), backward: reduce-scatter."""
    return _GatherFromSequenceParallelRegion.apply(x, comm) if comm.world_size > 1 else x


def reduce_scatter_to_sequence_parallel_region(x: Tensor, comm) -> Tensor:
    """ḡ — forward: reduce-scatter along s, partial (b, s, h) -> summed (b, s/t, h), backward: all-gather."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, comm) if comm.world_size > 1 else x


def once_over_tensor_group(x: Tensor, comm) -> Tensor:
    """A replicated x as one term of a sum over the group — forward: x on rank 0, zeros elsewhere, backward: identity
    (every rank's replicated x gets the sum's whole gradient)."""
    return _OnceOverTensorGroup.apply(x, comm) if comm.world_size > 1 else x


def gathered_linear(x: Tensor, weight, comm, bias=None) -> Tensor:
    """all_gather_s(x) W^T + b, x (b, s/t, in) -> (b, s, out/t); forward all-gather; backward that, reduce-scatter."""
    args = (x, weight, comm) + ((bias,) if bias is not None else ())
    return _GatheredLinear.apply(*args)


# --------------------------------------------------------------------------- layers
def _arrays(linear) -> tuple:
    """(weight, bias or None) arrays of a tensor-parallel linear, to rebuild it as its sequence-parallel kind."""
    return linear.weight.data, None if linear.bias is None else linear.bias.data


def _mark_sp(*params) -> None:
    """Tag parameters that see a slice of the sequence (their gradient is summed over the tensor group)."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """Column-parallel linear entered through g. x (b, s/t, in) -> (b, s, out/t).

    Forward: one all-gather of (b, s, in); backward: one all-gather (x, for dW) and one reduce-scatter of dL/dx.
    """

    def forward(self, x):
        return gathered_linear(x, self.weight, self.comm, self.bias)


class SequenceParallelRowLinear(RowParallelLinear):
    """Row-parallel linear left through ḡ. x (b, s, in/t) -> (b, s/t, out); forward reduce-scatter,
    backward all-gather."""

    def forward(self, x):
        y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


class SequenceParallelDropout(Module):
    """Dropout of a (b, s/t, h) slice with the mask the unsplit model draws for (b, s, h);
    identity in eval or p == 0. ``site``: the replaced dropout's (``nn.Dropout``)."""

    def __init__(self, p: float, comm, site=None):
        super().__init__()
        self.p, self.comm, self.site = p, comm, site

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        b, n, h = x.shape  # rows [r n, (r + 1) n) of the mask of all s rows (the stream advances by the whole mask)
        drop = MaskStream.reserve((b, n * self.comm.world_size, h), self.p, (0, self.comm.rank * n, 0), self.site)
        return F.Dropout.apply(x, drop.block((slice(0, b), slice(0, n), slice(0, h))), self.p)


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel token embedding left unsummed: idx (b, s) -> this rank's partial (b, s, C).

    :class:`EnterSequenceParallelRegion` sums the partials (Megatron-core: ``reduce_scatter_embeddings``).
    """

    def __init__(self, emb: VocabParallelEmbedding):
        Module.__init__(self)
        self.weight, self.comm, self.vocab_start = emb.weight, emb.comm, emb.vocab_start

    def forward(self, idx):
        return self.partial(idx)


class SequenceParallelPositionEmbedding(Embedding):
    """wpe (replicated) as one term of the partial sums: rows (s, C) on tensor rank 0, zeros on the others, so the
    exit's reduce-scatter adds them once; backward identity: every rank's wpe gets the whole gradient, as before."""

    def __init__(self, weight, comm):
        Module.__init__(self)
        self.weight, self.comm = weight, comm

    def forward(self, pos):
        return once_over_tensor_group(super().forward(pos), self.comm)


class EnterSequenceParallelRegion(Module):
    """The embedding's exit: partial sums (b, s, h) -> this rank's rows of their sum (b, s/t, h), then dropout.

    Forward: one reduce-scatter along s, (t-1)/t bsh e bytes (half an all-reduce); backward: one all-gather.
    """

    def __init__(self, p: float, comm, site=None):
        super().__init__()
        self.comm, self.dropout = comm, SequenceParallelDropout(p, comm, site)

    def forward(self, x):
        return self.dropout(reduce_scatter_to_sequence_parallel_region(x, self.comm))


class SequenceParallelAttention(ParallelCausalSelfAttention):
    """Tensor-parallel attention taking and returning (b, s/t, C); inside, (b, s, C/t) by heads as before."""

    def __init__(self, attn: ParallelCausalSelfAttention, comm):
        Module.__init__(self)
        self.c_attn = SequenceParallelColumnLinear(*_arrays(attn.c_attn), comm, stride=3)
        self.c_proj = SequenceParallelRowLinear(*_arrays(attn.c_proj), comm)
        self.n_head, self.attn_dropout = attn.n_head, attn.attn_dropout
        self.resid_dropout = SequenceParallelDropout(attn.resid_dropout.p, comm, attn.resid_dropout.site)
        self.core = attn.core

    def forward(self, x):
        qkv = self.c_attn(x)  # (b, s, 3C/t): the whole sequence
        b, s, c3 = qkv.shape
        h, cl = self.n_head, c3 // 3
        q, k, v = (z.reshape(b, s, h, cl // h).transpose(0, 2, 1, 3) for z in split(qkv, 3, axis=-1))
        y = self.attention_core(q, k, v).transpose(0, 2, 1, 3).reshape(b, s, cl)
        return self.resid_dropout(self.c_proj(y))


class SequenceParallelLMHead(ParallelLMHead):
    """Logits of this rank's vocabulary for the whole sequence: g(x) W_r^T. x (b, s/t, C) -> (b, s, V/t)."""

    def forward(self, x):
        return gathered_linear(x, self.weight, self.comm)


def sequence_parallelize(stage, comm) -> list[str]:
    """Split a tensor- and vocab-parallel stage over ``comm`` with sequence parallelism, in place (no-op for t = 1).

    Returns the converted module names. Raises TypeError: a built InterleavedStage, the blocks not tensor-parallel,
    wte not vocab-parallel; ValueError (in forward): t does not divide the sequence length.
    """
    refuse_interleaved(stage, "sequence_parallelize")
    if comm.world_size == 1:
        return []
    if not all(isinstance(b.mlp.c_fc, ColumnParallelLinear) for b in stage.transformer["h"]):
        raise TypeError("sequence_parallelize needs a tensor-parallel stage: call tensor_parallelize first")
    tr, done = stage.transformer, []
    if stage.is_first and not isinstance(tr["wte"], VocabParallelEmbedding):
        raise TypeError("sequence_parallelize needs a vocabulary-parallel embedding: call vocab_parallelize first")
    for name, block in tr["h"].named_children():
        block.attn = SequenceParallelAttention(block.attn, comm)
        mlp = block.mlp
        mlp.c_fc = SequenceParallelColumnLinear(*_arrays(mlp.c_fc), comm)
        mlp.c_proj = SequenceParallelRowLinear(*_arrays(mlp.c_proj), comm)
        mlp.dropout = SequenceParallelDropout(mlp.dropout.p, comm, mlp.dropout.site)
        _mark_sp(block.ln_1.weight, block.ln_1.bias, block.ln_2.weight, block.ln_2.bias,
                 block.attn.c_proj.bias, mlp.c_proj.bias)
        done += [f"transformer.h.{name}.attn", f"transformer.h.{name}.mlp"]
    if stage.is_first:  # wte(idx) + wpe(pos): partial sums, reduce-scattered by drop
        tr.wte = SequenceParallelEmbedding(tr["wte"])
        tr.wpe = SequenceParallelPositionEmbedding(tr["wpe"].weight, comm)
        tr.drop = EnterSequenceParallelRegion(tr["drop"].p, comm, tr["drop"].site)
        done += ["transformer.wte", "transformer.wpe", "transformer.drop"]
    if stage.is_last:
        _mark_sp(tr["ln_f"].weight, tr["ln_f"].bias)
        stage.lm_head = SequenceParallelLMHead(stage.lm_head.weight, comm)
        done.append("lm_head")
    stage.add_sequence_split("sequence_parallel", comm.world_size)
    return done


def allreduce_sequence_parallel_grads(params, comm) -> None:
    """Sum ``sequence_parallel`` parameters' gradients over the tensor group in place (one all-reduce)."""
    marked = [p for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if comm.world_size == 1 or not marked:
        return
    _sum_in_place([p.grad for p in marked], comm)


def _sum_in_place(arrays, comm) -> None:
    """Collective over ``comm``: every array replaced by its sum over the group, in one all-reduce."""
    flat = backend.xp.concatenate([a.reshape(-1) for a in arrays])
    with comm.traffic.op(TRAFFIC_LABEL):
        total = all_reduce(comm, flat)
    off = 0
    for a in arrays:
        a[...] = total[off:off + a.size].reshape(a.shape)
        off += a.size


class SequenceParallelGrads:
    """``sync.reduce_gradients()`` with the ``sequence_parallel`` parameters' gradients summed over the tensor group
    ``comm``: whole, before it (ZeRO 0-1; Megatron-LM's 2022 optimizer), or, where ``sync`` reduces inside backward
    (ZeRO 2-3: its ``held_grad_pieces`` is not None), after it, over the pieces this rank holds of them (Megatron-core's
    ``finalize_model_grads``: the data group's sync, then the norms). The sum is linear and every tensor rank of a
    data rank holds the same pieces (the same units; checked once, a 32-bit checksum of the pieces' (index, lo, hi)),
    so both orders agree to rounding; under ``--quantized-comm`` each tensor rank's part is quantized on its own."""

    def __init__(self, params, comm):
        self.params, self.comm, self.checked = list(params), comm, False
        self.marked = [p for p in self.params if getattr(p, "sequence_parallel", False)]

    def reduce(self, sync) -> None:
        """Collective: as the class says (data group, then tensor group, when ``sync`` holds pieces)."""
        if not self.marked or self.comm.world_size == 1 or sync.held_grad_pieces(self.marked) is None:
            allreduce_sequence_parallel_grads(self.params, self.comm)  # whole gradients, before the data group's
            sync.reduce_gradients()
            return
        sync.reduce_gradients()  # ZeRO 2-3: the reduce-scatters started in backward finish here
        held = sync.held_grad_pieces(self.marked)  # views into the reduced gradient shards
        if not self.checked:  # one int64 all-gather: the pieces' (parameter, lo, hi) agree over the tensor group
            index = {id(p): i for i, p in enumerate(self.params)}
            sig = zlib.crc32(repr([(index[id(p)], lo, hi) for p, lo, hi, _ in held]).encode())
            with self.comm.traffic.op(TRAFFIC_LABEL):
                sigs = backend.to_host(all_gather(self.comm, backend.xp.asarray(np.array([sig], dtype=np.int64))))
            if len(set(sigs.tolist())) != 1:
                raise RuntimeError(f"sequence parallelism: the tensor ranks hold different gradient pieces of the "
                                   f"norms and biases (layout checksums {sigs.tolist()}); their sum would be wrong")
            self.checked = True
        if held:
            _sum_in_place([view for _, _, _, view in held], self.comm)
