"""Memory-efficient attention: the FlashAttention recurrence on one device (``--attention flash``).

Per query block an online softmax over key blocks j <= i; backward recomputes P = exp(S - L) per block. Saves
q, k, v, O (B, H, T, D) and L (B, H, T) (L in at least float32), no (T, T) array; dropout reads the dense core's mask.
Source: Dao et al., arXiv:2205.14135; FlashAttention-2, arXiv:2307.08691, algorithms 1 and 2.
"""
from __future__ import annotations

import math
import numbers

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.nn.module import Module

ATTENTIONS = ("dense", "flash")  #: choices of ``--attention``


# --------------------------------------------------------------------------- the block kernel (ring attention's too)
_matmul = backend.matmul  # batched (torch.matmul, not the 2-D torch.mm); BLAS-friendly operands on NumPy


def block_scores(q, k, scale: float, mask=None):
    """S = q k^T scale, -inf where ``mask`` (bool, True = keep) is False. q (..., n, D),
    k (..., m, D) -> (..., n, m)."""
    s = _matmul(q, k.swapaxes(-1, -2)) * scale
    return s if mask is None else backend.xp.where(mask, s, -backend.xp.inf)


def online_softmax_step(m, l, o, s, v, keep=None, keep_scale: float = 1.0):
    """One key/value block of the online softmax: (m, l, o) -> (m', l', o').

    m, l (..., n): running row max and sum of exp(S - m); o (..., n, D); s (..., n, k); v (..., k, D);
    keep (..., n, k) bool or None. No row of s may be all -inf.
    """
    xp = backend.xp
    m_new = xp.maximum(m, s.max(axis=-1))
    alpha = xp.exp(m - m_new)
    p = xp.exp(s - m_new[..., None])
    l = l * alpha + p.sum(axis=-1)
    if keep is not None:
        p = p * keep * keep_scale
    return m_new, l, o * alpha[..., None] + _matmul(p, v)


def attention_block_grads(q, k, v, g, lse, dsum, scale: float, mask=None, keep=None, keep_scale: float = 1.0):
    """One block's (dq, dk, dv) from P = exp(S - L) recomputed: dv = P^T g, dS = P (g v^T - dsum), dq = dS k scale,
    dk = dS^T q scale; with dropout, keep * keep_scale multiplies P in dv and g v^T in dS.

    q, g (..., n, D), lse, dsum (..., n); k, v (..., m, D); mask (n, m) bool or None; keep (..., n, m) or None.
    """
    xp = backend.xp
    p = xp.exp(_matmul(q, k.swapaxes(-1, -2)) * scale - lse[..., None])
    if mask is not None:
        p = xp.where(mask, p, 0.0)
    dp = _matmul(g, v.swapaxes(-1, -2))
    if keep is not None:
        dv = _matmul((p * keep * keep_scale).swapaxes(-1, -2), g)
        dp = dp * keep * keep_scale
    else:
        dv = _matmul(p.swapaxes(-1, -2), g)
    ds = p * (dp - dsum[..., None])
    return _matmul(ds, k) * scale, _matmul(ds.swapaxes(-1, -2), q) * scale, dv


# --------------------------------------------------------------------------- the autograd Function
def _upcast(x, acc):
    return x.astype(acc, copy=False)


