"""Point-to-point messaging between ranks, and a ledger of the bytes each rank sends.

Every message minizero moves goes through one small interface, ``Communicator``:

    send / recv / sendrecv      blocking point-to-point, contiguous arrays only
    barrier / split / abort     group management, as in MPI
    native_*                    the library's own collectives (MPI_Allreduce, ...),
                                used only when a caller asks for ``native=True``

Two implementations:

    MPICommunicator     one process per rank, over mpi4py's buffer methods
                        (``Send``/``Recv``/``Sendrecv``/``Allreduce``/...; arrays are
                        never pickled).
    ThreadCommunicator  one thread per rank inside a single process (``run_in_threads``),
                        for notebooks and fast tests. Same semantics, plus a receive
                        timeout and prompt failure when any rank raises, so a buggy
                        algorithm fails a test instead of hanging it.

Byte accounting happens in exactly one place: the public methods of the base class
record ``buf.nbytes`` in ``comm.traffic`` (a ``TrafficLedger``) for every send, and an
estimate for every native collective (see ``Communicator.native_allreduce``).
Receives are not recorded: a rank's ledger counts what it *sent*.

Mirrors: the MPI-3.1 standard, chapters 3 (point-to-point) and 6 (``MPI_Comm_split``).
"""
from __future__ import annotations

import abc
import contextlib
import itertools
import numbers
import queue
import threading
import time

from minizero import backend
from minizero.comm.collectives import bytes_sent, shard_range

MAX_TAG = 32767  #: the largest tag every MPI implementation must accept (MPI_TAG_UB >= 32767)


# --------------------------------------------------------------------------- ledger
class TrafficLedger:
    """Bytes this rank sent, by operation label.

    ``record(nbytes)`` adds to the label that is active: the *outermost* open
    ``with op(label):`` block — of the parent ledger first, then of this one — else
    ``"p2p"``. Outermost wins so that a caller names the purpose of the messages
    (``with comm.traffic.op("metrics"): all_reduce(...)`` is counted as metrics,
    not as gradient all-reduce); a collective called on its own is named by the
    label it opens itself (``all_reduce``, ``reduce_scatter``, ...). A ledger made with ``parent=`` (what ``Communicator.split``
    does) forwards everything it records to the parent too, so the world
    communicator's ledger always holds the rank's total while a sub-communicator's
    ledger holds only what went through that sub-communicator.

    Attributes:
        bytes_sent: int, total bytes recorded.
        by_op: dict label -> bytes.
        calls: dict label -> number of calls: one per entry into ``op(label)`` (one
            collective call, however many messages it sends) and one per message sent
            outside any ``op`` block (label ``"p2p"``).

    A ledger belongs to one rank and is used from that rank's thread only (no locks).
    """

    def __init__(self, parent: TrafficLedger | None = None):
        self.parent = parent
        self._labels: list[str] = []
        self.reset()

    def reset(self) -> None:
        """Zero this ledger (not its parent)."""
        self.bytes_sent = 0
        self.by_op: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def current_label(self) -> str | None:
        """The outermost active label of the parent ledger, else of this one, else None."""
        outer = self.parent.current_label() if self.parent is not None else None
        if outer is not None:
            return outer
        return self._labels[0] if self._labels else None

    @contextlib.contextmanager
    def op(self, label: str):
        """Attribute bytes recorded inside the block to ``label`` (unless an outer block is open)."""
        self._add(label, nbytes=0, calls=1)
        self._labels.append(label)
        try:
            yield self
        finally:
            self._labels.pop()

    def record(self, nbytes: int) -> None:
        """Record one message of ``nbytes`` bytes sent by this rank.

        Raises:
            ValueError: negative ``nbytes``.
        """
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        label = self.current_label()
        if label is None:
            self._add("p2p", nbytes, calls=1)
        else:
            self._add(label, nbytes, calls=0)

    def _add(self, label: str, nbytes: int, calls: int) -> None:
        self.bytes_sent += nbytes
        self.by_op[label] = self.by_op.get(label, 0) + nbytes
        self.calls[label] = self.calls.get(label, 0) + calls
        if self.parent is not None:
            self.parent._add(label, nbytes, calls)

    def snapshot(self) -> dict:
        """A JSON-able copy: ``{"bytes_sent": int, "by_op": {...}, "calls": {...}}``."""
        return {"bytes_sent": self.bytes_sent, "by_op": dict(self.by_op), "calls": dict(self.calls)}

    def __repr__(self) -> str:
        return f"TrafficLedger(bytes_sent={self.bytes_sent}, by_op={self.by_op})"


