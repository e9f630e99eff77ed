"""Ring collectives that progress in steps, so computation can run while they are in flight.

:class:`RingCollective` runs :func:`~minizero.comm.collectives.ring_steps` over ``isend``/``irecv``, bitwise
equal to the blocking ring. Mirrors: MPI-3.1 section 3.7 (MPI_Test); PyTorch DDP's Reducer (Li et al. 2020).
"""
from __future__ import annotations

from minizero import backend, trace
from minizero.comm.base import DEFAULT_TIMEOUT_S, poll_until, timeout_message
from minizero.comm.collectives import _check_array, ring_steps, shard_range


class RingCollective:
    """One ring collective in place on a flat C-contiguous (n,) ``buf``, advanced by :meth:`progress` (never waits).

    ``op``: ``"all_reduce"``, ``"reduce_scatter"`` or ``"all_gather"``; ``tag``: one collective in flight per tag
    (use a :class:`Stream`); ``label``: the traffic label (default ``op``). Bytes: as the blocking ring.
    Raises TypeError/ValueError: ``buf`` not a flat writeable C-contiguous array, bad ``op``; NotImplementedError.
    """

    def __init__(self, comm, buf, op: str, tag: int, label: str | None = None, name: str | None = None,
                 **trace_args):
        _check_array(buf, "buf", writeable=True)
        if buf.ndim != 1:
            raise ValueError(f"buf must be 1-D (a flat buffer), got shape {buf.shape}")
        if not comm.nonblocking:
            raise NotImplementedError(f"{type(comm).__name__} has no isend/irecv; use the blocking collectives")
        self.comm, self.buf, self.op, self.tag = comm, buf, op, tag
        self.label, self.name, self.trace_args = label or op, name or op, trace_args
        self.steps = ring_steps(op, buf.size, comm.world_size, comm.rank)  # none on one rank; checks op
        self.tmp = None if op == "all_gather" else backend.array_module(buf).empty(  # the reduce steps' receive chunk
            shard_range(buf.size, comm.world_size, 0)[1], dtype=buf.dtype)
        self.step, self.requests, self.started_us, self.done, self.entry = 0, None, None, False, None

    def post(self) -> None:
        """Count the call and enter it in the flight recorder as ``posted`` (once; :meth:`start` does it too)."""
        if self.entry is None:
            self.entry = self.comm.traffic.count_call(self.label, self.buf) or False

    def start(self) -> RingCollective:
        """Count the call and post the first step (nothing to do with one rank). Returns self."""
        if self.started_us is not None:
            raise RuntimeError(f"{self.name} was already started")
        self.started_us = trace.now_us()
        self.post()
        if self.entry:
            self.entry.state = "started"
        self._post()
        return self

    def _post(self) -> None:
        if self.step == len(self.steps):
            self._finish()
            return
        (so, ss), (ro, rs), add = self.steps[self.step]
        incoming = self.tmp[:rs] if add else self.buf[ro:ro + rs]
        right, left = (self.comm.rank + 1) % self.comm.world_size, (self.comm.rank - 1) % self.comm.world_size
        with self.comm.traffic.labelled(self.label):
            self.requests = (self.comm.irecv(incoming, left, tag=self.tag),
                             self.comm.isend(self.buf[so:so + ss], right, tag=self.tag))

    def _finish(self) -> None:
        self.done, self.requests = True, None
        if self.entry:
            self.entry.state, self.entry.ended_us = "completed", trace.now_us()
        tracer = self.comm.traffic.active_tracer()  # the communicator's callback; None: no cost
        if tracer is not None:
            c = self.comm
            sent = sum(size for (_, size), _, _ in self.steps) * self.buf.itemsize  # the ring's, at any size
            tracer.complete(self.name, "comm", self.started_us, trace.now_us(), trace.IN_FLIGHT, op=self.op, bytes=sent,
                            peers=[(c.rank - 1) % c.world_size, (c.rank + 1) % c.world_size], **self.trace_args)

    def progress(self) -> bool:
        """Advance as far as the arrived messages allow, never waiting; True once finished."""
        if self.started_us is None:
            raise RuntimeError(f"{self.name}: progress() before start()")
        while not self.done:
            recv, send = self.requests
            if not (recv.test() and send.test()):
                return False
            (_, _), (ro, rs), add = self.steps[self.step]
            if add:
                acc = self.buf[ro:ro + rs]
                backend.array_module(acc).add(acc, self.tmp[:rs], out=acc)
            self.step += 1
            self._post()
        return True

    def wait(self) -> None:
        """Progress until finished, sleeping between tests. Raises CommTimeoutError after the communicator's
        ``timeout``."""
        _wait_until(self.comm, self.progress, f"{self.name} (tag {self.tag})", self.waiting_on)

    def waiting_on(self) -> int | None:
        """The neighbour the current step waits for: rank-1 (its message has not arrived), else rank+1."""
        if self.done or self.requests is None:
            return None
        n = self.comm.world_size
        return (self.comm.rank - 1) % n if not self.requests[0].test() else (self.comm.rank + 1) % n


def wait_all(comm, requests, what: str, peer: int | None = None) -> None:
    """Wait until every request's ``test()`` is True (requests of ``isend``/``irecv``), sleeping between
    tests; CommTimeoutError naming ``peer`` after the communicator's ``timeout`` (seconds)."""
    _wait_until(comm, lambda: all([r.test() for r in requests]), what, lambda: peer)


def _wait_until(comm, done, what: str, peer=lambda: None) -> None:
    timeout = getattr(comm, "timeout", DEFAULT_TIMEOUT_S)
    poll_until(done, timeout, lambda: timeout_message(comm.rank, comm.world_size, what, timeout, peer(),
                                                      getattr(comm, "world_rank", None)),
               getattr(comm, "spin_s", 0.0))


class Stream:
    """Collectives run one at a time in :meth:`submit` order (a NCCL stream)."""

    def __init__(self, comm):
        self.comm = comm
        self.queue: list[RingCollective] = []

    def submit(self, coll: RingCollective) -> None:
        """Queue ``coll`` (not yet started); it starts at once if the stream is idle."""
        self.queue.append(coll)
        coll.post()
        if len(self.queue) == 1:
            coll.start()
        self.progress()

    def progress(self) -> bool:
        """Advance without waiting; True when nothing is left in flight."""
        while self.queue:
            if not self.queue[0].progress():
                return False
            self.queue.pop(0)
            if self.queue:
                self.queue[0].start()
        return True

    def synchronize(self) -> None:
        """Wait until every submitted collective finished (CommTimeoutError after the comm's timeout)."""
        _wait_until(self.comm, self.progress, "overlapped collectives", self._head_waiting_on)

    def wait_for(self, coll: RingCollective, what: str | None = None) -> None:
        """Advance the stream until ``coll`` finished (CommTimeoutError naming ``what``, default its name)."""
        _wait_until(self.comm, lambda: self.progress() or coll.done, what or coll.name, self._head_waiting_on)

    def _head_waiting_on(self) -> int | None:
        return self.queue[0].waiting_on() if self.queue else None
