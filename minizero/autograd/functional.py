"""The neural-network ops a GPT needs, each a fused Function with a hand-written backward.

B = batch, T = sequence, C = width, V = vocabulary, H = heads, N = rows. What each op saves is what the ledger
counts as activations. Sources: layer norm (Ba et al. 2016), GELU tanh form (Hendrycks & Gimpel 2016),
inverted dropout (Srivastava et al. 2014), softmax cross-entropy with the log-sum-exp trick.
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend
from minizero.autograd.engine import Function, Tensor
from minizero.autograd.rng import (  # noqa: F401 (the generator's API, re-exported)
    MaskStream, dropout_keep_mask, fork_rng, get_rng_state, in_batch_rows, manual_seed, set_rng_state)
from minizero.autograd.kernels import (blockwise, causal_mask, causal_softmax_rows, compute_dtype, gelu_backward,
                                      gelu_forward, layer_norm_input_grad, layer_norm_rows, masked_scale, row_blocks,
                                      scatter_add_rows, softmax_backward_rows, widen)


def _flat2d(a):
    """``a`` (..., K) as (rows, K), rows spelled out (NumPy cannot infer -1 when K = 0)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


class Linear(Function):
    """y = x W^T + b. x (..., in), W (out, in), b (out,) or None -> y (..., out). Saves x and W."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        return backend.matmul(x, weight.T, bias)  # float16: the bias added in the GEMM's epilogue

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = len(ctx.needs_input_grad) > 2 and ctx.needs_input_grad[2]
        gm, op = backend.matmul_operand(g), backend.matmul_operand  # g widened once for both products
        dx = backend.to_dtype(backend.matmul(gm, op(w)), np.result_type(g.dtype, w.dtype)) if need_x else None
        dw = (backend.to_dtype(backend.matmul(_flat2d(gm).T, _flat2d(op(x))), np.result_type(g.dtype, x.dtype))
              if need_w else None)
        db = _flat2d(g).sum(axis=0, dtype=compute_dtype(g.dtype)).astype(g.dtype, copy=False) if need_b else None
        return (dx, dw, db)[: len(ctx.needs_input_grad)]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias``; see :class:`Linear`."""
    return Linear.apply(x, weight, bias) if bias is not None else Linear.apply(x, weight)


