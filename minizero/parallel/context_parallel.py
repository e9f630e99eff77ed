"""Context parallelism: causal attention over a sequence split across c ranks, by ring attention.

Rank i of the context group holds chunks i and 2c-1-i of 2c (causal load balance); q, k, v: (b, H, 2n, D),
n = s/(2c). Key/value blocks travel the ring by ``sendrecv`` with an online softmax (a step holds a (2n, 2n)
score block, never (s, s)); backward is FlashAttention's blockwise backward, dK, dV (float32 for 16-bit inputs)
travelling with their block.
Dropout draws the unsplit model's masks: each rank reads its chunks' elements (:class:`ContextParallelDropout`,
and the attention's (B, H, T, T) mask by blocks). Preconditions (:mod:`minizero.layout_checks`): 2c divides T, tp
divides T/c under sequence parallelism.
Sources: Liu et al., "Ring Attention", arXiv:2310.01889; Dao et al., FlashAttention, algorithm 4;
Megatron-LM's context parallelism (chunk pairing, the "dp-cp" group).
"""
from __future__ import annotations

import math

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.autograd import functional as F
from minizero.autograd.rng import MaskStream
from minizero.comm.collectives import check_int, check_rank
from minizero.comm.flight import name_split
from minizero.nn.flash_attention import attention_block_grads, block_scores, causal_mask, online_softmax_step
from minizero.nn.module import Dropout, Module
from minizero.parallel.sequence_parallel import SequenceParallelDropout
from minizero.parallel.ulysses import UlyssesAttentionCore

CP_TAG = 1300  #: tag of the ring messages
CP_ATTENTIONS = ("ring", "ulysses")  #: the attention cores of a split sequence (ulysses.py: by all-to-all)


# --------------------------------------------------------------------------- sharding along the sequence
def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) rank ``rank`` holds: (rank, 2 cp - 1 - rank)."""
    return rank, 2 * cp - 1 - rank


def split_for_context_parallel(x, rank: int, cp: int, axis: int):
    """Rank ``rank``'s two chunks of ``x`` along ``axis``, concatenated (new). Raises ValueError:
    2 cp does not divide it."""
    check_rank(rank, "rank", check_int(cp, "cp", 1))  # named errors, not an IndexError (rank -1) or a division by 0
    xp, s = backend.xp, x.shape[axis]
    if s % (2 * cp):
        raise ValueError(f"context parallelism needs the sequence length {s} divisible by 2 x cp = {2 * cp}")
    parts = xp.split(x, 2 * cp, axis=axis)
    a, b = chunk_ids(rank, cp)
    return xp.concatenate([parts[a], parts[b]], axis=axis)


def unsplit_from_context_parallel(shards, axis: int):
    """Inverse of :func:`split_for_context_parallel`: the whole array from every rank's shard, in rank order."""
    xp, cp = backend.xp, len(shards)
    chunks = [None] * (2 * cp)
    for r, sh in enumerate(shards):
        lo, hi = xp.split(sh, 2, axis=axis)
        a, b = chunk_ids(r, cp)
        chunks[a], chunks[b] = lo, hi
    return xp.concatenate(chunks, axis=axis)


