"""Point-to-point messaging between ranks, and a ledger of the bytes each rank sends.

This module gathers the names; the code is split by concept:

    traffic.py   TrafficLedger (bytes sent, by label)
    base.py      Communicator (the interface, argument checks, byte accounting)
    mpi.py       MPICommunicator, world()
    threads.py   ThreadCommunicator, run_in_threads, GroupFailedError


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

from minizero.comm.base import MAX_TAG, CommTimeoutError, Communicator  # noqa: F401
from minizero.comm.mpi import MPICommunicator, world  # noqa: F401
from minizero.comm.threads import (  # noqa: F401
    _THREAD_START_HOOKS,
    GroupFailedError,
    ThreadCommunicator,
    register_thread_start_hook,
    run_in_threads,
)
from minizero.comm.traffic import TrafficLedger  # noqa: F401
