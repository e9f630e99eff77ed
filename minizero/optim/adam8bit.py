"""8-bit Adam: Adam's m and v kept as 8-bit codes with one FP32 absmax per block.

Blocks of ``block_size`` (256) from each parameter's first element; m with the signed dynamic code, v the
unsigned one; parameters under ``min_8bit_size`` (4096) elements keep full state. State bytes per parameter:
2 + 8/B (FP32 Adam: 8). :class:`ShardedAdam8bit` (ZeRO 1-3) equals one process's codes bit for bit.
Source: Dettmers et al., arXiv:2110.02861; bitsandbytes' ``Adam8bit``/``AdamW8bit``.
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_reduce
from minizero.ledger import get_ledger
from minizero.quantization import (block_absmax, dequantize_blockwise, dynamic_code, linear_code,
                                      quantize_blockwise)
from minizero.optim.adamw import adamw_update, state_dtype
from minizero.optim.base import Optimizer

BLOCK_SIZE = 256  #: bitsandbytes' block size for blockwise 8-bit optimizers (the paper: 2048)
MIN_8BIT_SIZE = 4096  #: tensors with fewer elements keep FP32 state (bitsandbytes' ``min_8bit_size``)
CODES = ("dynamic", "linear")
MAX_BLOCK_SIZE = 1 << 16  #: train's --adam8bit-block-size cap (and quantize's --block-size), a checkpoint's too


def make_codes(code: str = "dynamic", device: bool = True):
    """``(signed code for m, unsigned code for v)``, float32 (256,) each, on the device (``device=False``: host).

    Raises ValueError: unknown ``code``.
    """
    if code == "dynamic":
        books = dynamic_code(signed=True), dynamic_code(signed=False)
    elif code == "linear":
        books = linear_code(signed=True), linear_code(signed=False)
    else:
        raise ValueError(f"code={code!r}; allowed: {', '.join(CODES)}")
    return tuple(backend.to_device(c) for c in books) if device else books


class QuantizedState:
    """One flat optimizer-state array in 8 bits: ``codes`` uint8 (n,) + ``absmax`` float32 (blocks,), zero at start.

    ``offset``: position of element 0 in its parameter (blocks are ``[k*B, (k+1)*B)`` of the parameter).
    """

    def __init__(self, n: int, code, block_size: int = BLOCK_SIZE, offset: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}; allowed: >= 1")
        self.code, self.block_size, self.offset = code, block_size, offset
        xp = backend.array_module(code)
        zero = int(backend.host_scalar(xp.argmin(xp.abs(code))))  # the code of 0.0
        self.codes = xp.full(n, zero, np.uint8)
        self.absmax = xp.zeros(-(-(offset % block_size + n) // block_size) if n else 0, np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes kept: codes + FP32 absmax per block."""
        return int(self.codes.nbytes + self.absmax.nbytes)

    def dequantize(self, dtype=np.float32):
        """The state as floats (n,) in ``dtype``: code value x block absmax."""
        return dequantize_blockwise(self.codes, self.absmax, self.code, self.block_size, self.offset, dtype)

    def block_absmax(self, x):
        """Absolute maximum of ``x`` (n,) over each block this array touches (partial for cut blocks)."""
        return block_absmax(x, self.block_size, self.offset)

    def requantize(self, x, absmax=None) -> None:
        """Store ``x`` (n,) as codes; ``absmax`` per block if given (agreed between ranks), else from ``x``."""
        self.codes[...], self.absmax[...] = quantize_blockwise(x, self.code, self.block_size, self.offset, absmax)


def state_arrays(a) -> dict:
    """The arrays one optimizer-state entry (``state_views``' last item) is kept as, by name, its values first:
    ``{"": a}`` for a float array; ``{"codes": uint8 (n,), "absmax": float32 (blocks,)}`` for a QuantizedState."""
    return {"codes": a.codes, "absmax": a.absmax} if isinstance(a, QuantizedState) else {"": a}


def _flat(a, what):
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (it is updated through a flat view), got strides {a.strides}")
    return a.reshape(-1)