# --------------------------------------------------------------------------- checks
def _check_array(buf, what: str, writeable: bool = False) -> None:
    """Raise unless ``buf`` is a C-contiguous array (and writeable, if asked)."""
    if not (hasattr(buf, "flags") and hasattr(buf, "nbytes")):
        raise TypeError(f"{what} must be an array (numpy/cupy), got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous, got shape {buf.shape} with strides {buf.strides}; "
            "pass xp.ascontiguousarray(a) (messages are sent straight from the array's memory)"
        )
    if writeable and not buf.flags.writeable:
        raise ValueError(f"{what} must be writeable (a receive writes into it)")


# --------------------------------------------------------------------------- interface
class Communicator(abc.ABC):
    """A group of ``world_size`` ranks that exchange contiguous arrays.

    Attributes:
        rank: int in ``[0, world_size)``, this rank's number in this communicator.
        world_size: int >= 1.
        traffic: ``TrafficLedger`` of the bytes this rank sent.

    Semantics follow MPI: ``send``/``recv`` are blocking and matched by
    (source, dest, tag, communicator); messages between one pair with one tag arrive in
    the order they were sent. ``send`` may return before the message is received
    (always so on threads, for small messages on MPI), so a cycle of ``send`` then
    ``recv`` can deadlock on MPI for large messages: use ``sendrecv``.

    Subclasses implement the ``_send``/``_recv``/... methods; the public ones here
    check arguments and record bytes, so that accounting is the same everywhere.
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
        with self.traffic.op("all_reduce"):
            self.traffic.record(self._estimate("all_reduce", x))
            self._native_allreduce(x, out)
        return out

    def native_reduce_scatter(self, x):
        """Library reduce-scatter (sum) of ``x.reshape(-1)``; returns this rank's 1-D chunk.

        Chunks follow ``shard_range(x.size, world_size, rank)``.
        Bytes: about (N-1)/N * x.nbytes, under label ``"reduce_scatter"``.
        """
        _check_array(x, "x")
        with self.traffic.op("reduce_scatter"):
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
        with self.traffic.op("all_gather"):
            self.traffic.record(bytes_sent("all_gather", n, shard.itemsize, self.world_size, self.rank))
            return self._native_allgather(shard.reshape(-1), n)

    def native_bcast(self, x, root: int = 0):
        """Library broadcast of root's ``x`` into ``x`` on every rank (in place); returns ``x``.

        Bytes: ``x.nbytes`` per child in a binomial tree rooted at ``root``
        (root: ceil(log2 N) messages), under label ``"broadcast"``.
        """
        _check_array(x, "x", writeable=True)
        root = self._check_rank(root, "root")
        with self.traffic.op("broadcast"):
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
        return backend.xp.empty(x.shape, dtype=x.dtype)
    _check_array(out, "out", writeable=True)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out has shape {out.shape} {out.dtype}, x has {x.shape} {x.dtype}; they must match")
    return out


# --------------------------------------------------------------------------- MPI
def _mpi():
    """Import mpi4py.MPI on first use (importing it initializes MPI)."""
    from mpi4py import MPI  # noqa: PLC0415

    return MPI


class MPICommunicator(Communicator):
    """A ``Communicator`` over an mpi4py communicator (default ``MPI.COMM_WORLD``).

    Point-to-point messages go as raw bytes (``[buf, MPI.BYTE]``), so every dtype works,
    float16 included; a receive checks that the byte count matches ``buf.nbytes``.
    Native collectives pass the arrays with their own MPI datatype (float16 needs an
    MPI with MPIX_C_FLOAT16, as MPICH >= 4 has).

    Attributes:
        mpi_comm: the wrapped ``mpi4py.MPI.Comm`` (for timing reductions in benchmarks).
    """

    def __init__(self, mpi_comm=None, traffic: TrafficLedger | None = None):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        self.traffic = TrafficLedger() if traffic is None else traffic

    def _send(self, buf, dest, tag):
        self.mpi_comm.Send([buf, _mpi().BYTE], dest=dest, tag=tag)

    def _recv(self, buf, source, tag):
        MPI = _mpi()
        status = MPI.Status()
        self.mpi_comm.Recv([buf, MPI.BYTE], source=source, tag=tag, status=status)
        self._check_count(status, buf, source, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        MPI = _mpi()
        status = MPI.Status()
        self.mpi_comm.Sendrecv([sendbuf, MPI.BYTE], dest, tag, [recvbuf, MPI.BYTE], source, tag, status=status)
        self._check_count(status, recvbuf, source, tag)

    def _check_count(self, status, buf, source, tag):
        got = status.Get_count(_mpi().BYTE)
        if got != buf.nbytes:
            raise ValueError(
                f"rank {self.rank}: message from rank {source} (tag {tag}) has {got} bytes, "
                f"but the receive buffer {buf.shape} {buf.dtype} has {buf.nbytes}"
            )

    def barrier(self):
        self.mpi_comm.Barrier()

    def split(self, color, key=0):
        color, key = _check_color(color), int(key)
        return MPICommunicator(self.mpi_comm.Split(color, key), traffic=TrafficLedger(parent=self.traffic))

    def abort(self, errorcode=1):
        _mpi().COMM_WORLD.Abort(errorcode)

    def _native_allreduce(self, x, out):
        MPI = _mpi()
        self.mpi_comm.Allreduce(MPI.IN_PLACE if out is x else x, out, op=MPI.SUM)

    def _native_reduce_scatter(self, flat):
        counts = [shard_range(flat.size, self.world_size, r)[1] for r in range(self.world_size)]
        out = backend.xp.empty(counts[self.rank], dtype=flat.dtype)
        self.mpi_comm.Reduce_scatter(flat, out, counts, op=_mpi().SUM)
        return out

    def _native_allgather(self, shard, n):
        ranges = [shard_range(n, self.world_size, r) for r in range(self.world_size)]
        out = backend.xp.empty(n, dtype=shard.dtype)
        counts, displs = [s for _, s in ranges], [o for o, _ in ranges]
        self.mpi_comm.Allgatherv(shard, [out, (counts, displs)])
        return out

    def _native_bcast(self, x, root):
        self.mpi_comm.Bcast(x, root=root)


_WORLD: MPICommunicator | None = None


def world() -> MPICommunicator:
    """The ``MPICommunicator`` over ``MPI.COMM_WORLD`` (one per process, so one ledger)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = MPICommunicator()
    return _WORLD


