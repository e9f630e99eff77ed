"""MPICommunicator: one process per rank, over mpi4py's buffer methods (arrays never pickled).

Every point-to-point message travels as two MPI messages with the same (dest, tag):
a 64-byte header (dtype, ndim, size, shape) on a duplicate of the communicator, then
the payload as raw bytes. The receiver checks the header against its buffer first, so
float32 [1,2,3,4] sent into an int32 buffer of the same byte size raises ``ValueError``
naming both, as ``ThreadCommunicator`` does, instead of reinterpreting the bits. The
traffic ledger counts payload bytes only (headers are bookkeeping, ``header_bytes``).

Waits never block inside MPI (MPICH's blocking ``Recv`` busy-polls a core): every
operation is a non-blocking request (``Isend``/``Irecv``/``Ibarrier``/``Iallreduce``...)
tested with ``MPI_Test`` and a sleep that backs off to 2 ms, so a rank waiting on a
stalled peer sleeps, and after ``timeout`` seconds raises :class:`CommTimeoutError`
naming the operation, the peer and the tag (the caller then aborts the job).

Device arrays (CuPy, or the strict module of ``--device strict``) are staged through host
memory: a send copies the array to a NumPy buffer (``backend.to_host``) and hands that to
mpi4py, a receive lands in a NumPy buffer and is copied to the device array afterwards
(``backend.to_device``). This MPI is not assumed CUDA-aware; the GPU-direct path is NCCL's.
NumPy arrays are handed to MPI as they are (no copy).

Mirrors: the MPI-3.1 standard, chapter 3 (point-to-point, non-blocking requests +
MPI_Test) and 5.12 (non-blocking collectives); PyTorch's process-group ``timeout``.
"""
from __future__ import annotations

import time

import numpy as np

from minizero import backend
from minizero.comm.base import DEFAULT_TIMEOUT_S, CommTimeoutError, Communicator, _check_color
from minizero.comm.collectives import shard_range
from minizero.comm.traffic import TrafficLedger

_MAX_SLEEP_S = 0.002  #: longest sleep between two MPI_Test calls of a waiting rank
_HEADER_WORDS = 8  #: int64 words: dtype string (8 ASCII bytes), ndim, size, up to 5 dimensions


def _header(buf) -> np.ndarray:
    """The 64-byte description of ``buf`` sent ahead of its bytes: dtype, ndim, size, shape."""
    h = np.zeros(_HEADER_WORDS, dtype=np.int64)
    h[0] = int.from_bytes(buf.dtype.str.encode("ascii")[:8].ljust(8, b"\0"), "little")
    h[1], h[2] = buf.ndim, buf.size
    if buf.ndim <= _HEADER_WORDS - 3:
        h[3:3 + buf.ndim] = buf.shape
    return h


def _describe(h: np.ndarray) -> str:
    """``(2, 3) <f4`` from a header (``size 70 <f4`` when the shape had too many dimensions)."""
    dtype = np.dtype(int(h[0]).to_bytes(8, "little").rstrip(b"\0").decode("ascii"))
    ndim = int(h[1])
    shape = tuple(int(d) for d in h[3:3 + ndim]) if ndim <= _HEADER_WORDS - 3 else f"size {int(h[2])}"
    return f"{shape} {dtype}"


def _staged(buf) -> np.ndarray:
    """The host array MPI reads for ``buf``: ``buf`` itself when it is a NumPy array, else a host copy."""
    return buf if isinstance(buf, np.ndarray) else backend.to_host(buf)


def _landing(buf) -> np.ndarray:
    """The host array MPI writes for ``buf``: ``buf`` itself when it is a NumPy array, else an empty host twin."""
    return buf if isinstance(buf, np.ndarray) else np.empty(buf.shape, dtype=buf.dtype)


def _unstage(buf, host: np.ndarray) -> None:
    """Copy a received host array into the device array ``buf`` (nothing when ``host`` is ``buf``)."""
    if host is not buf:
        buf[...] = backend.to_device(host)