def adam8bit_begin(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_scale: float = 1.0):
    """First half of :func:`adam8bit_update`: dequantize, AdamW step on ``p``; returns the new (m, v) as floats (n,)."""
    sd = state_dtype(p.dtype)
    mf, vf = m.dequantize(sd), v.dequantize(sd)
    adamw_update(_flat(p, "p"), g.reshape(-1), mf, vf, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    return mf, vf


def adam8bit_finish(m, v, mf, vf, absmax_m=None, absmax_v=None) -> None:
    """Second half: requantize ``mf``/``vf`` into ``m``/``v`` (block absmax given, or from the values)."""
    m.requantize(mf, absmax_m)
    v.requantize(vf, absmax_v)


def adam8bit_update(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, grad_scale: float = 1.0) -> None:
    """One AdamW step with 8-bit state, in place on ``p``, ``m`` and ``v`` (mirrors :func:`adamw_update`).

    ``m``, ``v``: :class:`QuantizedState` (dequantized to the state dtype, updated, requantized per block),
    or float arrays of p's shape (then this is :func:`adamw_update`). Other arguments as :func:`adamw_update`.
    Raises ValueError: ``p`` not C-contiguous; non-finite m or v.
    """
    if not isinstance(m, QuantizedState):
        adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
        return
    mf, vf = adam8bit_begin(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    adam8bit_finish(m, v, mf, vf)


def new_state(shape_or_n, dtype, eight_bit: bool, block_size: int, codes, offset: int = 0):
    """``(m, v)`` for a parameter (or its slice from ``offset``): 8-bit if ``eight_bit``, else zeros."""
    ledger = get_ledger()
    if eight_bit:
        n = shape_or_n if isinstance(shape_or_n, int) else math.prod(shape_or_n)
        m, v = QuantizedState(n, codes[0], block_size, offset), QuantizedState(n, codes[1], block_size, offset)
        for s in (m, v):
            ledger.track(s.codes, "optimizer_state")
            ledger.track(s.absmax, "optimizer_state")
        return m, v
    sd = state_dtype(dtype)
    m, v = backend.xp.zeros(shape_or_n, sd), backend.xp.zeros(shape_or_n, sd)
    ledger.track(m, "optimizer_state")
    ledger.track(v, "optimizer_state")
    return m, v


def state_nbytes(numels, param_dtype=np.float32, block_size: int = BLOCK_SIZE,
                 min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """Bytes of 8-bit Adam state: ``2n + 8 * ceil(n / B)`` per tensor (n >= ``min_8bit_size``),
    else ``2 n * itemsize``."""
    small = state_dtype(param_dtype).itemsize * 2
    return int(sum(2 * n + 8 * -(-n // block_size) if n >= min_8bit_size else small * n for n in numels))


class Adam8bit(Optimizer):
    """AdamW with 8-bit block-wise state; a drop-in for :class:`~minizero.optim.AdamW`.

    Args: as AdamW, plus block_size (default 256), min_8bit_size (4096), code (``"dynamic"`` or ``"linear"``),
    fp32_params (full-precision state: bitsandbytes' ``override_config``), master_weights (FP32 copies).
    Raises ValueError: a hyper-parameter out of range (named).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, block_size=BLOCK_SIZE,
                 min_8bit_size=MIN_8BIT_SIZE, code="dynamic", fp32_params=(), master_weights=False):
        for name, v, least in (("block_size", block_size, 1), ("min_8bit_size", min_8bit_size, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:  # NumPy ints as ints
                raise ValueError(f"Adam8bit: {name}={v!r}; allowed: an int >= {least}")
        super().__init__(params, lr, betas, eps, weight_decay)
        self.block_size, self.min_8bit_size, self.code = block_size, min_8bit_size, code
        codes = make_codes(code)
        self.masters = None
        if master_weights:
            self.masters = [backend.xp.array(p.data, dtype=np.float32, copy=True) for p in self.params]
            for a in self.masters:
                get_ledger().track(a, "optimizer_state")
        self.m, self.v = [], []
        keep = {id(p) for p in fp32_params}
        for p in self.params:
            eight_bit = p.size >= min_8bit_size and id(p) not in keep
            m, v = new_state(p.shape, p.dtype, eight_bit, block_size, codes)
            self.m.append(m)
            self.v.append(v)

    def _update(self, i, p, weight_decay, grad_scale):
        target = p.data if self.masters is None else self.masters[i]
        adam8bit_update(target, p.grad, self.m[i], self.v[i], self.step_count, self.lr, *self.betas, self.eps,
                        weight_decay, grad_scale)
        if self.masters is not None:
            p.data[...] = backend.to_dtype(target, p.dtype)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state held (codes, absmax, FP32 small tensors, masters if any)."""
        return int(sum(s.nbytes for s in self.m + self.v) + sum(a.nbytes for a in self.masters or []))

    def dequantized_state(self):
        """``[(m, v)]`` per parameter as float arrays of the parameter's shape (for inspection and tests)."""
        sd = [state_dtype(p.dtype) for p in self.params]
        out = []
        for p, m, v, dt in zip(self.params, self.m, self.v, sd):
            if isinstance(m, QuantizedState):
                m, v = m.dequantize(dt).reshape(p.shape), v.dequantize(dt).reshape(p.shape)
            out.append((m, v))
        return out

    def state_dict(self) -> dict:
        """Host copies: ``step``, and per parameter i ``m.i``/``v.i`` (arrays) or ``m.i.codes``/``m.i.absmax``."""
        out = {"step": self.step_count}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            for name, s in (("m", m), ("v", v)):
                if isinstance(s, QuantizedState):
                    out[f"{name}.{i}.codes"] = backend.to_host(s.codes).copy()
                    out[f"{name}.{i}.absmax"] = backend.to_host(s.absmax).copy()
                else:
                    out[f"{name}.{i}"] = backend.to_host(s).copy()
        return out


class ShardedAdam8bit:
    """The 8-bit Adam state of one rank's ZeRO shards (``shard_map``), and its update.

    Blocks held by several ranks (:attr:`shared`) agree on their absmax in :meth:`step_unit` with one float32
    all-reduce (``"adam8bit_absmax"``). ``fp32_names``: parameters whose state stays full precision.
    """

    def __init__(self, shard_map, comm, dtype, block_size: int = BLOCK_SIZE, min_8bit_size: int = MIN_8BIT_SIZE,
                 code: str = "dynamic", fp32_names=()):
        self.comm, self.block_size = comm, block_size
        codes = make_codes(code)
        self.pieces, self.state, self.shared = [], [], []
        for i, u in enumerate(shard_map.units):
            numel = {name: math.prod(shape) for name, shape in zip(u.param_names, u.shapes)}
            eight_bit = {name: n >= min_8bit_size and name not in fp32_names for name, n in numel.items()}
            cut = set()  # (param, block) cut by a shard boundary, seen from every rank
            on_any_rank = [pc for r in range(shard_map.world_size) for pc in shard_map.pieces(r, i)
                           if eight_bit[pc.param]]
            for pc in on_any_rank:
                if pc.lo % block_size:
                    cut.add((pc.param, pc.lo // block_size))
                if pc.hi < numel[pc.param] and pc.hi % block_size:
                    cut.add((pc.param, (pc.hi - 1) // block_size))
            self.shared.append({key: j for j, key in enumerate(sorted(cut))})
            pieces = shard_map.pieces(comm.rank, i)
            self.pieces.append(pieces)
            self.state.append([new_state(pc.hi - pc.lo, dtype, eight_bit[pc.param], block_size, codes, offset=pc.lo)
                               for pc in pieces])

    def step_unit(self, unit: int, param_shard, grad_shard, step: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, grad_scale: float = 1.0) -> None:
        """AdamW with 8-bit state on this rank's (S,) shard of ``unit``, in place; decay on 2-D+ parameters only.

        Collective when the unit has shared blocks (every rank, every unit, same order). Transient: the unit's m and v
        in the state dtype.
        """
        shared = self.shared[unit]
        pending = []
        for pc, (m, v) in zip(self.pieces[unit], self.state[unit]):
            sl = pc.shard_slice
            wd = weight_decay if Optimizer.decays(pc) else 0.0  # nanoGPT grouping
            if not isinstance(m, QuantizedState):
                adamw_update(param_shard[sl], grad_shard[sl], m, v, step, lr, beta1, beta2, eps, wd, grad_scale)
                continue
            mf, vf = adam8bit_begin(param_shard[sl], grad_shard[sl], m, v, step, lr, beta1, beta2, eps, wd,
                                    grad_scale)
            pending.append((pc, m, v, mf, vf, m.block_absmax(mf), v.block_absmax(vf)))
        if shared:  # each rank fills its own row, the all-reduce's sum collects the rows, max agrees per block
            table = backend.xp.zeros((self.comm.world_size, len(shared), 2), np.float32)
            for pc, m, v, mf, vf, am, av in pending:
                for i, j in self._shared_blocks(shared, pc):
                    table[self.comm.rank, j, 0], table[self.comm.rank, j, 1] = am[i], av[i]
            with self.comm.traffic.op("adam8bit_absmax"):
                table = all_reduce(self.comm, table).max(axis=0)
            for pc, m, v, mf, vf, am, av in pending:
                for i, j in self._shared_blocks(shared, pc):
                    am[i], av[i] = table[j, 0], table[j, 1]
        for pc, m, v, mf, vf, am, av in pending:
            adam8bit_finish(m, v, mf, vf, am, av)

    def _shared_blocks(self, shared: dict, pc):
        """``(block of the piece, row of the absmax table)`` for the piece's end blocks that other ranks share."""
        first = pc.lo // self.block_size
        for k in sorted({first, (pc.hi - 1) // self.block_size}):
            if (pc.param, k) in shared:
                yield k - first, shared[(pc.param, k)]

    def state_nbytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return int(sum(s.nbytes for unit in self.state for pair in unit for s in pair))

    def dequantized_pieces(self, unit: int):
        """``[(Piece, m, v)]`` of a unit as float arrays (for tests comparing with one process)."""
        out = []
        for pc, (m, v) in zip(self.pieces[unit], self.state[unit]):
            if isinstance(m, QuantizedState):
                m, v = m.dequantize(np.float64), v.dequantize(np.float64)
            out.append((pc, m, v))
        return out
