"""Quantized collectives: INT8 on the wire, FP32 (or float64) in memory (ZeRO++'s qwZ and qgZ).

Block absmax INT8 (:func:`minizero.quantization.quantize`, one FP32 scale per block of B); ``bytes_sent``
gives the bytes exactly. All work runs where the input lives; with one rank nothing is sent.
Source: Wang et al., "ZeRO++", arXiv:2306.10209 (qwZ and qgZ).
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.comm.collectives import _check_array, _check_shard, all_gather, check_int, shard_range
from minizero.quantization import dequantize, quantize

BLOCK_SIZE = 256  #: elements per FP32 scale on the wire
_A2A_TAG = 1009  # message tag of the quantized all-to-all (every kind of message has its own: tests/test_tags.py)


def _check_float(x, what: str, block_size) -> None:  # before: int inputs came back as zeros or one rank's part
    _check_array(x, what)
    check_int(block_size, "block_size", 1)
    if x.dtype.kind != "f":
        raise ValueError(f"{what} has dtype {x.dtype}; quantized collectives carry floats (float16/32/64)")


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def bytes_sent(op: str, n: int, world_size: int, rank: int, block_size: int = BLOCK_SIZE) -> int:
    """Bytes ``rank`` sends for ``op`` (``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``) of n elements.

    0 when N == 1. Raises ValueError: unknown ``op``.
    """
    if world_size == 1:
        return 0
    sizes = [shard_range(n, world_size, r)[1] for r in range(world_size)]
    if op == "all_gather":
        slot = _blocks(max(sizes), block_size)
        return n - sizes[(rank + 1) % world_size] + (world_size - 1) * slot * 4
    if op == "reduce_scatter":
        return sum(s + 4 * _blocks(s, block_size) for j, s in enumerate(sizes) if j != rank)
    if op == "all_reduce":
        return (bytes_sent("reduce_scatter", n, world_size, rank, block_size)
                + bytes_sent("all_gather", n, world_size, rank, block_size))
    raise ValueError(f"op={op!r}; allowed: 'all_gather', 'reduce_scatter', 'all_reduce'")


def quantized_all_gather(comm, shard, n: int | None = None, block_size: int = BLOCK_SIZE):
    """Ring all-gather of INT8-quantized shards (ZeRO++ qwZ); returns the dequantized (n,) array, equal on every rank.

    Args: shard: this rank's ``shard_range(n, N, rank)`` elements, float, C-contiguous; n: None = N equal shards.
    Error at most scale/2 per element; one rank: an exact copy. Bytes: ``bytes_sent("all_gather")``.
    Raises ValueError: wrong shard size, non-contiguous or non-finite shard.
    """
    _check_float(shard, "shard", block_size)
    world_size, rank = comm.world_size, comm.rank
    n = shard.size * world_size if n is None else n
    _check_shard(shard, n, world_size, rank)
    if world_size == 1:
        return shard.reshape(-1).copy()
    with comm.traffic.op("quantized_all_gather"):
        q, scale = quantize(shard.reshape(-1), 8, "block", block_size, what=f"rank {rank}'s shard")
        return _gather_codes(comm, q, scale, n, shard.dtype, block_size)


def _gather_codes(comm, q, scale, n: int, dtype, block_size: int, out=None):
    """Ring all-gather of every rank's INT8 codes ``q`` and FP32 block scales ``scale``, dequantized into
    ``out`` ((n,), ``dtype``; a new array if None) in rank order. Bytes: ``bytes_sent("all_gather", ...)``."""
    world_size = comm.world_size
    slot = _blocks(shard_range(n, world_size, 0)[1], block_size)  # the largest chunk's blocks
    xp = backend.array_module(q)
    padded = xp.zeros(slot, np.float32)
    padded[:scale.size] = scale
    codes = all_gather(comm, q, n)  # int8 (n,)
    scales = all_gather(comm, padded).reshape(world_size, slot)
    out = xp.empty(n, dtype=dtype) if out is None else out
    for r in range(world_size):
        o, s = shard_range(n, world_size, r)
        out[o:o + s] = dequantize(codes[o:o + s], scales[r, :_blocks(s, block_size)], (s,), 8, "block",
                                  block_size, dtype=dtype)
    return out


def _quantize_marking_non_finite(chunk, block_size):
    """INT8 block quantization of ``chunk``; a block with inf/NaN gets scale NaN (so it arrives as NaN)."""
    xp = backend.array_module(chunk)
    finite = xp.isfinite(chunk)
    if backend.host_scalar(finite.all()):
        return quantize(chunk, 8, "block", block_size)
    q, scale = quantize(xp.where(finite, chunk, 0), 8, "block", block_size)
    scale[xp.flatnonzero(~finite) // block_size] = np.nan
    return q, scale


def quantized_reduce_scatter(comm, x, block_size: int = BLOCK_SIZE):
    """Sum ``x`` over ranks with INT8 on the wire (ZeRO++ qgZ); returns this rank's ``shard_range`` chunk of the sum.

    An all-to-all (step s: send chunk r+s, receive from r-s), summed in full precision in that order; error at
    most the other ranks' scale/2; a block holding inf/NaN arrives as NaN. Bytes: ``bytes_sent("reduce_scatter")``.
    Raises ValueError: non-contiguous ``x``; sizes differing between ranks.
    """
    _check_float(x, "x", block_size)
    world_size, rank, n = comm.world_size, comm.rank, x.size
    flat = x.reshape(-1)
    off, size = shard_range(n, world_size, rank)
    out = flat[off:off + size].copy()
    if world_size == 1:
        return out
    with comm.traffic.op("quantized_reduce_scatter"):
        xp = backend.array_module(flat)
        # a message is [FP32 scales | INT8 codes]: the float32 view starts at byte 0 of the (aligned)
        # buffer, so it is 4-byte aligned whatever the chunk's length (a device faults on unaligned loads)
        nscale = 4 * _blocks(size, block_size)
        incoming = xp.empty(nscale + size, np.uint8)
        for s in range(1, world_size):
            dest, src = (rank + s) % world_size, (rank - s) % world_size
            o, sz = shard_range(n, world_size, dest)
            q, scale = _quantize_marking_non_finite(flat[o:o + sz], block_size)
            message = xp.concatenate([scale.view(np.uint8), q.view(np.uint8)])
            comm.sendrecv(message, dest, incoming, src, tag=_A2A_TAG)
            scales, codes = incoming[:nscale].view(np.float32), incoming[nscale:].view(np.int8)
            out += dequantize(codes, scales, (size,), 8, "block", block_size, dtype=x.dtype)
    return out


def quantized_all_reduce(comm, x, out=None, block_size: int = BLOCK_SIZE):
    """Sum ``x`` over ranks with INT8 on the wire: :func:`quantized_reduce_scatter`, then a quantized all-gather.

    Returns ``out`` (new if None), equal on every rank. Bytes: ``bytes_sent("all_reduce")``.
    Raises ValueError: non-contiguous ``x`` or ``out``, ``out`` read-only, of another shape or dtype.
    """
    _check_float(x, "x", block_size)
    if out is None:
        out = backend.array_module(x).empty(x.shape, dtype=x.dtype)
    _check_array(out, "out", writeable=True)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out is {out.shape} {out.dtype}, x is {x.shape} {x.dtype}; they must match")
    if comm.world_size == 1:
        out[...] = x
        return out
    with comm.traffic.op("quantized_all_reduce"):
        mine = quantized_reduce_scatter(comm, x, block_size)
        q, scale = _quantize_marking_non_finite(mine, block_size)
        _gather_codes(comm, q, scale, x.size, x.dtype, block_size, out=out.reshape(-1))
    return out
