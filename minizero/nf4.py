"""NF4: 4-bit NormalFloat weights with double-quantized block constants (QLoRA's storage).

Blocks of 64 get an absmax c1; codes are the nearest of 16 NF4 levels to W / c1, two per byte; c1 minus its mean is
stored as 8-bit dynamic codes with one float32 absmax per 256. Bytes (:func:`nf4_nbytes`): 4.127 bits per parameter.

Source: Dettmers et al., "QLoRA", arXiv:2305.14314, section 3 and appendix E; bitsandbytes ``create_normal_map``.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from minizero import backend
from minizero.quantization import dequantize_blockwise, dynamic_code, quantize_blockwise

BLOCK = 64  #: weights per first-level absmax constant (QLoRA's block size)
BLOCK2 = 256  #: first-level constants per second-level float32 constant
NF4_LEVELS = np.array([  # QLoRA appendix E / bitsandbytes: the 16 NF4 values, ascending
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)


def normal_float_levels(offset: float = 0.9677083) -> np.ndarray:
    """The NF4 construction: 8 positive and 7 negative standard-normal quantiles and an exact 0, scaled to [-1, 1].

    Positive side: the quantiles at 8 evenly spaced probabilities from ``offset`` down to (not including) 0.5; negative
    side: 7 from the same range; the asymmetry gives 0 an exact code. Returns (16,) float64, ascending.
    """
    q = NormalDist().inv_cdf
    pos = [q(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    neg = [-q(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    v = np.sort(np.array(pos + [0.0] + neg))
    return v / v.max()


def nf4_nbytes(n: int) -> int:
    """Stored bytes of an n-element NF4 weight with double quantization (see the module docstring)."""
    blocks = -(-n // BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // BLOCK2) + 4


def _levels_and_absmax(x):
    """(each element's nearest level (n,) uint8, each block's absmax (B,) float32) of x, the last block zero-padded.
    Raises ValueError: x empty or not finite."""
    if not (hasattr(x, "dtype") and hasattr(x, "shape")) or x.dtype.kind not in "biuf":
        raise TypeError(f"NF4Tensor of a {type(x).__name__}{f' of dtype {x.dtype}' if hasattr(x, 'dtype') else ''}; "
                        "allowed: an array (numpy/cupy) of real numbers")
    xp = backend.array_module(x)
    if x.size and x.dtype.itemsize > 4:  # float64 past float32's range became inf, then "non-finite elements"
        big = backend.host_scalar(xp.abs(x).max())
        if math.inf > big > float(np.finfo(np.float32).max):  # inf and NaN: named as non-finite below
            raise ValueError(f"NF4Tensor of a tensor holding {big!r}, beyond float32's "
                             f"{float(np.finfo(np.float32).max)!r}: its blocks' absmax are float32")
    flat = xp.asarray(x, dtype=np.float32).reshape(-1)
    if flat.size == 0:
        raise ValueError("NF4Tensor needs at least one element")
    if not bool(xp.isfinite(flat).all()):
        raise ValueError(f"NF4Tensor of a tensor with {int((~xp.isfinite(flat)).sum())} non-finite elements")
    n = flat.size
    blocks = -(-n // BLOCK)
    padded = xp.zeros(blocks * BLOCK, np.float32)
    padded[:n] = flat
    padded = padded.reshape(blocks, BLOCK)
    c1 = xp.abs(padded).max(axis=1)
    normed = padded / xp.where(c1 > 0, c1, 1)[:, None]
    levels = xp.asarray(NF4_LEVELS)
    mid = (levels[1:] + levels[:-1]) / 2  # nearest level: which midpoints lie below
    return xp.searchsorted(mid, normed.reshape(-1)).astype(np.uint8)[:n], c1


def block_absmax(x):
    """The first-level constants of x: each block of 64's absmax, (ceil(n/64),) float32 (what NF4 double-quantizes)."""
    return _levels_and_absmax(x)[1]


