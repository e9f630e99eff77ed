"""Array-level kernels of the fused Functions: in place, in the order of the formula (float64 bits unchanged).

float16 storage is widened once to float32 and rounded once at the store (Micikevicius et al. 2018, section 3).
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend

GELU_C = math.sqrt(2.0 / math.pi)  #: sqrt(2/pi) of GELU's tanh form


def compute_dtype(dtype) -> np.dtype:
    """The dtype elementwise work runs in: float32 for float16 storage, else the dtype itself."""
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


def widen(a):
    """``a`` in its compute dtype (:func:`compute_dtype`); no copy unless it is float16 (:func:`backend.widen`)."""
    return backend.widen(a)


def scatter_add_rows(shape, idx, rows):
    """``out = zeros(shape); out[idx[i]] += rows[i]`` in order of i, as ``np.add.at``: idx (N,), rows (N, C) -> (V, C).

    One float64 ``bincount`` (float64: add.at's bits; narrower: the float64 sum rounded once).
    """
    xp = backend.xp
    v, c = shape
    bins = (idx.reshape(-1, 1) * c + xp.arange(c)).reshape(-1)
    out = xp.bincount(bins, weights=backend.to_dtype(rows.reshape(-1), np.float64), minlength=v * c)  # exact
    return out.reshape(v, c).astype(rows.dtype, copy=False)


BLOCK_ELEMENTS = 1 << 16  #: elements per block of a blockwise kernel (256 KiB of float32: the core's cache holds
#: a block's few temporaries, so each pass after the first reads from cache, not memory)
BLOCKED_FROM = 4 * BLOCK_ELEMENTS  #: arrays smaller than this run as one block (blocks cost more than they save)


def row_blocks(rows: int, row_len: int) -> list[slice]:
    """Slices of ``rows`` rows of ``row_len`` elements, about :data:`BLOCK_ELEMENTS` each (at least one row; one empty
    slice for no rows); CuPy: one block (no cache to fit; each block would launch its kernels again)."""
    if backend.name == "cupy" or rows * row_len < BLOCKED_FROM:
        return [slice(0, rows)]
    step = max(1, BLOCK_ELEMENTS // max(row_len, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def blockwise(kernel, dtype, *arrays):
    """``kernel`` of the same-shape ``arrays`` (widened to their compute dtype) as a new array of ``dtype``, computed
    in flat blocks (:func:`row_blocks`); for elementwise kernels, whose every element depends on its own inputs only."""
    if len(row_blocks(arrays[0].size, 1)) == 1:  # one block: the kernel's own result, no copy
        return backend.to_dtype(kernel(*(widen(a) for a in arrays)), dtype)
    flat = [a.reshape(-1) for a in arrays]
    out = backend.xp.empty(arrays[0].shape, dtype)  # allocated in its own shape (the ledger reads it), filled flat
    into = out.reshape(-1)
    for b in row_blocks(out.size, 1):
        into[b] = backend.to_dtype(kernel(*(widen(f[b]) for f in flat)), dtype)
    return out


def gelu_tanh(x):
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)) as a new array, computed in place."""
    u = x * x
    u *= x
    u *= 0.044715
    u += x
    u *= GELU_C
    return backend.xp.tanh(u, out=u)


def gelu_forward(xs):
    """0.5 x (1 + tanh(...)) of the compute-dtype ``xs``, a new array."""
    u = gelu_tanh(xs)
    u += 1.0
    u *= xs
    u *= 0.5  # 0.5 * x * (1 + t): scaling by 0.5 is exact, so the order does not matter
    return u


def gelu_backward(xs, gs):
    """GELU's input gradient ``gs * d gelu / dx`` of the compute-dtype ``xs`` and ``gs``, a new array."""
    t = gelu_tanh(xs)
    dt = t * t  # dt = (1 - t^2) * c * (1 + 3 * 0.044715 * x^2)
    backend.xp.subtract(1.0, dt, out=dt)
    dt *= GELU_C
    w = xs * (3 * 0.044715)
    w *= xs
    w += 1.0
    dt *= w
    backend.xp.multiply(xs, 0.5, out=w)  # 0.5 x dt
    w *= dt
    t += 1.0  # 0.5 (1 + t) + 0.5 x dt
    t *= 0.5
    t += w
    t *= gs
    return t


def layer_norm_rows(xs, weight, bias, eps: float):
    """Layer norm of the rows of ``xs`` (rows, C) in its statistics dtype: ``(y, mean, rstd)``, the last two
    (rows, 1); a width of 0 takes the statistics of nothing as 0 (as PyTorch)."""
    xp = backend.xp
    if xs.shape[-1] == 0:
        mean = xp.zeros(xs.shape[:-1] + (1,), xs.dtype)
        var = xp.zeros_like(mean)
    else:
        mean = xs.mean(axis=-1, keepdims=True)
    d = xs - mean  # the one full-size temporary; every later step writes into it or into sq
    sq = d * d  # == (xs - mean) ** 2 (NumPy's power 2 is a square)
    if xs.shape[-1]:
        var = sq.mean(axis=-1, keepdims=True)
    del sq
    rstd = 1.0 / xp.sqrt(var + eps)
    d *= rstd
    d *= weight
    d += bias
    return d, mean, rstd


def layer_norm_input_grad(gx, xhat, rstd):
    """dx = rstd * (gx - mean(gx) - xhat * sum(gx * xhat) / C) of rows (rows, C), gx = g * w (overwritten)."""
    t = gx * xhat
    s = t.sum(axis=-1, keepdims=True)
    backend.xp.multiply(xhat, s, out=t)
    t /= gx.shape[-1]
    m = gx.mean(axis=-1, keepdims=True)
    gx -= m
    gx -= t
    gx *= rstd
    return gx


def causal_softmax_rows(xs, mask):
    """Softmax over the last axis of the (n, t, s) compute-dtype ``xs`` with the (t, s) ``mask``'s True positions
    at -inf, a new array."""
    e = xs.copy()  # then -inf written where masked: the same array as where(mask, -inf, xs), in about half the time
    backend.xp.copyto(e, -backend.xp.inf, where=mask)
    e -= e.max(axis=-1, keepdims=True)
    backend.xp.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return e


def softmax_backward_rows(ys, gs, renormalize: bool):
    """y * (g - sum(g * y)) over the last axis of compute-dtype rows; ``renormalize``: ``ys`` (a copy) divided by its
    sum first (a float16 softmax output does not sum to 1)."""
    if renormalize:
        ys /= ys.sum(axis=-1, keepdims=True)
    d = gs * ys
    s = d.sum(axis=-1, keepdims=True)
    backend.xp.subtract(gs, s, out=d)
    d *= ys
    return d


_MASKS = {}


def causal_mask(t: int, s: int):
    """The (t, s) bool mask of positions j > i (True = masked), built once per shape and backend."""
    key = (backend.name, t, s)
    if key not in _MASKS:
        _MASKS[key] = backend.xp.triu(backend.xp.ones((t, s), dtype=bool), k=1)
    return _MASKS[key]


def masked_scale(x, keep, scale: float):
    """x * keep * scale, in x's compute dtype, rounded to x's dtype once."""
    y = widen(x) * keep
    y *= y.dtype.type(scale)
    return backend.to_dtype(y, x.dtype)
