"""The dropout generator: counter-based, drawn on the device, the same bits on every array module.

Output i of the stream with key k is SplitMix64's ``mix64(k + (i + 1) * GAMMA)``; state (key, offset);
one stream per thread. Inside :func:`batch_rows` a mask is addressed instead of drawn: dropout site s of the
step at offset o is the mask of the whole global batch at key ``fold_in(fold_in(k, o), s)``, a micro-batch reads
its rows. Sources: Steele, Lea & Flood, OOPSLA 2014; Salmon et al., SC 2011; JAX's ``random.fold_in``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import numpy as np

from minizero import backend

GAMMA = 0x9E3779B97F4A7C15  #: SplitMix64's increment, 2**64 / golden ratio (odd)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  #: the finalizer's multipliers (Stafford's "mix13")
_MASK = 2 ** 64 - 1
MAX_DROPOUT = float(np.nextafter(np.float32(1), np.float32(0)))  #: float32(p) below 1 (:func:`_keep` compares it)
_local = threading.local()


def mix64_int(z: int) -> int:
    """SplitMix64's finalizer on one Python int (mod 2**64): the reference the array version must equal."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix64(z):
    """SplitMix64's finalizer on a uint64 array of ``backend.xp`` (wrapping arithmetic), in place; returns z."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def manual_seed(seed: int) -> None:
    """Start this thread's stream: key ``mix64(seed mod 2**64)``, offset 0. Raises TypeError: not an integer."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    _local.state = (mix64_int(int(seed)), 0)


def get_rng_state() -> dict:
    """This thread's ``{"key": int, "offset": int}`` (+ ``"rows": [lo, total]`` inside :func:`batch_rows`)."""
    if getattr(_local, "state", None) is None:
        manual_seed(0)
    key, offset = _local.state
    rows = getattr(_local, "rows", None)
    return {"key": key, "offset": offset} if rows is None else {"key": key, "offset": offset, "rows": list(rows)}


def set_rng_state(state: dict) -> None:
    """Continue from :func:`get_rng_state`'s state (no ``"rows"``: outside any :func:`batch_rows`).
    Raises ValueError: not ``{"key", "offset"}`` ints in [0, 2**64), or ``"rows"`` not 0 <= lo < total."""
    try:
        key, offset = int(state["key"]), int(state["offset"])
        rows = state.get("rows")
        rows = None if rows is None else (int(rows[0]), int(rows[1]))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise ValueError(f"a dropout generator state is {{'key': int, 'offset': int}}, got {state!r}") from None
    if not (0 <= key <= _MASK and 0 <= offset <= _MASK):
        raise ValueError(f"dropout generator key and offset must lie in [0, 2**64), got {state!r}")
    if rows is not None and not 0 <= rows[0] < rows[1]:
        raise ValueError(f"dropout generator rows must be [lo, total] with 0 <= lo < total, got {state!r}")
    _local.state, _local.rows = (key, offset), rows


def fold_in(key: int, data: int) -> int:
    """``mix64(key ^ mix64(data))``: a key derived from ``key`` and an int ``data`` >= 0 (``jax.random.fold_in``)."""
    return mix64_int(key ^ mix64_int(data))


def in_batch_rows() -> bool:
    """Whether this thread is inside :func:`batch_rows` (dropout masks addressed by site and row)."""
    return getattr(_local, "rows", None) is not None


@contextlib.contextmanager
def batch_rows(lo: int, total: int):
    """Inside: the micro-batch is rows [lo, lo + b) of ``total``; a dropout reads its rows of its site's mask of the
    global batch (:meth:`MaskStream.reserve`), the stream unmoved. Raises ValueError: not 0 <= lo < total."""
    if not 0 <= lo < total:
        raise ValueError(f"batch_rows: rows start {lo} must lie in [0, total {total})")
    before = getattr(_local, "rows", None)
    _local.rows = (int(lo), int(total))
    try:
        yield
    finally:
        _local.rows = before


@contextlib.contextmanager
def fork_rng():
    """Run a block, then put the dropout generator back where it was."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def uniform_bits(n: int):
    """The next ``n`` outputs of this thread's stream, (n,) uint64 of ``backend.xp``. Raises ValueError: ``n`` < 0."""
    if n < 0:
        raise ValueError(f"uniform_bits needs n >= 0 draws, got {n}")
    state = get_rng_state()
    key, offset = state["key"], state["offset"]
    xp = backend.xp
    z = xp.arange(1, n + 1, dtype=xp.uint64)  # counters offset + 1 .. offset + n
    z += np.uint64(offset)
    z *= np.uint64(GAMMA)
    z += np.uint64(key)
    _local.state = (key, (offset + n) & _MASK)
    return _mix64(z)


