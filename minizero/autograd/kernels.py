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
    out = xp.bincount(bins, weights=rows.reshape(-1), minlength=v * c)
    return out.reshape(v, c).astype(rows.dtype, copy=False)


def gelu_tanh(x):
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)) as a new array, computed in place."""
    u = x * x
    u *= x
    u *= 0.044715
    u += x
    u *= GELU_C
    return backend.xp.tanh(u, out=u)


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