class Embedding(Function):
    """Row lookup ``W[idx]``: W (V, C), idx integer (...) -> (..., C). Saves idx.

    Backward: dW[v] = sum of g where idx == v, by :func:`scatter_add_rows` (``np.add.at``'s order).
    """

    @staticmethod
    def forward(ctx, weight, idx):
        ctx.weight_shape = weight.shape
        ctx.save_for_backward(idx)
        return weight[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return scatter_add_rows(ctx.weight_shape, idx.reshape(-1), _flat2d(g)), None


def embedding(idx, weight: Tensor) -> Tensor:
    """Look up rows of ``weight`` (V, C) for integer ``idx`` (...); returns (..., C)."""
    if isinstance(idx, Tensor):
        idx = idx.data
    return Embedding.apply(weight, idx)


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis: x (..., C), w (C,), b (C,) -> (..., C).

    Statistics in at least float32. Saves x, w, mean (..., 1) and rstd (..., 1).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps=1e-5):
        xp, stat_dtype = backend.xp, np.promote_types(x.dtype, np.float32)
        stats = x.shape[:-1] + (1,)
        whole = not x.flags.c_contiguous  # strided: reduced in its own layout (a copy would change the rows' sums)
        if whole or len(row_blocks(math.prod(stats), x.shape[-1])) == 1:  # one block: the kernel's own arrays
            y, mean, rstd = layer_norm_rows(widen(x).astype(stat_dtype, copy=False), weight, bias, eps)
            ctx.save_for_backward(x, weight, mean, rstd)
            return backend.to_dtype(y, x.dtype)
        y, mean, rstd = xp.empty(x.shape, x.dtype), xp.empty(stats, stat_dtype), xp.empty(stats, stat_dtype)
        x2, y2, mean2, rstd2 = _flat2d(x), _flat2d(y), _flat2d(mean), _flat2d(rstd)  # views but for a strided x
        for b in row_blocks(*x2.shape):  # a block of rows at a time: see kernels.row_blocks
            yb, mean2[b], rstd2[b] = layer_norm_rows(widen(x2[b]).astype(stat_dtype, copy=False), weight, bias, eps)
            y2[b] = backend.to_dtype(yb, x.dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors
        xhat = widen(x).astype(mean.dtype, copy=False) - mean
        xhat *= rstd
        gs = widen(g).astype(mean.dtype, copy=False)
        t = gs * xhat
        dw = _flat2d(t).sum(axis=0).astype(w.dtype, copy=False)  # sums over all rows at once: their bits
        db = _flat2d(gs).sum(axis=0).astype(w.dtype, copy=False)
        del t
        if x.shape[-1] == 0:  # width 0: every gradient is empty
            return backend.xp.zeros_like(x), dw, db, None
        whole = not (x.flags.c_contiguous and g.flags.c_contiguous)  # strided: reduced in its own layout, as forward
        if whole or len(row_blocks(math.prod(x.shape[:-1]), x.shape[-1])) == 1:
            return backend.to_dtype(layer_norm_input_grad(gs * w, xhat, rstd), x.dtype), dw, db, None
        dx = backend.xp.empty(x.shape, x.dtype)
        xhat2, gs2, rstd2, dx2 = _flat2d(xhat), _flat2d(gs), _flat2d(rstd), _flat2d(dx)
        for b in row_blocks(*xhat2.shape):
            dx2[b] = backend.to_dtype(layer_norm_input_grad(gs2[b] * w, xhat2[b], rstd2[b]), x.dtype)
        return dx, dw, db, None


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer normalization over the last axis; see :class:`LayerNorm`."""
    return LayerNorm.apply(x, weight, bias, eps)


class GELU(Function):
    """GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Any shape; saves x.

    float16 computed in float32, rounded once at the store (:func:`compute_dtype`).
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return blockwise(gelu_forward, x.dtype, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return blockwise(gelu_backward, g.dtype, x, g)


def gelu(x: Tensor) -> Tensor:
    """GELU (tanh form); see :class:`GELU`."""
    return GELU.apply(x)


class ScaledMatMul(Function):
    """Attention scores ``(a * scale) @ b``, scaled first (as PyTorch's SDPA: no float16 overflow of q k^T).

    a (..., n, k), b (..., k, m) -> (..., n, m). Saves a and b (``a * scale`` recomputed in backward).
    """

    @staticmethod
    def forward(ctx, a, b, scale):
        ctx.scale = scale
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        return backend.matmul(backend.binary("multiply", a, a.dtype.type(scale)), b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        xp, s = backend.xp, ctx.scale
        scaled = lambda t: backend.binary("multiply", t, t.dtype.type(s))  # noqa: E731
        da = backend.matmul(scaled(g), xp.swapaxes(b, -1, -2)) if ctx.needs_input_grad[0] else None
        db = backend.matmul(xp.swapaxes(scaled(a), -1, -2), g) if ctx.needs_input_grad[1] else None
        return da, db, None


def scaled_matmul(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``(a * scale) @ b`` with the scale applied first; see :class:`ScaledMatMul`."""
    return ScaledMatMul.apply(a, b, scale)


class CausalSoftmax(Function):
    """Softmax over the last axis with position j > i masked out: scores (..., T, T) -> probabilities (..., T, T).

    In at least float32; saves the output. Backward: dx = y * (g - sum(g * y)), a float16 y renormalized
    to sum 1 first (lesson 04).
    """

    @staticmethod
    def forward(ctx, x):
        t, s = x.shape[-2], x.shape[-1]
        if len(row_blocks(math.prod(x.shape[:-2]), t * s)) == 1:  # one block: the kernel's own array, no copy
            y = backend.to_dtype(causal_softmax_rows(widen(x), causal_mask(t, s)), x.dtype)
            ctx.save_for_backward(y)
            return y
        y = backend.xp.empty(x.shape, x.dtype)  # in its own shape: the ledger counts (b, h, t, s) arrays as scores
        x3, y3 = (a.reshape(math.prod(x.shape[:-2]), t, s) for a in (x, y))
        for b in row_blocks(len(x3), t * s):  # a block of (t, s) matrices at a time: see kernels.row_blocks
            y3[b] = backend.to_dtype(causal_softmax_rows(widen(x3[b]), causal_mask(t, s)), x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        if len(row_blocks(math.prod(y.shape[:-1]), y.shape[-1])) == 1:
            return backend.to_dtype(softmax_backward_rows(widen(y), widen(g), y.dtype.itemsize < 4), g.dtype)
        dx = backend.xp.empty(g.shape, g.dtype)
        y2, g2, dx2 = _flat2d(y), _flat2d(g), _flat2d(dx)
        for b in row_blocks(*y2.shape):  # float16 probabilities do not sum to 1: renormalized, or a gradient
            # common to a whole row would leak through the (g - sum) difference
            dx2[b] = backend.to_dtype(softmax_backward_rows(widen(y2[b]), widen(g2[b]), y.dtype.itemsize < 4), g.dtype)
        return dx


def causal_softmax(scores: Tensor) -> Tensor:
    """Causally masked softmax over the last axis; see :class:`CausalSoftmax`."""
    return CausalSoftmax.apply(scores)


# ---- dropout (its counter-based generator: minizero.autograd.rng) --------------------


class Dropout(Function):
    """Inverted dropout by a bool keep mask of x's shape: y = x * keep / (1 - p), rounded to x's dtype once; the
    mask saved (1 byte per element). Every dropout of minizero, whole or a shard's, ends here."""

    @staticmethod
    def forward(ctx, x, keep, p):
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return masked_scale(x, keep, ctx.scale)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return masked_scale(g, keep, ctx.scale), None, None


def dropout(x: Tensor, p: float, training: bool = True, site=None) -> Tensor:
    """Dropout with probability ``p`` in training mode; identity otherwise or when p == 0. The mask: the
    stream's next draws (``rng.dropout_keep_mask``), or inside ``rng.batch_rows`` site ``site``'s rows
    (``MaskStream.reserve``; ``site``: the dropout's number in the model). ValueError: p outside [0, 1), or no
    ``site`` inside ``batch_rows``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if in_batch_rows():
        keep = MaskStream.reserve(x.shape, p, site=site).block(tuple(slice(0, d) for d in x.shape))
    else:
        keep = dropout_keep_mask(x.shape, p)
    return Dropout.apply(x, keep, p)


IGNORE_INDEX = -100  #: PyTorch's default ``ignore_index``: a target that adds nothing to the loss


def check_targets(targets, n: int, vocab_size: int, where: str = "cross_entropy", ignore_index: int = IGNORE_INDEX):
    """ValueError (first bad value and position) unless ``targets`` is (n,) ints in [0, vocab_size) or
    ``ignore_index``."""
    xp = backend.xp
    if getattr(targets, "shape", None) != (n,):
        raise ValueError(f"{where}: targets must have shape ({n},), got {getattr(targets, 'shape', type(targets))}")
    if n and not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"{where}: targets must be integers, got dtype {targets.dtype}")
    bad = xp.flatnonzero(((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: targets must lie in [0, {vocab_size}) or equal ignore_index {ignore_index}; "
                         f"target {int(targets[i])} at position {i} is outside ({bad.size} bad in all)")


def mean_over_kept(losses, keep):
    """sum(losses[keep]) / count(keep) in ``losses.dtype``; NaN when nothing is kept (PyTorch's 0/0).

    With every row kept this is ``losses.mean()`` bit for bit (the same sum divided by the same count).
    """
    xp = backend.xp
    count = keep.sum()
    total = xp.where(keep, losses, 0).sum()
    return xp.where(count > 0, total / xp.maximum(count, 1).astype(losses.dtype), xp.nan).astype(losses.dtype)


class CrossEntropy(Function):
    """Mean softmax cross-entropy of ``logits`` against integer ``targets`` (rows targeting ``ignore_index`` left out).

    logits (N, V), targets (N,) -> scalar (float32 for float16/32 logits, float64 for float64); NaN when every row
    is ignored. In at least float32 from z - m (m the row maximum, which cancels exactly). Saves logits, targets and
    log(sum exp(z - m)) (N,). Backward: (softmax - onehot) / n on kept rows, zero on ignored ones.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=IGNORE_INDEX):
        xp = backend.xp
        ls = backend.to_dtype(logits, np.promote_types(logits.dtype, np.float32))
        m = ls.max(axis=-1, keepdims=True)
        shifted = ls - m
        logsum = xp.log(xp.exp(shifted).sum(axis=-1))
        keep = targets != ignore_index
        picked = shifted[xp.arange(ls.shape[0]), xp.where(keep, targets, 0)]
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, targets, logsum)
        return mean_over_kept(logsum - picked, keep)  # float16 logits -> float32 loss

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        logits, targets, logsum = ctx.saved_tensors
        keep = targets != ctx.ignore_index
        ls = backend.to_dtype(logits, logsum.dtype)
        p = xp.exp((ls - ls.max(axis=-1, keepdims=True)) - logsum[:, None])
        p[xp.arange(logits.shape[0]), xp.where(keep, targets, 0)] -= 1.0
        p[~keep] = 0  # ignored rows: exactly zero
        n = xp.maximum(keep.sum(), 1).astype(p.dtype)
        return backend.to_dtype(p * (g / n), logits.dtype), None, None


def cross_entropy(logits: Tensor, targets, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy over the targets that are not ``ignore_index`` (PyTorch's ``F.cross_entropy``).

    ``logits`` (N, V) Tensor, ``targets`` (N,) ints. Raises ValueError: shapes disagree or a bad target.
    """
    t = targets.data if isinstance(targets, Tensor) else targets
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy expects logits (N, V) and targets (N,), got {logits.shape} and "
                         f"{getattr(t, 'shape', None)}")
    check_targets(t, logits.shape[0], logits.shape[1], ignore_index=ignore_index)
    return CrossEntropy.apply(logits, t, ignore_index)
