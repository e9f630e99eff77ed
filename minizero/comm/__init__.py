"""Messages between ranks: the Communicator interface (``base.py``) and the collectives written on it."""
from minizero.comm.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    bytes_sent,
    reduce_scatter,
    shard_range,
)
from minizero.comm.communicator import (
    CommTimeoutError,
    Communicator,
    GroupFailedError,
    MPICommunicator,
    ThreadCommunicator,
    TrafficLedger,
    register_thread_start_hook,
    run_in_threads,
    world,
)

__all__ = [
    "CommTimeoutError",
    "Communicator",
    "GroupFailedError",
    "MPICommunicator",
    "ThreadCommunicator",
    "TrafficLedger",
    "all_gather",
    "all_reduce",
    "broadcast",
    "bytes_sent",
    "reduce_scatter",
    "register_thread_start_hook",
    "run_in_threads",
    "shard_range",
    "world",
]
