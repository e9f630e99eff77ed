"""MPICommunicator: one process per rank, over mpi4py's buffer methods (arrays never pickled).

Mirrors: the MPI-3.1 standard, chapter 3 (point-to-point, non-blocking requests + MPI_Test).
"""
from __future__ import annotations

from minizero import backend
from minizero.comm.base import Communicator, _check_color
from minizero.comm.collectives import shard_range
from minizero.comm.traffic import TrafficLedger


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

