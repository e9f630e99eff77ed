"""The collectives' temporary buffers (ledger category ``comm_scratch``): the largest one alive at a time.

Per call on N ranks of n elements: all_reduce keeps ceil(n/N) elements (ring) or n (recursive doubling, up to 256 KiB);
reduce_scatter ceil(n/N) per receive buffer beside its result (``reduce_scatter_scratch``): none for N = 2, one for
N = 3 or on a rank whose own chunk is a largest one (every rank where N divides n), else two; all_gather, broadcast
and N = 1 nothing. The peak is the run's largest call: the largest DP bucket, ZeRO's largest padded unit (padded/N,
none at N = 2 unless overlapped), a (b, s, h) activation under tensor parallelism, the tied embedding's gradient
between first and last stage, the run's bookkeeping (:data:`METRICS_ROW`); with ``ep`` > 1 the dense and the
expert buckets apart (ZeRO: ``expert_zero.py``). Exact against the ledger for the DP and ZeRO layouts of
``python -m minizero.compare`` and for DP and ZeRO with ``ep`` (tests/test_estimator_moe.py); a bound for TP and PP;
0 for the paper accounting. Native (library) collectives, which the trainer can use for DP and ZeRO, allocate no
scratch of their own; the figure does not model them, so it bounds that ledger, whose peak is then the largest of the
other entries (plain DP: the metrics row's).
"""
from __future__ import annotations

import math

from minizero.comm.collectives import reduce_scatter_scratch
from minizero.comm.recursive_doubling import all_reduce_algorithm
from minizero.memory.estimator.model import ModelShape
from minizero.memory.estimator.strategy import Strategy, element_bytes
from minizero.memory.estimator.states import stage_parameters
from minizero.memory.estimator.zero_overlap import overlapped_ring_scratch, zero_units
from minizero.memory.estimator.expert_zero import moe_zero_peaks, uses_expert_zero

#: DataParallel's default bucket (``--bucket-mb 1``) in bytes
DEFAULT_BUCKET_BYTES = 1 << 20
#: float64 elements of the main job's largest bookkeeping all-reduce over the world: the traffic table's row at the
#: end of the run (``parallel/placement.py`` ``node_traffic``; larger than evaluation's loss sum and count)
METRICS_ROW = 20


def largest_bucket(sizes, itemsize: int, bucket_bytes: int) -> int:
    """Elements in the largest DataParallel bucket: ``sizes`` (tensor elements, model order) filled in reverse."""
    best = current = 0
    for n in reversed(sizes):
        if current and (current + n) * itemsize > bucket_bytes:
            best, current = max(best, current), 0
        current += n
    return max(best, current)


def all_reduce_scratch(n: int, itemsize: int, world_size: int) -> int:
    """Bytes of scratch one all-reduce of ``n`` elements over ``world_size`` ranks allocates (by its algorithm)."""
    if world_size == 1:
        return 0
    if all_reduce_algorithm(n * itemsize, world_size) == "ring":
        return math.ceil(n / world_size) * itemsize
    return n * itemsize


def comm_scratch_bytes(m: ModelShape, st: Strategy, stage: int, accounting: str) -> int:
    """Peak ``comm_scratch`` bytes on one rank of pipeline stage ``stage`` (see the module docstring)."""
    if accounting != "minizero" or st.world_size == 1:
        return 0
    _, g, e, _ = element_bytes(st)
    dp, t = st.data_ranks, st.tp
    out = [all_reduce_scratch(METRICS_ROW, 8, st.world_size),  # loss, gradient norm: smaller (8 bytes)
           all_reduce_scratch(len(m.moe_layers()) * (m.experts + 1), 8, st.world_size)]  # ExpertLoad's counts
    if dp > 1 and st.zero == 0:
        bucket = st.bucket_bytes or DEFAULT_BUCKET_BYTES
        if t == 1 and st.pp == 1 and st.ep > 1:  # ExpertDataParallel: dense buckets over N, the experts' over N/ep
            n = largest_bucket(m.tensor_sizes(part="dense"), g, bucket)
            out.append(all_reduce_scratch(largest_bucket(m.tensor_sizes(st.ep, "experts"), g, bucket), g, dp // st.ep))
        elif t == 1 and st.pp == 1:
            n = largest_bucket(m.tensor_sizes(), g, bucket)
        else:  # a bound: a bucket holds up to bucket bytes, or one larger tensor, and no more than the stage
            n = min(stage_parameters(m, st, stage, accounting=accounting), max(bucket // g, max(m.tensor_sizes())))
        out.append(all_reduce_scratch(n, g, dp))
    tp_scratch = all_reduce_scratch(st.micro_batch * m.seq_len * m.hidden, e, t) if t > 1 else 0
    if dp > 1 and st.zero >= 1 and uses_expert_zero(m, st):  # two optimizers (estimator/expert_zero.py)
        peaks = moe_zero_peaks(m, st, stage)
        chunks, replica = peaks["scratch"] * g, all_reduce_scratch(peaks["shard"], g, st.replicas)  # hybrid: a bound
        out.append(chunks + max(tp_scratch, replica) if st.overlap and st.zero >= 2 else max(chunks, replica))
    elif dp > 1 and st.zero >= 1:
        tied, chain = zero_units(m, st, stage)  # the stage's units padded, the last stage's head (or copy) too
        n = st.shard_ranks  # ZeRO's group; hybrid sharding all-reduces a shard over the replicas after (a bound then)
        padded = max(tied, *chain)
        replica = all_reduce_scratch(padded // n, g, st.replicas)
        if st.overlap and st.zero >= 2 and n > 1:  # the non-blocking ring's receive chunks instead
            # (estimator/zero_overlap.py), alive while backward's tensor-parallel all-reduces run
            out.append(overlapped_ring_scratch(m, st, stage) * g + max(tp_scratch, replica))
        else:
            out.append(max(reduce_scatter_scratch(padded, n, 0) * g, replica))
    out.append(tp_scratch)
    if st.pp > 1 and m.tied_embeddings and stage in (0, st.pp - 1):
        out.append(all_reduce_scratch(m.vocab_shard(t), g, 2))
    return max(out)
