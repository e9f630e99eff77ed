"""Model-state bytes of LoRA and QLoRA fine-tuning: a frozen base, adapters trained (Hu et al. 2021, section 4.1;
Dettmers et al. 2023, section 3 and appendix E).

Part of :mod:`minizero.memory.estimator`. A GPT block's adapted projections (minizero.nn.lora's TARGETS) are
c_attn (h + 2kv, h), attn.c_proj (h, h), c_fc (f, h), mlp.c_proj (h, f); an adapter of rank r on an (out, in)
matrix is r(in + out) elements. QLoRA stores each adapted matrix of n elements as NF4 with double quantization:
ceil(n/2) code bytes, one 8-bit constant per block of 64, one fp32 constant per 256 of those and one fp32 mean,
4.127 bits per parameter for large n.
"""
from __future__ import annotations

import math

from minizero.memory.estimator.model import as_shape

NF4_BLOCK, NF4_BLOCK2 = 64, 256  #: weights per 8-bit absmax; 8-bit absmaxes per fp32 constant (QLoRA, bitsandbytes)
LORA_TARGETS = ("c_attn", "c_proj", "c_fc")
LORA_BASES = ("nf4", "float")


def nf4_bytes(n: int) -> int:
    """Bytes of an n-element weight as NF4 with double-quantized block constants (:mod:`minizero.nf4`)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4


def adapted_matrices(model, targets=LORA_TARGETS) -> list[tuple[int, int]]:
    """(out, in) of every matrix :func:`minizero.nn.lora.add_lora` adapts, over all layers, in model order.

    Raises: ValueError for a target outside :data:`LORA_TARGETS` or a SwiGLU model (GPT's projections only).
    """
    m = as_shape(model)
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or m.mlp != "gelu":
        raise ValueError(f"LoRA bytes know GPT's projections {LORA_TARGETS}; got targets {tuple(targets)}, "
                         f"mlp {m.mlp!r}")
    h, f, kv = m.hidden, m.ffn_hidden, m.kv_hidden
    layer = [(name, shape) for name, shape in (("c_attn", (h + 2 * kv, h)), ("c_proj", (h, h)), ("c_fc", (f, h)),
                                              ("c_proj", (h, f))) if name in targets]
    return [shape for _ in range(m.n_layer) for _, shape in layer]


def lora_state_bytes(model, rank: int, targets=LORA_TARGETS, base: str = "nf4", element: int = 4,
                     dp: int = 1, zero: int = 0) -> dict:
    """Per-rank bytes of fine-tuning ``model`` with adapters of ``rank`` (AdamW: m and v in ``element`` bytes).

    ``base``: "nf4" (QLoRA: adapted matrices as :func:`nf4_bytes`, the rest of the base in ``element`` bytes)
    or "float" (LoRA: the whole base in ``element`` bytes). Adapters, their gradients and m, v: ``element`` bytes
    each; under ZeRO over ``dp`` ranks each adapter is one unit padded to a multiple of dp (minizero/zero/),
    sharded as ZeRO's Figure 1 says; the frozen base is never sharded.
    Returns {"frozen", "adapters", "parameters" (= frozen + adapters), "gradients", "optimizer_state",
    "bytes_per_parameter" ((parameters + gradients + optimizer_state) / Psi of the base)}.
    Raises: ValueError for rank < 1, an unknown base, dp < 1 or a ZeRO stage outside 0..3.
    """
    m = as_shape(model)
    if rank < 1 or base not in LORA_BASES or dp < 1 or zero not in (0, 1, 2, 3):
        raise ValueError(f"need rank >= 1, base in {LORA_BASES}, dp >= 1, zero in 0..3; "
                         f"got rank={rank}, base={base!r}, dp={dp}, zero={zero}")
    mats = adapted_matrices(m, targets)
    psi = m.num_parameters()
    frozen = element * psi
    if base == "nf4":
        frozen += sum(nf4_bytes(o * i) - element * o * i for o, i in mats)
    sizes = [rank * (o + i) for o, i in mats]
    full = sum(math.ceil(n / dp) * dp if zero else n for n in sizes)  # a unit's flat buffer, padded
    shard = sum(math.ceil(n / dp) for n in sizes)
    adapters = element * (shard if zero >= 3 else full)
    out = {"frozen": frozen, "adapters": adapters, "parameters": frozen + adapters,
           "gradients": element * (shard if zero >= 2 else full),
           "optimizer_state": 2 * element * (shard if zero >= 1 else full)}
    out["bytes_per_parameter"] = (out["parameters"] + out["gradients"] + out["optimizer_state"]) / psi
    return out
