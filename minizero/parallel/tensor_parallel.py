"""Tensor parallelism (Megatron-LM): every block's matrices split across the ``tp`` ranks of a group.

Column-parallel ``A_r = A[r*out/tp:(r+1)*out/tp]`` with f before it (forward identity, backward all-reduce);
row-parallel ``A_r = A[:, r*in/tp:(r+1)*in/tp]`` with g after it (forward all-reduce, backward identity).
c_attn and c_fc are column-parallel (c_attn with stride 3: Q, K, V rows of its heads), both c_proj row-parallel.
Traffic per block and micro-batch of (B, T, C): four all-reduces of B*T*C elements (two each way), per rank
8(tp-1)/tp * B*T*C*itemsize bytes on the ring, 4 log2(tp) * B*T*C*itemsize by recursive doubling (tp a power of
two), which :func:`~minizero.comm.collectives.all_reduce` takes up to 256 KiB (:func:`allreduce_bytes_per_block`).
Source: Shoeybi et al., arXiv:1909.08053, section 3, figure 3; Megatron-LM ``core/tensor_parallel/mappings.py``.
"""
from __future__ import annotations

from minizero import backend
from minizero.autograd import Function, Tensor, split
from minizero.autograd import functional as F
from minizero.autograd.rng import MaskStream
from minizero.comm.collectives import check_int, all_reduce, bytes_sent, check_rank
from minizero.nn.gpt import CausalSelfAttention
from minizero.nn.module import Module, Parameter
from minizero.nn.init import is_meta, meta


# --------------------------------------------------------------------------- primitives
def tp_all_reduce(comm, x):
    """Sum ``x`` over the tensor group (:func:`all_reduce`: recursive doubling up to 256 KiB, else the ring); a new
    contiguous array."""
    return all_reduce(comm, backend.xp.ascontiguousarray(x))


