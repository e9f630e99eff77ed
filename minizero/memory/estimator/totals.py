"""The whole rank: model states + activations + buffers, per pipeline stage (units, symbols: ``__init__.py``)."""
from __future__ import annotations

import dataclasses

from minizero.memory.estimator.model import (LINEAR_SAVES, MIN_8BIT_SIZE, QUANT_BLOCK, CATEGORIES, DEVICE_CATEGORIES,
    ModelShape, PRECISIONS, as_shape, precision_for_dtype)
from minizero.memory.estimator.strategy import Strategy, element_bytes, expert_tp, seq_len_at
from minizero.memory.estimator.states import stage_expert_parameters, stage_layers, stage_parameters, stage_state_bytes
from minizero.memory.estimator.activations import activation_bytes
from minizero.memory.estimator.scratch import comm_scratch_bytes
from minizero.memory.estimator.expert_zero import moe_zero_peaks, uses_expert_zero
from minizero.memory.estimator.zero_overlap import overlapped_buckets, prefetched_units


# ---- the whole rank ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes by ledger category, for one pipeline stage.

    ``offloaded`` is host memory; ``nvme`` is bytes in files (offload tier "nvme"), in neither the device total nor the
    ledger's memory categories (minizero reports them as the optimizer store's ``disk_bytes``).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    comm_buffers: int
    gathered: int
    offloaded: int
    stage: int = 0
    nvme: int = 0
    comm_scratch: int = 0  #: the largest collective's temporary buffers (estimator/scratch.py)

    @property
    def total(self) -> int:
        """Device bytes: every category except ``offloaded``."""
        return sum(getattr(self, c) for c in DEVICE_CATEGORIES)

    def as_dict(self) -> dict:
        """{category: bytes} in :data:`CATEGORIES` order (the ledger's names)."""
        return {c: getattr(self, c) for c in CATEGORIES}


