"""The Communicator interface: blocking point-to-point between ranks, checked and counted once.

``send``/``recv``/``sendrecv`` (contiguous arrays), ``barrier``/``split``/``abort``, and ``native_*`` (the
library's collectives, only with ``native=True``). The public methods record ``buf.nbytes`` of every send (an
estimate for native collectives) in ``comm.traffic``; receives are not recorded.

Mirrors: MPI-3.1, chapters 3 (point-to-point) and 6 (``MPI_Comm_split``).
"""
from __future__ import annotations

import abc
import os
import time
import numbers

from minizero import backend
from minizero.comm import flight
from minizero.comm.collectives import bytes_sent, shard_range
from minizero.comm.traffic import TrafficLedger

MAX_TAG = 32767  #: the largest tag every MPI implementation must accept (MPI_TAG_UB >= 32767)
DEFAULT_TIMEOUT_S = 600.0  #: seconds one wait may last before CommTimeoutError (PyTorch's NCCL default)


class CommTimeoutError(TimeoutError):
    """A send, receive or collective waited longer than the communicator's ``timeout``.

    The message names the operation, this rank, the peer rank waited on and the tag.
    """


MAX_SLEEP_S = 0.002  #: longest sleep between two polls of a waiting rank (MPI and NCCL communicators)


def poll_until(done, timeout: float, describe, spin_s: float = 0.0) -> None:
    """Call ``done()`` until it returns True: first without pausing for ``spin_s`` seconds, then sleeping.

    The sleep doubles from 10 us up to :data:`MAX_SLEEP_S`.

    Args:
        done: a callable returning True when the wait is over.  timeout: seconds before giving up (> 0).
        describe: a callable returning the CommTimeoutError's message.  spin_s: seconds to spin first (>= 0).
    Raises:
        CommTimeoutError: ``done()`` stayed False for ``timeout`` seconds.
    """
    start = time.monotonic()
    deadline, spin_until, delay = start + timeout, start + spin_s, 0.0
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise CommTimeoutError(describe())
        if now < spin_until:
            continue
        time.sleep(delay)
        delay = min(max(2 * delay, 1e-5), MAX_SLEEP_S)


SPIN_S = 0.01  #: seconds a waiting rank polls without sleeping, when it has a core of its own


