"""Messages between ranks: the Communicator interface and collectives written on it.

    communicator.py   Communicator (send/recv/sendrecv/barrier/split), MPICommunicator,
                      ThreadCommunicator + run_in_threads, TrafficLedger (bytes sent)
    collectives.py    ring reduce_scatter / all_gather / all_reduce, tree broadcast,
                      shard_range (which slice of a flat buffer a rank owns)
"""
from minizero.comm.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    bytes_sent,
    reduce_scatter,
    shard_range,
)
from minizero.comm.communicator import (
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
