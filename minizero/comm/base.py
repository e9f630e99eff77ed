"""The Communicator interface: blocking point-to-point between ranks, checked and counted once.

The public methods record ``buf.nbytes`` of every send (an estimate for native collectives) in
``comm.traffic``; receives are not recorded. Mirrors: MPI-3.1, chapters 3 (point-to-point) and 6 (split).
"""
from __future__ import annotations

import abc
import time
import numbers

from minizero import backend
from minizero.comm import flight
from minizero.comm.collectives import _check_array, _check_shard, bytes_sent, check_rank
from minizero.comm.traffic import TrafficLedger

MAX_TAG = 32767  #: the largest tag every MPI implementation must accept (MPI_TAG_UB >= 32767)
DEFAULT_TIMEOUT_S = 600.0  #: seconds one wait may last before CommTimeoutError (PyTorch's NCCL default)


class CommTimeoutError(TimeoutError):
    """A send, receive or collective waited longer than ``timeout``; names the operation, rank, peer and tag."""


MAX_SLEEP_S = 0.0002  #: longest sleep between two polls in a wait's first LONG_WAIT_S (MPI and NCCL communicators)
LONG_WAIT_S = 1.0  #: after this long a wait sleeps up to IDLE_SLEEP_S: a stalled peer, not a message on its way
IDLE_SLEEP_S = 0.002  #: longest sleep between two polls of a long wait


def poll_until(done, timeout: float, describe, spin_s: float = 0.0) -> None:
    """Call ``done()`` until it returns True: spin ``spin_s`` s, then sleep 10 us doubling to :data:`MAX_SLEEP_S`
    (to :data:`IDLE_SLEEP_S` once the wait is :data:`LONG_WAIT_S` old).

    The cap is short while a message is likely on its way: a sleeping rank frees its core for the others but answers
    late (docs/benchmarks.md, ``bench/bench_train.py``). ``describe()`` returns the error's message.
    Raises CommTimeoutError: ``done()`` stayed False for ``timeout`` s.
    """
    start = time.monotonic()
    deadline, spin_until, long_after, delay = start + timeout, start + spin_s, start + LONG_WAIT_S, 0.0
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise CommTimeoutError(describe())
        if now < spin_until:
            continue
        time.sleep(delay)
        delay = min(max(2 * delay, 1e-5), MAX_SLEEP_S if now < long_after else IDLE_SLEEP_S)


SPIN_S = 0.01  #: seconds a waiting rank polls without sleeping, when it has a core of its own


def spin_seconds(ranks_on_this_node: int) -> float:
    """Seconds a waiting rank spins: :data:`SPIN_S` when the node has a core (``sched_getaffinity``) per rank,
    else 0."""
    return SPIN_S if ranks_on_this_node <= backend.usable_cores() else 0.0


def timeout_message(rank: int, world_size: int, what: str, timeout: float, peer: int | None = None,
                    world_rank=None) -> str:
    """The CommTimeoutError text: who waited, for ``what``, for ``peer`` (None: any rank), how long; ``world_rank``
    (:meth:`Communicator.world_rank`) adds each rank's number in the job where a group's differs."""
    def named(r: int) -> str:
        w = r if world_rank is None else world_rank(r)
        return f"rank {r}" if w == r else f"rank {r} (world rank {w})"
    whom = named(peer) if peer is not None else "the other ranks"
    return (f"{named(rank)}: {what} waited {timeout:g} s for {whom} of a communicator of {world_size} "
            "(the communicator's timeout); a rank is stalled or gone")


# --------------------------------------------------------------------------- checks
def _check_message(buf, what: str, writeable: bool = False) -> None:
    """:func:`~minizero.comm.collectives._check_array` (a C-contiguous array, writeable if received into), and
    not an object array. Raises TypeError: not an array, or an object array; ValueError: as ``_check_array``."""
    _check_array(buf, what, writeable)
    if buf.dtype.kind == "O":
        raise TypeError(f"{what} has dtype object: it holds references, not bytes a message can carry")