def _pack(idx):
    """Two 4-bit levels per byte, element 2i in the low nibble: (ceil(n/2),) uint8."""
    xp = backend.array_module(idx)
    if idx.size % 2:
        idx = xp.concatenate([idx, xp.zeros(1, np.uint8)])
    return (idx[0::2] | (idx[1::2] << 4)).astype(np.uint8)


def _double_quantize(c1):
    """(mean (1,) float32, codes (B,) uint8, c2 (ceil(B/256),) float32): c1 less its mean, 8-bit signed dynamic codes
    with one absmax per 256 (bitsandbytes' double quantization)."""
    xp = backend.array_module(c1)
    mean = c1.mean(keepdims=True).astype(np.float32)
    codes, c2 = quantize_blockwise(c1 - mean, xp.asarray(dynamic_code(signed=True)), BLOCK2)
    return mean, codes.copy(), c2  # the codes in their own buffer of B bytes, not a view of the padded blocks


class NF4Tensor:
    """A frozen float tensor stored as NF4 codes with double-quantized absmax constants.

    ``NF4Tensor(x)``: x any float array (device or host); everything stays on ``x``'s array module.
    Attributes: ``shape``, ``codes`` uint8 (ceil(n/2),) (element 2i in the low nibble),
    ``c1_codes`` uint8 (B,), ``c2`` float32 (ceil(B/256),), ``c1_mean`` float32 (1,);
    :attr:`nbytes` equals :func:`nf4_nbytes`. :meth:`dequantize` returns the (shape) array W~.
    Raises:
        TypeError: x not an array of real numbers. ValueError: x empty, not finite or beyond float32's range.
    """

    def __init__(self, x):
        idx, c1 = _levels_and_absmax(x)
        self.shape = tuple(x.shape)
        self.codes = _pack(idx)
        self.c1_mean, self.c1_codes, self.c2 = _double_quantize(c1)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.codes, self.c1_codes, self.c2, self.c1_mean))

    def absmax(self):
        """The first-level constants as double quantization restores them: (B,) float32."""
        xp = backend.array_module(self.codes)
        c1 = dequantize_blockwise(self.c1_codes, self.c2, xp.asarray(dynamic_code(signed=True)), BLOCK2)
        return c1 + self.c1_mean

    def indices(self):
        """Each element's level, 0..15: (n,) uint8, unpacked."""
        xp = backend.array_module(self.codes)
        return xp.stack([self.codes & 0xF, self.codes >> 4], axis=1).reshape(-1)[:int(np.prod(self.shape))]

    def dequantize(self, dtype=np.float32):
        """W~ = NF4[index] * absmax of its block, in ``dtype``, of :attr:`shape`."""
        xp = backend.array_module(self.codes)
        idx = self.indices()
        c1 = xp.repeat(self.absmax(), BLOCK)[:idx.size]
        return (xp.asarray(NF4_LEVELS)[idx] * c1).astype(dtype).reshape(self.shape)


