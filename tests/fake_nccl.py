"""An in-process stand-in for ``cupy.cuda.nccl`` and ``cupy.cuda``: ranks are threads, buffers device arrays.

It checks what the NCCL communicator's code can get wrong without a GPU -- the ordering and
grouping of its calls -- and moves real bytes, so the collectives on top give real results:

* buffers are device arrays (strict arrays, :mod:`minizero.strict`) passed as raw addresses
  (``buf.data.ptr``), read and written through ctypes, as NCCL reads device pointers; NumPy
  arrays never reach it (NcclCommunicator sends host arrays over its bootstrap, as on CuPy);
  counts are elements of the given datatype;
* messages between two ranks match in issue order, with no tags (NCCL's rule);
* an ungrouped ``send`` returns only once the peer's ``recv`` took the message, and an
  ungrouped ``recv`` waits for it (``ncclSend`` blocks its stream until the peer receives):
  a cycle of ungrouped sends raises :class:`FakeDeadlock` after ``DEADLOCK_S`` seconds instead
  of hanging, naming the rank and the peer;
* between ``groupStart`` and ``groupEnd`` calls are only recorded; ``groupEnd`` posts every
  send, then completes every receive, then waits until the sends were taken (all at once, as
  NCCL progresses a group);
* a receive whose byte count differs from the message raises (real NCCL would not notice);
* every call is appended to the communicator's ``log``: (name, peer or root, count, in a group);
* CuPy 14's API: ``get_unique_id()`` returns ``bytes`` and the constructor refuses any other id;
  ``check_async_error()`` raises the communicator's ``async_error`` when a test set one.

It is a test double, not NCCL: no streams run (events are always done), no device.
"""
from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from types import SimpleNamespace

import numpy as np

DEADLOCK_S = 20.0  #: seconds an ungrouped send/recv waits before FakeDeadlock (tests may lower it)

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM = 0
_NUMPY = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
          NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32,
          NCCL_FLOAT64: np.float64}
available = True
CALLS: list = []  #: every call of every communicator, in issue order (list.append is atomic)


class FakeDeadlock(RuntimeError):
    """An ungrouped send or receive was not matched in time: on NCCL this call would hang."""


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    """``count`` elements of ``datatype`` at address ``ptr``, as a writeable NumPy view."""
    dtype = np.dtype(_NUMPY[datatype])
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype=dtype)


class _Log(list):
    """A communicator's calls, also appended to :data:`CALLS`."""

    def append(self, item):
        CALLS.append(item)
        super().append(item)


class _World:
    """What the ranks of one unique id share: FIFO message queues per (source, dest), a barrier, slots."""

    def __init__(self, size):
        self.size, self.lock = size, threading.Lock()
        self.queues: dict[tuple[int, int], queue.Queue] = {}
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def queue(self, source, dest) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((source, dest), queue.Queue())


_WORLDS: dict[tuple, _World] = {}
_WORLDS_LOCK = threading.Lock()
_IDS = itertools.count(1)
_GROUP = threading.local()  # per thread (= per rank): group depth and the calls recorded in it


def get_unique_id() -> bytes:
    """128 bytes, different on every call (NCCL: random bytes naming the root's socket); ``bytes`` as on CuPy 14."""
    k = next(_IDS)
    return bytes((k >> (8 * i)) & 0xFF for i in range(128))


def groupStart() -> None:  # noqa: N802  (CuPy's name)
    _GROUP.depth = getattr(_GROUP, "depth", 0) + 1
    _GROUP.calls = getattr(_GROUP, "calls", [])


def groupEnd() -> None:  # noqa: N802
    if getattr(_GROUP, "depth", 0) < 1:
        raise RuntimeError("groupEnd without groupStart")
    _GROUP.depth -= 1
    if _GROUP.depth:
        return
    calls, _GROUP.calls = _GROUP.calls, []
    sent = [comm._post(*args) for comm, kind, args in calls if kind == "send"]
    for comm, kind, args in calls:
        if kind == "recv":
            comm._take(*args)
    for comm, taken, peer in sent:
        comm._wait_taken(taken, peer)


