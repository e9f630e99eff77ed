"""Which parameters got a gradient on *some* data-parallel rank this step: every rank agrees.

Mirrors PyTorch DDP's ``find_unused_parameters=True`` (a bitmask all-gathered and OR-ed).
"""
from __future__ import annotations

import numpy as np

from minizero.comm.collectives import all_gather

LABEL = "used_parameters"  #: traffic label of the agreement's all-gather


def used_anywhere(comm, used_here) -> list:
    """Collective over ``comm``: P bools, equal on every rank: the OR over ranks of ``used_here`` (P bools).

    One all-gather of a ceil(P/8)-byte host bitmask (``used_parameters``): (N-1) * ceil(P/8) bytes per rank.
    """
    used = np.asarray([bool(u) for u in used_here], dtype=bool)
    if comm.world_size == 1 or used.size == 0:
        return used.tolist()
    mask = np.packbits(used)
    with comm.traffic.op(LABEL):
        every = all_gather(comm, mask).reshape(comm.world_size, mask.size)
    return np.unpackbits(np.bitwise_or.reduce(every, axis=0))[:used.size].astype(bool).tolist()
