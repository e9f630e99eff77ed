"""Model states per rank (ZeRO, Rajbhandari et al. 2020, section 3) and per pipeline stage (units: ``__init__.py``)."""
from __future__ import annotations

import math

from minizero.memory.estimator.model import as_shape
from minizero.memory.estimator.strategy import Strategy, element_bytes, expert_tp


# ---- model states: ZeRO -----------------------------------------------------------------------
def model_state_bytes(num_params: int, dp: int = 1, zero: int = 0, precision: str = "mixed",
                      optimizer: str = "adam") -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO-DP (ZeRO section 5, Figure 1).

    Psi = ``num_params``, N_d = ``dp``, K optimizer bytes per parameter: stage 0 (2 + 2 + K) Psi; 1 (2 + 2) Psi +
    K Psi/N_d; 2 2 Psi + (2 + K) Psi/N_d; 3 (2 + 2 + K) Psi/N_d; a shard is ceil(Psi/N_d) elements. fp32 4 + 4 + 8,
    fp64 8 + 8 + 16; 8-bit Adam K = master + 2 x (1 + 4/256).
    Returns {"parameters", "gradients", "optimizer_state"} in bytes.
    """
    s = Strategy(dp=dp, zero=zero, precision=precision, optimizer=optimizer).validate()
    pb, gbytes, _, k = element_bytes(s)
    shard = math.ceil(num_params / dp)
    return {"parameters": pb * (shard if zero >= 3 else num_params),
            "gradients": gbytes * (shard if zero >= 2 else num_params),
            "optimizer_state": round(k * (shard if zero >= 1 else num_params))}


def stage_layers(model, strategy: Strategy, stage: int = 0) -> list[int]:
    """Block indices of stage ``stage``: chunks j p + stage (j < v) of L/(pv) blocks (Narayanan et al. 2021, 2.2)."""
    m = as_shape(model)
    p, v = strategy.pp, strategy.virtual_stages
    per = m.n_layer // (p * v)
    return [c * per + k for j in range(v) for c in (j * p + stage,) for k in range(per)]


def stage_expert_parameters(model, strategy: Strategy, stage: int = 0, accounting: str = "paper") -> int:
    """Routed-expert parameters (elements) of stage ``stage`` on one rank: E/ep experts per MoE block, / tp
    in the paper accounting (whole in ``"minizero"``'s: :func:`~minizero.memory.estimator.strategy.expert_tp`)."""
    m = as_shape(model)
    blocks = sum(m.is_moe_layer(i) for i in stage_layers(m, strategy, stage))
    return blocks * (m.experts // strategy.ep) * m.expert_parameters(expert_tp(strategy, accounting))


def stage_parameters(model, strategy: Strategy, stage: int = 0, vocab_parallel: bool = True,
                     accounting: str = "paper") -> int:
    """Parameters (elements) of one pipeline stage on one tensor-parallel rank, before ZeRO sharding.

    Stage i holds L/p layers (:func:`stage_layers`; MoE blocks with E/ep routed experts); stage 0 also the
    embeddings, stage p-1 the final norm and head (Narayanan et al. 2021, section 2.2). ``vocab_parallel``: the
    embedding and the head are split by t (Megatron-LM; minizero's trainer: parallel/vocab_parallel.py) or replicated;
    the experts by :func:`~minizero.memory.estimator.strategy.expert_tp` of ``accounting``.
    """
    m = as_shape(model)
    p, t, et = strategy.pp, strategy.tp, expert_tp(strategy, accounting)
    n = sum(m.layer_parameters(t, i, strategy.ep, et) for i in stage_layers(m, strategy, stage))
    if stage == 0:
        n += m.embedding_parameters(t, vocab_parallel)
    if stage == p - 1:
        n += m.head_parameters(t, p, vocab_parallel)
    return n


def stage_state_bytes(model, strategy: Strategy, stage: int = 0, vocab_parallel: bool = True,
                      accounting: str = "paper") -> dict:
    """:func:`model_state_bytes` of stage ``stage``: the dense part over the N shard ranks (all data ranks, or
    ``dp_shard`` under hybrid sharding) plus the routed experts
    (:func:`stage_expert_parameters`) over N/ep (DeepSpeed-MoE; minizero's ``ExpertZero``)."""
    st = strategy
    psi = stage_parameters(model, st, stage, vocab_parallel, accounting)
    experts = stage_expert_parameters(model, st, stage, accounting)
    dense = model_state_bytes(psi - experts, st.shard_ranks, st.zero, st.precision, st.optimizer)  # --dp-shard N
    if not experts:
        return dense
    routed = model_state_bytes(experts, st.expert_shard_ranks, st.zero, st.precision, st.optimizer)
    return {k: dense[k] + routed[k] for k in dense}


def stage_shard(model, strategy: Strategy, stage: int = 0, accounting: str = "paper") -> int:
    """Elements of stage ``stage`` one rank keeps after ZeRO's split (the shard an offload moves each step): the dense
    part over the N shard ranks, the routed experts over their N/ep holders, each shard rounded up, as
    :func:`stage_state_bytes` splits them."""
    st = strategy
    experts = stage_expert_parameters(model, st, stage, accounting)
    dense = stage_parameters(model, st, stage, accounting=accounting) - experts
    return math.ceil(dense / st.shard_ranks) + (math.ceil(experts / st.expert_shard_ranks) if experts else 0)
