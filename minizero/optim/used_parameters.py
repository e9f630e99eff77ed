"""Which parameters got a gradient on *some* data-parallel rank this step: every rank agrees.

With data-dependent control flow (a block skipped on one rank) a parameter can have a gradient
on one rank and none on another. The optimizer's rule (PyTorch AdamW's ``grad is None``: no
decay, no moments) must then be decided for the group, not per rank, or the replicas (stage 0)
or the owned shards (ZeRO) drift apart: a parameter some rank touched is updated everywhere
with the average, a rank that produced no gradient counting as zeros; one no rank touched is
skipped everywhere. Mirrors PyTorch DDP's ``find_unused_parameters=True``, whose reducer
all-reduces a ``local_used_map`` (int32, one flag per parameter) every iteration.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_reduce

LABEL = "used_parameters"  #: traffic label of the agreement's all-reduce


def used_anywhere(comm, used_here) -> list:
    """Collective over ``comm``: for each parameter, did any rank give it a gradient this step?

    Args:
        comm: the data-parallel Communicator (N ranks; every rank calls, with the same
            parameters in the same order).
        used_here: one bool per parameter, True where this rank has a gradient for it.
    Returns:
        list of bool, the same on every rank: the OR of ``used_here`` over the ranks.
    One all-reduce (sum) of ``len(used_here)`` int32 flags (4 bytes each), counted under the traffic
    label ``used_parameters``: ``bytes_sent("all_reduce", P, 4, N, rank)`` per rank (log2 N messages by
    recursive doubling at these sizes); no message when N = 1. The gradients themselves are not
    touched, so the numbers of a step where every rank used every parameter are unchanged.
    """
    flags = np.asarray([bool(u) for u in used_here], dtype=np.int32)
    if comm.world_size == 1 or flags.size == 0:
        return [bool(f) for f in flags]
    with comm.traffic.op(LABEL):
        total = backend.to_host(all_reduce(comm, backend.to_device(flags)))
    return [bool(t) for t in total]
