"""The collectives' temporary buffers (ledger category ``comm_scratch``): the largest one alive at a time.

Part of :mod:`minizero.memory.estimator`. minizero's ring collectives (``comm/collectives.py``)
allocate, for the length of one call on N ranks and n elements of ``itemsize`` bytes::

    all_reduce       a receive chunk (ring)                   ceil(n/N)          elements
                     or a whole copy (recursive doubling,     n                  elements
                     for n * itemsize <= 256 KiB)
    reduce_scatter   a working copy + a receive chunk         n + ceil(n/N)      elements
    all_gather, broadcast, one rank (N = 1)                   nothing

Collectives run one at a time, so the peak is the largest call of the step:

* data parallel (ZeRO 0): the all-reduce of the largest gradient bucket (``bucket_bytes``,
  1 MiB by default as ``--bucket-mb``; buckets are filled greedily in reverse parameter
  order, a new one when the next tensor would overflow, as ``parallel/data_parallel.py``);
* ZeRO 1-3: the reduce-scatter of the largest unit's padded flat gradient (a layer, the token
  or position table, ln_f; each padded to a multiple of N); ZeRO 2-3 overlapped
  (``Strategy.overlap``): the non-blocking ring's receive chunk, padded/N elements;
* tensor parallelism: the all-reduce of one (b, s, h) activation over t ranks;
* pipeline (pp > 1, tied embeddings): the first and last stages' all-reduce of the
  embedding gradient over those two ranks;
* the gradient norm's and the loss's float64 scalars (8 bytes) when the group has N > 1.

Exact (checked against the ledger) for the data-parallel and ZeRO layouts of
``python -m minizero.compare``; for tensor and pipeline parallelism the bucket of a stage is
bounded by ``min(bucket, stage gradients)`` (the greedy layout of a split stage is not replayed).
Library collectives (``--native-comm``) keep their buffers inside MPI, which the ledger cannot
see: 0 there. The paper accounting counts none (0).
"""
from __future__ import annotations

import math

from minizero.comm.recursive_doubling import all_reduce_algorithm
from minizero.memory.estimator.model import ModelShape, Strategy, _bytes
from minizero.memory.estimator.zero_overlap import overlapped_ring_scratch

#: DataParallel's default bucket (``--bucket-mb 1``) in bytes
DEFAULT_BUCKET_BYTES = 1 << 20


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
    _, g, e, _ = _bytes(st)
    dp, t = st.data_ranks, st.tp
    out = [8]  # a float64 scalar all-reduced (loss, gradient norm) over a group of more than one rank
    if dp > 1 and st.zero == 0:
        bucket = st.bucket_bytes or DEFAULT_BUCKET_BYTES
        if t == 1 and st.pp == 1:
            n = largest_bucket(m.tensor_sizes(), g, bucket)
        else:
            n = min(bucket // g, m.layer_parameters(t) * (m.n_layer // st.pp))
        out.append(all_reduce_scratch(n, g, dp))
    if dp > 1 and st.zero >= 1:
        units = [m.layer_parameters(t)]
        if stage == 0:
            units += [m.vocab_size * m.hidden // (t if st.tp > 1 else 1), m.seq_len * m.hidden]
        if stage == st.pp - 1:
            units.append(2 * m.hidden)
        padded = max(math.ceil(u / dp) * dp for u in units)
        if st.overlap and st.zero >= 2:  # the non-blocking ring's receive chunks instead (estimator/zero_overlap.py)
            out.append(overlapped_ring_scratch(m, st, stage) * g)
        else:
            out.append((padded + padded // dp) * g)
    if t > 1:
        out.append(all_reduce_scratch(st.micro_batch * m.seq_len * m.hidden, e, t))
    if st.pp > 1 and m.tied_embeddings and stage in (0, st.pp - 1):
        out.append(all_reduce_scratch(m.vocab_size * m.hidden // t, g, 2))
    return max(out)
