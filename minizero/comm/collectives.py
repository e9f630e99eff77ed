"""Ring reduce-scatter, all-gather and all-reduce on ``sendrecv``; binomial-tree broadcast.

Bytes each rank sends: reduce-scatter and all-gather (N-1)/N * n * itemsize (exact when N divides n),
all-reduce twice that on the ring, log2(N) * n * itemsize by recursive doubling (up to 256 KiB; N a power of two,
else :func:`~minizero.comm.recursive_doubling.bytes_sent_recursive_doubling`). Sums in the
input dtype, in one fixed order, bit-identical on every rank. Each function records its bytes in ``comm.traffic``
under its own label, counts temporaries as ``comm_scratch`` and takes ``native=True`` to call the library's
collective instead. Source: Patarasuk & Yuan, JPDC 2009.

Argument checks are each rank's own: a rank whose array differs from its peers' in size raises where a message
does not fit, and its peers wait until the communicator's timeout; ranks calling different collectives on
arrays of one size are not detected here (``--debug-collectives`` compares every call's op and shape first).
"""
from __future__ import annotations

import functools

import numbers
from typing import TYPE_CHECKING

import numpy as np

from minizero import backend
from minizero.comm.recursive_doubling import (all_reduce_algorithm, bytes_sent_recursive_doubling,
                                              recursive_doubling_all_reduce_)
from minizero.ledger import get_ledger

if TYPE_CHECKING:
    from minizero.comm.communicator import Communicator

_RING_TAG = 1001  # tags for collective messages, apart from user point-to-point tag 0
_BCAST_TAG = 1002