class _FlashAttention(Function):
    """softmax(q k^T / sqrt(D), causal) -> dropout -> @ v by blocks. q, k, v (B, H, T, D) -> (B, H, T, D).

    ``drop``: a ``MaskStream`` of the (B, H, T, T) keep mask, or None. Saves q, k, v, O and L (B, H, T).
    """

    @staticmethod
    def forward(ctx, q, k, v, block, drop):
        xp = backend.xp
        b, h, t, d = q.shape
        scale, acc = 1.0 / math.sqrt(d), xp.promote_types(q.dtype, xp.float32)
        keep_scale = 1.0 / (1.0 - drop.p) if drop is not None else 1.0
        out = xp.empty(q.shape, dtype=q.dtype)
        lse = xp.empty((b, h, t), dtype=acc)
        bh = (slice(0, b), slice(0, h))
        for i0 in range(0, t, block):  # FlashAttention-2: the outer loop over query blocks
            qs = slice(i0, min(i0 + block, t))
            qb = _upcast(q[:, :, qs], acc)
            rows = (b, h, qs.stop - i0)
            m = xp.full(rows, -xp.inf, dtype=acc)  # running row maximum
            l = xp.zeros(rows, dtype=acc)  # running sum of exp(S - m)
            o = xp.zeros(rows + (d,), dtype=acc)  # running unnormalised output
            for ks, diag in _causal_blocks_of_row(qs, block):
                mask = causal_mask(qs.stop - qs.start) if diag else None
                s = block_scores(qb, _upcast(k[:, :, ks], acc), scale, mask)
                keep = drop.block(bh + (qs, ks)) if drop is not None else None
                m, l, o = online_softmax_step(m, l, o, s, _upcast(v[:, :, ks], acc), keep, keep_scale)
            out[:, :, qs] = o / l[..., None]
            lse[:, :, qs] = m + xp.log(l)
        ctx.block, ctx.drop, ctx.keep_scale = block, drop, keep_scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        q, k, v, out, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        block, drop, scale, acc = ctx.block, ctx.drop, 1.0 / math.sqrt(d), lse.dtype
        g = _upcast(g, acc)
        dsum = (g * _upcast(out, acc)).sum(axis=-1)  # rowsum(dO * O), the papers' D (here D is the head width)
        dq, dk, dv = (xp.zeros(x.shape, dtype=acc) for x in (q, k, v))
        bh = (slice(0, b), slice(0, h))
        for j0 in range(0, t, block):  # FlashAttention-2's backward: outer loop over key/value blocks
            ks = slice(j0, min(j0 + block, t))
            kb, vb = _upcast(k[:, :, ks], acc), _upcast(v[:, :, ks], acc)
            for i0 in range(j0, t, block):  # query blocks on or below the diagonal
                qs = slice(i0, min(i0 + block, t))
                mask = causal_mask(qs.stop - i0) if i0 == j0 else None
                keep = drop.block(bh + (qs, ks)) if drop is not None else None
                gq, gk, gv = attention_block_grads(_upcast(q[:, :, qs], acc), kb, vb, g[:, :, qs], lse[:, :, qs],
                                                   dsum[:, :, qs], scale, mask, keep, ctx.keep_scale)
                dq[:, :, qs] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


def _causal_blocks_of_row(qs: slice, block: int):
    """The key blocks query block ``qs`` sees: (key slice, diagonal?), left to right."""
    for j0 in range(0, qs.start + 1, block):
        yield slice(j0, min(j0 + block, qs.stop)), j0 == qs.start


def causal_mask(n: int):
    """(n, n) bool, True on and below the diagonal: a block of queries against the same positions' keys."""
    return backend.xp.tril(backend.xp.ones((n, n), dtype=bool))


def check_block(block) -> int:
    """``block`` as an int. Raises: ValueError naming the value unless it is a positive integer (NumPy's too)."""
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        raise ValueError(f"the attention block must be a positive integer (rows per query/key block), got {block!r}")
    return int(block)


def _is_float(dtype) -> bool:  # str(dtype), 5 us in NumPy 2, only for the kinds other than 'f' (ml_dtypes' 'V')
    return getattr(dtype, "kind", None) == "f" or str(dtype).startswith(("float", "bfloat"))


def _check_qkv(q, k, v) -> None:  # a named error up front, not NumPy's unpack/broadcast/matmul one from the kernel
    shapes, dtypes = [getattr(t, "shape", None) for t in (q, k, v)], [getattr(t, "dtype", None) for t in (q, k, v)]
    if len(shapes[0] or ()) != 4 or len(set(shapes)) != 1 or not all(map(_is_float, dtypes)):
        raise ValueError(f"flash_attention: q, k, v must be float (B, H, T, D) arrays of one shape, got shapes "
                         f"{shapes[0]}, {shapes[1]}, {shapes[2]} and dtypes {', '.join(map(str, dtypes))}")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, block: int, dropout=None) -> Tensor:
    """Causal attention by blocks of ``block`` rows, equal to the dense core: (B, H, T, D) -> (B, H, T, D).

    ``dropout``: the attention's dropout module, or None. Raises ValueError: ``block`` not a positive integer;
    q, k, v not float (B, H, T, D) of one shape.
    """
    check_block(block)
    _check_qkv(q, k, v)
    drop = dropout.reserve_mask((q.shape[0], q.shape[1], q.shape[2], k.shape[2])) if dropout is not None else None
    return _FlashAttention.apply(q, k, v, block, drop)


class FlashAttentionCore(Module):
    """An attention core (``attn.core``): q, k, v (B, H, T, D) -> (B, H, T, D) by :func:`flash_attention`."""

    def __init__(self, block: int):
        super().__init__()
        self.block = check_block(block)

    def forward(self, q, k, v, dropout=None):
        return flash_attention(q, k, v, self.block, dropout)


def use_flash_attention(stage, block: int) -> list[str]:
    """Make every block's ``attn.core`` a :class:`FlashAttentionCore` (before recompute, CP), by ``swap_modules``
    (an interleaved stage's chunks see the same cores); returns the names."""
    check_block(block)
    cores = {id(blk.attn.core) for blk in stage.transformer["h"]}
    return stage.swap_modules(lambda m: FlashAttentionCore(block) if id(m) in cores else None)
