"""ZeRO with experts (``ExpertZero``, parallel/expert_parallel.py; ``"minizero"`` accounting, ep > 1): two ZeRO
optimizers of one stage, the dense parameters over the N data ranks and each MoE block's E/ep experts (whole under
tp) over the N/ep expert-data ranks, each with its own gradient buckets and reduce-scatters.

Backward opens a block's dense unit, then its MoE unit (the MLP runs last in the block), reduces the MoE unit, then
the dense one. Blocking, an optimizer's bucket lives from open to reduce and its reduce-scatter's scratch only during
the call. Overlapped (``Strategy.overlap``, N > 1), :data:`~minizero.zero.overlap.REDUCE_BUCKETS` - 1 reduced
buckets stay in flight per optimizer, each with a receive chunk of ceil(padded/N): a dense chunk and an expert
chunk are alive together. The peaks are those of both optimizers, event by event (tests/test_plan_moe.py).
"""
from __future__ import annotations

import math

from minizero.comm.collectives import reduce_scatter_scratch
from minizero.memory.estimator.model import ModelShape
from minizero.memory.estimator.states import stage_layers
from minizero.memory.estimator.strategy import Strategy
from minizero.zero.overlap import REDUCE_BUCKETS


def uses_expert_zero(m: ModelShape, st: Strategy) -> bool:
    """Whether the trainer runs ``ExpertZero`` (ZeRO with ``--ep`` > 1) for this model and strategy."""
    return bool(m.experts) and st.ep > 1 and st.zero >= 1


def backward_events(m: ModelShape, st: Strategy, stage: int) -> list[tuple[str, str, int]]:
    """``("open" | "reduce", "dense" | "experts", padded elements)`` of every unit, in backward's order; the tied
    embedding opens first (at the head) and is reduced last."""
    ranks = {"dense": st.data_ranks, "experts": st.data_ranks // st.ep}
    t, h = st.tp, m.hidden
    vocab = math.ceil(m.vocab_size / t) * h
    tied = vocab if m.tied_embeddings and st.pp == 1 else 0
    events = []

    def unit(part, n, inner=()):
        padded = math.ceil(n / ranks[part]) * ranks[part]
        events.append(("open", part, padded))
        events.extend(inner)
        events.append(("reduce", part, padded))
    if tied:
        events.append(("open", "dense", tied))
    if stage == st.pp - 1:
        for n in ([vocab] if st.pp > 1 or not m.tied_embeddings else []) + [2 * h if m.norm == "layernorm" else h]:
            unit("dense", n)
    for i in reversed(stage_layers(m, st, stage)):
        experts = m.experts // st.ep * m.expert_parameters() if m.is_moe_layer(i) else 0
        before = len(events)
        if experts:
            unit("experts", experts)
        inner = events[before:]
        del events[before:]
        unit("dense", m.layer_parameters(t, i, st.ep, 1) - experts, inner)
    if stage == 0:
        bottom = (m.seq_len * h if m.learned_pos else 0) + (vocab if st.pp > 1 or not m.tied_embeddings else 0)
        if bottom:
            unit("dense", bottom)
    if tied:
        events.append(("reduce", "dense", tied))
    return events


def expert_zero_peaks(m: ModelShape, st: Strategy, stage: int) -> tuple[int, int]:
    """(gradient-bucket elements, receive-scratch elements) alive at once at their peaks on a rank of ``stage``:
    overlapped, the in-flight receive chunks of both optimizers; blocking, the largest reduce-scatter's scratch."""
    ranks = {"dense": st.data_ranks, "experts": st.data_ranks // st.ep}
    overlapped = {p: st.overlap and st.zero >= 2 and n > 1 for p, n in ranks.items()}
    open_, flight = {p: [] for p in ranks}, {p: [] for p in ranks}
    buckets = scratch = 0
    for kind, part, padded in backward_events(m, st, stage):
        if kind == "open":
            open_[part].append(padded)
        else:
            open_[part].remove(padded)
            if overlapped[part]:
                while len(flight[part]) >= REDUCE_BUCKETS - 1:
                    flight[part].pop(0)
                flight[part].append(padded)
            else:
                scratch = max(scratch, reduce_scatter_scratch(padded, ranks[part], 0))
        if st.zero >= 2:
            buckets = max(buckets, sum(map(sum, open_.values())) + sum(map(sum, flight.values())))
        scratch = max(scratch, sum(u // ranks[p] for p in ranks for u in flight[p]))
    return buckets, scratch