def _mpi():
    """Import mpi4py.MPI on first use (importing it initializes MPI)."""
    from mpi4py import MPI  # noqa: PLC0415

    return MPI


class _SendRequest:
    """``isend``'s request: the header's and the payload's MPI_Isend; ``test()`` is MPI_Testall,
    ``wait()`` completes them as every MPI wait here does (sleeping, with the communicator's timeout)."""

    def __init__(self, comm, requests, dest, tag):
        self.comm, self.requests, self.dest, self.tag, self.done = comm, requests, dest, tag, False

    def wait(self) -> None:
        if not self.done:
            self.comm._wait(self.requests, "isend", self.dest, self.tag)
            self.done = True

    def test(self) -> bool:
        if not self.done:
            self.done = _mpi().Request.Testall(self.requests)
        return self.done


class _RecvRequest:
    """``irecv``'s request: the header's MPI_Irecv; once it arrived and matches the buffer, the payload's."""

    def __init__(self, comm, buf, source, tag):
        self.comm, self.buf, self.source, self.tag = comm, buf, source, tag
        self.header = np.empty(_HEADER_WORDS, dtype=np.int64)
        self.host = _landing(buf)
        self.request = comm.header_comm.Irecv([self.header, _mpi().BYTE], source=source, tag=tag)
        self.payload, self.done = None, False

    def test(self) -> bool:
        if self.done:
            return True
        if self.payload is None:
            if not self.request.Test():
                return False
            if not np.array_equal(self.header, _header(self.buf)):
                raise ValueError(
                    f"rank {self.comm.rank}: irecv message from rank {self.source} (tag {self.tag}) is "
                    f"{_describe(self.header)}, the receive buffer is {_describe(_header(self.buf))}; they must match")
            self.payload = self.comm.mpi_comm.Irecv([self.host, _mpi().BYTE], source=self.source, tag=self.tag)
        self.done = self.payload.Test()
        if self.done:
            _unstage(self.buf, self.host)
        return self.done