def _stage_estimate(m: ModelShape, st: Strategy, s: int, accounting: str, stage: int) -> MemoryEstimate:
    pb, gbytes, e, _ = element_bytes(st)
    psi = stage_parameters(m, st, stage, accounting=accounting)  # the vocabulary split by t in both (vocab_parallel.py)
    states = stage_state_bytes(m, st, stage, accounting=accounting)
    params, grads, optim = states["parameters"], states["gradients"], states["optimizer_state"]
    if accounting == "minizero" and st.optimizer == "adam8bit" and st.world_size == 1:
        # minizero.optim.adam8bit, tensor by tensor: 2n + 8 ceil(n/256) bytes, fp32 moments under 4096 elements
        master, moment = PRECISIONS[st.precision][3:]
        optim = sum(master * n + (2 * n + 8 * -(-n // QUANT_BLOCK) if n >= MIN_8BIT_SIZE else 2 * moment * n)
                    for n in m.tensor_sizes())
    host = 0
    if st.offload in ("optimizer", "params") and accounting == "minizero":
        host += optim  # OptimizerStateStore: masters, m and v off the device; gradients stay (memory/offload.py)
        optim = 0
    elif st.offload in ("optimizer", "params"):  # ZeRO-Offload: gradient and optimizer shards on the host
        host += grads + optim
        grads = optim = 0
    if st.offload == "params":  # ZeRO-Infinity: the parameter shard too
        host += params
        params = 0
    act, act_host = activation_bytes(m, st, s, accounting, stage)
    host += act_host
    full_grads = gbytes * psi
    # ZeRO gathers and reduces unit by unit: a layer (or the embedding)
    largest_unit = m.layer_parameters(st.tp, ep=st.ep, expert_tp=expert_tp(st, accounting))
    if stage == 0:
        largest_unit = max(largest_unit, m.embedding_parameters(st.tp))
    comm = gathered = 0
    if accounting == "minizero":
        # minizero's own buffers (parallel/data_parallel.py, zero/stage2.py, zero/stage3.py): stage 0 keeps flat
        # buckets for every gradient; stages 2-3 open one unit's full-size gradient bucket at a
        # time, and stage 3 gathers one unit at a time -- plus the tied token embedding, which is
        # used at both ends of the model and stays open (gathered) in between.
        tied = m.vocab_shard(st.tp) if m.tied_embeddings and st.pp == 1 else 0
        if st.data_ranks > 1 and st.zero == 0:  # ExpertDataParallel: no expert buckets over one expert-data rank
            experts = gbytes * stage_expert_parameters(m, st, stage, accounting) if st.ep > 1 else 0
            for part in (full_grads - experts, experts * (st.data_ranks // st.ep > 1)):
                comm += part if st.bucket_bytes is None else min(st.bucket_bytes, part)
        overlapped = st.overlap and st.shard_ranks > 1  # double-buffered buckets, prefetch (estimator/zero_overlap.py)
        block = m.layer_parameters(st.tp, ep=st.ep, expert_tp=1)  # the MoE layer replicated in the tensor group
        if st.zero >= 2 and uses_expert_zero(m, st):  # two optimizers' buckets (estimator/expert_zero.py)
            comm += gbytes * moe_zero_peaks(m, st, stage)["buckets"]
        elif st.zero >= 2:  # ZeroOptimizer runs (and opens its buckets) over one rank too
            comm += gbytes * (overlapped_buckets(m, st, stage) if overlapped else block + tied)
        if st.zero == 3 and m.experts:  # forward's expert gathers kept to backward (estimator/expert_zero.py)
            gathered = pb * moe_zero_peaks(m, st, stage)["gathered"]
        elif st.zero == 3:
            gathered = pb * (prefetched_units(m, st, stage) if overlapped else block + tied)
    else:
        if st.data_ranks > 1 or st.offload != "none":  # the reduce (or copy-to-host) bucket; ZeRO-R section 6.2
            comm += full_grads if st.bucket_bytes is None else min(st.bucket_bytes, full_grads)
        if st.zero == 3 and (st.data_ranks > 1 or st.offload == "params"):
            gathered = 2 * pb * largest_unit  # the unit running and the prefetched next one
    if st.pp > 1:
        split = st.tp if st.sequence_parallel else 1
        boundary = e * (s // st.cp) * st.micro_batch * m.hidden // split  # one (b, s/cp, h) activation
        if accounting == "minizero":  # parallel/pipeline.py: the dL/d(input) buffer it sends back (not stage 0);
            # two at once when backwards run back to back with no receive to flush the pending send
            # (the last stage under GPipe); interleaved: every stage, stage 0's later chunks sending back too
            # (its sends never block, so the last one is still pending at the next backward)
            back_to_back = stage == st.pp - 1 and st.schedule == "gpipe" and st.micro_batches > 1
            interleaved = st.schedule == "interleaved"
            comm += (2 if back_to_back or interleaved else 1) * boundary if stage > 0 or interleaved else 0
        else:  # receive buffers: the activation forward, the gradient backward
            comm += 2 * boundary
    scratch = comm_scratch_bytes(m, st, stage, accounting)
    if st.offload_tier == "nvme":  # every offloaded byte goes to files instead of host memory
        return MemoryEstimate(params, grads, optim, act, comm, gathered, 0, stage, nvme=host, comm_scratch=scratch)
    return MemoryEstimate(params, grads, optim, act, comm, gathered, host, stage, comm_scratch=scratch)


def stage_kinds(model, strategy: Strategy) -> list[int]:
    """The first pipeline stage of each kind (first, last, middle by its blocks' MoE pattern), ascending. Stages of
    a kind differ only in micro-batches in flight, fewer with each index (:func:`activation_bytes`): these bound all."""
    m = as_shape(model)
    return sorted({(i == 0, i == strategy.pp - 1, tuple(map(m.is_moe_layer, stage_layers(m, strategy, i)))): i
                   for i in reversed(range(strategy.pp))}.values())


def estimate_stages(model, strategy: Strategy, seq_len: int | None = None, accounting: str = "paper",
                    within: float | None = None) -> list:
    """:class:`MemoryEstimate` of the first, the last, then the middle :func:`stage_kinds` (a middle one can be the
    fullest: stage 1 keeps p - 1 micro-batches, MoE blocks differ); the middle ones only if the ends fit ``within``."""
    ends = [estimate_memory(model, strategy, seq_len, accounting, stage=i) for i in sorted({0, strategy.pp - 1})]
    if within is not None and max(e.total for e in ends) > within:
        return ends
    return ends + [estimate_memory(model, strategy, seq_len, accounting, stage=i)
                   for i in stage_kinds(model, strategy)[1:-1]]


def estimate_memory(model, strategy: Strategy, seq_len: int | None = None, accounting: str = "paper",
                    stage: int | None = None) -> MemoryEstimate:
    """Per-rank bytes of every category for ``model`` trained under ``strategy``.

    Args:
        model: a :class:`ModelShape` or a minizero ``GPTConfig``.
        strategy: the :class:`Strategy`; with a GPTConfig its precision must match the config's dtype.
        seq_len: tokens per sequence s (default: the model's context).
        accounting: "paper" or "minizero".
        stage: pipeline stage; None picks the one with the largest device total.
    Returns:
        :class:`MemoryEstimate` (bytes): model states (:func:`model_state_bytes`), activations
        (:func:`activation_bytes`), ``comm_buffers`` and ``gathered`` (two of each with ``strategy.overlap``:
        :mod:`~minizero.memory.estimator.zero_overlap`); offloaded bytes in ``offloaded`` or ``nvme``.
    Raises:
        ValueError: an invalid strategy or one that does not fit the shape (named).
    """
    m = as_shape(model)
    st = strategy.validate(m)
    if hasattr(model, "dtype") and not isinstance(model, ModelShape):
        want = precision_for_dtype(model.dtype)
        if st.precision != want and not (want == "fp32" and st.precision in LINEAR_SAVES):  # bf16, fp8: fp32 weights
            raise ValueError(f"strategy precision {st.precision!r} does not match the config's dtype "
                             f"{model.dtype!r} (use precision={want!r})")
    s = seq_len_at(m, st, seq_len, stage)  # seq_len=0 was the model's, silently
    if stage is not None:
        return _stage_estimate(m, st, s, accounting, stage)
    ests = [_stage_estimate(m, st, s, accounting, i) for i in stage_kinds(m, st)]
    return max(ests, key=lambda x: x.total)
