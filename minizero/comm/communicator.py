"""Point-to-point messaging between ranks, and a ledger of the bytes each rank sends: the names, re-exported.

``traffic.py`` TrafficLedger; ``base.py`` Communicator (interface, checks, byte accounting); ``mpi.py``
MPICommunicator, world(); ``threads.py`` ThreadCommunicator, run_in_threads, GroupFailedError.
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
