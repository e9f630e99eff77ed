"""The Communicator names, re-exported from ``traffic.py``, ``base.py``, ``mpi.py`` and ``threads.py``."""
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