def ring_bytes(b: int, h: int, s: int, d: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends per call, {"forward", "backward"}, for (b, h, s/cp, d) blocks of k and v (``itemsize``)
    and of dk and dv (at least float32: 4 bytes for 16-bit inputs, ``itemsize`` from float32 up).

    Forward: (cp-1) passes of (k, v); backward: (cp-1) of (k, v) and cp of (dk, dv). 0 for cp = 1.
    """
    if cp == 1:
        return {"forward": 0, "backward": 0}
    blk = b * h * (s // cp) * d
    kv = 2 * (cp - 1) * blk * itemsize
    return {"forward": kv, "backward": kv + 2 * cp * blk * max(itemsize, 4)}


def _blocks(rank: int, src: int, cp: int, n: int):
    """(query rows, key rows, mask, the rows' and keys' slices of the whole sequence) for this rank's two query
    chunks against ``src``'s two key chunks; mask None (every key precedes every query) or (n, n) causal (the same
    chunk). A key chunk after the query chunk is skipped: the causal mask keeps none of it."""
    out = []
    for qi, qc in enumerate(chunk_ids(rank, cp)):
        for ki, kc in enumerate(chunk_ids(src, cp)):
            if qc < kc:
                continue
            mask = None if qc > kc else causal_mask(n)
            out.append((slice(qi * n, (qi + 1) * n), slice(ki * n, (ki + 1) * n), mask,
                        slice(qc * n, (qc + 1) * n), slice(kc * n, (kc + 1) * n)))
    return out


def _keep(drop, q, rows, keys):
    """The attention dropout's keep mask for one block (None without dropout): rows x keys of the whole mask."""
    return None if drop is None else drop.block((slice(0, q.shape[0]), slice(0, q.shape[1]), rows, keys))


def _ring_pass(comm, arrays):
    """Send ``arrays`` (a tuple of one dtype: concatenate would promote a mix) to the right neighbour as one message,
    receive the left neighbour's (same shapes)."""
    if comm.world_size == 1:
        return arrays
    xp = backend.xp
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    flat = xp.concatenate([a.reshape(-1) for a in arrays])
    with comm.traffic.op("ring_attention"):  # its own traffic kind in the job's report (Strategy.traffic_by_kind)
        got = comm.sendrecv(flat, right, xp.empty_like(flat), left, tag=CP_TAG)
    out, off = [], 0
    for a in arrays:
        out.append(got[off:off + a.size].reshape(a.shape))
        off += a.size
    return tuple(out)


