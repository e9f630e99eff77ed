"""Bytes of LoRA and QLoRA fine-tuning: a frozen base (QLoRA: NF4), trained adapters of r(in + out) elements.

Sources: Hu et al., arXiv:2106.09685, section 4.1; Dettmers et al., arXiv:2305.14314, section 3, appendix E.
"""
from __future__ import annotations

import math

from minizero.memory.estimator.activations import layer_rows, saved_outside_layers
from minizero.memory.estimator.model import activation_element, as_shape

NF4_BLOCK, NF4_BLOCK2 = 64, 256  #: weights per 8-bit absmax; 8-bit absmaxes per fp32 constant (QLoRA, bitsandbytes)
LORA_TARGETS = ("c_attn", "c_proj", "c_fc")
LORA_BASES = ("nf4", "float")


def nf4_bytes(n: int) -> int:
    """Bytes of an n-element weight as NF4 with double-quantized block constants (:mod:`minizero.nf4`)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4


def adapted_matrices(model, targets=LORA_TARGETS) -> list[tuple[int, int]]:
    """(out, in) of every matrix :func:`minizero.nn.lora.add_lora` adapts, all layers, in model order: ``c_attn``
    (h + 2kv, h), ``c_proj`` (h, h) and (h, f), ``c_fc`` (f, h), twice (gate, up) with SwiGLU. Raises ValueError:
    a target outside :data:`LORA_TARGETS`."""
    return [shape for _, shape, _, _ in adapted_splits(model, targets)]


def adapted_splits(model, targets=LORA_TARGETS) -> list[tuple[str, tuple[int, int], int, bool]]:
    """(name, (out, in), stride, row_parallel) of every matrix :func:`adapted_matrices` lists: how tensor
    parallelism splits it (row-parallel: both c_proj; stride 3: a c_attn of equal Q, K, V, split by part)."""
    m = as_shape(model)
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
        raise ValueError(f"LoRA targets {tuple(targets)}: allowed names are {', '.join(LORA_TARGETS)}")
    h, f, kv = m.hidden, m.ffn_hidden, m.kv_hidden
    up = [("c_fc", (f, h), 1)] * (2 if m.mlp == "swiglu" else 1)
    layer = [(name, shape, stride, name.endswith("c_proj")) for name, shape, stride in
             [("c_attn", (h + 2 * kv, h), 3 if kv == h else 1), ("attn.c_proj", (h, h), 1)] + up
             + [("mlp.c_proj", (h, f), 1)] if name.rpartition(".")[2] in targets]
    return [split for _ in range(m.n_layer) for split in layer]


def nf4_shard_runs(shape: tuple[int, int], stride: int, row_parallel: bool, tp: int, tp_rank: int = 0,
                   name: str = "a"):
    """(first, pitch, count, length) of tensor rank ``tp_rank``'s NF4 shard of an (out, in) weight, in whole blocks
    (:class:`minizero.nf4.NF4Shard`): column-parallel ``stride`` runs of out/(stride tp) rows, row-parallel one run
    of in/tp per row. Raises ValueError: a run is not whole NF4 blocks (QLoRA would quantize across shards), naming
    the weight (``name``, e.g. "the attn.c_proj"), its shape and the run."""
    out_f, in_f = shape
    run = in_f // tp if row_parallel else out_f // (stride * tp) * in_f
    if run % NF4_BLOCK or (in_f if row_parallel else out_f // stride) % tp:
        raise ValueError(f"tp {tp} splits {name} weight {tuple(shape)} into runs of {run} elements per rank, not a "
                         f"multiple of the NF4 block {NF4_BLOCK}")
    length = run // NF4_BLOCK
    return (tp_rank * length, tp * length, out_f if row_parallel else stride, length)


def nf4_shard_bytes(runs) -> int:
    """Bytes of an NF4 shard of ``runs``: n/2 codes, a byte per block, 4 per group of 256 blocks it spans, the mean."""
    first, pitch, count, length = runs
    groups = (first + (count - 1) * pitch + length - 1) // NF4_BLOCK2 - first // NF4_BLOCK2 + 1
    return count * length * (NF4_BLOCK // 2 + 1) + 4 * groups + 4


def lora_state_bytes(model, rank: int, targets=LORA_TARGETS, base: str = "nf4", element: int = 4,
                     dp: int = 1, zero: int = 0, optimizer_bytes: float | None = None, tp: int = 1,
                     tp_rank: int = 0) -> dict:
    """Per-rank bytes of fine-tuning ``model`` with adapters of ``rank``: the frozen base (``base`` "nf4": adapted
    matrices as :func:`nf4_bytes`, the rest ``element`` bytes; "float": all ``element`` bytes), adapters and their
    gradients (``element``), AdamW state (``optimizer_bytes`` per adapter parameter, default 2 x element); under
    ZeRO over ``dp`` ranks each adapter is one unit padded to a multiple of dp (minizero/zero/), the base whole.
    ``tp``: tensor rank ``tp_rank``'s shards (minizero/parallel/lora_tp.py): the blocks' matrices and column biases
    / tp, embeddings and norms whole; an adapter of a column-parallel matrix r (in + out/tp), of a row-parallel one
    r (in/tp + out); NF4 shards as :func:`nf4_shard_bytes` (the ranks differ by the 256-groups their blocks span).
    Returns {"frozen", "adapters", "parameters", "gradients", "optimizer_state", "bytes_per_parameter"} (the
    last: model states / Psi). Raises ValueError: rank < 1, an unknown base, dp < 1, zero outside 0..3, tp < 1,
    tp_rank outside 0..tp-1, or an NF4 shard that is not whole blocks.
    """
    m = as_shape(model)
    if rank < 1 or base not in LORA_BASES or dp < 1 or zero not in (0, 1, 2, 3) or not 0 <= tp_rank < tp:
        raise ValueError(f"need rank >= 1, base in {LORA_BASES}, dp >= 1, zero in 0..3, 0 <= tp_rank < tp; "
                         f"got rank={rank}, base={base!r}, dp={dp}, zero={zero}, tp={tp}, tp_rank={tp_rank}")
    mats = adapted_splits(m, targets)
    psi = m.num_parameters()
    frozen = element * (m.n_layer * m.layer_parameters(tp) + m.embedding_parameters(tp, vocab_parallel=False)
                        + m.head_parameters(tp, vocab_parallel=False)) if tp > 1 else element * psi
    sizes = []
    for name, (o, i), stride, row in mats:
        if base == "nf4":
            if tp == 1:
                nf4 = nf4_bytes(o * i)
            else:  # this rank's shard; a weight whose shards are not whole blocks is named
                nf4 = nf4_shard_bytes(nf4_shard_runs((o, i), stride, row, tp, tp_rank, f"the {name}"))
            frozen += nf4 - element * o * i // tp
        sizes.append(rank * (i // tp + o if row else i + o // tp))
    full = sum(math.ceil(n / dp) * dp if zero else n for n in sizes)  # a unit's flat buffer, padded
    shard = sum(math.ceil(n / dp) for n in sizes)
    adapters = element * (shard if zero >= 3 else full)
    out = {"frozen": frozen, "adapters": adapters, "parameters": frozen + adapters,
           "gradients": element * (shard if zero >= 2 else full),
           "optimizer_state": round((2 * element if optimizer_bytes is None else optimizer_bytes)
                                    * (shard if zero >= 1 else full))}
    out["bytes_per_parameter"] = (out["parameters"] + out["gradients"] + out["optimizer_state"]) / psi
    return out


#: the Linear whose input a layer row is, by the row's name (minizero.nn.gpt): only an adapted one saves it
_LINEAR_INPUT = {"QKV matmul input (ln_1 output)": "c_attn", "attention projection input": "c_proj",
                 "MLP input (ln_2 output)": "c_fc", "GeLU output (second linear input)": "c_proj",
                 "SiLU x up (down projection input)": "c_proj"}


def lora_activation_bytes(model, rank: int, seq_len: int, micro_batch: int, targets=LORA_TARGETS,
                          precision: str = "fp32", attention: str = "dense", tp: int = 1) -> int:
    """Bytes a LoRA / QLoRA step saves for backward (one rank, no recompute; minizero's rows): full training's,
    less what only frozen weights needed (the embeddings, block 0 before its first adapter, a frozen Linear's
    input, the LM head's), plus each adapter's x A^T (s, b, r). An NF4 base saves no weight (``_NF4Matmul``).
    ``tp``: one tensor rank's (the rows tensor parallelism splits / tp; the adapters' (s, b, r) whole)."""
    m = as_shape(model)
    per_layer = len(adapted_matrices(m, targets)) // m.n_layer
    e = activation_element(precision, "minizero")
    rows = [r for r in layer_rows(m, seq_len, micro_batch, "minizero", precision, 1, attention)
            if _LINEAR_INPUT.get(r.name, targets[0]) in targets]
    layer = sum(r.per_rank(tp, False) for r in rows) + per_layer * e * seq_len * micro_batch * rank
    first = layer - sum(r.per_rank(tp, False) for r in rows if _upstream(r, targets))
    _, head = saved_outside_layers(m, seq_len, micro_batch, "minizero", precision)
    return round(first + (m.n_layer - 1) * layer + sum(r.nbytes for r in head if r.name != "output projection input"))


def _upstream(row, targets) -> bool:
    """Whether block 0 computes ``row`` before its first adapter: then nothing it saves needs a gradient."""
    if "c_attn" in targets:
        return row.name.startswith("ln_1")
    if "c_proj" in targets:  # the attention projection comes first
        return row.part in ("pre", "core")
    return row.part in ("pre", "core") or row.name in (
        "attention projection input", "attention output dropout mask", "ln_2 input", "ln_2 mean and rstd")
