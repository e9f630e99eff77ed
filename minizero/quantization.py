"""Quantizers: symmetric absmax INT8/INT4 (per tensor, row or block) and the dynamic 8-bit code.

Absmax: ``scale = absmax(group) / qmax`` (qmax 127 or 7), ``q = round(x / scale)``, ``|x - q*scale| <= scale/2``
exactly; INT4 packs two codes per byte. Code books: each block divided by its FP32 absmax, mapped to the
nearest of 256 values. Non-finite input raises ValueError naming how many and where.
Sources: LLM.int8(), arXiv:2208.07339, section 2; QLoRA, arXiv:2305.14314, section 2; 8-bit optimizers,
arXiv:2110.02861; Dettmers 2016, arXiv:1511.04561.
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend

QMAX = {8: 127, 4: 7}
GRANULARITIES = ("tensor", "row", "block")
_FP32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
_FP32_MAX = float(np.finfo(np.float32).max)
_SCALE_BITS = 16  # significant bits kept in a scale, so q * scale is exact in float32


# --------------------------------------------------------------------------- checks
def _array(x):
    """``x`` itself if it is an array (host or device); a host array for a Python number or list."""
    return x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)


def check_finite(x, what: str = "x") -> None:
    """Raise ``ValueError`` if ``x`` holds inf or NaN (message: count, first flat index, value)."""
    x = _array(x)
    if x.dtype.kind != "f":
        return
    xp = backend.array_module(x)
    bad = ~xp.isfinite(x)
    if backend.host_scalar(bad.any()):
        i = int(backend.host_scalar(xp.flatnonzero(bad.reshape(-1))[0]))
        raise ValueError(f"{what} has {backend.host_scalar(bad.sum())} non-finite value(s) (first at flat index "
                         f"{i}: {backend.host_scalar(x.reshape(-1)[i])}); quantization needs finite input")


def _check_scheme(bits: int, granularity: str, block_size: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits={bits!r}; allowed: 8, 4")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}; allowed: an int >= 1")


# --------------------------------------------------------------------------- scales
def absmax_scale(absmax, bits: int):
    """FP32 scales (``absmax``'s shape): 0 for an all-zero group, else ``absmax / qmax`` rounded up to 16 bits.

    At least FP32's smallest normal. Raises ValueError: a group too large for an FP32 scale.
    """
    absmax = _array(absmax)
    xp = backend.array_module(absmax)
    a = absmax.astype(np.float64)
    raw = a / QMAX[bits]
    if backend.host_scalar((raw > _FP32_MAX / 2).any()):
        raise ValueError(f"absmax {backend.host_scalar(a.max()):.3e} is too large for an FP32 scale "
                         f"(limit {QMAX[bits] * _FP32_MAX / 2:.3e})")
    # round up to 16 significant bits: keep the top 15 of float64's 52 stored fraction bits and
    # carry anything below them into the kept part (a carry out of the fraction raises the
    # exponent: the next power of two, also exact). Integer arithmetic on the bit pattern, so it
    # is exact; equals ldexp(ceil(m * 2**16) / 2**16, e) of frexp(raw) = (m, e) for the normal
    # numbers that matter (smaller ones become FP32's smallest normal number below).
    low = np.uint64((1 << (52 - (_SCALE_BITS - 1))) - 1)
    up = ((raw.view(np.uint64) + low) & ~low).view(np.float64)  # same itemsize: any strides
    scale = xp.where(a == 0, 0.0, xp.maximum(up, _FP32_TINY))
    return scale.astype(np.float32)


def _groups(x64, granularity: str, block_size: int):
    """``x64`` (float64) as a 2-D array of groups (g, L), one scale per row; pads blocks with zeros."""
    if granularity == "tensor":
        return x64.reshape(1, -1)
    if granularity == "row":
        if x64.ndim < 2:
            raise ValueError(f"granularity='row' needs an array of 2+ dims (out, in), got shape {x64.shape}")
        return x64.reshape(x64.shape[0], -1)
    flat = x64.reshape(-1)
    nb = -(-flat.size // block_size)
    padded = backend.array_module(x64).zeros(nb * block_size, dtype=np.float64)
    padded[:flat.size] = flat
    return padded.reshape(nb, block_size)


def num_scales(shape, granularity: str, block_size: int = 64) -> int:
    """How many FP32 scales a tensor of ``shape`` needs: 1, rows, or ceil(numel / block_size)."""
    n = math.prod(shape)
    return {"tensor": 1, "row": shape[0] if len(shape) else 1, "block": -(-n // block_size)}[granularity]


def quantized_nbytes(shape, bits: int = 8, granularity: str = "tensor", block_size: int = 64) -> int:
    """Exact bytes stored for a tensor of ``shape``: codes (n or ceil(n/2)) + 4 per FP32 scale."""
    _check_scheme(bits, granularity, block_size)
    n = math.prod(shape)
    codes = n if bits == 8 else (n + 1) // 2
    return codes + 4 * num_scales(shape, granularity, block_size)


# --------------------------------------------------------------------------- INT4 packing
def pack_int4(codes):
    """Pack 4-bit codes in [-8, 7] two per byte: uint8 (ceil(n/2),), element 2i low nibble; ValueError outside
    the range or for codes that are not integers (float 1.7 was packed as 1)."""
    codes = _array(codes)
    if codes.dtype.kind not in "iu":
        raise ValueError(f"INT4 codes must be an integer array, got dtype {codes.dtype}")
    xp = backend.array_module(codes)
    c = codes.reshape(-1).astype(np.int16)
    if c.size:
        lo, hi = backend.host_scalar(c.min()), backend.host_scalar(c.max())
        if lo < -8 or hi > 7:
            raise ValueError(f"INT4 codes must lie in [-8, 7], got range [{lo}, {hi}]")
    if c.size % 2:
        c = xp.concatenate([c, xp.zeros(1, np.int16)])
    nib = (c & 0xF).astype(np.uint8)
    return nib[0::2] | (nib[1::2] << 4)


def unpack_int4(packed, n: int):
    """Inverse of :func:`pack_int4`: the first ``n`` codes as int8 (n,). Raises ValueError: too few bytes."""
    packed = _array(packed)
    xp = backend.array_module(packed)
    p = packed.astype(np.uint8, copy=False).reshape(-1)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:  # [:-1] would drop the last code
        raise ValueError(f"n={n!r}; allowed: an int >= 0, the number of codes packed")
    if p.size < (n + 1) // 2:
        raise ValueError(f"{p.size} packed bytes hold at most {2 * p.size} codes, asked for {n}")
    nib = xp.empty(2 * p.size, np.int8)
    nib[0::2] = (p & 0xF).astype(np.int8)
    nib[1::2] = (p >> 4).astype(np.int8)
    return ((nib ^ 8) - 8)[:n]  # sign-extend 4-bit two's complement


# --------------------------------------------------------------------------- absmax INT8 / INT4
def quantize(x, bits: int = 8, granularity: str = "tensor", block_size: int = 64, what: str = "x"):
    """Symmetric absmax quantization: ``x`` -> ``(q, scale)``, ``|x - dequantize(q, scale)| <= scale/2`` exactly.

    Args: bits 8 (codes [-127, 127]) or 4 ([-7, 7]); granularity ``"tensor"``, ``"row"`` (2+ dims) or ``"block"``.
    Returns q (int8 of x's shape; bits 4: packed uint8) and float32 scale (), (rows,) or (blocks,).
    Raises ValueError: inf/NaN in ``x`` (named ``what``), bad ``bits``/``granularity``/``block_size``, 'row' on 1-D,
    too large a value.
    """
    _check_scheme(bits, granularity, block_size)
    x = _array(x)
    xp = backend.array_module(x)
    check_finite(x, what)
    qmax = QMAX[bits]
    g = _groups(x.astype(np.float64), granularity, block_size)  # (groups, L)
    scale = absmax_scale(xp.abs(g).max(axis=1) if g.size else xp.zeros(g.shape[0]), bits)
    s = scale.astype(np.float64)[:, None]
    safe = xp.where(s == 0, 1.0, s)
    q = xp.rint(g / safe)
    # make |x - q*s| <= s/2 hold exactly: q*s is exact (<= 23 bits), and so is x - q*s
    # when it is that small (Sterbenz), so one correction step fixes a rounding slip of x/s
    r = g - q * s
    q += xp.sign(r) * (xp.abs(r) > s / 2)
    q = xp.clip(q, -qmax, qmax).reshape(-1)[:x.size]
    scale = scale.reshape(()) if granularity == "tensor" else scale
    if bits == 8:
        return q.astype(np.int8).reshape(x.shape), scale
    return pack_int4(q.astype(np.int8)), scale


def element_scale(scale, shape, granularity: str = "tensor", block_size: int = 64):
    """The scale of every element: float32 array of ``shape`` (to state error bounds elementwise)."""
    scale = _array(scale)
    xp = backend.array_module(scale)
    n, s = math.prod(shape), scale.astype(np.float32, copy=False)
    if granularity == "tensor":
        return xp.broadcast_to(s.reshape(()), shape)
    if granularity == "row":
        return xp.broadcast_to(s.reshape(-1, *([1] * (len(shape) - 1))), shape)
    return xp.repeat(s.reshape(-1), block_size)[:n].reshape(shape)


def dequantize(q, scale, shape=None, bits: int = 8, granularity: str = "tensor", block_size: int = 64,
               dtype=np.float32):
    """Inverse of :func:`quantize`: ``q * scale`` of ``shape`` (required for bits=4), in ``dtype`` (float32 default).

    Raises ValueError: bits=4 without ``shape``, or a ``scale`` of the wrong size.
    """
    _check_scheme(bits, granularity, block_size)
    if shape is None:
        if bits == 4:
            raise ValueError("INT4 codes are packed two per byte: pass the original shape")
        shape = q.shape
    shape, q, scale = tuple(shape), _array(q), _array(scale)
    expected = num_scales(shape, granularity, block_size)
    if scale.size != expected:
        raise ValueError(f"scale has {scale.size} entries; shape {shape} with granularity "
                         f"{granularity!r} (block_size {block_size}) needs {expected}")
    codes = q.reshape(-1) if bits == 8 else unpack_int4(q, math.prod(shape))
    out = codes.astype(dtype).reshape(shape)
    out *= element_scale(scale, shape, granularity, block_size).astype(dtype)
    return out


class QuantizedTensor:
    """A tensor stored as integer codes + FP32 scales (:meth:`from_array`); ``nbytes``, ``dense_nbytes``."""

    def __init__(self, q, scale, shape, bits, granularity, block_size, dtype):
        self.q, self.scale, self.shape = q, scale, tuple(shape)
        self.bits, self.granularity, self.block_size, self.dtype = bits, granularity, block_size, np.dtype(dtype)

    @classmethod
    def from_array(cls, x, bits: int = 8, granularity: str = "row", block_size: int = 64) -> "QuantizedTensor":
        """Quantize ``x`` (see :func:`quantize` for arguments and errors)."""
        x = _array(x)
        q, scale = quantize(x, bits, granularity, block_size)
        return cls(q, scale, x.shape, bits, granularity, block_size, x.dtype)

    def dequantize(self, dtype=None):
        """The float array (``dtype`` default: the original dtype)."""
        return dequantize(self.q, self.scale, self.shape, self.bits, self.granularity, self.block_size,
                          dtype=self.dtype if dtype is None else dtype)

    @property
    def nbytes(self) -> int:
        """Stored bytes, codes and scales: equals :func:`quantized_nbytes`."""
        return int(self.q.nbytes + self.scale.nbytes)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the original float array."""
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self):
        return (f"QuantizedTensor(shape={self.shape}, INT{self.bits} {self.granularity}"
                f"{f' {self.block_size}' if self.granularity == 'block' else ''}, {self.nbytes} bytes)")


# --------------------------------------------------------------------------- block-wise code books (8-bit Adam)
def dynamic_code(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8):
    """The 256 values of the dynamic (tree) 8-bit code, sorted ascending, float32 (256,).

    As bitsandbytes' ``create_dynamic_map``: per exponent i = 0..6, 10**(i-6) times the midpoints of
    ``linspace(0.1, 1, k_i + 1)``, k_i = 2**i (signed, with negatives) or 2**(i+1) (unsigned), plus 0 and 1.
    Dettmers 2016 (arXiv:1511.04561); Dettmers et al. 2022 (arXiv:2110.02861).
    """
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        b = np.linspace(0.1, 1, items)
        means = (b[:-1] + b[1:]) / 2.0
        data += list(10.0 ** (-(max_exponent_bits - 1) + i) * means)
        if signed:
            data += list(-(10.0 ** (-(max_exponent_bits - 1) + i)) * means)
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return np.sort(np.array(data)).astype(np.float32)


def linear_code(signed: bool = True):
    """A linear 8-bit code (sorted float32 (256,)): signed on [-1, 1], unsigned on [0, 1] (``create_linear_map``)."""
    vals = np.concatenate([np.linspace(-1.0, 1.0, 255), [0.0]]) if signed else np.linspace(0.0, 1.0, 256)
    return np.sort(vals).astype(np.float32)


def _check_block_size(block_size) -> None:
    if not (isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool) and block_size >= 1):
        raise ValueError(f"block_size={block_size!r}; allowed: an int >= 1")


