"""Messages between ranks: the Communicator interface and collectives written on it.

    communicator.py   the names below, gathered from: traffic.py (TrafficLedger, bytes
                      sent), base.py (Communicator: send/recv/sendrecv/barrier/split,
                      CommTimeoutError), mpi.py (MPICommunicator), threads.py
                      (ThreadCommunicator + run_in_threads)
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
