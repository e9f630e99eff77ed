"""Hybrid sharding: ZeRO shards over groups of N consecutive data ranks and replicates across the D/N groups.

D data ranks, shard degree N (``--dp-shard``), R = D/N replicas; data rank d is in shard group d // N at index
d % N, and in replica group d % N (the R ranks that hold the same shard)::

    D = 4, N = 2     shard groups  [0 1] [2 3]     ZeRO's comm: all-gathers, reduce-scatters, the norm
                     replica groups [0 2] [1 3]    one all-reduce of each rank's reduced gradient shard

Per reduce (stages 2-3: each unit's bucket in every backward; stage 1: once a step) the gradient is
reduce-scattered inside the shard group, (N-1)/N x 4Ψ bytes sent per rank, then each rank's (S,) shard,
S = Ψ/N, is summed over its replica group, 2(R-1)/R x 4Ψ/N bytes; the mean divides by D once. Parameters
are gathered inside the shard group only; every rank keeps 1/N of the optimizer state (and of gradients,
parameters by stage).
N = D is plain ZeRO (no replica group, bitwise the same); N = 1 keeps whole states and all-reduces gradients.

Sources: PyTorch FSDP ``ShardingStrategy.HYBRID_SHARD`` (shard inside a node, replicate across nodes);
Zhang et al. 2022, "MiCS: Near-linear Scaling for Training Gigantic Model on Public Cloud" (arXiv:2205.00119),
section 3 (partition groups and replication groups, the two-hop gradient synchronisation);
torchtitan's ``data_parallel_shard_degree`` x ``data_parallel_replicate_degree``.
"""
from __future__ import annotations

from minizero.comm.collectives import all_reduce
from minizero.optim.used_parameters import used_anywhere
from minizero.zero.shards import model_state_formula


def hybrid_groups(comm, shard: int):
    """Collective over the data group ``comm`` (D ranks): ``(shard group, replica group)``; the replica group is
    None when ``shard`` = D (plain ZeRO). Shard group: data ranks [g N, (g+1) N); replica group: the ranks at the
    same index inside their shard group. Raises ValueError: ``shard`` does not divide D."""
    d, r = comm.world_size, comm.rank
    if shard < 1 or d % shard:
        raise ValueError(f"shard degree {shard} must be >= 1 and divide the data group's {d} ranks")
    if shard == d:
        return comm, None
    groups = comm.split(color=r // shard, key=r), comm.split(color=r % shard, key=r)
    recorder = comm.traffic.active_recorder()  # the flight recorder's names (and --debug-collectives' check)
    if recorder is not None:
        for name, group, members in zip(("dp_shard", "dp_replicate"), groups,
                                        (range(r - r % shard, r - r % shard + shard), range(r % shard, d, shard))):
            recorder.name_group(group, name, [comm.world_rank(k) for k in members])
    return groups


def replica_count(replicas) -> int:
    """R: how many shard groups hold each shard (1 without a replica group)."""
    return 1 if replicas is None else replicas.world_size


def sum_over_replicas(replicas, shard, native: bool = False):
    """The second hop: ``shard`` (S,) summed over the replica group in place (ring or recursive doubling,
    :func:`~minizero.comm.collectives.all_reduce`: ring 2(R-1)/R x ``shard.nbytes`` sent per rank); returns it.
    Nothing is sent without a replica group."""
    if replicas is None or replicas.world_size == 1:
        return shard
    return all_reduce(replicas, shard, native=native, out=shard)


def counts_once(replicas) -> bool:
    """Whether this rank's owned shard counts in a sum over *all* data ranks (the gradient norm over the world):
    only the first shard group's, since the other R-1 hold the same numbers."""
    return replicas is None or replicas.rank == 0


def used_over_replicas(replicas, used: list) -> list:
    """The OR of ``used`` (P bools) over the replica group: after the shard group's OR, the whole data group's."""
    return used if replicas is None else used_anywhere(replicas, used)


def hybrid_formula(stage: int, num_params: int, dp: int, shard: int, param_bytes: int = 4, grad_bytes: int = 4,
                   state_bytes: int = 8) -> dict:
    """Bytes per rank of model states ``{"parameters", "gradients", "optimizer_state", "total"}``, before padding,
    and bytes sent per rank and step (one micro-batch) ``{"inside", "across"}`` (inside the shard group, across
    replicas) under ZeRO ``stage`` with D = ``dp`` ranks in shard groups of N = ``shard``. Ring collectives."""
    out = model_state_formula(stage, num_params, shard, param_bytes, grad_bytes, state_bytes)
    n, r = shard, dp // shard
    gathers = 2 if stage == 3 else 1  # stage 3: in forward and in backward; stages 1-2: after the step
    out["inside"] = (n - 1) / n * num_params * (grad_bytes + gathers * param_bytes)
    out["across"] = 2 * (r - 1) / r * num_params * grad_bytes / n
    return out
