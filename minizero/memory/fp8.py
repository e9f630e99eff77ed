"""FP8 training, emulated (``--precision fp8``): E4M3 forward, E5M2 gradients, per-tensor scales.

``q = round(clip(x * s, -max, max)) / s``, s = max / amax (``current``) or the largest of the last
``AMAX_HISTORY`` (``delayed``); E4M3 max 448, E5M2 max 57344. Weights and Adam state stay FP32 (no master copy).
Source: Micikevicius et al., arXiv:2209.05433; NVIDIA Transformer Engine's ``DelayedScaling``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from minizero import backend
from minizero.autograd import Function, Tensor
from minizero.autograd.functional import _flat2d  # (..., K) -> (rows, K)
from minizero.autograd.grad_mode import is_grad_enabled
from minizero.comm.collectives import all_gather
from minizero.ledger import get_ledger
from minizero.nn.module import Linear, Module

AMAX_HISTORY = 16  #: delayed scaling's window (TE's examples; its DelayedScaling default is 1024 in TE 1.x)
SCALINGS = ("delayed", "current")


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """An FP8 grid: ``mantissa`` stored bits, smallest normal exponent ``emin``, largest finite ``max``; NaN encodes
    as ``nan`` (ml_dtypes'), and low 7 bits from ``nan_from`` up decode as NaN."""

    name: str
    mantissa: int
    emin: int
    max: float
    nan: int
    nan_from: int

    @property
    def rounds_to_max(self) -> float:
        """The largest magnitude that rounds to ``max`` without saturating: max + half its quantum."""
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa - 1)


E4M3 = FP8Format("e4m3", 3, -6, 448.0, 0x7F, 0x7F)
E5M2 = FP8Format("e5m2", 2, -14, 57344.0, 0x7E, 0x7D)