# --------------------------------------------------------------------------- bookkeeping
def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's ``(offset, size)`` of ``n`` elements split ``world_size`` ways, as ``np.array_split``.

    Example: ``[shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]``.
    Raises ValueError: ``n`` not an int >= 0, ``world_size`` not an int >= 1 or ``rank`` not in ``[0, world_size)``.
    """
    check_int(n, "n", 0)
    check_rank(rank, "rank", check_int(world_size, "world_size", 1))
    base, extra = divmod(n, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def check_int(value, what: str, low: int) -> int:  # an int >= low (NumPy's too; no bool, no float)
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)) or value < low:
        raise ValueError(f"{what}={value!r}; allowed: an int >= {low}")
    return int(value)  # NumPy's as a plain int: recursive doubling's fold reads int.bit_length


def check_rank(value, what: str, world_size: int) -> int:
    """``value`` (a root, peer or rank; NumPy's ints too, not a bool) as an int in ``0..world_size - 1``.
    Raises ValueError naming ``what``, the value and the ranks allowed."""
    if type(value) is int and 0 <= value < world_size:  # the common case, without numbers.Integral's ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < world_size:
        kind = "a bool, not a rank" if isinstance(value, bool) else "not a rank"  # True would pass as rank 1
        raise ValueError(f"{what}={value!r} is {kind}; allowed: an int in 0..{world_size - 1}")
    return int(value)


def _binomial_tree(rank: int, root: int, world_size: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` of ``rank`` in a binomial broadcast tree rooted at ``root`` (Thakur et al. 2005)."""
    v = (rank - root) % world_size
    mask, parent = 1, None
    while mask < world_size:
        if v & mask:
            parent = (v - mask + root) % world_size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < world_size:
            children.append((v + mask + root) % world_size)
        mask >>= 1
    return parent, children


def bytes_sent(op: str, n: int, itemsize: int, world_size: int, rank: int, root: int = 0) -> int:
    """Bytes ``rank`` sends in minizero's algorithm for ``op`` on ``n`` elements of ``itemsize``.

    ``op``: ``"reduce_scatter"``, ``"all_gather"``, ``"all_reduce"`` (the algorithm :func:`all_reduce` picks
    for n * itemsize bytes) or ``"broadcast"``. Raises ValueError: unknown ``op``, or an argument out of range.
    """
    if op not in ("reduce_scatter", "all_gather", "all_reduce", "broadcast"):
        raise ValueError(f"op={op!r}; allowed: 'all_reduce', 'reduce_scatter', 'all_gather', 'broadcast'")
    n, itemsize = check_int(n, "n", 0), check_int(itemsize, "itemsize", 1)
    world_size = check_int(world_size, "world_size", 1)
    rank, root = check_rank(rank, "rank", world_size), check_rank(root, "root", world_size)
    def chunk(r):
        return shard_range(n, world_size, r % world_size)[1]

    if op == "reduce_scatter":
        elems = n - chunk(rank)
    elif op == "all_gather":
        elems = n - chunk(rank + 1)
    elif op == "all_reduce" and all_reduce_algorithm(n * itemsize, world_size) == "recursive_doubling":
        return bytes_sent_recursive_doubling(n, itemsize, world_size, rank)
    elif op == "all_reduce":
        elems = 2 * n - chunk(rank) - chunk(rank + 1)
    else:  # broadcast
        elems = n * len(_binomial_tree(rank, root, world_size)[1])
    return elems * itemsize


def divide_before_sum(dtype) -> bool:
    """For a mean over N ranks: divide each addend by N before the sum (True) or the sum after (False).

    True for floats narrower than 4 bytes (float16 sums of finite gradients overflow 65504; PyTorch FSDP's
    ``_gradient_predivide_factor``); False for float32/float64.
    """
    return backend.xp.dtype(dtype).itemsize < 4


def mean_scale_(x, world_size: int, before_sum: bool, predivided: bool = False):
    """In place on ``x``: the part of dividing by ``world_size`` that belongs at this point of a mean; returns ``x``.

    ``before_sum``: called just before (True) or just after (False) the sum over ranks; the division
    happens at one of the two, as :func:`divide_before_sum` decides. Before: ``x / N``; after: ``x * (1/N)``.
    ``predivided``: the addends already carry the 1/N (DeepSpeed's ``prescale_gradients``); nothing is done.
    """
    if world_size > 1 and not predivided and divide_before_sum(x.dtype) == before_sum:
        if before_sum:
            backend.array_module(x).divide(x, x.dtype.type(world_size), out=x)
        else:
            x *= x.dtype.type(1.0 / world_size)
    return x


def _check_array(buf, what: str, writeable: bool = False) -> None:
    """Raise unless ``buf`` is a C-contiguous array (a broadcast view is not); ``writeable``: it is received into.

    The one array check of messages (``Communicator``) and collectives. Raises TypeError: not an array;
    ValueError: not C-contiguous, or read-only where ``writeable``.
    """
    if type(buf) is np.ndarray and buf.flags.c_contiguous and (buf.flags.writeable or not writeable):
        return  # the common case, checked first (every message)
    if not (hasattr(buf, "flags") and hasattr(buf, "nbytes")):
        raise TypeError(f"{what} must be an array (numpy/cupy), got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous, got shape {buf.shape} with strides {buf.strides}; "
            "pass xp.ascontiguousarray(a) (messages are sent straight from the array's memory)"
        )
    if writeable and not getattr(buf.flags, "writeable", True):
        raise ValueError(f"{what} is read-only (shape {buf.shape}); received bytes need a writeable array")


def _check_shard(shard, n: int, world_size: int, rank: int) -> tuple[int, int]:  # shard_range, if shard fits it
    offset, size = shard_range(n, world_size, rank)
    if shard.size != size:
        raise ValueError(f"rank {rank}: shard has {shard.size} elements, but shard_range(n={n}, "
                         f"world_size={world_size}, rank={rank}) gives {size}")
    return offset, size


def _check_summable(x, what: str) -> None:
    """Raise ValueError unless ``x`` holds numbers (bool, int, float, complex): a sum of strings or objects is none."""
    if x.dtype.kind not in "biufc":
        raise ValueError(f"{what} has dtype {x.dtype}; a sum over ranks needs numbers (bool, int, float, complex)")


def _scratch(a):
    """Count ``a``, a collective's new temporary buffer, as ``comm_scratch`` in the ledger; returns ``a``.

    ``track_temporary``: the algorithm that uses it tracks nothing, so the peaks are those of tracking ``a`` until it
    is freed, at a fraction of the cost (every small all-reduce takes one).
    """
    get_ledger().track_temporary(a, "comm_scratch")
    return a


# --------------------------------------------------------------------------- the ring
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@functools.lru_cache(maxsize=256)  # the same few (op, size) pairs every step: plan once
def ring_steps(op: str, n: int, world_size: int, rank: int) -> tuple[tuple[tuple, tuple, bool], ...]:
    """The steps of the ring ``op`` on ``n`` elements for ``rank``:
    ``((send_off, send_size), (recv_off, recv_size), add)``.

    Send that chunk to rank+1 while receiving rank-1's into the other (``add``: reduce-scatter; else store).
    :func:`ring_` and :class:`~minizero.comm.nonblocking.RingCollective` both run these steps (bitwise equal).
    Raises ValueError: unknown ``op``.
    """
    if op not in RING_OPS:
        raise ValueError(f"op={op!r}; allowed: {RING_OPS}")
    chunks = [shard_range(n, world_size, r) for r in range(world_size)]
    steps = []
    if op in ("all_reduce", "reduce_scatter"):
        steps += [(chunks[(rank - s - 1) % world_size], chunks[(rank - s - 2) % world_size], True)
                  for s in range(world_size - 1)]
    if op in ("all_reduce", "all_gather"):
        steps += [(chunks[(rank - s) % world_size], chunks[(rank - s - 1) % world_size], False)
                  for s in range(world_size - 1)]
    return tuple(steps)


def ring_(comm: Communicator, buf, op: str, tmp=None, src=None) -> None:
    """Run the ring ``op`` in place on the flat (n,) ``buf``, blocking: one ``sendrecv`` per step.

    ``reduce_scatter``: chunk ``comm.rank`` ends as the sum; ``all_gather``: chunk ``comm.rank`` must be set,
    every chunk ends filled; ``all_reduce``: both. ``tmp``: receive scratch of at least the largest chunk.
    ``src`` (reduce_scatter, all_reduce): the flat input, read where ``buf`` would hold an untouched copy of it
    (the first send, each step's own addend), so ``buf`` need not be filled first; the same sums, bitwise.
    """
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    steps = ring_steps(op, buf.size, comm.world_size, comm.rank)
    for i, ((send_off, send_size), (recv_off, recv_size), add) in enumerate(steps):
        incoming = tmp[:recv_size] if add else buf[recv_off:recv_off + recv_size]
        sending = src if src is not None and i == 0 else buf  # reduce_scatter: later sends are sums made here
        comm.sendrecv(sending[send_off:send_off + send_size], right, incoming, left, tag=_RING_TAG)
        if add:
            acc = buf[recv_off:recv_off + recv_size]
            mine = acc if src is None else src[recv_off:recv_off + recv_size]
            backend.array_module(acc).add(mine, incoming, out=acc)


def reduce_scatter_scratch(n: int, world_size: int, rank: int) -> int:
    """Elements of scratch :func:`reduce_scatter` takes on ``rank``: receive buffers of the largest chunk,
    ceil(n/N) each; none for N <= 2, one for N = 3 or where ``rank``'s own chunk is a largest one, else two."""
    largest, own = shard_range(n, world_size, 0)[1], shard_range(n, world_size, rank)[1]
    return largest * ((world_size >= 3) + (world_size >= 4 and own < largest))


def ring_reduce_scatter_into(comm: Communicator, src, out, tmp) -> None:
    """The ring reduce-scatter of the flat (n,) ``src`` (only read) into ``out``, this rank's (size,) chunk of the sum.

    The :func:`ring_steps` of ``ring_(buf, "reduce_scatter")``, bitwise, without its (n,) ``buf``: a partial sum is
    made in the buffer it was received into and sent on at the next step, so receive buffers alternate. The last
    step receives into ``out``; the ones before it into ``tmp``'s first chunk, ``out`` (where the largest chunk
    fits) or ``tmp``'s second, so a step never receives into the buffer it sends. ``tmp``:
    :func:`reduce_scatter_scratch` elements.
    """
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    steps = ring_steps("reduce_scatter", src.size, comm.world_size, comm.rank)
    largest = shard_range(src.size, comm.world_size, 0)[1]
    receivers = (out, tmp[:largest], out if out.size == largest else tmp[largest:])  # by steps to go: 0, odd, even
    (send_off, send_size), _, _ = steps[0]
    sending = src[send_off:send_off + send_size]  # first this rank's own addend, then the sums made here
    for i, (_, (recv_off, recv_size), _) in enumerate(steps):
        to_go = len(steps) - 1 - i
        incoming = receivers[0 if to_go == 0 else 2 - to_go % 2][:recv_size]
        comm.sendrecv(sending, right, incoming, left, tag=_RING_TAG)
        backend.array_module(incoming).add(src[recv_off:recv_off + recv_size], incoming, out=incoming)
        sending = incoming


# --------------------------------------------------------------------------- public collectives
def reduce_scatter(comm: Communicator, x, native: bool = False):
    """Sum ``x`` over ranks and return this rank's chunk of the sum.

    Args:
        x: any shape, C-contiguous, same size and dtype on every rank; not modified.
    Returns:
        (size,) array of x's dtype: elements ``shard_range(n, world_size, rank)`` of the sum.
    Bytes (``"reduce_scatter"``): (n - size) * itemsize. Scratch: :func:`reduce_scatter_scratch`, at most two
    largest chunks. Raises TypeError: ``x`` not an array; ValueError: ``x`` not C-contiguous or not numbers; a size
    that differs from a peer's raises where a message does not fit (module docstring).
    """
    _check_array(x, "x")
    _check_summable(x, "x")
    if native:
        return comm.native_reduce_scatter(x)
    n, world_size = x.size, comm.world_size
    size = shard_range(n, world_size, comm.rank)[1]
    with comm.traffic.op("reduce_scatter", x):
        if world_size == 1:  # nothing to reduce: the chunk is the whole of x
            return x.reshape(-1).copy()
        xp = backend.array_module(x)
        out = xp.empty(size, dtype=x.dtype)  # the last step (and others, where it fits) receives and adds into it
        tmp = _scratch(xp.empty(reduce_scatter_scratch(n, world_size, comm.rank), dtype=x.dtype))
        ring_reduce_scatter_into(comm, x.reshape(-1), out, tmp)
        return out


def all_gather(comm: Communicator, shard, n: int | None = None, native: bool = False, out=None):
    """Concatenate every rank's shard, in rank order, on every rank (inverse of ``reduce_scatter``).

    Args:
        shard: C-contiguous, ``shard_range(n, world_size, rank)[1]`` elements.  n: total (None: shard.size * N).
        out: optional (n,) C-contiguous writeable array of shard's dtype to gather into (PyTorch's
        ``all_gather_into_tensor``); it may hold ``shard`` itself, as ZeRO's flat buffer holds its owned shard.
    Returns ``out`` (a new (n,) array if None). Bytes (``"all_gather"``): (n - size of rank+1's shard) * itemsize.
    Raises ValueError: ``shard`` or ``out`` not C-contiguous, ``out`` read-only or not (n,) of shard's dtype,
    ``shard`` not this rank's ``shard_range`` size for ``n``.
    """
    _check_array(shard, "shard")
    world_size, rank = comm.world_size, comm.rank
    if n is None:
        n = shard.size * world_size
    offset, size = _check_shard(shard, n, world_size, rank)
    if out is not None:
        _check_array(out, "out", writeable=True)
        if out.shape != (n,) or out.dtype != shard.dtype:
            raise ValueError(f"out is {out.shape} {out.dtype}; the gathered array is ({n},) {shard.dtype}")
    if native:
        gathered = comm.native_allgather(shard, n)
        if out is None:
            return gathered
        out[...] = gathered
        return out
    if out is None:
        out = backend.array_module(shard).empty(n, dtype=shard.dtype)
    with comm.traffic.op("all_gather", out):  # the whole (n,) result: the same on every rank, unlike the shards
        out[offset:offset + size] = shard.reshape(-1)  # NumPy copies through a temporary where the two overlap
        ring_(comm, out, "all_gather")
        return out


def all_reduce(comm: Communicator, x, native: bool = False, out=None):
    """Elementwise sum of ``x`` over ranks, on every rank: recursive doubling up to 256 KiB
    (``SMALL_ALLREDUCE_MAX_BYTES``, set by ``MINIZERO_SMALL_ALLREDUCE_MAX_BYTES``), else the ring.

    Args:
        x: any shape, C-contiguous, same shape and dtype on every rank.  out: optional array of x's shape (may be x
        or overlap it).
    Returns ``out`` (a new array if None). Bytes (``"all_reduce"``): ring 2(N-1)/N * x.nbytes; recursive doubling
    log2(N) * x.nbytes (N a power of two). Raises TypeError: not an array; ValueError: non-contiguous ``x``/``out``,
    ``x`` not numbers, ``out`` of another shape/dtype or read-only.
    """
    _check_array(x, "x")
    _check_summable(x, "x")
    if out is not None:
        _check_array(out, "out", writeable=True)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out is {out.shape} {out.dtype}, x is {x.shape} {x.dtype}; they must match")
    if native:
        return comm.native_allreduce(x, out=out)
    if out is None:
        out = backend.array_module(x).empty(x.shape, dtype=x.dtype)
    with comm.traffic.op("all_reduce", x):
        if comm.world_size == 1:  # one rank: a copy, no scratch
            if out is not x:
                out[...] = x
            return out
        # the algorithm works in place in out (buf is a view); where out would hold an untouched copy of x it reads
        # x itself (src), so a separate out is never filled with x first
        buf = out.reshape(-1)
        src = None if backend.array_module(x).may_share_memory(out, x) else x.reshape(-1)
        if src is None and out is not x:  # out overlaps x: copy first (the algorithm writes out before it reads x)
            out[...] = x
        if all_reduce_algorithm(buf.nbytes, comm.world_size) == "recursive_doubling":
            recursive_doubling_all_reduce_(comm, buf, _scratch(backend.array_module(buf).empty_like(buf)), src=src)
            return out
        tmp = _scratch(backend.array_module(x).empty(shard_range(buf.size, comm.world_size, 0)[1], dtype=x.dtype))
        ring_(comm, buf, "all_reduce", tmp, src=src)
    return out


def broadcast(comm: Communicator, x, root: int = 0, native: bool = False):
    """Copy root's ``x`` into ``x`` on every other rank (in place, binomial tree); returns ``x``.

    Bytes (``"broadcast"``): ``x.nbytes`` per child. Raises ValueError: ``root`` out of range, ``x`` not
    C-contiguous. Source: Thakur, Rabenseifner & Gropp, IJHPCA 2005.
    """
    _check_array(x, "x")
    root = check_rank(root, "root", comm.world_size)
    if native:
        return comm.native_bcast(x, root)
    parent, children = _binomial_tree(comm.rank, root, comm.world_size)
    with comm.traffic.op("broadcast", x, root=root):
        if parent is not None:
            comm.recv(x, parent, tag=_BCAST_TAG)
        for child in children:
            comm.send(x, child, tag=_BCAST_TAG)
    return x
