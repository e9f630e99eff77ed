"""The analytic model: per-rank bytes, messages and FLOPs of training a transformer, without running it.

per rank = parameters + gradients + optimizer_state + activations + comm_buffers + gathered (offloaded and nvme bytes
are reported apart). Every function returns bytes (Python ints) unless its name says otherwise; tensor sizes are
elements; :func:`gb` is 10**9 bytes, :func:`gib` 2**30. Symbols as Korthikanti et al. Table 1 (a, b, h, L, p, s, t, V,
f; c context ranks) and ZeRO's Psi, N_d, K. ``accounting="paper"`` follows the papers; ``"minizero"`` what minizero's
code keeps, checked against the ledger by tests/test_estimator.py and tests/test_compare.py.

Sources: ZeRO, arXiv:1910.02054, sections 3 and 5; Korthikanti et al., arXiv:2205.05198, sections 4-5;
Narayanan et al., arXiv:2104.04473; ZeRO-Offload; ZeRO-Infinity; 8-bit optimizers, arXiv:2110.02861; LoRA,
arXiv:2106.09685; QLoRA, arXiv:2305.14314 (``lora.py``).
"""
from __future__ import annotations

from minizero.memory.estimator.model import (
    ACCOUNTINGS, ATTENTIONS, CATEGORIES, CP_ATTENTIONS, DEVICE_CATEGORIES, LINEAR_SAVES, MIN_8BIT_SIZE, OFFLOAD,
    OFFLOAD_MIN_BYTES, OFFLOAD_TIERS, OPTIMIZERS, PRECISIONS, QUANT_BLOCK, RECOMPUTE, SCHEDULES, ZERO_STAGES,
    ModelShape, activation_element, as_shape, gb, gib, precision_for_dtype)
from minizero.memory.estimator.strategy import Strategy, element_bytes, expert_tp
from minizero.memory.estimator.states import (
    model_state_bytes, stage_expert_parameters, stage_layers, stage_parameters, stage_shard, stage_state_bytes)
from minizero.memory.estimator.activations import (
    Saved, activation_bytes, in_flight, layer_activation_bytes, layer_rows, saved_outside_layers, saved_per_layer)
from minizero.memory.estimator.lora import (
    LORA_BASES, LORA_TARGETS, adapted_matrices, adapted_splits, lora_activation_bytes, lora_state_bytes, nf4_bytes)
from minizero.memory.estimator.totals import MemoryEstimate, estimate_memory, estimate_stages, stage_kinds
from minizero.memory.estimator.traffic import (
    comm_bytes_per_step, expert_all_to_all_bytes, kaplan_flops, korthikanti_flops, model_flops_per_step,
    pipeline_sends, replica_bytes, ring_attention_bytes, tensor_parallel_bytes, ulysses_attention_bytes)

__all__ = [  # the package's API, re-exported
    "ACCOUNTINGS", "ATTENTIONS", "CATEGORIES", "CP_ATTENTIONS", "DEVICE_CATEGORIES", "LINEAR_SAVES", "MIN_8BIT_SIZE",
    "OFFLOAD", "OFFLOAD_MIN_BYTES", "OFFLOAD_TIERS", "OPTIMIZERS", "PRECISIONS", "QUANT_BLOCK", "RECOMPUTE",
    "SCHEDULES", "ZERO_STAGES", "ModelShape", "Strategy", "element_bytes", "expert_tp", "activation_element",
    "as_shape", "gb", "gib", "precision_for_dtype", "model_state_bytes", "stage_expert_parameters", "stage_layers",
    "stage_parameters", "stage_shard", "stage_state_bytes", "Saved", "activation_bytes", "in_flight",
    "layer_activation_bytes", "layer_rows", "saved_outside_layers", "saved_per_layer", "LORA_BASES", "LORA_TARGETS",
    "adapted_matrices", "adapted_splits", "lora_activation_bytes", "lora_state_bytes", "nf4_bytes", "MemoryEstimate",
    "estimate_memory", "estimate_stages", "stage_kinds", "comm_bytes_per_step", "expert_all_to_all_bytes",
    "kaplan_flops", "korthikanti_flops", "model_flops_per_step", "pipeline_sends", "replica_bytes",
    "ring_attention_bytes", "tensor_parallel_bytes", "ulysses_attention_bytes",
]
