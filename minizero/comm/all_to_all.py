"""All-to-all by pairwise exchange over ``sendrecv``: rank r's j-th piece ends on rank j, in rank order.

::

    N = 3, rank r holds pieces r0 r1 r2 (piece j is for rank j)
    round k = 1, 2: send piece (r+k) mod N to rank r+k, receive from rank r-k into slot r-k
        rank 0: 00 | 10 20        rank 1: 01 | 11 21        rank 2: 02 | 12 22   (after N-1 rounds)

Deadlock-free, N-1 rounds of one piece each: MPICH's ``MPI_Alltoall`` for large messages (Thakur,
Rabenseifner & Gropp 2005); variable splits first exchange the counts the same way.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.comm import flight

_A2A_TAG, _COUNT_TAG = 1007, 1008  # every kind of message has its own tag (tests/test_tags.py)


def _exchange(comm, x, send_offsets, out, recv_offsets) -> None:
    """The N-1 rounds: piece j of ``x`` (rows send_offsets[j]:[j+1]) to rank j, into rows recv_offsets[i]:[i+1] of
    out."""
    n, r = comm.world_size, comm.rank
    out[recv_offsets[r]:recv_offsets[r + 1]] = x[send_offsets[r]:send_offsets[r + 1]]
    for k in range(1, n):
        dest, src = (r + k) % n, (r - k) % n
        comm.sendrecv(x[send_offsets[dest]:send_offsets[dest + 1]], dest,
                      out[recv_offsets[src]:recv_offsets[src + 1]], src, tag=_A2A_TAG)


def all_to_all(comm, x):
    """Equal splits: ``x`` (N*m, ...) is N pieces of m rows; returns (N*m, ...) with rank j's piece r at rows j*m.

    Bytes: (N-1)/N * x.nbytes (``"all_to_all"``). Raises ValueError on every rank: N does not divide ``x.shape[0]``.
    """
    n = comm.world_size
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(f"all_to_all needs a first dimension divisible by world_size={n}, got shape {x.shape}")
    offsets = [j * (x.shape[0] // n) for j in range(n + 1)]
    out = backend.array_module(x).empty_like(x)
    with comm.traffic.op("all_to_all", x):
        _exchange(comm, x, offsets, out, offsets)
    return out


def all_to_all_v(comm, x, send_counts):
    """Variable splits: rows ``send_counts[j]`` of ``x`` go to rank j; returns ``(out, recv_counts)``, in rank order.

    Bytes: 8 (N-1) (``"all_to_all_counts"``) and the rows sent (``"all_to_all"``). Raises ValueError (before any
    message): counts of the wrong length, negative, or not summing to ``x.shape[0]``.
    """
    n, r = comm.world_size, comm.rank
    counts = list(send_counts)  # ints as they are: 2.7 was counted as 2, '2' and True as 2 and 1
    if (x.ndim == 0 or len(counts) != n or not all(isinstance(c, (int, np.integer)) and c >= 0 for c in counts)
            or any(isinstance(c, bool) for c in counts) or sum(counts) != x.shape[0]):
        raise ValueError(f"rank {r}: send_counts {counts} must be {n} non-negative ints summing to "
                         f"x.shape[0] = {x.shape[0] if x.ndim else None}")
    counts = [int(c) for c in counts]
    mine = np.array(counts, dtype=np.int64).reshape(n, 1)
    theirs = np.empty_like(mine)
    with comm.traffic.op("all_to_all_counts", mine):
        _exchange(comm, mine, list(range(n + 1)), theirs, list(range(n + 1)))
    recv_counts = [int(c) for c in theirs[:, 0]]
    send_off, recv_off = np.concatenate([[0], np.cumsum(counts)]), np.concatenate([[0], np.cumsum(recv_counts)])
    out = backend.array_module(x).empty((int(recv_off[-1]),) + x.shape[1:], dtype=x.dtype)
    with comm.traffic.op("all_to_all", flight.Described(x.shape[1:], x.dtype)):  # rows differ by rank: one row
        _exchange(comm, x, [int(v) for v in send_off], out, [int(v) for v in recv_off])
    return out, recv_counts