# --------------------------------------------------------------------------- the autograd Function
class _RingAttention(Function):
    """softmax(q k^T scale, causal) -> dropout -> @ v over the context group. q, k, v (b, H, 2n, D) -> (b, H, 2n, D).

    ``drop``: a ``MaskStream`` of the whole (b, H, T, T) keep mask, or None. Saves q, k, v, out and the row
    log-sum-exp (b, H, 2n) (at least float32), no mask.
    Forward: c-1 ring passes of (k, v). Backward: c-1 of (k, v) in their own dtype and c of (dk, dv) in the
    accumulation dtype (float32 for 16-bit inputs, as ring-flash-attention's accumulators): two messages a pass
    rather than one buffer of two dtypes packed as bytes.
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, drop):
        xp, cp, r = backend.xp, comm.world_size, comm.rank
        n, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        keep_scale = 1.0 / (1.0 - drop.p) if drop is not None else 1.0
        acc_t = xp.promote_types(q.dtype, xp.float32)
        m = xp.full(q.shape[:3], -xp.inf, dtype=acc_t)  # running row maximum
        l = xp.zeros(q.shape[:3], dtype=acc_t)  # running sum of exp(score - m)
        o = xp.zeros(q.shape, dtype=acc_t)  # running unnormalised output
        kv = (k, v)
        for j in range(cp):
            if j:
                kv = _ring_pass(comm, kv)
            kb, vb = kv
            for qs, ks, mask, rows, keys in _blocks(r, (r - j) % cp, cp, n):  # flash's block step
                sc = block_scores(q[:, :, qs].astype(acc_t, copy=False), kb[:, :, ks].astype(acc_t, copy=False),
                                  scale, mask)
                m[:, :, qs], l[:, :, qs], o[:, :, qs] = online_softmax_step(
                    m[:, :, qs], l[:, :, qs], o[:, :, qs], sc, vb[:, :, ks].astype(acc_t), _keep(drop, q, rows, keys),
                    keep_scale)
        out = (o / l[..., None]).astype(q.dtype)
        ctx.comm, ctx.drop, ctx.keep_scale = comm, drop, keep_scale
        ctx.save_for_backward(q, k, v, out, m + xp.log(l))
        return out

    @staticmethod
    def backward(ctx, g):
        xp, comm = backend.xp, ctx.comm
        q, k, v, out, lse = ctx.saved_tensors
        cp, r = comm.world_size, comm.rank
        n, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        acc_t = lse.dtype
        g = g.astype(acc_t)
        dsum = (g * out.astype(acc_t)).sum(axis=-1)  # rowsum(dO * O), FlashAttention's D (here D is the head width)
        dq = xp.zeros(q.shape, dtype=acc_t)
        kb, vb = k, v
        dkb, dvb = xp.zeros(k.shape, dtype=acc_t), xp.zeros(v.shape, dtype=acc_t)
        for j in range(cp):
            if j:
                kb, vb = _ring_pass(comm, (kb, vb))  # in their own dtype
                dkb, dvb = _ring_pass(comm, (dkb, dvb))  # in acc_t
            for qs, ks, mask, rows, keys in _blocks(r, (r - j) % cp, cp, n):
                kk, vv, qq = kb[:, :, ks].astype(acc_t), vb[:, :, ks].astype(acc_t), q[:, :, qs].astype(acc_t)
                gq, gk, gv = attention_block_grads(qq, kk, vv, g[:, :, qs], lse[:, :, qs], dsum[:, :, qs], scale, mask,
                                                   _keep(ctx.drop, q, rows, keys), ctx.keep_scale)
                dq[:, :, qs] += gq
                dkb[:, :, ks] += gk
                dvb[:, :, ks] += gv
        if cp > 1:  # the block held now is rank r+1's: one more pass brings every dk, dv home
            dkb, dvb = _ring_pass(comm, (dkb, dvb))
        return dq.astype(q.dtype), dkb.astype(k.dtype), dvb.astype(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, comm, dropout=None) -> Tensor:
    """Causal attention of this rank's chunks against the whole sequence: q, k, v (b, H, 2n, D) -> (b, H, 2n, D).
    ``dropout``: the attention's dropout (``reserve_mask``: the whole (b, H, T, T) mask); None or without it: none."""
    b, h, t2, _ = q.shape
    reserve, whole = getattr(dropout, "reserve_mask", None), t2 * comm.world_size
    drop = reserve((b, h, whole, whole)) if reserve is not None else None
    return _RingAttention.apply(q, k, v, comm, drop)


# --------------------------------------------------------------------------- in the model
def context_parallelize(stage, comm, attention: str = "ring") -> list[str]:
    """Split a stage's sequence over the context group ``comm`` (c ranks), in place; returns the converted names.

    Pre-hooks keep this rank's chunks of ids and targets, (b, T) -> (b, 2n), with global ``wpe`` positions; by
    ``swap_modules`` every ``attn.core`` becomes a :class:`RingAttentionCore` or (``"ulysses"``) an
    ``UlyssesAttentionCore``, every other dropout a :class:`ContextParallelDropout`. No-op for c = 1.
    Raises ValueError: ``attention`` not "ring" or "ulysses".
    """
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"unknown context-parallel attention {attention!r}; allowed: {CP_ATTENTIONS}")
    cp = comm.world_size
    if cp == 1:
        return []
    done = []
    for part in stage.chunks:
        done += _split_sequence(part, comm)
    cores = {id(block.attn.core) for block in stage.transformer["h"]}
    core_dropouts = {id(block.attn.attn_dropout) for block in stage.transformer["h"]}  # a core draws its by blocks

    def split_core(core):
        return RingAttentionCore(comm) if attention == "ring" else UlyssesAttentionCore(comm, core)

    def swap(m):  # the attention cores, and every (b, s, h) dropout
        if id(m) in cores:  # a core under selective recompute: the new core inside a new wrapper
            return m.map_wrapped(split_core)
        if type(m) is SequenceParallelDropout:  # rows of the rank's chunks, split again over the tensor group
            return ContextParallelDropout(m.p, comm, m.comm, m.site)
        if type(m) is Dropout and id(m) not in core_dropouts:
            return ContextParallelDropout(m.p, comm, site=m.site)
        return None

    return done + stage.swap_modules(swap)