def _check_code(code) -> None:
    """A code book :func:`quantize_blockwise` can search: 2 to 256 (uint8 codes) finite floats, ascending."""
    if code.ndim != 1 or not 2 <= code.size <= 256 or code.dtype.kind != "f":
        raise ValueError(f"code has shape {code.shape} and dtype {code.dtype}; allowed: 2 to 256 floats, ascending "
                         "(dynamic_code(), linear_code())")
    xp = backend.array_module(code)
    if not backend.host_scalar(xp.isfinite(code).all() & (code[1:] >= code[:-1]).all()):
        raise ValueError("code must hold finite values in ascending order: the nearest value is found by "
                         "binary search (dynamic_code(), linear_code())")


def _check_x_offset(x, offset) -> None:
    """What :func:`quantize_blockwise` can store: numbers whose absmax fits float32, at an int offset >= 0."""
    if x.dtype.kind not in "biuf":
        raise ValueError(f"x has dtype {x.dtype}; allowed: bool, int or float numbers")
    if not (isinstance(offset, (int, np.integer)) and not isinstance(offset, bool) and offset >= 0):
        raise ValueError(f"offset={offset!r}; allowed: an int >= 0 (x[0]'s place in the block grid)")
    check_finite(x)
    big = backend.host_scalar(backend.array_module(x).abs(x).max()) if x.size and x.dtype.itemsize > 4 else 0
    if big > float(np.finfo(np.float32).max):  # the block maxima are float32: inf would turn every element into NaN
        raise ValueError(f"x holds {big!r}, beyond float32's {float(np.finfo(np.float32).max)!r}: block maxima "
                         "are stored as float32")