def round_to_fp8(x, fmt: FP8Format):
    """float32 -> float32 of the nearest values of ``fmt`` (ties to even), saturated at +-max.
    TypeError unless float32."""
    xp = backend.array_module(x)
    if x.dtype != np.float32:
        raise TypeError(f"round_to_fp8 takes float32, got {x.dtype}")
    mag = xp.minimum(xp.abs(x), np.float32(fmt.max))  # saturate (inf too); NaN stays NaN
    e = ((mag.view(xp.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(xp.int32) - 127
    e = xp.maximum(e, np.int32(fmt.emin))
    quantum = _quantum(e, fmt.mantissa, xp)
    q = xp.rint(mag / quantum) * quantum  # exact: a power-of-two division, then round half to even
    return xp.where((x.view(xp.uint32) >> np.uint32(31)) == 1, -q, q).astype(xp.float32)  # -0.0 keeps its sign


def _quantum(e, mantissa: int, xp):
    """2^(e - mantissa) as float32, built from its exponent bits (e: int32 array, e - mantissa >= -126)."""
    return ((e - mantissa + 127).astype(xp.uint32) << np.uint32(23)).view(xp.float32)


def to_fp8_bits(q, fmt: FP8Format):
    """float32 values on ``fmt``'s grid or NaN (:func:`round_to_fp8`) -> 8-bit codes (uint8): sign, biased exponent
    (0 for subnormals), mantissa; ml_dtypes' float8_e4m3fn / float8_e5m2 bits."""
    xp = backend.array_module(q)
    nan = xp.isnan(q)
    mag = xp.where(nan, np.float32(0), xp.abs(q))
    e = ((mag.view(xp.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(xp.int32) - 127
    normal = e >= fmt.emin
    e = xp.maximum(e, np.int32(fmt.emin))
    k = (mag / _quantum(e, fmt.mantissa, xp)).astype(xp.int32)  # exact integer: the significand's steps
    biased = xp.where(normal, e - (fmt.emin - 1), 0)
    mant = xp.where(normal, k - (1 << fmt.mantissa), k)
    sign = (q.view(xp.uint32) >> np.uint32(31)).astype(xp.int32)
    return ((sign << 7) | xp.where(nan, fmt.nan, (biased << fmt.mantissa) | mant)).astype(xp.uint8)


def from_fp8_bits(b, fmt: FP8Format):
    """uint8 codes of ``fmt`` -> float32 values (exact); the inverse of :func:`to_fp8_bits`. E5M2's +-inf codes
    (0x7C, 0xFC), which saturating casts never write, decode as +-65536, not as ml_dtypes' inf."""
    xp = backend.array_module(b)
    b = b.astype(xp.int32)
    biased, mant = (b >> fmt.mantissa) & ((1 << (7 - fmt.mantissa)) - 1), b & ((1 << fmt.mantissa) - 1)
    normal = biased > 0
    e = xp.where(normal, biased + (fmt.emin - 1), fmt.emin).astype(xp.int32)
    val = xp.where(normal, mant + (1 << fmt.mantissa), mant).astype(xp.float32) * _quantum(e, fmt.mantissa, xp)
    val = xp.where((b & 0x7F) >= fmt.nan_from, np.float32(np.nan), val)
    return xp.where((b >> 7) == 1, -val, val)


class ScaledCast:
    """One tensor's FP8 cast with its per-tensor scale; ``cast(x)`` -> float32 q / s; ``stats()``: saturated,
    underflowed. ``group``: the ranks holding slices of one tensor (context parallelism's sequence chunks); each
    cast's amax is their max (all-gather, label ``fp8_amax``), the whole tensor's, as one process casts it."""

    def __init__(self, fmt: FP8Format, scaling: str, group=None):
        if scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling must be one of {SCALINGS}, got {scaling!r}")
        self.fmt, self.scaling, self.history, self.pending = fmt, scaling, None, None
        self.group = group if group is not None and group.world_size > 1 else None
        self.elements, self.saturated, self.underflowed = 0, 0, 0  # device scalars once cast (no sync per cast)

    def cast(self, x):
        """x float32 -> the dequantized float32 values q / s."""
        codes, scale = self.quantize(x)
        return from_fp8_bits(codes, self.fmt) / scale

    def quantize(self, x):
        """x float32 -> (uint8 codes of q = fp8(x s), the scale s as a 0-d float32 array); updates the history
        (delayed scaling) when gradients are enabled, so evaluation leaves it as training left it."""
        xp = backend.array_module(x)
        # the amax of nothing is 0 (an empty slice on some rank): it still joins the group's all-gather below
        amax = xp.abs(x).max().astype(xp.float32) if x.size else xp.zeros((), dtype=xp.float32)
        if self.group is not None:
            with self.group.traffic.op("fp8_amax"):
                amax = all_gather(self.group, amax[None]).max()
        if self.scaling == "delayed":
            if self.history is None:
                self.history = xp.zeros(AMAX_HISTORY, dtype=xp.float32)
            past = self.history.max()
            ref = xp.where(past > 0, past, amax)  # the first cast has no history: its own amax
            if is_grad_enabled():  # training casts only: an evaluation (no_grad) must not move the scales
                if self.pending is None:
                    self.record(amax[None])
                else:
                    self.pending.append(amax)
        else:
            ref = amax
        floor = np.float32(self.fmt.max * 2.0 ** -127)  # an amax below it scales by 2^127: finite in float32
        scale = xp.where(ref > 0, np.float32(self.fmt.max) / xp.maximum(ref, floor), np.float32(1.0))
        scaled = x * scale
        q = round_to_fp8(scaled.astype(xp.float32, copy=False), self.fmt)
        self.elements += int(x.size)
        self.saturated = self.saturated + (xp.abs(scaled) > np.float32(self.fmt.rounds_to_max)).sum()
        self.underflowed = self.underflowed + ((q == 0) & (x != 0)).sum()
        return to_fp8_bits(q, self.fmt), scale.astype(xp.float32)

    def record(self, amaxes) -> None:
        """Put ``amaxes`` ((k,) float32, oldest first) into ``history`` ((AMAX_HISTORY,), newest first)."""
        xp = backend.array_module(amaxes)
        if self.history is None:
            self.history = xp.zeros(AMAX_HISTORY, dtype=xp.float32)
        self.history = xp.concatenate([amaxes[::-1].astype(xp.float32), self.history])[:AMAX_HISTORY]

    def stats(self) -> dict:
        """{"elements", "saturated", "underflowed"} over every cast so far, as host ints."""
        return {"elements": self.elements, "saturated": int(backend.to_host(self.saturated)),
                "underflowed": int(backend.to_host(self.underflowed))}


class _FP8Linear(Function):
    """y = fp8(x) fp8(W)^T + b (E4M3, FP32 accumulation): x (..., in), W (out, in), casts ({"x", "w", "g"}:
    :class:`ScaledCast`), b (out,) or None, float32 -> (..., out) float32; backward: g8 = g cast to E5M2,
    dx = g8 fp8(W), dW = g8^T fp8(x), db = sum g unquantised.
    Saves the 8-bit codes of x and W (1 byte per element) and their scales.
    """

    @staticmethod
    def forward(ctx, x, weight, casts, bias=None):
        (cx, sx), (cw, sw) = casts["x"].quantize(x), casts["w"].quantize(weight)
        ctx.save_for_backward(cx, sx, cw, sw)
        ctx.casts, ctx.has_bias, ctx.g8, ctx.wants_dw = casts, bias is not None, None, ctx.needs_input_grad[1]
        y = backend.matmul(from_fp8_bits(cx, E4M3) / sx, (from_fp8_bits(cw, E4M3) / sw).T)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, g):
        cx, sx, cw, sw = ctx.saved_tensors
        need = ctx.needs_input_grad  # a split backward asks for dx (B), then dW (W): g is cast once, at B
        if ctx.g8 is None:
            ctx.g8 = ctx.casts["g"].quantize(g)
        gq = from_fp8_bits(ctx.g8[0], E5M2) / ctx.g8[1]
        if ctx.wants_dw and not need[1]:  # W comes later and takes these codes
            get_ledger().track(ctx.g8[0], "activations")
        else:
            ctx.g8 = None
        dx = backend.matmul(gq, from_fp8_bits(cw, E4M3) / sw) if need[0] else None
        dw = None
        if need[1]:
            xq = from_fp8_bits(cx, E4M3) / sx
            dw = backend.matmul(_flat2d(gq).T, _flat2d(xq))
        db = _flat2d(g).sum(axis=0) if ctx.has_bias and need[3] else None
        return (dx, dw, None, db) if ctx.has_bias else (dx, dw, None)


class FP8Linear(Linear):
    """A Linear computing in FP8 (:class:`_FP8Linear`), its three casts' scales kept here; same Parameters.
    ``group``: the ranks that split x and g along the sequence (W is whole on each)."""

    def __init__(self, linear: Linear, scaling: str, group=None):
        Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.casts = {"x": ScaledCast(E4M3, scaling, group), "w": ScaledCast(E4M3, scaling),
                      "g": ScaledCast(E5M2, scaling, group)}

    def forward(self, x: Tensor) -> Tensor:
        args = (x, self.weight, self.casts) + (() if self.bias is None else (self.bias,))
        return _FP8Linear.apply(*args)


class AmaxReduction:
    """Delayed scaling across data parallelism (TE's amax all-reduce(MAX) over ``fp8_group``): ``model``'s delayed
    casts hold a step's amaxes in ``pending`` (the scale is fixed within a step); :meth:`reduce` (collective over
    ``comm``, the data group, once per step after the backward) all-gathers them (label ``fp8_amax``) and puts
    the max over ranks into every history. The first step casts with each rank's own amax (no history yet)."""

    def __init__(self, model, comm=None):
        self.comm = comm
        self.casts = [c for _, m in model.named_modules() if isinstance(m, FP8Linear)
                      for c in m.casts.values() if c.scaling == "delayed"]
        for c in self.casts:
            c.pending = []

    def reduce(self) -> None:
        """Collective over ``comm``: the step's pending amaxes, their max over ranks, into the histories."""
        counts = [len(c.pending) for c in self.casts]
        if not sum(counts):
            return
        amax = backend.xp.stack([a for c in self.casts for a in c.pending])
        if self.comm is not None and self.comm.world_size > 1:
            with self.comm.traffic.op("fp8_amax"):
                amax = all_gather(self.comm, amax).reshape(self.comm.world_size, -1).max(axis=0)
        start = 0
        for c, k in zip(self.casts, counts):
            if k:
                c.record(amax[start:start + k])
            c.pending, start = [], start + k


def fp8_state(model) -> dict:
    """``{layer name: {"x" | "w" | "g": [AMAX_HISTORY floats]}}``: the delayed casts' histories (exact in JSON)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            hist = {k: [float(v) for v in backend.to_host(c.history)] for k, c in m.casts.items()
                    if c.history is not None}
            if hist:
                out[name] = hist
    return out


def load_fp8_state(model, state: dict) -> list[str]:
    """Set :func:`fp8_state`'s histories by layer name; returns the delayed FP8 layers it has none for."""
    missing = []
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear) and any(c.scaling == "delayed" for c in m.casts.values()):
            if name not in state:
                missing.append(name)
                continue
            for k, values in state[name].items():
                m.casts[k].history = backend.xp.asarray(np.array(values, dtype=np.float32))
    return missing


def use_fp8(model, scaling: str = "delayed", group=None) -> list[str]:
    """Replace every plain :class:`Linear` under ``model`` by an :class:`FP8Linear` (in place); their names.
    ``group``: the context-parallel ranks (collective: the casts of x and g take the max amax over it).

    Raises: ValueError for an unknown ``scaling``; TypeError for a parameter that is not float32.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"FP8 scaling must be one of {SCALINGS}, got {scaling!r}")
    for name, p in model.named_parameters():
        if p.dtype != np.float32:
            raise TypeError(f"FP8 compute keeps float32 parameters; {name} is {p.dtype}")
    return model.swap_modules(lambda m: FP8Linear(m, scaling, group) if type(m) is Linear else None)