def reserve(n: int) -> tuple[int, int]:
    """Skip the next ``n`` outputs; return their (key, offset) for :func:`keep_mask_at`. ValueError: ``n`` < 0."""
    if n < 0:
        raise ValueError(f"reserve needs n >= 0 draws, got {n}")
    state = get_rng_state()
    _local.state = (state["key"], (state["offset"] + n) & _MASK)
    return state["key"], state["offset"]


def _keep(z, p: float):
    """``u >= float32(p)``, u = (z >> 40) 2**-24 exact in float32, as z >= ceil(float32(p) 2**24) 2**40 (uint64)."""
    t = math.ceil(float(np.float32(p)) * 2 ** 24) << 40
    return z >= np.uint64(t) if t <= _MASK else backend.xp.zeros(z.shape, dtype=bool)


def keep_mask_at(key: int, offset: int, index, p: float):
    """Keep decisions of outputs ``index`` (uint64 C-order positions, overwritten) of the mask at (key, offset)."""
    index += np.uint64((offset + 1) & _MASK)
    index *= np.uint64(GAMMA)
    index += np.uint64(key)
    return _keep(_mix64(index), p)


def dropout_keep_mask(shape, p: float):
    """A bool mask of ``shape`` on the device, True with probability 1 - p: ``u >= p``,
    u the top 24 bits times 2**-24."""
    shape = tuple(int(d) for d in shape)
    return _keep(uniform_bits(math.prod(shape)).reshape(shape), p)  # a new array of ``shape`` (the ledger's unit)


@dataclasses.dataclass(frozen=True)
class MaskStream:
    """A dropout mask of ``shape`` at (key, offset); ``block(slices)`` reads the caller's part from ``origin``."""

    key: int
    offset: int
    shape: tuple
    origin: tuple
    p: float

    @classmethod
    def reserve(cls, shape, p: float, origin=None, site=None) -> "MaskStream":
        """The mask of ``shape`` (axis 0: rows) read from ``origin``: the stream's next prod(``shape``) draws, or
        inside :func:`batch_rows` site ``site``'s (total, *shape[1:]) mask at key fold_in(fold_in(key, offset), site)
        from row lo. Raises ValueError: inside, ``site`` None or rows past ``total``."""
        shape = tuple(int(d) for d in shape)
        origin = tuple(origin or (0,) * len(shape))
        rows = getattr(_local, "rows", None)
        if rows is None:
            key, offset = reserve(math.prod(shape))
            return cls(key, offset, shape, origin, p)
        (lo, total), state = rows, get_rng_state()
        if site is None or lo + origin[0] + shape[0] > total:
            raise ValueError(f"a dropout mask inside batch_rows needs a site and rows inside the global batch: site "
                             f"{site}, rows [{lo + origin[0]}, {lo + origin[0] + shape[0]}) of {total}")
        key = fold_in(fold_in(state["key"], state["offset"]), site)
        return cls(key, 0, (total,) + shape[1:], (lo + origin[0],) + origin[1:], p)

    def block(self, slices):
        """The bool keep mask of the caller's array at ``slices``, on the device."""
        xp = backend.xp
        starts = [o + sl.start for sl, o in zip(slices, self.origin)]
        counts = [sl.stop - sl.start for sl in slices]
        if all(s == 0 and c == n for s, c, n in zip(starts[1:], counts[1:], self.shape[1:])):
            inner = math.prod(self.shape[1:])  # whole rows (a dropout's micro-batch): one run of the C order
            flat = xp.arange(starts[0] * inner, (starts[0] + counts[0]) * inner, dtype=xp.uint64).reshape(counts)
            return keep_mask_at(self.key, self.offset, flat, self.p)  # a new array of the block's shape
        flat = xp.zeros((1,) * len(self.shape), dtype=xp.uint64)
        for axis, (sl, n, o) in enumerate(zip(slices, self.shape, self.origin)):
            r = xp.arange(o + sl.start, o + sl.stop, dtype=xp.uint64)
            flat = flat * np.uint64(n) + r.reshape((1,) * axis + (-1,) + (1,) * (len(self.shape) - axis - 1))
        return keep_mask_at(self.key, self.offset, flat, self.p)