def _check_absmax(absmax, n: int, offset: int, block_size: int, nb: int) -> None:
    if absmax.shape != (nb,):
        raise ValueError(f"absmax has shape {absmax.shape}; {n} elements at offset {offset} with block_size "
                         f"{block_size} span {nb} blocks")


def _block_view(x, block_size: int, offset: int):
    """``x`` (n,) zero-padded to whole blocks of a grid whose block 0 starts ``offset % B`` elements before x[0]."""
    _check_block_size(block_size)
    head = offset % block_size
    nb = -(-(head + x.size) // block_size)
    padded = backend.array_module(x).zeros(nb * block_size, dtype=x.dtype)
    padded[head:head + x.size] = x
    return padded.reshape(nb, block_size), head


def block_absmax(x, block_size: int, offset: int = 0):
    """Absolute maximum of every block of flat ``x`` (n,) -> float32 (nb,). See :func:`quantize_blockwise`."""
    x = _array(x)
    xp = backend.array_module(x)
    blocks, _ = _block_view(x.reshape(-1), block_size, offset)
    return xp.abs(blocks).max(axis=1).astype(np.float32) if blocks.size else xp.zeros(0, np.float32)


def quantize_blockwise(x, code, block_size: int = 256, offset: int = 0, absmax=None):
    """Block-wise code-book quantization of flat ``x`` (n,) -> ``(codes uint8 (n,), absmax float32 (nb,))``.

    Blocks ``[k*B, (k+1)*B)`` of a grid where ``x[0]`` is at ``offset`` (a ZeRO shard's first block is partial);
    ``absmax``: known block maxima (agreed between ranks), else computed.
    ``code``: ascending values in [-1, 1] (:func:`dynamic_code`, :func:`linear_code`); each element takes the nearest.
    Raises ValueError: ``x`` not finite numbers within float32's range, ``offset`` not an int >= 0, an ``absmax`` of
    the wrong size or not finite and >= 0, or a ``code`` that is not 2 to 256 ascending finite floats.
    Source: bitsandbytes ``quantize_blockwise``.
    """
    x, code = _array(x), _array(code)
    xp = backend.array_module(x)
    x = x.reshape(-1)
    _check_x_offset(x, offset)
    _check_code(code)
    blocks, head = _block_view(x, block_size, offset)
    if absmax is None:
        absmax = xp.abs(blocks).max(axis=1).astype(np.float32) if blocks.size else xp.zeros(0, np.float32)
    else:  # given: the agreed maxima, each finite and >= 0 (a NaN or negative one scrambles its block)
        absmax = _array(absmax)
        if absmax.dtype.kind not in "iuf":
            raise ValueError(f"absmax has dtype {absmax.dtype}; allowed: block maxima, finite numbers >= 0")
        bad = (~(absmax >= 0) | ~xp.isfinite(absmax)).reshape(-1)
        if backend.host_scalar(bad.any()):
            i = int(backend.host_scalar(xp.flatnonzero(bad)[0]))
            raise ValueError(f"absmax[{i}] = {backend.host_scalar(absmax.reshape(-1)[i])!r}; allowed: block maxima, "
                             "finite numbers >= 0")
    absmax = absmax.astype(np.float32, copy=False)
    _check_absmax(absmax, x.size, offset, block_size, blocks.shape[0])
    a = absmax.astype(blocks.dtype)[:, None]
    normed = blocks / xp.where(a == 0, 1, a)
    mid = (code[:-1].astype(np.float64) + code[1:]) / 2  # decision thresholds between neighbouring values
    idx = xp.searchsorted(mid, normed.reshape(-1)).astype(np.uint8)
    return idx[head:head + x.size], absmax


def dequantize_blockwise(codes, absmax, code, block_size: int = 256, offset: int = 0, dtype=np.float32):
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax`` of each block, (n,) in ``dtype``."""
    codes, absmax, code = _array(codes), _array(absmax), _array(code)
    xp = backend.array_module(codes)
    codes = codes.reshape(-1)
    _check_block_size(block_size)
    head = offset % block_size
    _check_absmax(absmax, codes.size, offset, block_size, -(-(head + codes.size) // block_size))
    block = (head + xp.arange(codes.size)) // block_size
    return code[codes].astype(dtype) * absmax.astype(np.float32, copy=False).astype(dtype)[block]
