"""ThreadCommunicator: ranks as threads of one process (``run_in_threads``), for notebooks and tests.

MPI semantics plus prompt failure when any rank raises, so a buggy algorithm fails a test instead of hanging.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import queue
import threading
import time

from threadpoolctl import threadpool_limits

from minizero import backend
from minizero.comm.base import CommTimeoutError, Communicator, _check_color, poll_until, timeout_message
from minizero.comm.collectives import check_int, shard_range
from minizero.comm.traffic import TrafficLedger


class GroupFailedError(RuntimeError):
    """Raised in a waiting rank thread when another rank of its ``run_in_threads`` failed."""


class _ThreadGroup:
    """What the rank threads of one ``run_in_threads`` call share: the first failure, the ranks that returned."""

    def __init__(self):
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.failure: tuple[int, BaseException] | None = None  # (thread rank, exception)
        self.returned: set[int] = set()  # thread ranks whose fn returned: a wait for one of them fails at once
        self.contexts: list[_Context] = []
        self.ids = itertools.count()

    def new_context(self, size: int) -> _Context:
        ctx = _Context(size, next(self.ids))
        with self.lock:
            self.contexts.append(ctx)
        return ctx

    def finish(self, thread_rank: int) -> None:  # thread_rank returned: wake every waiting rank to check on it
        with self.lock:
            self.returned.add(thread_rank)
            contexts = list(self.contexts)
        for ctx in contexts:
            with ctx.arrival:
                ctx.arrival.notify_all()

    def fail(self, thread_rank: int, exc: BaseException) -> None:
        """Remember the first failure and wake every waiting rank."""
        with self.lock:
            if self.failure is None:
                self.failure = (thread_rank, exc)
            self.failed.set()
            contexts = list(self.contexts)
        for ctx in contexts:
            with ctx.arrival:
                ctx.arrival.notify_all()  # ranks waiting in barrier()/native_*/split() raise


class _Context:
    """One communicator's shared state: message queues, a barrier (``arrival``, counts), exchange slots."""

    def __init__(self, size: int, context_id: int):
        self.size = size
        self.id = context_id
        self.arrival, self.arrived, self.generation = threading.Condition(), 0, 0
        self.slots: list = [None] * size
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int, int], queue.Queue] = {}

    def queue(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self.lock:
            if (source, dest, tag) not in self.queues:
                self.queues[(source, dest, tag)] = queue.Queue()
            return self.queues[(source, dest, tag)]


class _DoneRequest:
    """``isend`` on threads: the message was copied into the queue, so the buffer is free at once."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _QueueRecvRequest:
    """``irecv`` on threads: ``test()`` takes the message from the queue if it is there (never waits)."""

    def __init__(self, comm, buf, source, tag):
        self.comm, self.buf, self.source, self.tag, self.done = comm, buf, source, tag, False

    def test(self) -> bool:
        if self.done:
            return True
        c = self.comm
        try:
            msg = c._ctx.queue(self.source, c.rank, self.tag).get_nowait()
        except queue.Empty:
            if c._group.failed.is_set():
                raise c._failed_error(f"a message from rank {self.source} with tag {self.tag} (irecv)") from None
            if c._returned([self.source]) is None:
                return False
            try:  # a message sent before it returned is in the queue by now
                msg = c._ctx.queue(self.source, c.rank, self.tag).get_nowait()
            except queue.Empty:
                raise c._returned_error(self.source, "irecv") from None
        if msg.shape != self.buf.shape or msg.dtype != self.buf.dtype:
            raise ValueError(f"{c._who()}: irecv message from rank {self.source} (tag {self.tag}) is {msg.shape} "
                             f"{msg.dtype}, the receive buffer is {self.buf.shape} {self.buf.dtype}; they must match")
        self.buf[...] = msg
        self.done = True
        return True

    def wait(self) -> None:
        """Take the message once it is there; CommTimeoutError after the communicator's timeout."""
        c = self.comm  # worded as recv's: a split group's ranks with their world ranks
        poll_until(self.test, c.timeout, lambda: str(c._timeout_error(f"irecv (tag {self.tag})", self.source)))


class ThreadCommunicator(Communicator):
    """A ``Communicator`` whose ranks are threads of one process; make it with ``run_in_threads``.

    ``send`` copies into a queue and returns (eager); ``recv`` raises ``CommTimeoutError`` after ``timeout`` s,
    or ``GroupFailedError`` once any rank raised. Native collectives sum every rank's array in rank order.
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

    def _timeout_error(self, what: str, peer: int | None = None) -> CommTimeoutError:  # worded as MPI's and NCCL's
        return CommTimeoutError(timeout_message(self.rank, self.world_size, what, self.timeout, peer,
                                                lambda r: self._thread_ranks[r]))

    def _failed_error(self, waiting_for: str) -> GroupFailedError:
        rank, exc = self._group.failure
        return GroupFailedError(
            f"{self._who()} stopped waiting for {waiting_for}: thread rank {rank} raised "
            f"{type(exc).__name__}: {exc}"
        )

    # -- point to point ------------------------------------------------------------
    def _send(self, buf, dest, tag):
        self._ctx.queue(self.rank, dest, tag).put(buf.copy())

    def _recv(self, buf, source, tag, op="recv"):
        q = self._ctx.queue(source, self.rank, tag)
        what = f"a message from rank {source} with tag {tag} ({op})"
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                msg = q.get(timeout=self._POLL_S)
                break
            except queue.Empty:
                if self._group.failed.is_set():
                    raise self._failed_error(what) from None
                if self._returned([source]) is not None:
                    try:  # a message sent before it returned is in the queue by now
                        msg = q.get_nowait()
                        break
                    except queue.Empty:
                        raise self._returned_error(source, op) from None
                if time.monotonic() > deadline:
                    raise self._timeout_error(f"{op} (tag {tag})", source) from None
        if msg.shape != buf.shape or msg.dtype != buf.dtype:
            raise ValueError(
                f"{self._who()}: {op} message from rank {source} (tag {tag}) is {msg.shape} {msg.dtype}, "
                f"the receive buffer is {buf.shape} {buf.dtype}; they must match"
            )
        buf[...] = msg

    def _isend(self, buf, dest, tag):
        self._send(buf, dest, tag)
        return _DoneRequest()

    def _irecv(self, buf, source, tag):
        return _QueueRecvRequest(self, buf, source, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._send(sendbuf, dest, tag)  # never blocks, so no deadlock
        self._recv(recvbuf, source, tag, "sendrecv")

    # -- group management ------------------------------------------------------------
    def _returned(self, peers) -> int | None:  # the first of peers (ranks here) whose thread returned, or None
        return next((r for r in peers if r != self.rank and self._thread_ranks[r] in self._group.returned), None)

    def _returned_error(self, peer: int, what: str) -> GroupFailedError:
        label = self.traffic.current_label() or what
        return GroupFailedError(f"{self._who()}: {label} waits for rank {peer}, which has already returned")

    def _wait(self, what: str) -> None:
        ctx, deadline = self._ctx, time.monotonic() + self.timeout
        with ctx.arrival:
            generation, ctx.arrived = ctx.generation, ctx.arrived + 1
            if ctx.arrived == ctx.size:  # the last to arrive releases the others
                ctx.arrived, ctx.generation = 0, generation + 1
                ctx.arrival.notify_all()
            while ctx.generation == generation:
                ctx.arrival.wait(self._POLL_S)
                if ctx.generation != generation:
                    break
                if self._group.failed.is_set():
                    raise self._failed_error(what)
                gone = self._returned(range(ctx.size))  # not arrived: it cannot return while waiting here
                if gone is not None:
                    raise self._returned_error(gone, what)
                if time.monotonic() > deadline:
                    raise self._timeout_error(what)

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

    def world_rank(self, rank):  # the thread rank: run_in_threads' world
        return self._thread_ranks[rank]

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
                backend.array_module(acc).add(acc, p, out=acc)
            return acc

        out[...] = self._exchange(x, total, "native_allreduce")

    def _native_reduce_scatter(self, flat):
        off, size = shard_range(flat.size, self.world_size, self.rank)

        def my_chunk(parts):
            self._same_arrays(parts, "native_reduce_scatter")
            acc = parts[0][off:off + size].copy()
            for p in parts[1:]:
                backend.array_module(acc).add(acc, p[off:off + size], out=acc)
            return acc

        return self._exchange(flat, my_chunk, "native_reduce_scatter")

    def _native_allgather(self, shard, n):
        def concatenate(parts):
            if sum(p.size for p in parts) != n or len({p.dtype for p in parts}) != 1:
                raise ValueError(f"native_allgather: shards {[(p.size, p.dtype) for p in parts]} "
                                 f"do not make one array of n={n} elements")
            return backend.array_module(parts[0]).concatenate(parts)

        return self._exchange(shard, concatenate, "native_allgather")

    def _native_bcast(self, x, root):
        def copy_root(parts):
            self._same_arrays(parts, "native_bcast")
            if self.rank != root:
                x[...] = parts[root]

        self._exchange(x, copy_root, "native_bcast")


_THREAD_START_HOOKS: list = []


def register_thread_start_hook(fn):
    """Run ``fn()`` at the start of every rank thread of ``run_in_threads`` (once per function); returns ``fn``."""
    if fn not in _THREAD_START_HOOKS:
        _THREAD_START_HOOKS.append(fn)
    return fn


def run_in_threads(world_size: int, fn, *args, timeout: float = 60.0, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` rank threads; return results by rank.

    ``timeout`` (seconds) bounds every single wait. Raises ValueError: ``world_size`` < 1, ``timeout`` not finite > 0;
    else the first exception any rank raised (GroupFailedError: one waits for a returned rank), prefixed [rank r/N].
    With ``world_size`` > 1 the BLAS runs 1 thread while the ranks run (each rank thread is a core's worth of work).
    """
    world_size = int(check_int(world_size, "world_size", 1))  # not True for 1; NumPy's ints as check_rank
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r}; timeout must be a finite number of seconds > 0")
    group = _ThreadGroup()
    ctx = group.new_context(world_size)
    results = [None] * world_size

    def rank_main(rank):
        try:
            for hook in list(_THREAD_START_HOOKS):
                hook()
            comm = ThreadCommunicator(group, ctx, rank, list(range(world_size)), timeout=timeout)
            results[rank] = fn(comm, *args, **kwargs)
            group.finish(rank)
        except BaseException as exc:  # noqa: BLE001  (reported in the caller below)
            group.fail(rank, exc)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"minizero-rank-{r}", daemon=True)
               for r in range(world_size)]
    # Rank threads that each call a multithreaded BLAS oversubscribe the cores: N ranks x T threads compete for fewer
    # cores than that; one BLAS thread per rank avoids it.
    with threadpool_limits(limits=1, user_api="blas") if world_size > 1 else contextlib.nullcontext():
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
