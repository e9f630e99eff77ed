"""Hybrid sharding: ZeRO shards over groups of N consecutive data ranks and replicates across the D/N groups.

D data ranks, shard degree N (``--dp-shard``), R = D/N replicas; data rank d is in shard group d // N at index
d % N, and in replica group d % N (the R ranks that hold the same shard)::

    D = 4, N = 2     shard groups  [0 1] [2 3]     ZeRO's comm: all-gathers, reduce-scatters, the norm
                     replica groups [0 2] [1 3]    one all-reduce of each rank's reduced gradient shard

Per reduce the gradient is reduce-scattered inside the shard group ((N-1)/N x 4Ψ bytes per rank), then each
rank's Ψ/N shard all-reduced over its replica group (2(R-1)/R x 4Ψ/N); the mean divides by D once. Parameters
are gathered inside the shard group; states are 1/N per rank. N = D is plain ZeRO, bitwise (lesson 02, 9).
Sources: PyTorch FSDP ``HYBRID_SHARD``; MiCS, Zhang et al. 2022 (arXiv:2205.00119); torchtitan's
``data_parallel_shard_degree`` x ``data_parallel_replicate_degree``.
"""
from __future__ import annotations

from minizero.comm.collectives import all_reduce
from minizero.comm.flight import name_split
from minizero.optim.used_parameters import used_anywhere
from minizero.zero.shards import model_state_formula


def hybrid_groups(comm, shard: int, names=("dp_shard", "dp_replicate")):
    """Collective over the data group ``comm``: (shard group, replica group or None when ``shard`` = D); ``names``:
    the flight recorder's for the two. Raises ValueError: ``shard`` does not divide D."""
    d, r = comm.world_size, comm.rank
    if shard < 1 or d % shard:
        raise ValueError(f"shard degree {shard} must be >= 1 and divide the data group's {d} ranks")
    if shard == d:
        return comm, None
    groups = comm.split(color=r // shard, key=r), comm.split(color=r % shard, key=r)
    members = range(r - r % shard, r - r % shard + shard), replica_members(d, shard, r)  # data ranks of each
    for name, group, ranks in zip(names, groups, members):
        name_split(comm, group, name, ranks)
    return groups


def replica_members(d: int, shard: int, rank: int) -> range:
    """Data rank ``rank``'s replica group (D = ``d``, N = ``shard``): the same index in every shard group."""
    return range(rank % shard, d, shard)


def replica_count(replicas) -> int:  # R: how many shard groups hold each shard
    return 1 if replicas is None else replicas.world_size


def sum_over_replicas(replicas, shard, native: bool = False):
    """The second hop: ``shard`` (S,) summed in place over the replica group (all_reduce); returns it."""
    if replicas is None or replicas.world_size == 1:
        return shard
    return all_reduce(replicas, shard, native=native, out=shard)


def counts_once(replicas) -> bool:
    """Whether this rank's shard counts in a sum over all data ranks: the first shard group's only (R-1 copies)."""
    return replicas is None or replicas.rank == 0


def used_over_replicas(replicas, used: list) -> list:
    # the OR of used (P bools) over the replica group: after the shard group's OR, the whole data group's
    return used if replicas is None else used_anywhere(replicas, used)


def hybrid_formula(stage: int, num_params: int, dp: int, shard: int, param_bytes: int = 4, grad_bytes: int = 4,
                   state_bytes: int = 8) -> dict:
    """Model-state bytes per rank (:func:`model_state_formula` over N) and ring bytes sent per rank and step
    ``{"inside", "across"}`` the shard group, under ZeRO ``stage``, D = ``dp`` ranks, N = ``shard``."""
    out = model_state_formula(stage, num_params, shard, param_bytes, grad_bytes, state_bytes)
    n, r = shard, dp // shard
    gathers = 2 if stage == 3 else 1  # stage 3: in forward and in backward; stages 1-2: after the step
    out["inside"] = (n - 1) / n * num_params * (grad_bytes + gathers * param_bytes)
    out["across"] = 2 * (r - 1) / r * num_params * grad_bytes / n
    return out
