"""QLoRA's pieces: NF4 weights with double quantization, and LoRA adapters on a frozen base.

NF4 (Dettmers et al. 2023, "QLoRA", arXiv:2305.14314, section 3 and appendix E): 16 code values at
quantiles of N(0, 1) normalised to [-1, 1], with an exact 0 (:data:`NF4_CODE`, as bitsandbytes
publishes it; :func:`nf4_code` rebuilds it from the quantiles). A weight is cut into blocks of 64;
each block stores its absmax and each element the index of the nearest code value to w / absmax
(two 4-bit indices per byte). Double quantization: the absmax constants, less their mean, are
quantized again to 8 bits in blocks of 256 with one float32 scale each (symmetric linear int8 here;
bitsandbytes uses its 8-bit dynamic code). Bytes per weight: 1/2 + 1/64 + 4/(64 x 256), 4.127 bits.

LoRA (Hu et al. 2021, arXiv:2106.09685): y = x W^T + b + (alpha / r) (x A^T) B^T with W, b frozen,
A (r, in) drawn uniform in +-1/sqrt(in) (PEFT's default) and B (out, r) zero, so training starts
from the base model. Only A and B are Parameters: gradients, optimizer state and (under data
parallelism or ZeRO) reductions and shards exist for them only. ``merged_weight`` = W + (alpha/r) B A.
"""
from __future__ import annotations

import dataclasses
from statistics import NormalDist

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, linear
from minizero.ledger import get_ledger
from minizero.nn.module import Linear, Module, Parameter

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)  #: bitsandbytes' NF4 values (QLoRA appendix E)
BLOCK, ABSMAX_BLOCK = 64, 256  #: elements per absmax; absmax constants per second-level scale


