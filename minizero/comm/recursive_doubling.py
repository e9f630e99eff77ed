"""Recursive-doubling all-reduce for small buffers, by hand on ``sendrecv``, and the size rule.

log2(p) steps: at step k rank v exchanges its whole buffer with v XOR 2^k and adds; for N not a power of two
the first 2(N - p) ranks fold in pairs first. A balanced-tree sum, the same bits on every rank.
Source: Thakur, Rabenseifner & Gropp, IJHPCA 2005.
"""
from __future__ import annotations

import os

from minizero import backend
from minizero.numerals import integer

_RD_TAG = 1003  #: tag of recursive-doubling messages (every kind of message has its own: tests/test_tags.py)

#: all-reduces of at most this many bytes use recursive doubling, larger ones the ring.
#: Why: recursive doubling waits on log2(N) exchanges, the ring on 2(N-1), so small messages, bound by
#: per-message latency, favour it; large ones are bound by bytes, where the ring's bandwidth-optimal 2(N-1)/N
#: of the buffer wins (log2(N) x the buffer would be 1.7x it at N = 8). The threshold stays below the 1 MiB
#: gradient buckets so that they keep the ring's bytes, which is what matters on a real network;
#: ``python bench/bench_allreduce.py --launch 4,8`` measures where the two cross on a given machine.
#: ``MINIZERO_SMALL_ALLREDUCE_MAX_BYTES`` overrides it (-1: always the ring), for benchmarks and for the tests that
#: check the ring's own properties.
THRESHOLD_ENV, DEFAULT_MAX_BYTES = "MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", 256 * 1024


def threshold_from_env() -> int:
    """The all-reduce size rule's bytes from :data:`THRESHOLD_ENV` (unset or empty: 256 KiB). Raises ValueError: not an
    integer >= -1 in ASCII digits (the programs check it with their arguments, so a bad value stops them before
    any work)."""
    text = os.environ.get(THRESHOLD_ENV)
    if not text:  # unset or empty
        return DEFAULT_MAX_BYTES
    try:
        value = integer(text)  # the flags' rule: ASCII digits, an optional sign, no '_'
    except ValueError:
        value = None
    if value is None or value < -1:
        raise ValueError(f"{THRESHOLD_ENV}={text!r}; allowed: an integer >= -1 (bytes; -1: always the ring)")
    return value


try:
    SMALL_ALLREDUCE_MAX_BYTES = threshold_from_env()
except ValueError:  # refused with the arguments (minizero.args), not here: importing must not fail
    SMALL_ALLREDUCE_MAX_BYTES = DEFAULT_MAX_BYTES


def all_reduce_algorithm(nbytes: int, world_size: int) -> str:
    """``"recursive_doubling"`` for ``nbytes <= SMALL_ALLREDUCE_MAX_BYTES`` on 2+ ranks, else ``"ring"``."""
    return "recursive_doubling" if world_size > 1 and nbytes <= SMALL_ALLREDUCE_MAX_BYTES else "ring"


def _fold(world_size: int) -> tuple[int, int]:
    """``(p, r)``: p the largest power of two <= world_size, r = world_size - p."""
    p = 1 << (world_size.bit_length() - 1)
    return p, world_size - p


def _real_rank(v: int, rem: int) -> int:
    """The rank of virtual rank ``v`` of the doubling (odd ranks below 2 rem, then the rest)."""
    return 2 * v + 1 if v < rem else v + rem


def _partners(v: int, p: int, rem: int) -> list[int]:
    """The rank virtual rank ``v`` exchanges with at each of the log2(p) steps: virtual rank v XOR 2^k."""
    return [_real_rank(v ^ (1 << k), rem) for k in range(p.bit_length() - 1)]


def recursive_doubling_peers(world_size: int, rank: int) -> list[int]:
    """The ranks ``rank`` sends its whole buffer to in :func:`recursive_doubling_all_reduce_`, in order: a folded-out
    rank its odd neighbour; the others each step's partner, then (odd ranks below 2 rem) the sum to rank - 1.
    Raises ValueError: ``rank`` not in 0..world_size - 1 (rank 5 of 3 was given partner 6)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} of world_size={world_size!r}; allowed: 0 <= rank < world_size")
    if world_size == 1:
        return []
    p, rem = _fold(world_size)
    if rank < 2 * rem and rank % 2 == 0:
        return [rank + 1]
    v = rank // 2 if rank < 2 * rem else rank - rem
    return _partners(v, p, rem) + ([rank - 1] if rank < 2 * rem else [])


def bytes_sent_recursive_doubling(n: int, itemsize: int, world_size: int, rank: int) -> int:
    """Bytes ``rank`` sends in :func:`recursive_doubling_all_reduce_` on n elements of ``itemsize``."""
    return len(recursive_doubling_peers(world_size, rank)) * n * itemsize


def recursive_doubling_all_reduce_(comm, buf, tmp, src=None) -> None:
    """In place on the flat (n,) ``buf``: afterwards the sum over ranks; ``tmp``: n elements of buf's dtype.

    ``src``: the flat input, read until the first sum is written to ``buf`` (so ``buf`` need not hold a copy
    of it first); None: ``buf`` holds the input. The same bits either way.
    """
    xp, rank, world_size = backend.array_module(buf), comm.rank, comm.world_size
    p, rem = _fold(world_size)
    mine = buf if src is None else src  # this rank's partial sum: the input until buf is written
    if rank < 2 * rem and rank % 2 == 0:  # folded out: hand the buffer on, get the sum back
        comm.send(mine, rank + 1, tag=_RD_TAG)
        comm.recv(buf, rank + 1, tag=_RD_TAG)
        return
    if rank < 2 * rem:
        comm.recv(tmp, rank - 1, tag=_RD_TAG)
        xp.add(tmp, mine, out=buf)  # x_2i + x_2i+1
        mine = buf
        v = rank // 2
    else:
        v = rank - rem
    for k, partner in enumerate(_partners(v, p, rem)):
        comm.sendrecv(mine, partner, tmp, partner, tag=_RD_TAG)
        if v >> k & 1:  # the lower virtual rank's partial sum first (commutative: the same bits either way)
            xp.add(tmp, mine, out=buf)
        else:
            xp.add(mine, tmp, out=buf)
        mine = buf
    if rank < 2 * rem:
        comm.send(buf, rank - 1, tag=_RD_TAG)
