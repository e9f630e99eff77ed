"""ZeRO's buffers when communication overlaps computation (``Strategy.overlap``).

Blocking: one unit's gradient bucket and (ZeRO-3) one gathered unit alive, plus the tied embedding. Overlapped:
:data:`~minizero.zero.overlap.REDUCE_BUCKETS` = 2 buckets and :data:`~minizero.zero.overlap.GATHERED_UNITS` = 2
gathered units (the largest sum of 2 units adjacent in backward order, plus the tied embedding), and a ring
receive chunk of ceil(padded/N) elements. Exact against the ledger for p = 1, an untied head too
(tests/test_estimator.py).

Mirrors: DeepSpeed's ``overlap_comm``; FSDP's ``backward_prefetch``.
"""
from __future__ import annotations

import math

from minizero.memory.estimator.model import ModelShape
from minizero.memory.estimator.strategy import Strategy
from minizero.memory.estimator.states import stage_layers
from minizero.zero.overlap import GATHERED_UNITS, REDUCE_BUCKETS


def _padded(n: int, dp: int) -> int:
    return math.ceil(n / dp) * dp


def _tables(m: ModelShape, st: Strategy) -> list[int]:
    """Stage 0's embedding units but a tied table at p = 1, in backward order: ``wpe``, then ``wte`` (unit 0)."""
    own_table = st.pp > 1 or not m.tied_embeddings
    return [u for u in (m.seq_len * m.hidden if m.learned_pos else 0, m.vocab_shard(st.tp) if own_table else 0) if u]


def zero_units(m: ModelShape, st: Strategy, stage: int) -> tuple[int, list[int]]:
    """``(tied, chain)``: the tied embedding's padded elements (0 if none on this stage) and the other units'
    padded elements in backward order, one per unit of ``zero/shards.py`` ``find_units``."""
    dp, t = st.shard_ranks, st.tp  # ZeRO shards over dp x cp (or dp_shard ranks: hybrid sharding)
    vocab = m.vocab_shard(t)  # the embedding and head split by t (parallel/vocab_parallel.py)
    chain = []
    if stage == st.pp - 1:  # an untied head (or the last stage's copy of a tied one, p > 1) is reduced first
        chain += ([vocab] if st.pp > 1 or not m.tied_embeddings else []) + [m.norm_size]
    chain += [m.layer_parameters(t, i, st.ep, 1) for i in stage_layers(m, st, stage)]  # the MoE layer whole
    chain += _tables(m, st) if stage == 0 else []
    tied = vocab if m.tied_embeddings and st.pp == 1 else 0
    return _padded(tied, dp), [_padded(u, dp) for u in chain]


def window_peak(chain: list[int], width: int) -> int:
    """The largest sum of ``width`` consecutive elements of ``chain`` (all of it when shorter)."""
    if len(chain) <= width:
        return sum(chain)
    return max(sum(chain[i:i + width]) for i in range(len(chain) - width + 1))


def overlapped_buckets(m: ModelShape, st: Strategy, stage: int) -> int:
    """Elements of gradient buckets alive at the peak: tied + the largest ``REDUCE_BUCKETS`` adjacent units, stage 0's
    tables as one (backward opens both buckets at the sum of their outputs)."""
    tied, chain = zero_units(m, st, stage)
    tables = len(_tables(m, st)) if stage == 0 else 0
    if tables > 1:
        chain = chain[:-tables] + [sum(chain[-tables:])]
    return tied + window_peak(chain, REDUCE_BUCKETS)


def prefetched_units(m: ModelShape, st: Strategy, stage: int) -> int:
    """Elements gathered at the peak (ZeRO-3 with prefetch): tied + the largest ``GATHERED_UNITS`` adjacent units."""
    tied, chain = zero_units(m, st, stage)
    return tied + window_peak(chain, GATHERED_UNITS)


def overlapped_ring_scratch(m: ModelShape, st: Strategy, stage: int) -> int:
    """Elements of receive chunks alive at once: ceil(padded/N) of ``REDUCE_BUCKETS - 1`` units in flight
    (the tied embedding is reduced last, after the chain's last unit)."""
    tied, chain = zero_units(m, st, stage)
    order = chain + ([tied] if tied else [])
    return window_peak([u // st.shard_ranks for u in order], REDUCE_BUCKETS - 1)
