"""MPICommunicator: one process per rank, over mpi4py's buffer methods (arrays never pickled).

Every message carries a 64-byte header (dtype, ndim, size, shape) checked against the receive buffer;
up to :data:`PACK_MAX_BYTES` header and payload travel as one message on ``header_comm``. The ledger counts
payload bytes only. Device arrays are staged through host memory.
Mirrors: MPI-3.1, chapter 3 and section 5.12; PyTorch's process-group ``timeout``.
"""
from __future__ import annotations

import functools

import numpy as np

from minizero import backend
from minizero.comm.base import (DEFAULT_TIMEOUT_S, Communicator, _check_color, poll_until, spin_seconds,
                                timeout_message)
from minizero.comm.collectives import shard_range
from minizero.comm.traffic import TrafficLedger

_HEADER_WORDS = 8  #: int64 words: dtype string (8 ASCII bytes), ndim, size, up to 5 dimensions
_HEADER_BYTES = 8 * _HEADER_WORDS
PACK_MAX_BYTES = 64 * 2 ** 10  #: payloads up to this go in one message with their header (a copy each side)


def _header(buf) -> np.ndarray:
    """The 64-byte description of ``buf`` sent ahead of its bytes: dtype, ndim, size, shape (read-only)."""
    return _header_of(buf.dtype, buf.shape)[0]


def _header_bytes(buf) -> bytes:
    """:func:`_header` as ``bytes``: what a received header is compared with."""
    return _header_of(buf.dtype, buf.shape)[1]


@functools.lru_cache(maxsize=1024)  # a job sends the same few shapes every step: build each header once
def _header_of(dtype: np.dtype, shape: tuple) -> tuple[np.ndarray, bytes]:
    h = np.zeros(_HEADER_WORDS, dtype=np.int64)
    h[0] = int.from_bytes(dtype.str.encode("ascii")[:8].ljust(8, b"\0"), "little")
    h[1], h[2] = len(shape), int(np.prod(shape, dtype=np.int64))
    if len(shape) <= _HEADER_WORDS - 3:
        h[3:3 + len(shape)] = shape
    h.flags.writeable = False
    return h, h.tobytes()


def _dtype_of(h: np.ndarray) -> np.dtype:  # the dtype a header names (its first word, as _header_of wrote it)
    return np.dtype(int(h[0]).to_bytes(8, "little").rstrip(b"\0").decode("ascii"))


def _payload_bytes(h: np.ndarray) -> int:
    """Payload bytes a header announces: size x the dtype's item size."""
    return int(h[2]) * _dtype_of(h).itemsize


def _describe(h: np.ndarray) -> str:
    """``(2, 3) <f4`` from a header (``size 70 <f4`` when the shape had too many dimensions)."""
    dtype = _dtype_of(h)
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


_MPI = None


