"""Context parallelism: causal attention over a sequence split across c ranks, by ring attention.

Rank i of the context group holds chunks i and 2c-1-i of 2c (causal load balance); q, k, v: (b, H, 2n, D),
n = s/(2c). Key/value blocks travel the ring by ``sendrecv`` with an online softmax (a step holds a (2n, 2n)
score block, never (s, s)); backward is FlashAttention's blockwise backward, dK, dV travelling with their block.
Preconditions (:mod:`minizero.layout_checks`): no dropout, 2c divides T, tp divides T/c under sequence parallelism.
Sources: Liu et al., "Ring Attention", arXiv:2310.01889; Dao et al., FlashAttention, algorithm 4;
Megatron-LM's context parallelism (chunk pairing, the "dp-cp" group).
"""
from __future__ import annotations

import math

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.nn.flash_attention import attention_block_grads, block_scores, online_softmax_step
from minizero.nn.module import Module
from minizero.memory.recompute import CheckpointWrapper
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
    """Bytes one rank sends per call, {"forward", "backward"}, for (b, h, s/cp, d) blocks of ``itemsize``.

    Forward: (cp-1) passes of (k, v); backward: (cp-1) of (k, v, dk, dv) and one more of (dk, dv). 0 for cp = 1.
    """
    if cp == 1:
        return {"forward": 0, "backward": 0}
    blk = b * h * (s // cp) * d * itemsize
    return {"forward": 2 * (cp - 1) * blk, "backward": 2 * (cp - 1) * blk + 2 * cp * blk}


def _mask(qc: int, kc: int, n: int):
    """Which (query, key) pairs of chunk qc x chunk kc the causal mask keeps: None (all), 'none', or (n, n) bool."""
    if qc > kc:
        return None
    if qc < kc:
        return "none"
    return backend.xp.tril(backend.xp.ones((n, n), dtype=bool))


def _blocks(rank: int, src: int, cp: int, n: int):
    """(query rows, key rows, mask) for this rank's two query chunks against ``src``'s two key chunks."""
    out = []
    for qi, qc in enumerate(chunk_ids(rank, cp)):
        for ki, kc in enumerate(chunk_ids(src, cp)):
            m = _mask(qc, kc, n)
            if not isinstance(m, str):
                out.append((slice(qi * n, (qi + 1) * n), slice(ki * n, (ki + 1) * n), m))
    return out


def _ring_pass(comm, arrays):
    """Send ``arrays`` (a tuple) to the right neighbour, receive the left neighbour's (same shapes)."""
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
    """softmax(q k^T scale, causal) v over the context group. q, k, v (b, H, 2n, D) -> out (b, H, 2n, D).

    Saves q, k, v, out and the row log-sum-exp (b, H, 2n) (at least float32).
    Forward: c-1 ring passes of (k, v); backward: c-1 of (k, v) and c of (dk, dv).
    """

    @staticmethod
    def forward(ctx, q, k, v, comm):
        xp, cp, r = backend.xp, comm.world_size, comm.rank
        n, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        acc_t = xp.promote_types(q.dtype, xp.float32)
        m = xp.full(q.shape[:3], -xp.inf, dtype=acc_t)  # running row maximum
        l = xp.zeros(q.shape[:3], dtype=acc_t)  # running sum of exp(score - m)
        o = xp.zeros(q.shape, dtype=acc_t)  # running unnormalised output
        kv = (k, v)
        for j in range(cp):
            if j:
                kv = _ring_pass(comm, kv)
            kb, vb = kv
            for qs, ks, mask in _blocks(r, (r - j) % cp, cp, n):  # the flash block step (nn/flash_attention.py)
                sc = block_scores(q[:, :, qs].astype(acc_t, copy=False), kb[:, :, ks].astype(acc_t, copy=False),
                                  scale, mask)
                m[:, :, qs], l[:, :, qs], o[:, :, qs] = online_softmax_step(
                    m[:, :, qs], l[:, :, qs], o[:, :, qs], sc, vb[:, :, ks].astype(acc_t))
        out = (o / l[..., None]).astype(q.dtype)
        ctx.comm = comm
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
        dsum = (g * out.astype(acc_t)).sum(axis=-1)  # D = rowsum(dO * O)
        dq = xp.zeros(q.shape, dtype=acc_t)
        kb, vb = k, v
        dkb, dvb = xp.zeros(k.shape, dtype=acc_t), xp.zeros(v.shape, dtype=acc_t)
        for j in range(cp):
            if j:
                kb, vb, dkb, dvb = _ring_pass(comm, (kb, vb, dkb, dvb))
            for qs, ks, mask in _blocks(r, (r - j) % cp, cp, n):
                kk, vv, qq = kb[:, :, ks].astype(acc_t), vb[:, :, ks].astype(acc_t), q[:, :, qs].astype(acc_t)
                gq, gk, gv = attention_block_grads(qq, kk, vv, g[:, :, qs], lse[:, :, qs], dsum[:, :, qs], scale, mask)
                dq[:, :, qs] += gq
                dkb[:, :, ks] += gk
                dvb[:, :, ks] += gv
        if cp > 1:  # the block held now is rank r+1's: one more pass brings every dk, dv home
            dkb, dvb = _ring_pass(comm, (dkb, dvb))
        return dq.astype(q.dtype), dkb.astype(k.dtype), dvb.astype(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, comm) -> Tensor:
    """Causal attention of this rank's chunks against the whole sequence. q, k, v (b, H, 2n, D) -> (b, H, 2n, D)."""
    return _RingAttention.apply(q, k, v, comm)


# --------------------------------------------------------------------------- in the model
def context_parallelize(stage, comm, attention: str = "ring") -> list[str]:
    """Split a stage's sequence over the context group ``comm``, in place; returns the converted names
    (no-op for c = 1).

    Pre-hooks keep this rank's chunks of ids and targets, (b, T) -> (b, 2n), with global ``wpe`` positions; every
    ``attn.core`` becomes a :class:`RingAttentionCore` or (``"ulysses"``) an ``UlyssesAttentionCore``, by
    ``swap_modules``. Raises ValueError: ``attention`` not "ring" or "ulysses".
    """
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"unknown context-parallel attention {attention!r}; allowed: {CP_ATTENTIONS}")
    cp = comm.world_size
    if cp == 1:
        return []
    done = []
    for part in getattr(stage, "chunks", [stage]):
        done += _split_sequence(part, comm)
    cores = {id(block.attn.core) for block in stage.transformer["h"]}

    def split_core(core):  # selective recompute came first: the new core inside a new wrapper
        if isinstance(core, CheckpointWrapper):
            return CheckpointWrapper(split_core(core.inner))
        return RingAttentionCore(comm) if attention == "ring" else UlyssesAttentionCore(comm, core)

    return done + stage.swap_modules(lambda m: split_core(m) if id(m) in cores else None)


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
    stage.sequence_shards *= cp  # activations between stages: (b, T / (cp [x tp under SP]), C)
    return done


class RingAttentionCore(Module):
    """An attention core: q, k, v (b, H, 2n, D) -> (b, H, 2n, D) by :func:`ring_attention` over ``comm``;
    no parameters."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def forward(self, q, k, v, dropout=None):  # no attention dropout (the command line refuses it)
        return ring_attention(q, k, v, self.comm)


def context_group(dp_comm, cp: int):
    """The context-parallel group inside a data group of dp*cp ranks: data ranks [k cp, (k+1) cp) (None for cp = 1)."""
    return None if cp == 1 else dp_comm.split(color=dp_comm.rank // cp, key=dp_comm.rank % cp)