# --------------------------------------------------------------------------- threads
class GroupFailedError(RuntimeError):
    """Raised in a waiting rank thread when another rank of its ``run_in_threads`` failed."""


class _ThreadGroup:
    """What the rank threads of one ``run_in_threads`` call share: the first failure."""

    def __init__(self):
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.failure: tuple[int, BaseException] | None = None  # (thread rank, exception)
        self.contexts: list[_Context] = []
        self.ids = itertools.count()

    def new_context(self, size: int) -> _Context:
        ctx = _Context(size, next(self.ids))
        with self.lock:
            self.contexts.append(ctx)
            if self.failed.is_set():
                ctx.barrier.abort()
        return ctx

    def fail(self, thread_rank: int, exc: BaseException) -> None:
        """Remember the first failure and wake every waiting rank."""
        with self.lock:
            if self.failure is None:
                self.failure = (thread_rank, exc)
            self.failed.set()
            contexts = list(self.contexts)
        for ctx in contexts:
            ctx.barrier.abort()  # ranks waiting in barrier()/native_*/split() raise


class _Context:
    """One communicator's shared state: message queues, a barrier, exchange slots."""

    def __init__(self, size: int, context_id: int):
        self.size = size
        self.id = context_id
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int, int], queue.Queue] = {}

    def queue(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self.lock:
            if (source, dest, tag) not in self.queues:
                self.queues[(source, dest, tag)] = queue.Queue()
            return self.queues[(source, dest, tag)]


class ThreadCommunicator(Communicator):
    """A ``Communicator`` whose ranks are threads of one process; make it with ``run_in_threads``.

    ``send`` copies the array into the (source, dest, tag, communicator) queue and
    returns at once (eager, like MPI for small messages). ``recv`` waits at most
    ``timeout`` seconds and then raises ``TimeoutError`` naming the ranks and the tag;
    if any rank of the group raised, every waiting rank raises ``GroupFailedError``
    promptly instead of hanging. Native collectives are computed from every rank's
    array directly (deposited in shared slots between two barriers), summing in rank
    order, so every rank gets bit-identical results.
    """

    _POLL_S = 0.05  # how often a waiting recv checks for failure and timeout

    def __init__(self, group: _ThreadGroup, ctx: _Context, rank: int, thread_ranks: list[int],
                 traffic: TrafficLedger | None = None, timeout: float = 60.0):
        self._group, self._ctx, self._thread_ranks = group, ctx, thread_ranks
        self.rank, self.world_size = rank, ctx.size
        self.traffic = TrafficLedger() if traffic is None else traffic
        self.timeout = timeout  #: seconds a recv / barrier waits before TimeoutError

    def _who(self) -> str:
        return f"rank {self.rank} (thread rank {self._thread_ranks[self.rank]}, communicator {self._ctx.id})"

    def _failed_error(self, waiting_for: str) -> GroupFailedError:
        rank, exc = self._group.failure
        return GroupFailedError(
            f"{self._who()} stopped waiting for {waiting_for}: thread rank {rank} raised "
            f"{type(exc).__name__}: {exc}"
        )

    # -- point to point ------------------------------------------------------------
    def _send(self, buf, dest, tag):
        self._ctx.queue(self.rank, dest, tag).put(buf.copy())

    def _recv(self, buf, source, tag):
        q = self._ctx.queue(source, self.rank, tag)
        what = f"a message from rank {source} with tag {tag}"
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                msg = q.get(timeout=self._POLL_S)
                break
            except queue.Empty:
                if self._group.failed.is_set():
                    raise self._failed_error(what) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self._who()} waited {self.timeout} s for {what}") from None
        if msg.shape != buf.shape or msg.dtype != buf.dtype:
            raise ValueError(
                f"{self._who()}: message from rank {source} (tag {tag}) is {msg.shape} {msg.dtype}, "
                f"the receive buffer is {buf.shape} {buf.dtype}; they must match"
            )
        buf[...] = msg

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._send(sendbuf, dest, tag)  # never blocks, so no deadlock
        self._recv(recvbuf, source, tag)

    # -- group management ------------------------------------------------------------
    def _wait(self, what: str) -> None:
        try:
            self._ctx.barrier.wait(timeout=self.timeout)
        except threading.BrokenBarrierError:
            if self._group.failed.is_set():
                raise self._failed_error(what) from None
            raise TimeoutError(f"{self._who()} waited {self.timeout} s in {what}") from None

    def _exchange(self, obj, combine, what: str):
        """Every rank deposits ``obj``; returns ``combine(objs by rank)`` computed on each rank."""
        self._ctx.slots[self.rank] = obj
        self._wait(what)  # all deposited
        result = combine(list(self._ctx.slots))
        self._wait(what)  # all have read: slots may be reused, arrays modified
        return result

    def barrier(self):
        self._wait("barrier")

    def split(self, color, key=0):
        color, key = _check_color(color), int(key)
        entries = self._exchange((color, key), list, "split")
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        old_ranks = [r for _, r in members]  # new rank i is old rank old_ranks[i]
        leader = old_ranks[0]
        new_ctx = self._group.new_context(len(old_ranks)) if self.rank == leader else None
        contexts = self._exchange(new_ctx, list, "split")
        return ThreadCommunicator(
            self._group, contexts[leader], old_ranks.index(self.rank),
            [self._thread_ranks[r] for r in old_ranks],
            traffic=TrafficLedger(parent=self.traffic), timeout=self.timeout,
        )

    def abort(self, errorcode=1):
        exc = RuntimeError(f"{self._who()} called abort(errorcode={errorcode})")
        self._group.fail(self._thread_ranks[self.rank], exc)
        raise exc

    # -- native collectives ----------------------------------------------------------
    def _same_arrays(self, parts, what):
        shapes = [(p.shape, p.dtype) for p in parts]
        if len(set(shapes)) != 1:
            raise ValueError(f"{what}: ranks passed different arrays (shape, dtype by rank): {shapes}")

    def _native_allreduce(self, x, out):
        def total(parts):
            self._same_arrays(parts, "native_allreduce")
            acc = parts[0].copy()
            for p in parts[1:]:
                backend.xp.add(acc, p, out=acc)
            return acc

        out[...] = self._exchange(x, total, "native_allreduce")

    def _native_reduce_scatter(self, flat):
        off, size = shard_range(flat.size, self.world_size, self.rank)

        def my_chunk(parts):
            self._same_arrays(parts, "native_reduce_scatter")
            acc = parts[0][off:off + size].copy()
            for p in parts[1:]:
                backend.xp.add(acc, p[off:off + size], out=acc)
            return acc

        return self._exchange(flat, my_chunk, "native_reduce_scatter")

    def _native_allgather(self, shard, n):
        def concatenate(parts):
            if sum(p.size for p in parts) != n or len({p.dtype for p in parts}) != 1:
                raise ValueError(f"native_allgather: shards {[(p.size, p.dtype) for p in parts]} "
                                 f"do not make one array of n={n} elements")
            return backend.xp.concatenate(parts)

        return self._exchange(shard, concatenate, "native_allgather")

    def _native_bcast(self, x, root):
        def copy_root(parts):
            self._same_arrays(parts, "native_bcast")
            if self.rank != root:
                x[...] = parts[root]

        self._exchange(x, copy_root, "native_bcast")


