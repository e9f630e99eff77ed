"""AdamW, the learning-rate schedule and global-norm gradient clipping.

:func:`adamw_update` is written once on flat arrays, for every optimizer layout (whole parameters; ZeRO shards).
Sources: Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019, Algorithm 2, as ``torch.optim.AdamW``
(``p -= lr * wd * p`` before the Adam step); nanoGPT's grouping (decay 2-D weights) and warmup + cosine.
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend
from minizero.optim.base import Optimizer
from minizero.optim.state_store import OptimizerStateStore


def adamw_update(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: float = 1.0) -> None:
    """One AdamW step, in place on ``p``, ``m`` and ``v`` (``m``, ``v``: the state dtype, p's shape).

    ``p`` (any float dtype; the FP32 master under mixed precision) and ``g`` (p's shape) are widened to ``m``'s
    dtype; the gradient used is ``g * grad_scale`` (1/loss-scale and clipping folded in). ``step``: 1-based t.
    """
    gs = backend.to_dtype(g, m.dtype)
    if grad_scale != 1.0:
        gs = gs * m.dtype.type(grad_scale)
    m *= beta1
    m += (1.0 - beta1) * gs
    v *= beta2
    v += (1.0 - beta2) * (gs * gs)
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    denom = backend.array_module(v).sqrt(v / bc2) + eps  # NumPy for offloaded (host) state
    update = (lr / bc1) * (m / denom)
    if p.dtype == m.dtype:
        if weight_decay:
            p *= 1.0 - lr * weight_decay
        p -= update
    else:  # low-precision p: compute in the state dtype, then round once
        pw = backend.to_dtype(p, m.dtype)  # p's dtype is not m's: a new array
        if weight_decay:
            pw *= 1.0 - lr * weight_decay
        pw -= update
        p[...] = backend.to_dtype(pw, p.dtype)


def state_dtype(param_dtype) -> np.dtype:
    """Adam state dtype for a parameter dtype: float64 stays float64, everything else float32."""
    return np.dtype(np.float64) if np.dtype(param_dtype) == np.float64 else np.dtype(np.float32)


class AdamW(Optimizer):
    """AdamW over a list of Parameters with nanoGPT's weight-decay grouping; ``grad is None`` skipped, as PyTorch.

    ``master_weights``: update an FP32 copy, the parameter gets the rounded result (Micikevicius et al. 2018, 3.1).
    ``store``: where m, v and masters live (default device). State: ``optimizer_state``, m and v in
    :func:`state_dtype`: 8 bytes per parameter (16 for float64; +4 with masters). Raises ValueError: a
    hyper-parameter out of range (named).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, master_weights=False,
                 store=None):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.store = store if store is not None else OptimizerStateStore("none")
        self.m, self.v = [], []
        self.masters = None
        if master_weights:
            self.masters = [self.store.copy_of(p.data, np.float32) for p in self.params]
        for p in self.params:
            dt = state_dtype(p.dtype)
            self.m.append(self.store.zeros(p.shape, dt))
            self.v.append(self.store.zeros(p.shape, dt))

    def _update(self, i, p, weight_decay, grad_scale):
        target = self.store.to_store(p.data) if self.masters is None else self.masters[i]
        grad = self.store.to_store(p.grad)  # offloaded: the update runs where the state is
        adamw_update(target, grad, self.m[i], self.v[i], self.step_count, self.lr, *self.betas, self.eps,
                     weight_decay, grad_scale)
        if self.masters is not None or target is not p.data:
            p.data[...] = backend.to_device(backend.to_dtype(target, p.dtype))

    def state_dict(self) -> dict:
        """Host copies: ``{"step": int, "m.i": array, "v.i": array}`` for parameter index i."""
        out = {"step": self.step_count}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            out[f"m.{i}"], out[f"v.{i}"] = backend.to_host(m).copy(), backend.to_host(v).copy()
        return out


def cosine_lr(step: int, max_lr: float, warmup: int, total: int, min_lr: float) -> float:
    """Learning rate at 0-based ``step``: ``max_lr * (step + 1) / warmup``, then cosine to ``min_lr`` at ``total``.

    Raises: ValueError for a ``step``, ``warmup`` or ``total`` that is not an integer >= 0 (step -2 gave a
    negative learning rate in warm-up)."""
    for name, v in (("step", step), ("warmup", warmup), ("total", total)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"cosine_lr: {name}={v!r}; allowed: an integer >= 0")
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def global_grad_norm_sq(grads) -> float:
    """Sum of squares of all gradient elements (computed in float64 on the device), a Python float."""
    total = backend.xp.zeros((), dtype=np.float64)
    for g in grads:
        if g is not None:
            total += (backend.to_dtype(g, np.float64) ** 2).sum()
    return float(total)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)); 1 when ``max_norm`` <= 0 or inf (``torch.nn.utils.clip_grad_norm_``)."""
    if isinstance(max_norm, (bool, str)) or math.isnan(max_norm):  # NaN > 0 is False: it would skip clipping unsaid
        raise ValueError(f"max_norm={max_norm!r}; allowed: a number (<= 0 or inf: no clipping)")
    if max_norm > 0 and math.isfinite(max_norm):
        return min(1.0, max_norm / (norm + 1e-6))
    return 1.0


def clip_grad_norm_(params, max_norm: float, norm_sq: float | None = None) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the norm before clipping.

    ``max_norm`` <= 0 or inf: no clipping. ``norm_sq``: the squared norm if known (ZeRO). Mirrors
    ``torch.nn.utils.clip_grad_norm_``.
    """
    if norm_sq is None:
        norm_sq = global_grad_norm_sq(p.grad for p in params)
    total = math.sqrt(norm_sq)
    coef = clip_coefficient(total, max_norm)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad *= p.grad.dtype.type(coef)
    return total