def _split_sequence(stage, comm) -> list[str]:
    """The hooks of :func:`context_parallelize` on one :class:`PipelineStage` (one chunk of an interleaved stage)."""
    cp, r = comm.world_size, comm.rank

    def local(a):
        return None if a is None else split_for_context_parallel(a.data if isinstance(a, Tensor) else a, r, cp, 1)

    def split_inputs(_module, args):  # (x, targets): ids on the first stage, targets on the last
        x, rest = args[0], args[1:]
        return (local(x) if stage.is_first else x,) + tuple(local(a) for a in rest)

    stage.register_forward_pre_hook(split_inputs)
    tr, done = stage.transformer, []
    if stage.is_first:
        def global_positions(_wpe, args):  # positions (2n,) of the local tokens -> rows of this rank's two chunks
            return (split_for_context_parallel(backend.xp.arange(args[0].shape[0] * cp), r, cp, 0),)

        tr["wpe"].register_forward_pre_hook(global_positions)
        done.append("transformer.wpe")
    stage.add_sequence_split("context_parallel", cp)  # activations between stages: (b, T / (cp [x tp under SP]), C)
    return done


class RingAttentionCore(Module):
    """An attention core: q, k, v (b, H, 2n, D) -> (b, H, 2n, D) by :func:`ring_attention` over ``comm``;
    no parameters."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, q, k, v, dropout=None):
        return ring_attention(q, k, v, self.comm, dropout)


class ContextParallelDropout(Module):
    """Dropout of this rank's rows with the mask the unsplit model draws for (b, T, h): its two chunks (b, 2n, h), or
    with sequence parallelism (``seq_comm``: the tensor group) rows [tp_rank m, (tp_rank + 1) m) of them, m = 2n/tp.
    Each rank computes its rows' elements only (``MaskStream``: inside ``rng.batch_rows`` the site's addressed mask,
    outside it the stream advances by the whole mask). Identity in eval or p = 0."""

    def __init__(self, p: float, comm, seq_comm=None, site=None):
        super().__init__()
        self.p, self.comm, self.seq_comm, self.site = p, comm, seq_comm, site

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        b, m, h = x.shape
        tp, tp_rank = (1, 0) if self.seq_comm is None else (self.seq_comm.world_size, self.seq_comm.rank)
        n = m * tp // 2  # rows per chunk
        drop = MaskStream.reserve((b, 2 * n * self.comm.world_size, h), self.p, site=self.site)
        keep = []
        for i, c in enumerate(chunk_ids(self.comm.rank, self.comm.world_size)):  # local rows [i n, (i + 1) n)
            lo, hi = max(tp_rank * m, i * n), min((tp_rank + 1) * m, (i + 1) * n)
            if lo < hi:
                keep.append(drop.block((slice(0, b), slice(c * n + lo - i * n, c * n + hi - i * n), slice(0, h))))
        keep = keep[0] if len(keep) == 1 else backend.xp.concatenate(keep, axis=1)
        return F.Dropout.apply(x, keep, self.p)


def context_group(dp_comm, cp: int):
    """The context-parallel group inside a data group of dp*cp ranks: data ranks [k cp, (k+1) cp) (None for cp = 1),
    named ``cp`` in the flight recorder (ring attention's and Ulysses')."""
    if cp == 1:
        return None
    first = dp_comm.rank - dp_comm.rank % cp
    group = dp_comm.split(color=first // cp, key=dp_comm.rank % cp)
    name_split(dp_comm, group, "cp", range(first, first + cp))
    return group