def _mpi():
    """mpi4py.MPI, imported on first use (importing it initializes MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # noqa: PLC0415

        _MPI = MPI
    return _MPI


def _bytes_of(buf) -> memoryview:
    """``buf``'s bytes as a flat byte view (``buf`` is a C-contiguous host array, as every buffer here).

    A memoryview, not a uint8 array: copying between memoryviews costs half as much as NumPy's slice assignment,
    which counts at a few KiB (every message up to ``PACK_MAX_BYTES`` is copied once each side).
    """
    try:
        return memoryview(buf).cast("B")
    except (TypeError, ValueError):  # a dtype without a buffer format (datetime64, ...): through a uint8 view
        return memoryview(buf.reshape(-1).view(np.uint8))


class _SendRequest:
    """``isend``'s request: the MPI_Isend(s) of one message and the arrays they send from (kept alive); ``test()`` is
    MPI_Testall, ``wait()`` completes them as every MPI wait here does (sleeping, with the communicator's timeout)."""

    def __init__(self, comm, posted, dest, tag):
        (self.requests, self.keep), self.comm, self.dest, self.tag, self.done = posted, comm, dest, tag, False

    def wait(self) -> None:
        if not self.done:
            self.comm._wait(self.requests, "isend", self.dest, self.tag)
            self.done = True

    def test(self) -> bool:
        if not self.done:
            self.done = _mpi().Request.Testall(self.requests)
        return self.done


class _Incoming:
    """One message being received into ``buf`` from ``source``: ``irecv``'s request.

    ``test()`` is True once ``buf`` holds the payload; raises ValueError naming both when they do not match.
    """

    def __init__(self, comm, buf, source, tag, op="irecv"):
        MPI = _mpi()
        self.comm, self.buf, self.source, self.tag, self.op, self.done = comm, buf, source, tag, op, False
        self.host = _landing(buf)  # a device buffer lands in a host twin (MPI here is not CUDA-aware)
        self.packed = buf.nbytes <= PACK_MAX_BYTES
        self.msg = np.zeros(_HEADER_BYTES + (buf.nbytes if self.packed else 0), dtype=np.uint8)
        self.header = comm.header_comm.Irecv([self.msg, MPI.BYTE], source=source, tag=tag)
        self.payload = None if self.packed else comm.mpi_comm.Irecv([self.host, MPI.BYTE], source=source, tag=tag)
        self.checked = False

    def _mismatch(self, truncated: bool = False) -> ValueError:
        """The mismatch ValueError, raised once the payload is out of MPI's way (received or cancelled)."""
        MPI = _mpi()
        h = self.msg[:_HEADER_BYTES].view(np.int64)
        got = (_describe(h) if h[0] else "a message") + (" (longer than expected)" if truncated else "")
        try:
            if not truncated and h[0] and _payload_bytes(h) > PACK_MAX_BYTES:
                drain = self.payload or self.comm.mpi_comm.Irecv([np.empty(0, np.uint8), MPI.BYTE],
                                                                 source=self.source, tag=self.tag)
                self.comm._wait([drain], self.op, self.source, self.tag)
            elif self.payload is not None:
                self.payload.Cancel()
                self.payload.Wait()
        except MPI.Exception:  # truncated: the message was consumed all the same
            pass
        return ValueError(f"rank {self.comm.rank}: {self.op} message from rank {self.source} (tag {self.tag}) is "
                          f"{got}, the receive buffer is {_describe(_header(self.buf))}; they must match")

    def wait(self) -> None:
        """Receive until ``test()`` is True, as every MPI wait here (spin, then sleep); CommTimeoutError after the
        communicator's timeout, ValueError as ``test()``."""
        self.comm._poll(self.test, self.op, self.source, self.tag)

    def test(self) -> bool:
        if not self.checked:
            try:
                if not self.header.Test():
                    return False
            except _mpi().Exception as e:  # a larger message than expected: MPICH fills what fits, header first
                if e.Get_error_class() != _mpi().ERR_TRUNCATE:
                    raise
                raise self._mismatch(truncated=True) from None
            # a shorter message or a lone header of the other kind says another size in its header
            received = memoryview(self.msg)
            if received[:_HEADER_BYTES] != _header_bytes(self.buf):
                raise self._mismatch()
            self.checked = True
            if self.packed and self.buf.nbytes:
                _bytes_of(self.host)[:] = received[_HEADER_BYTES:]
        if not self.done:
            self.done = self.payload is None or self.payload.Test()
            if self.done:
                _unstage(self.buf, self.host)
        return self.done


class MPICommunicator(Communicator):
    """A ``Communicator`` over an mpi4py communicator (default ``MPI.COMM_WORLD``); float16 needs MPIX_C_FLOAT16.

    Attributes: mpi_comm; timeout (seconds any one wait may last, default 600); header_bytes (kept out of traffic).
    Raises (any operation): CommTimeoutError; ValueError for a shape/dtype mismatch.
    """

    def __init__(self, mpi_comm=None, traffic: TrafficLedger | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 spin_s: float | None = None):
        MPI = _mpi()
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if spin_s is None:  # how many ranks share this node's cores (a collective, once per world)
            node = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
            spin_s = spin_seconds(node.Get_size())
            node.Free()
        self.spin_s = spin_s  #: seconds a wait polls without sleeping (0 when ranks outnumber cores)
        self.header_comm = self.mpi_comm.Dup()  # collective: headers in their own context, same tags
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        self.traffic = TrafficLedger() if traffic is None else traffic
        self.timeout = timeout  #: seconds one wait may last before CommTimeoutError (> 0)
        self.header_bytes = 0  #: bytes of message headers sent (not in ``traffic``)
        self._world_ranks = None  #: COMM_WORLD's rank of each rank (:meth:`world_rank`), translated on first use

    # -- waiting: MPI_Test, spinning briefly where each rank has a core, then sleeping ---------
    def _wait(self, requests, op: str, peer=None, tag=None) -> None:
        """Complete ``requests`` (``poll_until``: spin ``self.spin_s``, then sleep);
        CommTimeoutError after ``self.timeout`` s."""
        self._poll(lambda: _mpi().Request.Testall(requests), op, peer, tag)

    def _poll(self, done, op: str, peer=None, tag=None) -> None:
        """Call ``done()`` until it is True (spin, then sleep); CommTimeoutError after ``self.timeout`` s."""
        if done():  # often so (a send already out, a message already here): no timeout or message to set up
            return
        what = op if tag is None else f"{op} (tag {tag})"
        poll_until(done, self.timeout, lambda: timeout_message(self.rank, self.world_size, what, self.timeout, peer,
                                                               self.world_rank), self.spin_s)

    def _post_send(self, buf, dest, tag) -> tuple[list, np.ndarray]:
        """Post ``buf``'s message; returns ([its MPI requests], the array sent from, to keep alive until done)."""
        MPI = _mpi()
        h, h_bytes = _header_of(buf.dtype, buf.shape)
        self.header_bytes += _HEADER_BYTES
        host = _staged(buf)  # a device buffer is read from a host copy (MPI here is not CUDA-aware)
        if buf.nbytes <= PACK_MAX_BYTES:  # one message: header + payload in one staging array
            msg = np.empty(_HEADER_BYTES + buf.nbytes, dtype=np.uint8)
            packed = memoryview(msg)
            packed[:_HEADER_BYTES] = h_bytes
            packed[_HEADER_BYTES:] = _bytes_of(host)
            return [self.header_comm.Isend([msg, MPI.BYTE], dest=dest, tag=tag)], msg
        return [self.header_comm.Isend([h, MPI.BYTE], dest=dest, tag=tag),
                self.mpi_comm.Isend([host, MPI.BYTE], dest=dest, tag=tag)], (h, host)

    def _receive(self, buf, source, tag, op, pending=()):
        """Receive into ``buf`` (ValueError on a mismatch), then finish the requests ``pending``."""
        incoming = _Incoming(self, buf, source, tag, op)
        if pending:  # one wait for both: the receive (checked first) and the sends
            testall = _mpi().Request.Testall
            self._poll(lambda: incoming.test() and testall(pending), op, source, tag)
        else:
            self._poll(incoming.test, op, source, tag)

    def _send(self, buf, dest, tag):
        requests, _keep = self._post_send(buf, dest, tag)
        self._wait(requests, "send", dest, tag)

    def _recv(self, buf, source, tag):
        self._receive(buf, source, tag, "recv")

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        requests, _keep = self._post_send(sendbuf, dest, tag)
        self._receive(recvbuf, source, tag, "sendrecv", pending=requests)

    def _isend(self, buf, dest, tag):
        return _SendRequest(self, self._post_send(buf, dest, tag), dest, tag)

    def _irecv(self, buf, source, tag):
        return _Incoming(self, buf, source, tag)

    def barrier(self):
        self._wait([self.mpi_comm.Ibarrier()], "barrier")

    def split(self, color, key=0):
        color, key = _check_color(color), int(key)
        return MPICommunicator(self.mpi_comm.Split(color, key), traffic=TrafficLedger(parent=self.traffic),
                               timeout=self.timeout, spin_s=self.spin_s)

    def world_rank(self, rank: int) -> int:
        if self._world_ranks is None:  # every rank's, once: two groups made (MPI_Comm_group), translated, freed
            mine, world = self.mpi_comm.Get_group(), _mpi().COMM_WORLD.Get_group()
            try:
                self._world_ranks = mine.Translate_ranks(list(range(self.world_size)), world)
            finally:
                mine.Free()
                world.Free()
        return self._world_ranks[rank]

    def abort(self, errorcode=1):
        _mpi().COMM_WORLD.Abort(errorcode)

    def _headers(self, buf, what: str) -> list:
        """Every rank's ``(shape, dtype)`` of ``buf`` (one 64-byte Iallgather), so a native collective of
        arrays that differ raises ValueError on every rank instead of reducing part of them."""
        mine = _header(buf)
        every = np.empty((self.world_size, mine.size), dtype=mine.dtype)
        self._wait([self.mpi_comm.Iallgather(mine, every)], what)
        return [_describe(h) for h in every]

    def _same_arrays(self, buf, what: str) -> None:
        shapes = self._headers(buf, what)
        if len(set(shapes)) != 1:
            raise ValueError(f"{what}: ranks passed different arrays (shape, dtype by rank): {shapes}")

    def _native_allreduce(self, x, out):
        self._same_arrays(x, "native_allreduce")
        MPI = _mpi()
        hx = _staged(x)
        hout = hx if out is x else _landing(out)
        self._wait([self.mpi_comm.Iallreduce(MPI.IN_PLACE if out is x else hx, hout, op=MPI.SUM)], "native_allreduce")
        _unstage(out, hout)

    def _native_reduce_scatter(self, flat):
        self._same_arrays(flat, "native_reduce_scatter")
        counts = [shard_range(flat.size, self.world_size, r)[1] for r in range(self.world_size)]
        out = np.empty(counts[self.rank], dtype=flat.dtype)
        self._wait([self.mpi_comm.Ireduce_scatter(_staged(flat), out, counts, op=_mpi().SUM)], "native_reduce_scatter")
        return backend.to_device(out)

    def _native_allgather(self, shard, n):
        ranges = [shard_range(n, self.world_size, r) for r in range(self.world_size)]
        out = np.empty(n, dtype=shard.dtype)
        counts, displs = [s for _, s in ranges], [o for o, _ in ranges]
        ns = np.empty(self.world_size, dtype=np.int64)  # every rank's n, then every rank's shard
        self._wait([self.mpi_comm.Iallgather(np.array([n], dtype=np.int64), ns)], "native_allgather")
        sizes = self._headers(shard.reshape(-1), "native_allgather")
        expect = [f"({shard_range(int(ns[0]), self.world_size, r)[1]},) {np.dtype(shard.dtype)}"
                  for r in range(self.world_size)]
        if len(set(ns.tolist())) != 1 or len({x.split(" ")[-1] for x in sizes}) != 1 or sizes != expect:
            raise ValueError(f"native_allgather: shards {sizes} do not make one array of n={n} elements "
                             f"(n by rank {ns.tolist()}; expected {expect})")
        self._wait([self.mpi_comm.Iallgatherv(_staged(shard), [out, (counts, displs)])], "native_allgather")
        return backend.to_device(out)

    def _native_bcast(self, x, root):
        self._same_arrays(x, "native_bcast")
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