# --------------------------------------------------------------------------- interface
class Communicator(abc.ABC):
    """A group of ``world_size`` ranks that exchange contiguous arrays (MPI semantics).

    Attributes: rank in ``[0, world_size)``; world_size >= 1; traffic: ``TrafficLedger`` of bytes sent.
    ``send``/``recv`` block and match by (source, dest, tag), in order per pair and tag; a send-then-recv cycle
    can deadlock for large messages (use ``sendrecv``). Subclasses implement ``_send``/``_recv``/...
    """

    rank: int
    world_size: int
    traffic: TrafficLedger

    # -- point to point ------------------------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send all of ``buf`` (any shape, C-contiguous) to rank ``dest``; records ``buf.nbytes``.

        Raises TypeError: not an array; ValueError: not C-contiguous, ``dest`` or ``tag`` (``[0, 32767]``) out of range.
        """
        _check_message(buf, "send buffer")
        dest, tag = self._check_rank(dest, "dest"), self._check_tag(tag)
        self.traffic.record(buf.nbytes)
        self._send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive from rank ``source`` into the preallocated ``buf`` (the sent array's size) and return it.

        Raises ValueError: ``buf`` not C-contiguous or read-only, bad ``source``/``tag``, size mismatch;
        TimeoutError, GroupFailedError (``ThreadCommunicator``).
        """
        _check_message(buf, "recv buffer", writeable=True)
        source, tag = self._check_rank(source, "source"), self._check_tag(tag)
        self._recv(buf, source, tag)
        return buf

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Send ``sendbuf`` to ``dest`` and receive ``recvbuf`` from ``source`` at once (deadlock-free in a ring).

        The buffers must not overlap. Returns ``recvbuf``; records ``sendbuf.nbytes``. Raises as ``send`` and ``recv``.
        """
        _check_message(sendbuf, "send buffer")
        _check_message(recvbuf, "recv buffer", writeable=True)
        dest, source = self._check_rank(dest, "dest"), self._check_rank(source, "source")
        tag = self._check_tag(tag)
        self.traffic.record(sendbuf.nbytes)
        self._sendrecv(sendbuf, dest, recvbuf, source, tag)
        return recvbuf

    # -- non-blocking point to point (minizero.comm.nonblocking drives these) -------------
    def isend(self, buf, dest: int, tag: int = 0):
        """Start sending ``buf`` to ``dest`` (MPI_Isend): a request with ``test()`` and ``wait()``;
        records ``buf.nbytes``.

        ``buf`` must not change until ``test()`` is True. Raises as ``send``; NotImplementedError:
        no non-blocking transport.
        """
        _check_message(buf, "send buffer")
        dest, tag = self._check_rank(dest, "dest"), self._check_tag(tag)
        self.traffic.record(buf.nbytes)
        return self._isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int = 0):
        """Start receiving from ``source`` into ``buf`` (MPI_Irecv): a request with ``test()`` and ``wait()`` (as
        ``isend``'s); either raises ValueError on a mismatch, ``wait()`` CommTimeoutError past the timeout.

        Raises as ``recv``; NotImplementedError without a non-blocking transport.
        """
        _check_message(buf, "recv buffer", writeable=True)
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
        """Collective: ranks with equal ``color`` form a new communicator ordered by ``key``,
        then old rank (MPI_Comm_split).

        Its ``traffic`` is a child of this one's (bytes show in both). Raises ValueError: ``color`` not an int >= 0.
        """

    def world_rank(self, rank: int) -> int:
        """This communicator's ``rank`` as a rank of the whole job (the same here; a split MPI group maps it)."""
        return rank

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
        """Library all-reduce (sum) of C-contiguous ``x`` into ``out`` (may be ``x``; None: allocated); returns ``out``.

        Records ``bytes_sent("all_reduce", ...)`` as ``"all_reduce"``. Raises ValueError: non-contiguous or mismatched.
        """
        _check_message(x, "x")
        out = _prepare_out(x, out)
        with self.traffic.op("all_reduce", x):
            self.traffic.record(self._estimate("all_reduce", x))
            self._native_allreduce(x, out)
        return out

    def native_reduce_scatter(self, x):
        """Library reduce-scatter (sum) of ``x.reshape(-1)``; returns this rank's ``shard_range`` chunk."""
        _check_message(x, "x")
        with self.traffic.op("reduce_scatter", x):
            self.traffic.record(self._estimate("reduce_scatter", x))
            return self._native_reduce_scatter(x.reshape(-1))

    def native_allgather(self, shard, n: int):
        """Library all-gather of 1-D ``shard_range(n, ...)`` chunks into (n,) (``"all_gather"``).

        Raises ValueError: ``shard.size`` is not this rank's ``shard_range`` size.
        """
        _check_message(shard, "shard")
        _check_shard(shard, n, self.world_size, self.rank)
        with self.traffic.op("all_gather", flight.Described((n,), shard.dtype)):
            self.traffic.record(bytes_sent("all_gather", n, shard.itemsize, self.world_size, self.rank))
            return self._native_allgather(shard.reshape(-1), n)

    def native_bcast(self, x, root: int = 0):
        """Library broadcast of root's ``x`` into ``x`` on every rank, in place; returns ``x`` (``"broadcast"``)."""
        root = self._check_rank(root, "root")
        _check_message(x, "x", writeable=self.rank != root)  # the root only reads x
        with self.traffic.op("broadcast", x, root=root):
            self.traffic.record(self._estimate("broadcast", x, root))
            self._native_bcast(x, root)
        return x

    # -- helpers -----------------------------------------------------------------------
    def _estimate(self, op: str, x, root: int = 0) -> int:
        return bytes_sent(op, x.size, x.itemsize, self.world_size, self.rank, root=root)

    def _check_rank(self, r, what: str) -> int:
        return check_rank(r, what, self.world_size)

    @staticmethod
    def _check_tag(tag) -> int:
        if type(tag) is int and 0 <= tag <= MAX_TAG:
            return tag
        if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag={tag!r}; allowed: an int in [0, {MAX_TAG}]")  # a bool as the ranks: refused
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
    _check_message(out, "out", writeable=True)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, x has {x.shape} {x.dtype}; they must match")
    return out