def shard_runs(shape: tuple[int, int], stride: int, row_parallel: bool, tp: int, rank: int = 0, name: str = "a"):
    """(first, pitch, count, length) in blocks of rank ``rank``'s :class:`NF4Shard` of an (out, in) weight split
    by rows (``stride`` runs) or columns over ``tp``. Raises ValueError naming the weight: ``tp`` does not divide the
    split dimension, or a run is not whole blocks of :data:`BLOCK`."""
    out_f, in_f = shape
    split, what = (in_f, "columns") if row_parallel else (out_f // stride, "rows per stride block")
    if split % tp:
        raise ValueError(f"tp {tp} does not divide the {split} {what} of {name} weight {tuple(shape)}")
    run = in_f // tp if row_parallel else out_f // (stride * tp) * in_f
    if run % BLOCK:
        raise ValueError(f"tp {tp} splits {name} weight {tuple(shape)} into runs of {run} elements per rank, not a "
                         f"multiple of the NF4 block {BLOCK}")
    length = run // BLOCK
    return (rank * length, tp * length, out_f if row_parallel else stride, length)


def tensor_parallel_sizes(ranks: int, divided, nf4_splits=()) -> list[int]:
    """The tensor-parallel sizes t on ``ranks`` ranks, ascending (1 always): t divides ``ranks`` and each size in
    ``divided`` (heads, widths) and cuts each weight of ``nf4_splits`` ((name, (out, in), stride, row_parallel),
    none for a float base) into whole NF4 blocks per rank (:func:`shard_runs`)."""
    sizes = []
    for t in range(1, min((ranks, *divided)) + 1):
        if ranks % t or any(d % t for d in divided):
            continue
        try:
            for _, shape, stride, row_parallel in nf4_splits if t > 1 else ():  # one shard: the whole's blocks
                shard_runs(shape, stride, row_parallel, t)
            sizes.append(t)
        except ValueError:
            pass
    return sizes


class NF4Shard(NF4Tensor):
    """A shard of a weight as NF4, quantized as the whole weight's blocks: runs of whole blocks of 64.

    ``x``: the shard (any shape); ``whole_absmax``: :func:`block_absmax` of the whole weight (B,), gathered from the
    shards; ``runs`` (first, pitch, count, length): the shard holds ``count`` runs of ``length`` whole blocks, run k
    from whole block ``first + k * pitch``, in the shard's row-major order. Each element's level and block absmax are
    the whole's; the absmax constants are the whole's double quantization (its mean, its groups of 256): this rank
    keeps its blocks' 8-bit codes and the ``c2`` of groups ``first // 256 ..`` (its last block's). So
    :meth:`dequantize` equals the whole :class:`NF4Tensor`'s rows/columns bitwise. Bytes: n/2 + blocks +
    4 (groups spanned) + 4 (:func:`nf4_shard_nbytes`).
    Raises ValueError: x's size is not ``count * length`` blocks of 64, or its absmax is not the whole's at ``runs``.
    """

    def __init__(self, x, whole_absmax, runs: tuple[int, int, int, int]):
        self.shape, self.runs = tuple(x.shape), tuple(int(v) for v in runs)
        first, pitch, count, length = self.runs
        n = int(np.prod(self.shape))
        if n != count * length * BLOCK:
            raise ValueError(f"an NF4 shard of {n} elements is not {count} run(s) of {length} whole block(s) "
                             f"of {BLOCK}")
        idx, c1 = _levels_and_absmax(x)
        self.codes = _pack(idx)
        blocks = self.blocks()
        if not bool((whole_absmax[blocks] == c1).all()):
            raise ValueError(f"the NF4 shard's block absmax differ from the whole weight's at runs {self.runs}")
        mean, codes, c2 = _double_quantize(whole_absmax)
        self.c1_mean, self.c1_codes = mean, codes[blocks]
        self.first_group = first // BLOCK2
        self.c2 = c2[self.first_group:(first + (count - 1) * pitch + length - 1) // BLOCK2 + 1].copy()

    def blocks(self):
        """The whole weight's index of each of this shard's blocks, in order: (blocks,) int64."""
        first, pitch, count, length = self.runs
        xp = backend.array_module(self.codes)
        return (first + pitch * xp.arange(count)[:, None] + xp.arange(length)[None, :]).reshape(-1)

    def absmax(self):
        """The shard's first-level constants as the whole's double quantization restores them: (blocks,) float32."""
        xp = backend.array_module(self.codes)
        group = self.blocks() // BLOCK2 - self.first_group
        code = xp.asarray(dynamic_code(signed=True))
        return code[self.c1_codes].astype(np.float32) * self.c2.astype(np.float32)[group] + self.c1_mean


def nf4_shard_nbytes(runs: tuple[int, int, int, int]) -> int:
    """Stored bytes of an :class:`NF4Shard` of ``runs`` (first, pitch, count, length)."""
    first, pitch, count, length = runs
    blocks = count * length
    groups = (first + (count - 1) * pitch + length - 1) // BLOCK2 - first // BLOCK2 + 1
    return blocks * BLOCK // 2 + blocks + 4 * groups + 4
