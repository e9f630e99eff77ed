"""The Communicator names, re-exported from ``traffic.py``, ``base.py``, ``mpi.py`` and ``threads.py``."""
from __future__ import annotations

from minizero.comm.base import MAX_TAG, CommTimeoutError, Communicator
from minizero.comm.mpi import MPICommunicator, world
from minizero.comm.threads import GroupFailedError, ThreadCommunicator, register_thread_start_hook, run_in_threads
from minizero.comm.traffic import TrafficLedger

__all__ = [  # the Communicator names, re-exported
    "MAX_TAG", "CommTimeoutError", "Communicator", "MPICommunicator", "world", "GroupFailedError",
    "ThreadCommunicator", "register_thread_start_hook", "run_in_threads", "TrafficLedger",
]