def _in_group() -> bool:
    return getattr(_GROUP, "depth", 0) > 0


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)`` for threads of one process."""

    def __init__(self, ndev, comm_id, rank):
        if not isinstance(comm_id, bytes):  # CuPy 14: NcclCommunicator(int ndev, bytes commId, int rank)
            raise TypeError(f"commId must be bytes (CuPy 14), got {type(comm_id).__name__}")
        if len(comm_id) != 128:
            raise ValueError("the unique id must have 128 bytes")
        with _WORLDS_LOCK:
            self.world = _WORLDS.setdefault(comm_id, _World(ndev))
        if self.world.size != ndev or not 0 <= rank < ndev:
            raise ValueError(f"rank {rank} of {ndev} does not fit the world of {self.world.size}")
        self._rank, self.aborted = rank, False
        self.async_error = None  #: set it to an exception to fake an NCCL asynchronous error
        self.log: list = _Log()  #: (call, peer or root, count, inside a group) in issue order

    def check_async_error(self):
        """Raise the injected asynchronous error, if any (CuPy: NcclError from ncclCommGetAsyncError)."""
        if self.async_error is not None:
            raise self.async_error

    def rank_id(self):
        return self._rank

    def size(self):
        return self.world.size

    def abort(self):
        self.aborted = True

    def destroy(self):
        pass

    # -- point to point ---------------------------------------------------------------------
    def send(self, ptr, count, datatype, peer, stream):
        self.log.append(("send", peer, count, _in_group()))
        if _in_group():
            _GROUP.calls.append((self, "send", (ptr, count, datatype, peer)))
            return
        self._wait_taken(*self._post(ptr, count, datatype, peer)[1:])

    def recv(self, ptr, count, datatype, peer, stream):
        self.log.append(("recv", peer, count, _in_group()))
        if _in_group():
            _GROUP.calls.append((self, "recv", (ptr, count, datatype, peer)))
            return
        self._take(ptr, count, datatype, peer)

    def _post(self, ptr, count, datatype, peer):
        taken = threading.Event()
        data = _view(ptr, count, datatype).copy()
        self.world.queue(self._rank, peer).put((data, taken))
        return self, taken, peer

    def _wait_taken(self, taken, peer):
        if not taken.wait(DEADLOCK_S):
            raise FakeDeadlock(f"rank {self._rank}: send to rank {peer} was never received; an ungrouped "
                               "ncclSend blocks until the peer receives (use groupStart/groupEnd)")

    def _take(self, ptr, count, datatype, peer):
        try:
            data, taken = self.world.queue(peer, self._rank).get(timeout=DEADLOCK_S)
        except queue.Empty:
            raise FakeDeadlock(f"rank {self._rank}: receive from rank {peer} never matched a send") from None
        out = _view(ptr, count, datatype)
        if data.nbytes != out.nbytes:
            raise ValueError(f"rank {self._rank}: message from rank {peer} has {data.nbytes} bytes, "
                             f"the receive {out.nbytes}")
        out[...] = data.view(out.dtype)
        taken.set()

    # -- collectives: every rank's input in a slot, between two barriers ---------------------
    def _exchange(self, array):
        if _in_group():
            raise RuntimeError("the fake runs collectives outside groups only")
        self.world.slots[self._rank] = array.copy()
        self.world.barrier.wait(DEADLOCK_S)
        inputs = list(self.world.slots)
        self.world.barrier.wait(DEADLOCK_S)
        return inputs

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        self.log.append(("allReduce", None, count, False))
        inputs = self._exchange(_view(sendbuf, count, datatype))
        total = inputs[0].copy()
        for a in inputs[1:]:
            total += a
        _view(recvbuf, count, datatype)[...] = total

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self.log.append(("reduceScatter", None, recvcount, False))
        inputs = self._exchange(_view(sendbuf, recvcount * self.world.size, datatype))
        part = slice(self._rank * recvcount, (self._rank + 1) * recvcount)
        total = inputs[0][part].copy()
        for a in inputs[1:]:
            total += a[part]
        _view(recvbuf, recvcount, datatype)[...] = total

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        self.log.append(("allGather", None, count, False))
        inputs = self._exchange(_view(sendbuf, count, datatype))
        _view(recvbuf, count * self.world.size, datatype)[...] = np.concatenate(inputs)

    def bcast(self, buff, count, datatype, root, stream):
        self.log.append(("bcast", root, count, False))
        inputs = self._exchange(_view(buff, count, datatype))
        _view(buff, count, datatype)[...] = inputs[root]


# --------------------------------------------------------------------------- cupy.cuda stand-in
class Event:
    """Always done: the fake runs every call on the host before it returns."""

    done = True

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        pass


class Stream:
    """``ptr`` 0; waits are no-ops."""

    ptr = 0

    def __init__(self, non_blocking=False):
        self.non_blocking = non_blocking

    def wait_event(self, event):
        if not getattr(event, "recorded", False):
            raise RuntimeError("a stream waits on an event that was never recorded")

    def synchronize(self):
        pass


_CURRENT = Stream()
cuda = SimpleNamespace(Event=Event, Stream=Stream, get_current_stream=lambda: _CURRENT,
                       runtime=SimpleNamespace(getDeviceCount=lambda: 1), Device=lambda d: SimpleNamespace(use=lambda: d))
