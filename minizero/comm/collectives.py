"""Collectives written by hand on top of ``sendrecv``: ring reduce-scatter, all-gather, all-reduce.

A flat buffer of n elements is cut into ``world_size`` chunks by ``shard_range``; in N-1 steps rank r sends
one chunk to r+1 and receives one from r-1. Bytes each rank sends (``bytes_sent``): reduce-scatter and
all-gather (N-1)/N * n * itemsize each (exact when N divides n), all-reduce twice that. Sums are in the input
dtype, in ring order, each chunk summed once then copied (bit-identical on every rank); temporaries are
counted in the memory ledger as ``comm_scratch``. Every function records its bytes in ``comm.traffic`` under
its own label and takes ``native=True`` to call the library's collective instead.

Source: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009 (Horovod's and NCCL's ring).
"""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

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
    """This rank's ``(offset, size)`` in a flat buffer of ``n`` elements split ``world_size`` ways.

    Contiguous chunks like ``np.array_split``: the first ``n % world_size`` ranks get
    one element more. Chunks may be empty when ``n < world_size``.
    Example: ``[shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]``.
    Raises:
        ValueError: ``n < 0``, ``world_size < 1`` or ``rank`` not in ``[0, world_size)``.
    """
    if n < 0:
        raise ValueError(f"n={n}; allowed: n >= 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; allowed: world_size >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}; allowed: 0..{world_size - 1}")
    base, extra = divmod(n, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _binomial_tree(rank: int, root: int, world_size: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` of ``rank`` in a binomial broadcast tree rooted at ``root``.

    With v = (rank - root) mod N, v's parent is v minus its lowest set bit and its
    children are v + 2^k for every 2^k below that bit (all k for the root), largest
    first. Depth ceil(log2 N). (Thakur, Rabenseifner & Gropp, IJHPCA 2005, Sec. 4.3.)
    """
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

    ``op``: ``"reduce_scatter"`` (n minus own chunk), ``"all_gather"`` (n minus rank+1's
    chunk), ``"all_reduce"`` (the algorithm :func:`all_reduce` picks for n * itemsize bytes:
    the ring's both halves, or recursive doubling's log2(N) whole buffers), ``"broadcast"``
    (n per binomial-tree child).
    Used for the ledger estimate of native collectives and by tests.
    Raises:
        ValueError: unknown ``op``.
    """
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
    elif op == "broadcast":
        elems = n * len(_binomial_tree(rank, root, world_size)[1])
    else:
        raise ValueError(f"op={op!r}; allowed: 'all_reduce', 'reduce_scatter', 'all_gather', 'broadcast'")
    return elems * itemsize


def divide_before_sum(dtype) -> bool:
    """For a mean over N ranks: divide each rank's addend by N *before* the sum (True) or the sum after (False).

    True for float16 (and any float narrower than 4 bytes): local gradients of up to 4e4, each
    finite, overflow float16's 65504 once summed over ranks, and a loss-scaled FP16 step is then
    skipped for nothing; pre-divided, the partial sums are bounded by the largest mean. PyTorch
    DDP divides gradients by the world size before its all-reduce for the same reason
    (``gradient_predivide_factor``; fairscale and Horovod offer a float32 reduction instead).
    False for float32/float64, whose range a sum of N gradients cannot leave: there the sum is
    divided once, afterwards, which keeps their results bit for bit as they were.
    """
    return backend.xp.dtype(dtype).itemsize < 4


def mean_scale_(x, world_size: int, before_sum: bool, predivided: bool = False):
    """In place on ``x``: the part of dividing by ``world_size`` that belongs at this point of a mean.

    Call it with ``before_sum=True`` just before the sum over ranks and ``False`` just after; the
    division happens at exactly one of the two, as :func:`divide_before_sum` decides for
    ``x.dtype``. Before: ``x / N`` correctly rounded (exact for N a power of 2); after:
    ``x * (1/N)`` in ``x``'s dtype (what DataParallel and ZeRO have always done). With
    ``predivided`` the addends already carry the 1/N (the backward seed did it: FP16 training
    seeds S/(k N), DeepSpeed's ``prescale_gradients``), and the mean is the plain sum. Returns ``x``.
    """
    if world_size > 1 and not predivided and divide_before_sum(x.dtype) == before_sum:
        if before_sum:
            backend.array_module(x).divide(x, x.dtype.type(world_size), out=x)
        else:
            x *= x.dtype.type(1.0 / world_size)
    return x


def _check_contiguous(x, what: str) -> None:
    if not (hasattr(x, "flags") and hasattr(x, "size")):
        raise TypeError(f"{what} must be an array (numpy/cupy), got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous, got shape {x.shape} with strides {x.strides}; "
            "pass xp.ascontiguousarray(x)"
        )


def _scratch(a):
    """Count ``a``, a collective's temporary buffer, as ``comm_scratch`` in the ledger (until it is freed); returns ``a``."""
    get_ledger().track(a, "comm_scratch")
    return a


# --------------------------------------------------------------------------- the ring
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def ring_steps(op: str, n: int, world_size: int, rank: int) -> list[tuple[tuple, tuple, bool]]:
    """The steps of the ring ``op`` on a flat buffer of ``n`` elements, for ``rank``: the one ring.

    Each step is ``((send_off, send_size), (recv_off, recv_size), add)``: send that chunk of the
    buffer to rank+1 while receiving rank-1's into the other (``add``: add it, reduce-scatter;
    else store it, all-gather). Reduce-scatter step s sends chunk r-s-1 and adds into r-s-2;
    all-gather step s sends chunk r-s and stores r-s-1 (the diagram above). The blocking
    :func:`ring_` and the non-blocking :class:`~minizero.comm.nonblocking.RingCollective` both
    run exactly these steps, so their results are bitwise equal.
    Raises:
        ValueError: unknown ``op``.
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
    return steps


def ring_(comm: Communicator, buf, op: str, tmp=None) -> None:
    """Run the ring ``op`` in place on the flat (n,) ``buf``, blocking: one ``sendrecv`` per step.

    ``reduce_scatter``: chunk ``comm.rank`` ends as the sum over ranks (other chunks hold partial
    sums); ``all_gather``: chunk ``comm.rank`` must be set, every chunk ends filled;
    ``all_reduce``: both, every chunk ends as the sum. ``tmp``: receive scratch of at least the
    largest chunk, needed by the adding steps. Sums in ``buf``'s dtype, in ring order.
    """
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    for (send_off, send_size), (recv_off, recv_size), add in ring_steps(op, buf.size, comm.world_size, comm.rank):
        incoming = tmp[:recv_size] if add else buf[recv_off:recv_off + recv_size]
        comm.sendrecv(buf[send_off:send_off + send_size], right, incoming, left, tag=_RING_TAG)
        if add:
            acc = buf[recv_off:recv_off + recv_size]
            backend.array_module(acc).add(acc, incoming, out=acc)


# --------------------------------------------------------------------------- public collectives
def reduce_scatter(comm: Communicator, x, native: bool = False):
    """Sum ``x`` over ranks and return this rank's chunk of the sum.

    Args:
        x: any shape, C-contiguous, same size and dtype on every rank; read as ``x.reshape(-1)``, not modified.
        native: use the library's reduce-scatter.
    Returns:
        (size,) array of x's dtype: elements [offset, offset+size) of the sum, ``shard_range(n, world_size, rank)``.
    Bytes (label ``"reduce_scatter"``): (n - size) * itemsize; scratch n + ceil(n/N) elements.
    Raises:
        ValueError: ``x`` not C-contiguous; a size mismatch between ranks (from ``recv``).
    """
    _check_contiguous(x, "x")
    if native:
        return comm.native_reduce_scatter(x)
    n, world_size = x.size, comm.world_size
    offset, size = shard_range(n, world_size, comm.rank)
    with comm.traffic.op("reduce_scatter", x):
        if world_size == 1:  # nothing to reduce: the chunk is the whole of x
            return x.reshape(-1).copy()
        buf = _scratch(x.reshape(-1).copy())
        tmp = _scratch(backend.array_module(x).empty(shard_range(n, world_size, 0)[1], dtype=x.dtype))
        ring_(comm, buf, "reduce_scatter", tmp)
        return buf[offset:offset + size].copy()  # a copy, so the full buffer can be freed


def all_gather(comm: Communicator, shard, n: int | None = None, native: bool = False):
    """Concatenate every rank's shard, in rank order, on every rank (inverse of ``reduce_scatter``).

    Args:
        shard: C-contiguous, ``shard_range(n, world_size, rank)[1]`` elements, same dtype on every rank.
        n: total length; None: n = shard.size * N.  native: use the library's all-gather.
    Returns:
        (n,) array of shard's dtype.
    Bytes (label ``"all_gather"``): (n - size of rank+1's shard) * itemsize.
    Raises:
        ValueError: ``shard`` not C-contiguous, or not this rank's ``shard_range`` size for ``n``.
    """
    _check_contiguous(shard, "shard")
    world_size, rank = comm.world_size, comm.rank
    if n is None:
        n = shard.size * world_size
    offset, size = shard_range(n, world_size, rank)
    if shard.size != size:
        raise ValueError(
            f"rank {rank}: shard has {shard.size} elements, but shard_range(n={n}, "
            f"world_size={world_size}, rank={rank}) gives {size}"
        )
    if native:
        return comm.native_allgather(shard, n)
    out = backend.array_module(shard).empty(n, dtype=shard.dtype)
    with comm.traffic.op("all_gather", out):  # the whole (n,) result: the same on every rank, unlike the shards
        out[offset:offset + size] = shard.reshape(-1)
        ring_(comm, out, "all_gather")
        return out


def all_reduce(comm: Communicator, x, native: bool = False, out=None):
    """Elementwise sum of ``x`` over ranks, on every rank: recursive doubling up to 256 KiB, else the ring.

    Args:
        x: any shape, C-contiguous, same shape and dtype on every rank; not modified (unless ``out is x``).
        native: use the library's all-reduce (``comm.native_allreduce``).
        out: optional C-contiguous array of x's shape and dtype (may be ``x``).
    Returns:
        ``out`` (a new array if None); with one rank, a copy.
    Bytes (label ``"all_reduce"``): ring 2(N-1)/N * x.nbytes when N divides n; recursive doubling log2(N) *
        x.nbytes; scratch ceil(n/N) or n elements (``comm_scratch``).
    Raises:
        ValueError: non-contiguous ``x`` or ``out``, ``out`` of another shape/dtype.
    """
    _check_contiguous(x, "x")
    if out is not None:
        _check_contiguous(out, "out")
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out is {out.shape} {out.dtype}, x is {x.shape} {x.dtype}; they must match")
    if native:
        return comm.native_allreduce(x, out=out)
    if out is None:
        out = backend.array_module(x).empty(x.shape, dtype=x.dtype)
    with comm.traffic.op("all_reduce", x):
        if out is not x:
            out[...] = x
        buf = out.reshape(-1)  # a view: the algorithm works in place in out
        if comm.world_size == 1:  # one rank: a copy, no scratch
            return out
        if all_reduce_algorithm(buf.nbytes, comm.world_size) == "recursive_doubling":
            recursive_doubling_all_reduce_(comm, buf, _scratch(backend.array_module(buf).empty_like(buf)))
            return out
        tmp = _scratch(backend.array_module(x).empty(shard_range(buf.size, comm.world_size, 0)[1], dtype=x.dtype))
        ring_(comm, buf, "all_reduce", tmp)
    return out


def broadcast(comm: Communicator, x, root: int = 0, native: bool = False):
    """Copy root's ``x`` into ``x`` on every other rank (in place, binomial tree); returns ``x``.

    Args:
        x: C-contiguous, same shape and dtype on every rank.  root: the sending rank.
        native: use the library's broadcast.
    Bytes (label ``"broadcast"``): ``x.nbytes`` per child; (N-1) * x.nbytes summed over ranks.
    Raises:
        ValueError: ``root`` not in ``[0, world_size)``, ``x`` not C-contiguous.
    Source: Thakur, Rabenseifner & Gropp, IJHPCA 2005, section 4.3.
    """
    _check_contiguous(x, "x")
    if not isinstance(root, numbers.Integral) or not 0 <= root < comm.world_size:
        raise ValueError(f"root={root!r} is not a rank; allowed: 0..{comm.world_size - 1}")
    if native:
        return comm.native_bcast(x, root)
    parent, children = _binomial_tree(comm.rank, root, comm.world_size)
    with comm.traffic.op("broadcast", x):
        if parent is not None:
            comm.recv(x, parent, tag=_BCAST_TAG)
        for child in children:
            comm.send(x, child, tag=_BCAST_TAG)
    return x
