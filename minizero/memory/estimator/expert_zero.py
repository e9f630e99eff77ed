"""ZeRO with MoE blocks (``"minizero"`` accounting): the units backward opens and reduces, replayed event by event.

With ``ep`` > 1 (``ExpertZero``, parallel/expert_parallel.py) two ZeRO optimizers run: the dense parameters over the N
data ranks (hybrid sharding: the shard group), each MoE layer's E/ep experts (whole under tp) over the N/ep expert-data
ranks, each with its own buckets, reduce-scatters and gathers. Backward opens a block's dense unit, then its MoE unit
(the MLP runs last in the block), reduces the MoE unit, then the dense one. Blocking, a bucket lives from open to reduce
and a reduce-scatter's scratch only during the call. Overlapped (``Strategy.overlap``, N > 1): per optimizer the last
reduced buckets stay in flight (:data:`~minizero.zero.overlap.REDUCE_BUCKETS` - 1), each with a receive chunk of
padded/n, n its optimizer's group (N dense, N/ep experts), and opening a unit prefetches the optimizer's next one
(ZeRO-3; the expert products' saved slices of the gathered experts are handles, zero/stage3.py, so no forward gather
outlives its forward).
Exact against the ledgers (tests/test_estimator_moe.py; under tp the scratch, with the tensor group's, a bound).
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


def _ranks(st: Strategy) -> dict:  # each optimizer's shard group (hybrid sharding: N and N/ep)
    return {"dense": st.shard_ranks, "experts": st.expert_shard_ranks}


def backward_units(m: ModelShape, st: Strategy, stage: int) -> tuple[list, list]:
    """``(units, events)``: units ``(part, padded elements)``, part "dense" or "experts" (its
    optimizer; ep = 1: every unit "dense", an MoE block whole); events ``("open" | "reduce", unit index)`` in
    backward's order, the tied embedding opened first (at the head) and reduced last."""
    ranks, t, h = _ranks(st), st.tp, m.hidden
    vocab = m.vocab_shard(t)
    units, events = [], []

    def unit(part, n):
        units.append((part, math.ceil(n / ranks[part]) * ranks[part]))
        return len(units) - 1
    tied = unit("dense", vocab) if m.tied_embeddings and st.pp == 1 else None
    if tied is not None:
        events.append(("open", tied))
    if stage == st.pp - 1:
        for n in ([vocab] if st.pp > 1 or not m.tied_embeddings else []) + [m.norm_size]:
            u = unit("dense", n)
            events += [("open", u), ("reduce", u)]
    for i in reversed(stage_layers(m, st, stage)):
        moe = m.is_moe_layer(i)
        experts = m.experts // st.ep * m.expert_parameters() if moe and st.ep > 1 else 0
        block = unit("dense", m.layer_parameters(t, i, st.ep, 1) - experts)
        inner = [("open", unit("experts", experts)), ("reduce", len(units) - 1)] if experts else []
        events += [("open", block), *inner, ("reduce", block)]
    bottom = (m.seq_len * h if m.learned_pos else 0) + (vocab if st.pp > 1 or not m.tied_embeddings else 0)
    if stage == 0 and bottom:
        u = unit("dense", bottom)
        events += [("open", u), ("reduce", u)]
    if tied is not None:
        events.append(("reduce", tied))
    return units, events


def moe_zero_peaks(m: ModelShape, st: Strategy, stage: int) -> dict:
    """Elements alive at once at their peaks on a rank of ``stage``: {"buckets": gradient buckets (ZeRO 2-3),
    "scratch": receive chunks (overlapped: both optimizers' in flight; blocking: the largest call's),
    "gathered": ZeRO-3's gathered units, "shard": the largest unit's shard (hybrid sharding's replica hop)}."""
    ranks = _ranks(st)
    units, events = backward_units(m, st, stage)
    overlapped = {p: st.overlap and st.zero >= 2 and n > 1 for p, n in ranks.items()}
    order = {p: [u for kind, u in events if kind == "open" and units[u][0] == p] for p in ranks}
    open_, flight, gathered = set(), {p: [] for p in ranks}, set()
    peaks = dict.fromkeys(("buckets", "scratch", "gathered"), 0)
    peaks["shard"] = max((padded // ranks[part] for part, padded in units), default=0)
    for kind, u in events:
        part, padded = units[u]
        if kind == "open":
            open_.add(u)
            gathered.add(u)
            later = order[part][order[part].index(u) + 1:]
            if overlapped[part] and later:  # ZeRO-3's prefetch of the optimizer's next unit
                gathered.add(later[0])
        else:
            open_.discard(u)
            gathered.discard(u)
            if overlapped[part]:
                while len(flight[part]) >= REDUCE_BUCKETS - 1:
                    flight[part].pop(0)
                flight[part].append(u)
            else:
                peaks["scratch"] = max(peaks["scratch"], reduce_scatter_scratch(padded, ranks[part], 0))
        in_flight = [(v, p) for p in ranks for v in flight[p]]
        alive = {"buckets": sum(units[v][1] for v in open_) + sum(units[v][1] for v, _ in in_flight),
                 "scratch": sum(units[v][1] // ranks[p] for v, p in in_flight),
                 "gathered": sum(units[v][1] for v in gathered)}
        for k, v in alive.items():
            peaks[k] = max(peaks[k], v)
    if st.zero < 2:
        peaks["buckets"] = 0
    if st.zero < 3:
        peaks["gathered"] = 0
    return peaks