def shard_array(full, dim: int, rank: int, size: int, stride: int = 1):
    """Rank ``rank``'s part of ``full`` split ``size`` ways along ``dim`` in each of ``stride`` equal blocks.

    Example: c_attn's (3C, C) weight, stride 3: rows [rC/tp, (r+1)C/tp) of Q, K and V, a (3C/tp, C) shard.
    Returns a new C-contiguous (or meta) array. Raises ValueError: ``stride * size`` does not divide the dim,
    ``size`` not an int >= 1, ``rank`` not in ``[0, size)`` or ``stride`` not an int >= 1.
    """
    xp = backend.xp
    check_rank(rank, "rank", check_int(size, "size", 1))  # a negative rank would index from the end
    check_int(stride, "stride", 1)
    n = full.shape[dim]
    if n % (stride * size):
        raise ValueError(f"cannot split dimension {dim} of size {n} into {stride} block(s) x {size} parts")
    if is_meta(full):  # bytes: a meta (shape-only) array stays meta; nn/init.py draws the shard later
        return meta(full.shape[:dim] + (n // size,) + full.shape[dim + 1:], full.dtype)
    parts = [xp.split(block, size, axis=dim)[rank] for block in xp.split(full, stride, axis=dim)]
    return xp.ascontiguousarray(xp.concatenate(parts, axis=dim))


def unshard_arrays(shards, dim: int, stride: int = 1):
    """Inverse of :func:`shard_array`: the full array from every rank's shard (in rank order)."""
    xp = backend.xp
    pieces = [xp.split(s, stride, axis=dim) for s in shards]
    return xp.concatenate([pieces[r][j] for j in range(stride) for r in range(len(shards))], axis=dim)


def allreduce_bytes_per_block(batch: int, seq: int, n_embd: int, itemsize: int, tp: int, rank: int = 0) -> dict:
    """Bytes one tensor rank sends for one block and micro-batch: ``forward``, ``backward``,
    ``calls_*`` (2 each way)."""
    one = bytes_sent("all_reduce", batch * seq * n_embd, itemsize, tp, rank)
    return {"forward": 2 * one, "backward": 2 * one, "calls_forward": 2, "calls_backward": 2}


# --------------------------------------------------------------------------- the f and g operators
class _CopyToTensorParallelRegion(Function):
    """Megatron's f: forward identity, backward all-reduce (sum over the tensor group)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        return tp_all_reduce(ctx.comm, g), None


class _ReduceFromTensorParallelRegion(Function):
    """Megatron's g: forward all-reduce (sum over the tensor group), backward identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return tp_all_reduce(comm, x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tensor_parallel_region(x: Tensor, comm) -> Tensor:
    """f — forward: identity, backward: all-reduce. x: (..., C) replicated over the group."""
    return _CopyToTensorParallelRegion.apply(x, comm) if comm.world_size > 1 else x


def reduce_from_tensor_parallel_region(x: Tensor, comm) -> Tensor:
    """g — forward: all-reduce, backward: identity. x: (..., C) partial sums -> their sum, replicated."""
    return _ReduceFromTensorParallelRegion.apply(x, comm) if comm.world_size > 1 else x


# --------------------------------------------------------------------------- layers
def mark_shard(p: Parameter, dim: int, stride: int) -> Parameter:
    """Tag a shard as Megatron does: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def is_tensor_parallel_duplicate(p) -> bool:
    """True for a parameter replicated across the tensor group (held whole by every tensor rank)."""
    return not getattr(p, "tensor_model_parallel", False)


class ColumnParallelLinear(Module):
    """Y_r = f(X) A_r^T + b_r: the output features split across the tensor group.

    x (..., in) replicated -> (..., out/tp); weight (out/tp, in), bias (out/tp,), ``partition_dim`` 0.
    Forward: none; backward: one all-reduce of dL/dx (the f operator). Shoeybi et al. 2019, section 3.
    """

    def __init__(self, weight, bias, comm, stride: int = 1):
        super().__init__()
        self.weight = mark_shard(Parameter(weight), 0, stride)
        self.bias = mark_shard(Parameter(bias), 0, stride) if bias is not None else None
        self.comm = comm

    @classmethod
    def from_linear(cls, linear, comm, stride: int = 1) -> "ColumnParallelLinear":
        """This rank's shard of an existing :class:`minizero.nn.Linear` (the same init, not a new one)."""
        r, n = comm.rank, comm.world_size
        bias = None if linear.bias is None else shard_array(linear.bias.data, 0, r, n, stride)
        return cls(shard_array(linear.weight.data, 0, r, n, stride), bias, comm, stride)

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel_region(x, self.comm), self.weight, self.bias)


class RowParallelLinear(Module):
    """Y = g(X_r A_r^T) + b: the input features split, partial products summed.

    x (..., in/tp) -> (..., out) replicated; weight (out, in/tp), ``partition_dim`` 1; bias (out,) replicated.
    Forward: one all-reduce of (..., out) (the g operator); backward: none. Shoeybi et al. 2019, section 3.
    """

    def __init__(self, weight, bias, comm):
        super().__init__()
        self.weight = mark_shard(Parameter(weight), 1, 1)
        self.bias = Parameter(bias) if bias is not None else None
        self.comm = comm

    @classmethod
    def from_linear(cls, linear, comm) -> "RowParallelLinear":
        """This rank's shard of an existing :class:`minizero.nn.Linear`; the bias is copied whole."""
        w = shard_array(linear.weight.data, 1, comm.rank, comm.world_size)
        return cls(w, None if linear.bias is None else linear.bias.data.copy(), comm)

    def forward(self, x):
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


class HeadParallelDropout(Module):
    """Dropout of attention probabilities (B, H/tp, T, T): the (B, H, T, T) mask drawn whole,
    heads [lo, lo + H/tp) kept."""

    def __init__(self, p: float, n_head_total: int, lo: int, site=None):
        super().__init__()
        self.p, self.n_head_total, self.lo, self.site = p, n_head_total, lo, site

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = self.reserve_mask(x.shape).block(tuple(slice(0, d) for d in x.shape))  # only these heads' draws
        return F.Dropout.apply(x, keep, self.p)

    def reserve_mask(self, shape):
        """As ``Dropout.reserve_mask``: this rank's heads of the (B, H, T, T) mask of every head, by block."""
        if not self.training or self.p == 0.0:
            return None
        b, _, t, s = shape
        return MaskStream.reserve((b, self.n_head_total, t, s), self.p, (0, self.lo, 0, 0), self.site)


class ParallelCausalSelfAttention(CausalSelfAttention):
    """Causal self-attention over this rank's H/tp heads. x (B, T, C) replicated -> (B, T, C) replicated.

    c_attn: column-parallel C -> 3C/tp (stride 3); c_proj: row-parallel C/tp -> C; no message in between.
    """

    def __init__(self, attn: CausalSelfAttention, comm):
        Module.__init__(self)  # not CausalSelfAttention's: every child is the split or reused one below
        tp, r = comm.world_size, comm.rank
        self.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, comm, stride=3)
        self.c_proj = RowParallelLinear.from_linear(attn.c_proj, comm)
        self.n_head = attn.n_head // tp  # local heads
        self.attn_dropout = HeadParallelDropout(attn.attn_dropout.p, attn.n_head, r * self.n_head,
                                                attn.attn_dropout.site)
        self.resid_dropout = attn.resid_dropout  # after g: replicated, same mask on every tensor rank
        self.core = attn.core

    def forward(self, x):
        b, t, _ = x.shape
        h = self.n_head
        q, k, v = split(self.c_attn(x), 3, axis=-1)  # each (B, T, C/tp)
        cl = q.shape[-1]
        q, k, v = (z.reshape(b, t, h, cl // h).transpose(0, 2, 1, 3) for z in (q, k, v))  # (B, H/tp, T, D)
        y = self.attention_core(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, cl)
        return self.resid_dropout(self.c_proj(y))


def tensor_parallelize(model: Module, comm) -> list[str]:
    """Split every block of ``model`` (``model.transformer["h"]``) across the tensor group ``comm``, in place.

    Each shard is cut from the existing weights; parameter names stay. Returns the converted modules' names.
    Raises ValueError: ``comm.world_size`` does not divide the heads or the hidden size.
    """
    tp = comm.world_size
    done = []
    if tp == 1:
        return done
    blocks = model.transformer["h"]
    for name, block in blocks.named_children():
        if isinstance(block.attn, ParallelCausalSelfAttention):  # a second call would split the shards again
            raise ValueError(f"tensor_parallelize: transformer.h.{name} is already split; call it once per model")
        n_head, c = block.attn.n_head, block.attn.c_proj.out_features
        if n_head % tp or c % tp:
            raise ValueError(f"tensor parallel size {tp} must divide n_head={n_head} and n_embd={c}")
        block.attn = ParallelCausalSelfAttention(block.attn, comm)
        block.mlp.c_fc = ColumnParallelLinear.from_linear(block.mlp.c_fc, comm)
        block.mlp.c_proj = RowParallelLinear.from_linear(block.mlp.c_proj, comm)
        done += [f"transformer.h.{name}.attn", f"transformer.h.{name}.mlp.c_fc", f"transformer.h.{name}.mlp.c_proj"]
    return done