def spin_seconds(ranks_on_this_node: int) -> float:
    """How long a waiting rank spins: :data:`SPIN_S` when the node has a core per rank, else 0.

    Cores are those this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN_S if ranks_on_this_node <= cores else 0.0


def timeout_message(rank: int, world_size: int, what: str, timeout: float, peer: int | None = None) -> str:
    """The CommTimeoutError text of every waiting communicator: who waited, for what, for whom, how long.

    ``what``: the operation (with its tag, if any); ``peer``: the rank waited on, or None (any of them).
    """
    whom = f"rank {peer}" if peer is not None else "the other ranks"
    return (f"rank {rank}: {what} waited {timeout:g} s for {whom} of a communicator of {world_size} "
            "(the communicator's timeout); a rank is stalled or gone")


# --------------------------------------------------------------------------- checks
def _check_array(buf, what: str, writeable: bool = False) -> None:
    """Raise unless ``buf`` is a C-contiguous array.

    ``writeable``: ``buf`` is received into. Only what NumPy and CuPy both have is read (CuPy has no
    ``flags.writeable``, and its broadcast views are not read-only): a broadcast view of more than
    one element is not C-contiguous, so the contiguity check refuses it.
    """
    if not (hasattr(buf, "flags") and hasattr(buf, "nbytes")):
        raise TypeError(f"{what} must be an array (numpy/cupy), got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous, got shape {buf.shape} with strides {buf.strides}; "
            "pass xp.ascontiguousarray(a) (messages are sent straight from the array's memory)"
        )


# --------------------------------------------------------------------------- interface
class Communicator(abc.ABC):
    """A group of ``world_size`` ranks that exchange contiguous arrays (MPI semantics).

    Attributes:
        rank: int in ``[0, world_size)``.  world_size: int >= 1.  traffic: ``TrafficLedger`` of bytes sent.
    ``send``/``recv`` block and match by (source, dest, tag); one pair's messages on one tag arrive in order; a
    ``send`` then ``recv`` cycle can deadlock for large messages (use ``sendrecv``). Subclasses implement
    ``_send``/``_recv``/...; the public methods check arguments and record bytes.
    """

    rank: int
    world_size: int
    traffic: TrafficLedger

    # -- point to point ------------------------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send all of ``buf`` (any shape, C-contiguous) to rank ``dest``.

        Bytes: records ``buf.nbytes``.
        Raises:
            TypeError: ``buf`` is not an array. ValueError: ``buf`` not C-contiguous,
            ``dest`` not in ``[0, world_size)``, ``tag`` not in ``[0, 32767]``.
        """
        _check_array(buf, "send buffer")
        dest, tag = self._check_rank(dest, "dest"), self._check_tag(tag)
        self.traffic.record(buf.nbytes)
        self._send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive a message from rank ``source`` into ``buf`` (preallocated) and return it.

        ``buf`` must have the size (and, to be meaningful, the shape and dtype) of the
        array that was sent. Bytes: none recorded.
        Raises:
            ValueError: ``buf`` not C-contiguous or read-only, bad ``source``/``tag``,
            or the message's size does not match ``buf``.
            TimeoutError, GroupFailedError: ``ThreadCommunicator`` only, see there.
        """
        _check_array(buf, "recv buffer", writeable=True)
        source, tag = self._check_rank(source, "source"), self._check_tag(tag)
        self._recv(buf, source, tag)
        return buf

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source`` at once.

        The two buffers must not overlap. Never deadlocks in a ring (everyone sends
        right and receives from the left). Returns ``recvbuf``.
        Bytes: records ``sendbuf.nbytes``.
        Raises: as ``send`` and ``recv``.
        """
        _check_array(sendbuf, "send buffer")
        _check_array(recvbuf, "recv buffer", writeable=True)
        dest, source = self._check_rank(dest, "dest"), self._check_rank(source, "source")
        tag = self._check_tag(tag)
        self.traffic.record(sendbuf.nbytes)
        self._sendrecv(sendbuf, dest, recvbuf, source, tag)
        return recvbuf

    # -- non-blocking point to point (minizero.comm.nonblocking drives these) -------------
    def isend(self, buf, dest: int, tag: int = 0):
        """Start sending ``buf`` to ``dest``; returns a request whose ``test()`` is True once ``buf``
        may be reused (MPI_Isend) and whose ``wait()`` blocks until then (with this communicator's
        timeout). ``buf`` must not change until then. Bytes: records ``buf.nbytes``.
        Raises: as ``send``; NotImplementedError if this communicator has no non-blocking transport.
        """
        _check_array(buf, "send buffer")
        dest, tag = self._check_rank(dest, "dest"), self._check_tag(tag)
        self.traffic.record(buf.nbytes)
        return self._isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int = 0):
        """Start receiving from ``source`` into ``buf``; returns a request whose ``test()`` is True once
        ``buf`` holds the message (MPI_Irecv); ``test()`` raises ValueError on a shape/dtype mismatch.
        Raises: as ``recv``; NotImplementedError without a non-blocking transport.
        """
        _check_array(buf, "recv buffer", writeable=True)
        source, tag = self._check_rank(source, "source"), self._check_tag(tag)
        return self._irecv(buf, source, tag)

    @property
    def nonblocking(self) -> bool:
        """True when ``isend``/``irecv`` work here (MPI and threads; not every test double)."""
        return type(self)._isend is not Communicator._isend

    def _isend(self, buf, dest, tag):
        raise NotImplementedError(f"{type(self).__name__} has no non-blocking sends; use the blocking collectives")

    def _irecv(self, buf, source, tag):
        raise NotImplementedError(f"{type(self).__name__} has no non-blocking receives; use the blocking collectives")

    # -- group management ------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self) -> None:
        """Return only when every rank of this communicator has called ``barrier``."""

    @abc.abstractmethod
    def split(self, color: int, key: int = 0) -> Communicator:
        """Collective: ranks with equal ``color`` form a new communicator (MPI_Comm_split).

        Ranks in the new communicator are ordered by ``key``, ties by the old rank.
        The new communicator's ``traffic`` is a fresh ``TrafficLedger`` whose parent is
        this one's: its bytes show up in both (the parent keeps the rank's total).
        Raises:
            ValueError: ``color`` is not an int >= 0.
        """

    @abc.abstractmethod
    def abort(self, errorcode: int = 1) -> None:
        """Stop every rank of the job (MPI: ``MPI_Abort`` on COMM_WORLD)."""

    # -- native (library) collectives ------------------------------------------------
    # Bytes recorded for a native collective are an estimate: what minizero's own
    # algorithm (collectives.py: ring for all-reduce / reduce-scatter / all-gather,
    # binomial tree for broadcast) sends from this rank for the same call, so that
    # ledgers compare equal with native=True and native=False. The library may use
    # another algorithm (MPICH picks by message size) and send more or less.
    def native_allreduce(self, x, out=None):
        """Library all-reduce (sum). ``x``: any shape, C-contiguous; returns ``out``.

        ``out``: same shape/dtype as ``x`` (may be ``x`` itself); allocated if None.
        Bytes: records ``bytes_sent("all_reduce", ...)`` (about 2(N-1)/N * x.nbytes)
        under label ``"all_reduce"``.
        Raises: ValueError for a non-contiguous ``x`` or a mismatched ``out``.
        """
        _check_array(x, "x")
        out = _prepare_out(x, out)
        with self.traffic.op("all_reduce", x):
            self.traffic.record(self._estimate("all_reduce", x))
            self._native_allreduce(x, out)
        return out

    def native_reduce_scatter(self, x):
        """Library reduce-scatter (sum) of ``x.reshape(-1)``; returns this rank's 1-D chunk.

        Chunks follow ``shard_range(x.size, world_size, rank)``.
        Bytes: about (N-1)/N * x.nbytes, under label ``"reduce_scatter"``.
        """
        _check_array(x, "x")
        with self.traffic.op("reduce_scatter", x):
            self.traffic.record(self._estimate("reduce_scatter", x))
            return self._native_reduce_scatter(x.reshape(-1))

    def native_allgather(self, shard, n: int):
        """Library all-gather: 1-D chunks laid out by ``shard_range(n, ...)`` -> (n,) array.

        Bytes: about (N-1)/N * n * itemsize, under label ``"all_gather"``.
        Raises: ValueError if ``shard.size`` is not this rank's ``shard_range`` size.
        """
        _check_array(shard, "shard")
        size = shard_range(n, self.world_size, self.rank)[1]
        if shard.size != size:
            raise ValueError(
                f"rank {self.rank}: shard has {shard.size} elements, but shard_range(n={n}, "
                f"world_size={self.world_size}, rank={self.rank}) gives {size}"
            )
        with self.traffic.op("all_gather", flight.Described((n,), shard.dtype)):
            self.traffic.record(bytes_sent("all_gather", n, shard.itemsize, self.world_size, self.rank))
            return self._native_allgather(shard.reshape(-1), n)

    def native_bcast(self, x, root: int = 0):
        """Library broadcast of root's ``x`` into ``x`` on every rank (in place); returns ``x``.

        Bytes: ``x.nbytes`` per child in a binomial tree rooted at ``root``
        (root: ceil(log2 N) messages), under label ``"broadcast"``.
        """
        _check_array(x, "x", writeable=True)
        root = self._check_rank(root, "root")
        with self.traffic.op("broadcast", x):
            self.traffic.record(self._estimate("broadcast", x, root))
            self._native_bcast(x, root)
        return x

    # -- helpers -----------------------------------------------------------------------
    def _estimate(self, op: str, x, root: int = 0) -> int:
        return bytes_sent(op, x.size, x.itemsize, self.world_size, self.rank, root=root)

    def _check_rank(self, r, what: str) -> int:
        if not isinstance(r, numbers.Integral) or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} is not a rank; allowed: 0..{self.world_size - 1}")
        return int(r)

    @staticmethod
    def _check_tag(tag) -> int:
        if not isinstance(tag, numbers.Integral) or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag={tag!r}; allowed: an int in [0, {MAX_TAG}]")
        return int(tag)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    @abc.abstractmethod
    def _send(self, buf, dest, tag): ...

    @abc.abstractmethod
    def _recv(self, buf, source, tag): ...

    @abc.abstractmethod
    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag): ...

    @abc.abstractmethod
    def _native_allreduce(self, x, out): ...

    @abc.abstractmethod
    def _native_reduce_scatter(self, flat): ...

    @abc.abstractmethod
    def _native_allgather(self, shard, n): ...

    @abc.abstractmethod
    def _native_bcast(self, x, root): ...


def _check_color(color) -> int:
    if not isinstance(color, numbers.Integral) or color < 0:
        raise ValueError(f"color={color!r}; allowed: an int >= 0")
    return int(color)


def _prepare_out(x, out):
    """``out`` checked against ``x`` (same shape and dtype, contiguous), or a new array."""
    if out is None:
        return backend.array_module(x).empty(x.shape, dtype=x.dtype)
    _check_array(out, "out", writeable=True)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, x has {x.shape} {x.dtype}; they must match")
    return out

