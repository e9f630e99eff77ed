"""Which parameters got a gradient on *some* data-parallel rank this step: every rank agrees.

With data-dependent control flow (a block skipped on one rank) a parameter can have a gradient
on one rank and none on another. The optimizer's rule (PyTorch AdamW's ``grad is None``: no
decay, no moments) must then be decided for the group, not per rank, or the replicas (stage 0)
or the owned shards (ZeRO) drift apart: a parameter some rank touched is updated everywhere
with the average, a rank that produced no gradient counting as zeros; one no rank touched is
skipped everywhere. Mirrors PyTorch DDP's ``find_unused_parameters=True`` (whose reducer
all-reduces a ``local_used_map`` each iteration); here the map is a bitmask, all-gathered and OR-ed.
"""
from __future__ import annotations

import numpy as np

from minizero.comm.collectives import all_gather

LABEL = "used_parameters"  #: traffic label of the agreement's all-gather


def used_anywhere(comm, used_here) -> list:
    """Collective over ``comm``: for each parameter, did any rank give it a gradient this step?

    Args:
        comm: the data-parallel Communicator (N ranks; every rank calls, with the same
            parameters in the same order).
        used_here: P bools, True where this rank has a gradient for that parameter.
    Returns:
        list of P bools, the same on every rank: the OR of ``used_here`` over the ranks.
    One all-gather of a host bitmask of ceil(P/8) bytes (uint8, ``np.packbits``) under the traffic
    label ``used_parameters``: (N-1) * ceil(P/8) bytes sent per rank, nothing when N = 1. Host
    memory only (no device transfer); the gradients are not touched.
    """
    used = np.asarray([bool(u) for u in used_here], dtype=bool)
    if comm.world_size == 1 or used.size == 0:
        return used.tolist()
    mask = np.packbits(used)
    with comm.traffic.op(LABEL):
        every = all_gather(comm, mask).reshape(comm.world_size, mask.size)
    return np.unpackbits(np.bitwise_or.reduce(every, axis=0))[:used.size].astype(bool).tolist()
