"""BF16 mixed precision (``--precision bf16``): bfloat16 matmuls, FP32 weights, no loss scale.

Rounding: round-to-nearest-even on the uint32 view (``bits += 0x7FFF + ((bits >> 16) & 1)``, top 16 bits; NaN
stays quiet). Recipe: ``torch.autocast(dtype=torch.bfloat16)``: every Linear takes bf16 x and W, accumulates
in FP32 and returns bf16; layer norm, softmax and the loss stay FP32. A :class:`~minizero.nn.Matmul` (the MoE
layer's router and expert products) becomes a :class:`BF16Matmul`, the same product without a bias.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.autograd.functional import _flat2d  # (..., K) -> (rows, K)
from minizero.nn.module import Linear, Matmul, Module

_ROUND, _QUIET = np.uint32(0x7FFF), np.uint32(0x00400000)  # the rounding bias; a NaN's quiet bit


def to_bf16_bits(x):
    """float32 array -> its bfloat16 (round-to-nearest-even) as a uint16 array of the same module.

    Raises: TypeError unless ``x`` is float32.
    """
    xp = backend.array_module(x)
    if x.dtype != np.float32:
        raise TypeError(f"to_bf16_bits takes float32, got {x.dtype}")
    bits = x.view(xp.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = bits + _ROUND + ((bits >> np.uint32(16)) & np.uint32(1))
    out = xp.where(nan, bits | _QUIET, rounded) >> np.uint32(16)
    return out.astype(xp.uint16)


def from_bf16_bits(b):
    """uint16 bfloat16 bits -> float32 (exact)."""
    xp = backend.array_module(b)
    return (b.astype(xp.uint32) << np.uint32(16)).view(xp.float32)


def round_bf16(x):
    """float32 array -> float32 array of the nearest bfloat16 values (ties to even); a new array."""
    return from_bf16_bits(to_bf16_bits(x))


class _BF16Linear(Function):
    """y = bf16(bf16(x) bf16(W)^T + b): x (..., in), W (out, in), b (out,) or None, all float32 -> (..., out).

    Saves bf16(x) and bf16(W) as uint16 (2 bytes per element). Backward: g rounded to bf16; dx, dW, db from it,
    each rounded to bf16.
    """

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        bx, bw = to_bf16_bits(x), to_bf16_bits(weight)
        ctx.save_for_backward(bx, bw)
        xr, wr = from_bf16_bits(bx), from_bf16_bits(bw)
        ctx.has_bias = bias is not None
        y = backend.matmul(xr, wr.T)
        if bias is not None:
            y += bias  # the epilogue in FP32, one rounding after it
        return round_bf16(y)

    @staticmethod
    def backward(ctx, g):
        xr, wr = (from_bf16_bits(b) for b in ctx.saved_tensors)
        g, need = round_bf16(g), ctx.needs_input_grad  # a split backward asks for dx (B), then dW (W)
        dx = round_bf16(backend.matmul(g, wr)) if need[0] else None
        dw = round_bf16(backend.matmul(_flat2d(g).T, _flat2d(xr))) if need[1] else None
        db = round_bf16(_flat2d(g).sum(axis=0)) if ctx.has_bias and need[2] else None
        return (dx, dw, db) if ctx.has_bias else (dx, dw)


class BF16Linear(Linear):
    """A Linear whose product runs in bf16 (:class:`_BF16Linear`); shares the original's Parameters (same names)."""

    def __init__(self, linear: Linear):
        Module.__init__(self)
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        args = (x, self.weight) if self.bias is None else (x, self.weight, self.bias)
        return _BF16Linear.apply(*args)


class BF16Matmul(Matmul):
    """``x @ w`` in bf16: x (N, in), w (in, out) float32 -> (N, out), as :class:`_BF16Linear` with W = w^T (a view)."""

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return _BF16Linear.apply(x, w.T)


def use_bf16(model) -> list[str]:
    """Replace every plain :class:`Linear` under ``model`` by a :class:`BF16Linear`, every plain :class:`Matmul` by
    a :class:`BF16Matmul` (in place); returns their names.

    Raises: TypeError for a parameter that is not float32 (bf16 keeps FP32 weights).
    """
    for name, p in model.named_parameters():
        if p.dtype != np.float32:
            raise TypeError(f"BF16 compute keeps float32 parameters; {name} is {p.dtype}")
    return model.swap_modules(lambda m: BF16Linear(m) if type(m) is Linear
                              else BF16Matmul() if type(m) is Matmul else None)
