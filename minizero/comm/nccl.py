"""NcclCommunicator: one process per GPU, messages over NCCL (``cupy.cuda.nccl``), set up through MPI.

Rank 0's unique id is broadcast over the bootstrap, then ``ncclCommInitRank``; ``sendrecv`` is one NCCL
group; ``tag`` is ignored and receive sizes are not checked. Calls are queued on this communicator's
stream, ordered with the current stream by events; host arrays travel over the bootstrap; no
``isend``/``irecv``. Mirrors: the NCCL user guide (group calls, point-to-point), PyTorch's ``ProcessGroupNCCL``.
"""
from __future__ import annotations


import numpy as np

from minizero import backend
from minizero.comm.base import DEFAULT_TIMEOUT_S, Communicator, _check_color, poll_until, timeout_message
from minizero.comm.collectives import shard_range
from minizero.comm.traffic import TrafficLedger

UNIQUE_ID_BYTES = 128  #: NCCL_UNIQUE_ID_BYTES
CUDA_ERROR_NOT_READY = 600  #: cudaErrorNotReady: the one cudaEventQuery status besides 0 (done) that is not an error
#: numpy dtype name -> name of the NCCL datatype constant in ``cupy.cuda.nccl``
DATATYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
             "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
             "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}


def import_nccl():
    """``(cupy.cuda.nccl, cupy.cuda)``. Raises ImportError (with the install command): no CuPy or NCCL binding."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415  (optional dependency)
        import cupy.cuda as cuda  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"NCCL needs CuPy with NCCL ({e}); install it with pip install -e \".[gpu]\" "
                          "(CUDA 12) or \".[gpu-cuda13]\" (CUDA 13), or use MPI") from e
    if not getattr(nccl, "available", True):
        raise ImportError("CuPy is installed without NCCL (cupy.cuda.nccl.available is False); pip install "
                          "nvidia-nccl-cu12 (CUDA 12; nvidia-nccl-cu13 for CUDA 13), or use MPI")
    return nccl, cuda


def use_local_device(local_rank: int, cuda=None) -> int:
    """Make GPU ``local_rank % device_count`` current (as ``torchrun``'s ``LOCAL_RANK``); returns its number.

    Call before any CuPy allocation. Raises ImportError without CuPy; RuntimeError when no GPU is visible.
    """
    cuda = import_nccl()[1] if cuda is None else cuda
    count = cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("no CUDA device is visible (CUDA_VISIBLE_DEVICES?); NCCL needs one GPU per rank")
    device = local_rank % count
    cuda.Device(device).use()
    return device


def pointer(buf) -> int:
    """The address of ``buf``'s first byte (``buf.data.ptr``). Raises TypeError: a host array."""
    data = buf.data
    if hasattr(data, "ptr"):
        return int(data.ptr)
    raise TypeError(f"NCCL moves device memory; got a host array ({type(buf).__module__}."
                    f"{type(buf).__name__} {buf.shape} {buf.dtype}): make it with backend.xp")


class NcclCommunicator(Communicator):
    """A ``Communicator`` over NCCL, one rank per GPU, set up through ``bootstrap`` (collective).

    Args:
        bootstrap: a Communicator over the same ranks (carries the unique id and ``split``).
        timeout: seconds a blocking wait may last before CommTimeoutError (> 0).  blocking: wait on the host
            for every operation, or only order it on the streams.  nccl, cuda: the CuPy modules or stand-ins.
    Raises ImportError: no CuPy/NCCL; TypeError (any operation): a dtype not in :data:`DATATYPES`.
    """

    def __init__(self, bootstrap: Communicator, traffic: TrafficLedger | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, blocking: bool = True, nccl=None, cuda=None):
        if nccl is None or cuda is None:
            nccl, cuda = import_nccl()
        self.nccl, self.cuda, self.bootstrap = nccl, cuda, bootstrap
        self.rank, self.world_size = bootstrap.rank, bootstrap.world_size
        self.traffic = TrafficLedger() if traffic is None else traffic
        self.timeout, self.blocking = timeout, blocking
        # [kind, 128 values]: kind 1 = bytes (CuPy 14+), 0 = a tuple of signed chars (CuPy 13); int64 carries either
        uid = np.zeros(1 + UNIQUE_ID_BYTES, dtype=np.int64)
        if self.rank == 0:
            got = nccl.get_unique_id()
            uid[0] = isinstance(got, bytes)
            uid[1:] = np.frombuffer(got, dtype=np.uint8) if uid[0] else got
        bootstrap.native_bcast(uid, root=0)
        comm_id = uid[1:].astype(np.uint8).tobytes() if uid[0] else tuple(int(v) for v in uid[1:])
        self.comm = nccl.NcclCommunicator(self.world_size, comm_id, self.rank)
        self.stream = cuda.Stream(non_blocking=True)

    @property
    def mpi_comm(self):
        """The bootstrap's ``mpi4py`` communicator (None over threads)."""
        return getattr(self.bootstrap, "mpi_comm", None)

    # -- stream ordering and waiting --------------------------------------------------------
    def _begin(self) -> None:
        """The NCCL stream waits for what is already queued on the current stream (the buffers' writers)."""
        ready = self.cuda.Event()
        ready.record(self.cuda.get_current_stream())
        self.stream.wait_event(ready)

    def _end(self, op: str, peer=None) -> None:
        """The current stream waits for the NCCL call; with ``blocking`` the host waits too (timeout)."""
        done = self.cuda.Event()
        done.record(self.stream)
        self.cuda.get_current_stream().wait_event(done)
        if not self.blocking:
            return
        check = getattr(self.comm, "check_async_error", None)  # raises NCCL's asynchronous error, if any
        query = getattr(getattr(self.cuda, "runtime", None), "eventQuery", None)  # the raw cudaEventQuery status

        def finished():
            if check is not None:
                check()
            if query is None:
                return done.done
            status = query(done.ptr)  # Event.done is only ``status == 0``: a sticky CUDA error would look like waiting
            if status in (0, CUDA_ERROR_NOT_READY):
                return status == 0
            self.cuda.runtime.eventSynchronize(done.ptr)  # raises CuPy's CUDARuntimeError naming the error
            raise RuntimeError(f"rank {self.rank}: CUDA error {status} while waiting for NCCL {op}")

        poll_until(finished, self.timeout,
                   lambda: timeout_message(self.rank, self.world_size, f"NCCL {op}", self.timeout, peer))

    def _ptr(self, buf) -> int:
        return pointer(buf)

    def _datatype(self, dtype) -> int:
        name = np.dtype(dtype).name
        if name not in DATATYPES:
            raise TypeError(f"NCCL has no datatype for {name}; allowed: {sorted(DATATYPES)}")
        return getattr(self.nccl, DATATYPES[name])

    def _host(self, *bufs) -> bool:
        """True when the buffers are host arrays (they go over the bootstrap); TypeError for a mix."""
        host = [not hasattr(b.data, "ptr") for b in bufs]
        if any(host) and not all(host):
            raise TypeError(f"rank {self.rank}: a host and a device array in one NCCL call "
                            f"({', '.join(type(b).__name__ for b in bufs)}); make both with backend.xp")
        return host[0]

    # -- point to point: bytes, as MPI.BYTE ---------------------------------------------------
    def _send(self, buf, dest, tag):
        if self._host(buf):
            return self.bootstrap._send(buf, dest, tag)
        self._begin()
        self.comm.send(self._ptr(buf), buf.nbytes, self.nccl.NCCL_UINT8, dest, self.stream.ptr)
        self._end("send", dest)

    def _recv(self, buf, source, tag):
        if self._host(buf):
            return self.bootstrap._recv(buf, source, tag)
        self._begin()
        self.comm.recv(self._ptr(buf), buf.nbytes, self.nccl.NCCL_UINT8, source, self.stream.ptr)
        self._end("recv", source)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        """One NCCL group: the send and the receive progress together, so a ring cannot deadlock."""
        if self._host(sendbuf, recvbuf):
            return self.bootstrap._sendrecv(sendbuf, dest, recvbuf, source, tag)
        self._begin()
        self.nccl.groupStart()
        try:
            self.comm.send(self._ptr(sendbuf), sendbuf.nbytes, self.nccl.NCCL_UINT8, dest, self.stream.ptr)
            self.comm.recv(self._ptr(recvbuf), recvbuf.nbytes, self.nccl.NCCL_UINT8, source, self.stream.ptr)
        finally:
            self.nccl.groupEnd()
        self._end("sendrecv", source)

    # -- group management --------------------------------------------------------------------
    def barrier(self):
        """Every rank's queued device work is finished, then the bootstrap's barrier (NCCL has none)."""
        self.cuda.get_current_stream().synchronize()
        self.stream.synchronize()
        self.bootstrap.barrier()

    def split(self, color, key=0):
        """MPI_Comm_split of the bootstrap, then one NCCL communicator per color (its own unique id)."""
        color, key = _check_color(color), int(key)
        return NcclCommunicator(self.bootstrap.split(color, key), traffic=TrafficLedger(parent=self.traffic),
                                timeout=self.timeout, blocking=self.blocking, nccl=self.nccl, cuda=self.cuda)

    def world_rank(self, rank):  # the bootstrap's (an MPI or thread group of the same ranks)
        return self.bootstrap.world_rank(rank)

    def abort(self, errorcode=1):
        """``ncclCommAbort`` (frees a rank stuck in a kernel), then the bootstrap's abort (the whole job)."""
        try:
            self.comm.abort()
        finally:
            self.bootstrap.abort(errorcode)

    # -- native collectives ------------------------------------------------------------------
    def _native_allreduce(self, x, out):
        if self._host(x, out):
            return self.bootstrap._native_allreduce(x, out)
        self._begin()
        self.comm.allReduce(self._ptr(x), self._ptr(out), x.size, self._datatype(x.dtype), self.nccl.NCCL_SUM,
                            self.stream.ptr)
        self._end("native_allreduce")

    def _padded_chunk(self, n: int) -> int:
        return -(-n // self.world_size) if n else 0

    def _native_reduce_scatter(self, flat):
        if self._host(flat):
            return self.bootstrap._native_reduce_scatter(flat)
        n, N = flat.size, self.world_size
        c = self._padded_chunk(n)
        size = shard_range(n, N, self.rank)[1]
        send = flat
        if c * N != n:  # NCCL's chunks are equal: lay shard_range's chunks out in (N, c) rows
            send = backend.xp.zeros((N, c), dtype=flat.dtype)
            for r in range(N):
                off, s = shard_range(n, N, r)
                send[r, :s] = flat[off:off + s]
        out = backend.xp.empty(c, dtype=flat.dtype)
        self._begin()
        self.comm.reduceScatter(self._ptr(send), self._ptr(out), c, self._datatype(flat.dtype), self.nccl.NCCL_SUM,
                                self.stream.ptr)
        self._end("native_reduce_scatter")
        return out[:size] if size != c else out

    def _native_allgather(self, shard, n):
        if self._host(shard):
            return self.bootstrap._native_allgather(shard, n)
        N, c = self.world_size, self._padded_chunk(n)
        send = shard
        if shard.size != c:
            send = backend.xp.zeros(c, dtype=shard.dtype)
            send[:shard.size] = shard
        rows = backend.xp.empty((N, c), dtype=shard.dtype)
        self._begin()
        self.comm.allGather(self._ptr(send), self._ptr(rows), c, self._datatype(shard.dtype), self.stream.ptr)
        self._end("native_allgather")
        if c * N == n:
            return rows.reshape(-1)
        return backend.xp.concatenate([rows[r, :shard_range(n, N, r)[1]] for r in range(N)])

    def _native_bcast(self, x, root):
        if self._host(x):
            return self.bootstrap._native_bcast(x, root)
        self._begin()
        self.comm.bcast(self._ptr(x), x.size, self._datatype(x.dtype), root, self.stream.ptr)
        self._end("native_bcast", root)