class MPICommunicator(Communicator):
    """A ``Communicator`` over an mpi4py communicator (default ``MPI.COMM_WORLD``).

    Point-to-point messages go as raw bytes (``[buf, MPI.BYTE]``), so every dtype works,
    float16 included, each preceded by a header: a receive checks that the sender's shape
    and dtype match ``buf`` (ValueError naming both otherwise).
    Native collectives pass the arrays with their own MPI datatype (float16 needs an
    MPI with MPIX_C_FLOAT16, as MPICH >= 4 has).

    Attributes:
        mpi_comm: the wrapped ``mpi4py.MPI.Comm`` (for timing reductions in benchmarks).
        timeout: seconds any one wait may last (default 600, PyTorch's NCCL default);
            then :class:`CommTimeoutError`. Settable; ``split`` copies it.
        header_bytes: header bytes sent (8 int64 per message), kept out of ``traffic``.
    Raises (any operation): CommTimeoutError; ValueError for a shape/dtype mismatch.
    """

    def __init__(self, mpi_comm=None, traffic: TrafficLedger | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.header_comm = self.mpi_comm.Dup()  # collective: headers in their own context, same tags
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        self.traffic = TrafficLedger() if traffic is None else traffic
        self.timeout = timeout  #: seconds one wait may last before CommTimeoutError (> 0)
        self.header_bytes = 0  #: bytes of message headers sent (not in ``traffic``)

    # -- waiting: MPI_Test with a sleep, never a busy wait -----------------------------
    def _wait(self, requests, op: str, peer=None, tag=None) -> None:
        """Complete ``requests``, sleeping between tests; CommTimeoutError after ``self.timeout`` s."""
        MPI = _mpi()
        deadline = time.monotonic() + self.timeout
        delay = 0.0
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                whom = f"rank {peer}" if peer is not None else "the other ranks"
                raise CommTimeoutError(
                    f"rank {self.rank}: {op}{'' if tag is None else f' (tag {tag})'} waited {self.timeout:g} s "
                    f"for {whom} of a communicator of {self.world_size} (--comm-timeout); a rank is stalled or gone")
            time.sleep(delay)
            delay = min(max(2 * delay, 1e-5), _MAX_SLEEP_S)

    def _post_send(self, buf, dest, tag) -> list:
        MPI = _mpi()
        h = _header(buf)
        self.header_bytes += h.nbytes
        return [self.header_comm.Isend([h, MPI.BYTE], dest=dest, tag=tag),
                self.mpi_comm.Isend([_staged(buf), MPI.BYTE], dest=dest, tag=tag)]  # the request keeps it alive

    def _receive(self, buf, source, tag, op, pending=()):
        """Receive the header, check it against ``buf``, then the payload (and finish ``pending``)."""
        MPI = _mpi()
        h = np.empty(_HEADER_WORDS, dtype=np.int64)
        self._wait([self.header_comm.Irecv([h, MPI.BYTE], source=source, tag=tag)], op, source, tag)
        if not np.array_equal(h, _header(buf)):
            raise ValueError(
                f"rank {self.rank}: {op} message from rank {source} (tag {tag}) is {_describe(h)}, "
                f"the receive buffer is {_describe(_header(buf))}; they must match")
        host = _landing(buf)
        self._wait([self.mpi_comm.Irecv([host, MPI.BYTE], source=source, tag=tag), *pending], op, source, tag)
        _unstage(buf, host)

    def _send(self, buf, dest, tag):
        self._wait(self._post_send(buf, dest, tag), "send", dest, tag)

    def _recv(self, buf, source, tag):
        self._receive(buf, source, tag, "recv")

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._receive(recvbuf, source, tag, "sendrecv", pending=self._post_send(sendbuf, dest, tag))

    def _isend(self, buf, dest, tag):
        return _SendRequest(self, self._post_send(buf, dest, tag), dest, tag)

    def _irecv(self, buf, source, tag):
        return _RecvRequest(self, buf, source, tag)

    def barrier(self):
        self._wait([self.mpi_comm.Ibarrier()], "barrier")

    def split(self, color, key=0):
        color, key = _check_color(color), int(key)
        return MPICommunicator(self.mpi_comm.Split(color, key), traffic=TrafficLedger(parent=self.traffic),
                               timeout=self.timeout)

    def abort(self, errorcode=1):
        _mpi().COMM_WORLD.Abort(errorcode)

    def _native_allreduce(self, x, out):
        MPI = _mpi()
        hx = _staged(x)
        hout = hx if out is x else _landing(out)
        self._wait([self.mpi_comm.Iallreduce(MPI.IN_PLACE if out is x else hx, hout, op=MPI.SUM)], "native_allreduce")
        _unstage(out, hout)

    def _native_reduce_scatter(self, flat):
        counts = [shard_range(flat.size, self.world_size, r)[1] for r in range(self.world_size)]
        out = np.empty(counts[self.rank], dtype=flat.dtype)
        self._wait([self.mpi_comm.Ireduce_scatter(_staged(flat), out, counts, op=_mpi().SUM)], "native_reduce_scatter")
        return backend.to_device(out)

    def _native_allgather(self, shard, n):
        ranges = [shard_range(n, self.world_size, r) for r in range(self.world_size)]
        out = np.empty(n, dtype=shard.dtype)
        counts, displs = [s for _, s in ranges], [o for o, _ in ranges]
        self._wait([self.mpi_comm.Iallgatherv(_staged(shard), [out, (counts, displs)])], "native_allgather")
        return backend.to_device(out)

    def _native_bcast(self, x, root):
        host = _staged(x)
        self._wait([self.mpi_comm.Ibcast(host, root=root)], "native_bcast")
        _unstage(x, host)


_WORLD: MPICommunicator | None = None


def world() -> MPICommunicator:
    """The ``MPICommunicator`` over ``MPI.COMM_WORLD`` (one per process, so one ledger)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = MPICommunicator()
    return _WORLD