def nf4_code(offset: float = 0.9677083) -> np.ndarray:
    """The 16 NF4 values from normal quantiles: 8 positive at linspace(offset, 1/2, 9)[:-1], 7 negative at
    linspace(offset, 1/2, 8)[:-1], and 0; scaled so the largest magnitude is 1 (bitsandbytes' construction)."""
    q = NormalDist().inv_cdf
    pos = [q(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    neg = [-q(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    v = np.sort(np.array(pos + [0.0] + neg))
    return v / np.abs(v).max()


@dataclasses.dataclass
class NF4Tensor:
    """A weight in NF4 with double-quantized absmax: ``codes`` uint8 (two indices per byte), ``absmax_q``
    int8 (one per block of 64), ``absmax_scale`` float32 (one per 256 absmax), ``absmax_mean`` float."""

    codes: object
    absmax_q: object
    absmax_scale: object
    absmax_mean: float
    shape: tuple

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + 8-bit absmax + float32 second-level scales + the float32 mean."""
        return int(self.codes.nbytes + self.absmax_q.nbytes + self.absmax_scale.nbytes + 4)


def _pad(flat, multiple):
    xp = backend.array_module(flat)
    extra = (-flat.size) % multiple
    return xp.concatenate([flat, xp.zeros(extra, dtype=flat.dtype)]) if extra else flat


def quantize_nf4(w) -> NF4Tensor:
    """float array (any shape) -> :class:`NF4Tensor` (nearest code value per element; see the module docstring)."""
    xp = backend.array_module(w)
    flat = _pad(w.astype(xp.float32).reshape(-1), BLOCK).reshape(-1, BLOCK)
    absmax = xp.abs(flat).max(axis=1)
    mean = float(backend.to_host(absmax.mean()))
    centred = _pad(absmax - np.float32(mean), ABSMAX_BLOCK).reshape(-1, ABSMAX_BLOCK)
    scale = xp.abs(centred).max(axis=1) / np.float32(127)
    scale = xp.where(scale > 0, scale, np.float32(1)).astype(xp.float32)
    absmax_q = xp.rint(centred / scale[:, None]).astype(xp.int8)
    deq_absmax = _dequantize_absmax(absmax_q, scale, mean)[:flat.shape[0]]
    norm = flat / xp.where(deq_absmax > 0, deq_absmax, np.float32(1))[:, None]
    code = xp.asarray(np.array(NF4_CODE, np.float32))
    idx = xp.abs(norm[..., None] - code).argmin(axis=-1).astype(xp.uint8).reshape(-1)
    return NF4Tensor((idx[0::2] << np.uint8(4)) | idx[1::2], absmax_q.reshape(-1), scale, mean, tuple(w.shape))


def _dequantize_absmax(absmax_q, scale, mean):
    return (absmax_q.reshape(-1, ABSMAX_BLOCK).astype(np.float32) * scale[:, None]).reshape(-1) + np.float32(mean)


def dequantize_nf4(t: NF4Tensor):
    """:class:`NF4Tensor` -> float32 array of ``t.shape``: code[index] x the block's dequantized absmax."""
    xp = backend.array_module(t.codes)
    idx = xp.stack([t.codes >> np.uint8(4), t.codes & np.uint8(15)], axis=1).reshape(-1, BLOCK)
    absmax = _dequantize_absmax(t.absmax_q, t.absmax_scale, t.absmax_mean)[:idx.shape[0]]
    vals = xp.asarray(np.array(NF4_CODE, np.float32))[idx] * absmax[:, None]
    n = int(np.prod(t.shape))
    return vals.reshape(-1)[:n].reshape(t.shape)


class LoRALinear(Module):
    """A frozen Linear (NF4 or as given) plus a trainable low-rank update. x (..., in) -> (..., out).

    Parameters: ``lora_A`` (r, in) and ``lora_B`` (out, r) only. The base weight and bias are plain
    arrays (no gradient, no optimizer state), counted as ``parameters`` in the ledger.
    """

    def __init__(self, base: Linear, r: int, alpha: float, quantize: bool, seed: int = 0):
        super().__init__()
        if not isinstance(r, int) or r < 1 or r > min(base.in_features, base.out_features):
            raise ValueError(f"LoRA rank must be an integer in [1, {min(base.in_features, base.out_features)}], "
                             f"got {r!r}")
        self.in_features, self.out_features, self.r, self.scale = base.in_features, base.out_features, r, alpha / r
        w = base.weight.data
        self.base = quantize_nf4(w) if quantize else w  # the stored array itself: frozen, counted once
        self.base_bias = None if base.bias is None else base.bias.data
        for a in ((self.base.codes, self.base.absmax_q, self.base.absmax_scale) if quantize else (self.base,)):
            get_ledger().track(a, "parameters")
        bound = 1.0 / np.sqrt(self.in_features)
        a = np.random.default_rng(seed).uniform(-bound, bound, (r, self.in_features)).astype(w.dtype)
        self.lora_A = Parameter(backend.to_device(a))
        self.lora_B = Parameter(backend.xp.zeros((self.out_features, r), dtype=w.dtype))

    def base_weight(self):
        """The frozen weight (out, in) as used in forward (dequantized when NF4)."""
        return dequantize_nf4(self.base) if isinstance(self.base, NF4Tensor) else self.base

    def merged_weight(self):
        """W + (alpha / r) B A, (out, in): the weight a plain Linear needs to compute the same function."""
        w = self.base_weight()
        return (w + self.scale * (self.lora_B.data @ self.lora_A.data)).astype(w.dtype)

    def forward(self, x):
        w = self.base_weight().astype(self.lora_A.dtype, copy=False)
        y = linear(x, Tensor(w)) if self.base_bias is None else linear(x, Tensor(w), Tensor(self.base_bias))
        return y + linear(linear(x, self.lora_A), self.lora_B) * self.scale


def apply_lora(model, r: int, alpha: float, targets=("c_attn", "c_fc"), quantize: bool = True) -> list[str]:
    """Freeze ``model`` and give every plain Linear named in ``targets`` a :class:`LoRALinear`; their names.

    Every other parameter keeps its array but stops requiring grad. Raises: ValueError for a bad rank or
    when no Linear matches ``targets``.
    """
    for p in model.parameters():
        p.requires_grad = False
    done = []
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is Linear and name in targets:
                setattr(parent, name, LoRALinear(child, r, alpha, quantize, seed=len(done)))
                done.append(f"{prefix}.{name}" if prefix else name)
    if not done:
        raise ValueError(f"no Linear named one of {tuple(targets)} in the model")
    return done