_THREAD_START_HOOKS: list = []


def register_thread_start_hook(fn):
    """Run ``fn()`` (no arguments) at the start of every rank thread of ``run_in_threads``.

    For per-rank thread-local state (e.g. a memory ledger). Registering the same
    function twice has no effect. Returns ``fn`` (usable as a decorator).
    """
    if fn not in _THREAD_START_HOOKS:
        _THREAD_START_HOOKS.append(fn)
    return fn


def run_in_threads(world_size: int, fn, *args, timeout: float = 60.0, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` rank threads; return results by rank.

    Each thread gets its own ``ThreadCommunicator`` (``comm.rank`` = its index) with
    its own ``TrafficLedger``; registered thread-start hooks run first in each thread.
    ``timeout`` (seconds) bounds every single wait in ``recv``/``barrier``/collectives.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
        The first exception raised in any rank (same object and type), its message
        prefixed with ``[rank r/N]``; other ranks blocked on it were released with
        ``GroupFailedError`` and are not reported.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; allowed: an int >= 1")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}; allowed: seconds > 0")
    group = _ThreadGroup()
    ctx = group.new_context(world_size)
    results = [None] * world_size

    def rank_main(rank):
        try:
            for hook in list(_THREAD_START_HOOKS):
                hook()
            comm = ThreadCommunicator(group, ctx, rank, list(range(world_size)), timeout=timeout)
            results[rank] = fn(comm, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (reported in the caller below)
            group.fail(rank, exc)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"minizero-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if group.failure is not None:
        rank, exc = group.failure
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"[rank {rank}/{world_size}] {exc.args[0]}",) + exc.args[1:]
        elif hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"raised in rank {rank} of {world_size} (run_in_threads)")
        raise exc
    return results
