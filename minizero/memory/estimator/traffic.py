"""Bytes sent per group and FLOPs, per step (Korthikanti et al. 2022, Kaplan et al. 2020; units: ``__init__.py``)."""
from __future__ import annotations

import math

from minizero.comm.collectives import bytes_sent, shard_range
from minizero.memory.estimator.model import activation_element, as_shape
from minizero.memory.estimator.strategy import Strategy, element_bytes, seq_len_at
from minizero.memory.estimator.states import stage_expert_parameters, stage_layers, stage_parameters, stage_shard
from minizero.memory.estimator.activations import _layer_stored, layer_rows


# ---- communication per step -------------------------------------------------------------------
def _ring(n: int) -> float:
    """Fraction of the buffer a rank sends in a ring reduce-scatter or all-gather: (n - 1)/n."""
    return (n - 1) / n


def tensor_parallel_calls(m, st: Strategy, stage: int) -> int:
    """The paper's tensor-parallel all-reduces one rank of ``stage`` runs a step: per layer and micro-batch 4 (full
    recompute +2), plus the vocab-parallel embedding's and head's (:func:`comm_bytes_per_step`'s ``tp``)."""
    per_layer = 4 + (2 if st.recompute == "full" else 0)
    return st.micro_batches * ((m.n_layer // st.pp) * per_layer + (stage == 0) + (stage == st.pp - 1))


def pipeline_sends(st: Strategy, stage: int) -> int:
    """Activations and gradients a rank of pipeline stage ``stage`` sends per micro-batch: each of its v chunks sends
    its output on and its input's gradient back, but for the first chunk's gradient (stage 0) and the last chunk's
    output (stage p-1): 2v, or 2v - 1 at either end (Narayanan et al. 2021, 2.2.2; 0 at pp 1)."""
    return 0 if st.pp == 1 else 2 * st.virtual_stages - (stage in (0, st.pp - 1))


def comm_bytes_per_step(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0,
                        accounting: str = "paper") -> dict:
    """Bytes one rank of pipeline stage ``stage`` sends per optimizer step, by parallelism (ring collectives).

    P, G: the stage's parameter and gradient bytes on this rank; N data ranks; m micro-batches; e itemsize.
    ``dp``: ZeRO 0 2(N-1)/N G; ZeRO 1 (N-1)/N (G + P); ZeRO 2 (N-1)/N (m G + P); ZeRO 3 m(N-1)/N (2P + G) (ZeRO, section
    7); the routed experts' P and G over their N/ep expert-data ranks instead; ``dp_shard``: N = dp_shard x cp, +
    2(R-1)/R G/N (experts: G/(N/ep)) across R replicas per reduce. ``ep``: :func:`expert_all_to_all_bytes`. ``tp``: per
    layer and micro-batch 4 all-reduces of sbh e, 2(t-1)/t each (full recompute +2), plus the vocab-parallel embedding's
    and head's (sequence parallelism: Korthikanti et al.'s count, the same bytes; it leaves out the re-gathers for dW in
    backward that Megatron-LM and minizero send); ``"minizero"``: :func:`tensor_parallel_bytes`, what the trainer sends.
    ``pp``: per micro-batch sbh e / t in each of :func:`pipeline_sends`' sends, plus the tied embedding's gradient.
    ``cp``: :func:`ring_attention_bytes` (or, for ``cp_attention="ulysses"``, :func:`ulysses_attention_bytes`) forward
    and backward, and forward again under recompute. ``pcie``: offload traffic.

    Activation messages use the precision's activation itemsize (bf16/fp8: 2, a GPU's; minizero's emulation
    sends float32, twice that). Returns: {"dp", "tp", "pp", "cp", "ep", "pcie"} in bytes; with cp > 1
    sequence-sized arrays are 1/cp as long.
    """
    m = as_shape(model)
    st = strategy.validate(m)
    s = seq_len_at(m, st, seq_len, stage)  # stage 5 of 2 and seq_len -1 gave numbers before
    pb, gbytes, e, _ = element_bytes(st)
    t, mb, c = st.tp, st.micro_batches, st.cp
    psi = stage_parameters(m, st, stage, accounting=accounting)  # the vocabulary split by t in both (vocab_parallel.py)
    experts = stage_expert_parameters(m, st, stage, accounting)  # whole under tp in "minizero"'s
    dp = _zero_bytes(pb * (psi - experts), gbytes * (psi - experts), st.shard_ranks, st.zero, mb) \
        + _replica_bytes(gbytes * (psi - experts), st, mb) \
        + _zero_bytes(pb * experts, gbytes * experts, st.expert_shard_ranks, st.zero, mb) \
        + _replica_bytes(gbytes * experts, st, mb, st.expert_shard_ranks)
    x = e * (s // c) * st.micro_batch * m.hidden  # one (b, s/cp, h) activation, bytes
    layers = m.n_layer // st.pp
    tp = 0.0
    if t > 1 and accounting == "minizero":
        tp = tensor_parallel_bytes(m, st, s, stage)["total"]
    elif t > 1:
        tp = tensor_parallel_calls(m, st, stage) * 2 * _ring(t) * x
    pp = 0.0
    if st.pp > 1:
        # each tensor rank sends its stage's whole output (paper: 1/t, Megatron's scatter-gather; minizero splits it
        # only under sequence parallelism, parallel/pipeline.py)
        pp = mb * pipeline_sends(st, stage) * x / (t if accounting == "paper" or st.sequence_parallel else 1)
        if m.tied_embeddings and stage in (0, st.pp - 1):
            pp += gbytes * m.vocab_shard(t)  # 2-rank all-reduce
    if st.cp_attention == "ulysses":
        attn = ulysses_attention_bytes(st.micro_batch, m.n_head // t, m.n_kv_head // t, s, m.hidden // m.n_head, e, c)
    else:
        attn = ring_attention_bytes(st.micro_batch, m.n_kv_head // t, s, m.hidden // m.n_head, e, c)
    passes = attn["forward"] * (2 if st.recompute != "none" else 1) + attn["backward"]
    cp = mb * layers * passes  # every layer of the stage (all its chunks), every micro-batch
    pcie = 0.0
    shard = stage_shard(m, st, stage, accounting)  # the routed experts over N/ep, as their states
    if st.offload in ("optimizer", "params"):
        pcie += (gbytes + pb) * shard
    if st.offload == "params":
        pcie += 2 * mb * pb * shard
    if st.offload_activations:  # every micro-batch's saved arrays go down in forward and come back in backward
        rows = layer_rows(m, s, st.micro_batch, "paper", st.precision, c, st.attention, cp_attention=st.cp_attention)
        pcie += 2 * mb * layers * _layer_stored(rows, t, st.sequence_parallel, st.recompute)
    ep = expert_all_to_all_bytes(m, st, s, stage)["total"]
    return {"dp": round(dp), "tp": round(tp), "pp": round(pp), "cp": round(cp), "ep": ep, "pcie": round(pcie)}


def tensor_parallel_bytes(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0,
                          tp_rank: int = 0, shard_rank: int | None = None) -> dict:
    """Bytes tensor rank ``tp_rank`` of stage ``stage`` sends per step on its tensor group in minizero's trainer
    (vocabulary-parallel ends, minizero's algorithms: ``comm.collectives.bytes_sent``): {"forward", "backward",
    "loss", "grads", "total"}.

    One activation: n = b (s/c) h elements (activation itemsize). Per layer and micro-batch: forward 2 all-reduces
    of n (sequence parallelism: 2 all-gathers and 2 reduce-scatters), again under full recompute; backward 2
    all-reduces (SP: 2 reduce-scatters and 4 all-gathers, the column-parallel inputs re-gathered for dW). Stage 0:
    the embedding's exit, an all-reduce forward (SP: a reduce-scatter, backward an all-gather); the last stage: the
    head's entry, an all-reduce backward (SP: an all-gather forward, a reduce-scatter and the re-gather backward),
    and the loss, an all-gather of the N = b s/c row maxima and 2 all-reduces of N (itemsize >= 4). ``grads``, SP
    only, once per step: the all-reduce of the norms' and row-parallel biases' gradients (ZeRO 2-3: of the pieces in
    ZeRO shard rank ``shard_rank``'s gradient shards; None: the mean over the N shard ranks). An MoE block (no SP) keeps
    its experts whole: one all-reduce each way. Equal to the trainer's ``tensor_parallel_activations``
    (tests/test_sequence_parallel.py).
    """
    m = as_shape(model)
    st = strategy.validate(m)
    if shard_rank is not None and not 0 <= shard_rank < st.shard_ranks:  # with or without SP, tp 1 too
        raise ValueError(f"shard_rank={shard_rank}; allowed: 0 to {st.shard_ranks - 1} (N = {st.shard_ranks})")
    t = st.tp
    if t == 1:
        return {"forward": 0, "backward": 0, "loss": 0, "grads": 0, "total": 0}
    s, e = (seq_len or m.seq_len) // st.cp, activation_element(st.precision, "minizero")
    n, rows, layers = st.micro_batch * s * m.hidden, st.micro_batch * s, m.n_layer // st.pp
    moe = sum(m.is_moe_layer(i) for i in stage_layers(m, st, stage))  # experts whole: the attention's pair only
    first, last = stage == 0, stage == st.pp - 1

    def sent(op, count, itemsize=e):
        return bytes_sent(op, count, itemsize, t, tp_rank)
    ag, rs, ar = sent("all_gather", n), sent("reduce_scatter", n), sent("all_reduce", n)
    passes = 2 if st.recompute == "full" else 1
    if st.sequence_parallel:
        forward = layers * passes * 2 * (ag + rs) + first * rs + last * ag
        backward = layers * (2 * rs + 4 * ag) + first * ag + last * (rs + ag)
    else:
        pairs = 2 * layers - moe
        forward, backward = (pairs * passes + first) * ar, (pairs + last) * ar
    le = max(e, 4)
    loss = last * (sent("all_gather", t * rows, le) + 2 * sent("all_reduce", rows, le))
    grads = 0
    if st.sequence_parallel:
        counts = _sequence_parallel_grad_counts(m, st, stage)
        ranks = range(len(counts)) if shard_rank is None or len(counts) == 1 else [shard_rank]
        grads = sum(sent("all_reduce", counts[d], element_bytes(st)[1]) for d in ranks) / len(ranks)
    mb = st.micro_batches
    out = {"forward": mb * forward, "backward": mb * backward, "loss": mb * loss, "grads": grads}
    return dict(out, total=sum(out.values()))


def _sequence_parallel_grad_counts(m, st: Strategy, stage: int) -> list[int]:
    """Elements of the norms' and row-parallel biases' gradients that sequence parallelism sums over the tensor group,
    per ZeRO shard rank d < N (ZeRO 2-3: the pieces in d's shards; ZeRO 0-1: all of them, one entry)."""
    h, norm = m.hidden, m.norm_size
    bias = [(h, True)] if m.bias else []  # a row-parallel output bias
    units = []  # per flat unit (zero/shards.py), its [(elements, summed over the tensor group?)] in order
    for i in stage_layers(m, st, stage):  # a block: ln_1 | c_attn, c_proj.weight | c_proj.bias | ln_2 | mlp | bias
        split, replicated = m.attention_parameters(st.tp)
        attn = split + replicated - len(bias) * h
        mlp = m.layer_parameters(st.tp, i) - 2 * norm - attn - 2 * len(bias) * h
        units.append([(norm, True), (attn, False), *bias, (norm, True), (mlp, False), *bias])
    if stage == st.pp - 1:
        units.append([(norm, True)])  # ln_f
    n = st.shard_ranks if st.zero >= 2 else 1
    counts = [0] * n
    for unit in units:
        padded, off = math.ceil(sum(size for size, _ in unit) / n) * n, 0
        for size, summed in unit:
            for d in range(n) if summed else ():
                lo, chunk = shard_range(padded, n, d)
                counts[d] += max(0, min(off + size, lo + chunk) - max(off, lo))
            off += size
    return counts


def _zero_bytes(P: float, G: float, n: int, zero: int, mb: int) -> float:
    """Bytes a rank sends to reduce G (and gather P) over ``n`` ranks per step under ZeRO ``zero`` (see above)."""
    if n == 1 or not P + G:
        return 0.0
    if zero == 0:
        return 2 * _ring(n) * G
    if zero == 1:
        return _ring(n) * (G + P)
    if zero == 2:
        return _ring(n) * (mb * G + P)
    return mb * _ring(n) * (2 * P + G)


def replica_bytes(model, strategy: Strategy, stage: int = 0, accounting: str = "paper") -> float:
    """The part of :func:`comm_bytes_per_step`'s ``"dp"`` a rank sends across the replicas under hybrid sharding
    (``strategy.dp_shard``; 0 without): the plan's step time puts it on the slower link."""
    m, st = as_shape(model), strategy
    experts = stage_expert_parameters(m, st, stage, accounting)
    psi, gbytes = stage_parameters(m, st, stage, accounting=accounting) - experts, element_bytes(st)[1]
    return _replica_bytes(gbytes * psi, st, st.micro_batches) \
        + _replica_bytes(gbytes * experts, st, st.micro_batches, st.expert_shard_ranks)


def _replica_bytes(G: float, st: Strategy, mb: int, n: int | None = None) -> float:
    """Hybrid sharding's second hop (zero/hybrid.py): the ring all-reduce of each rank's G/n gradient shard (n: N, or
    N/ep for routed experts) over the R replicas, once a step (ZeRO-1) or once a micro-batch (ZeRO 2-3)."""
    if st.replicas == 1 or not G:
        return 0.0
    return (1 if st.zero == 1 else mb) * 2 * _ring(st.replicas) * G / (n or st.shard_ranks)


def expert_all_to_all_bytes(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0) -> dict:
    """Bytes one rank sends per step in the MoE blocks' all-to-alls: {"forward", "backward", "counts", "total"}.

    Per MoE block and micro-batch (T = b s/cp tokens, C = ceil(cf T k / E) slots, rows of h x e bytes): dispatch
    sends the kept rows bound for other ranks, (E - E/ep) C when every expert is full (E C <= T k), else the
    balanced (ep-1)/ep T k; combine sends as many back; backward repeats both (full recompute: forward twice).
    Counts (``parallel/moe.py``, ``comm/all_to_all.py``): the (ep, E/ep) int64 matrix forward, (ep-1) E/ep x 8,
    and 8 (ep-1) before each of the 4 variable-split exchanges. EQUAL to the trainer's ledger (``expert_all_to_all``
    of ``Strategy.traffic_by_kind``) when every expert fills its C slots on every rank (tests/test_plan_moe.py),
    an upper bound when E C <= T k; minizero sends only kept rows (GShard and DeepSpeed pad to C). 0 at ep 1.
    """
    m = as_shape(model)
    st = strategy.validate(m)
    blocks = sum(m.is_moe_layer(i) for i in stage_layers(m, st, stage))
    ep = st.ep
    if ep == 1 or not blocks:
        return {"forward": 0, "backward": 0, "counts": 0, "total": 0}
    s = seq_len or m.seq_len
    e = element_bytes(st)[2]
    tokens = st.micro_batch * (s // st.cp)
    slots, choices = m.experts * m.capacity(tokens), tokens * m.top_k
    rows = (slots - slots // ep) if slots <= choices else round(choices * (ep - 1) / ep)  # dispatch's = combine's
    one_way = 2 * rows * m.hidden * e  # dispatch + combine
    passes = 2 if st.recompute == "full" else 1
    per = blocks * st.micro_batches
    forward, backward = per * passes * one_way, per * one_way
    counts = per * (passes * ((ep - 1) * (m.experts // ep) * 8 + 2 * 8 * (ep - 1)) + 2 * 8 * (ep - 1))
    return {"forward": forward, "backward": backward, "counts": counts, "total": forward + backward + counts}


def ring_attention_bytes(micro_batch: int, heads: int, seq_len: int, head_dim: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends in one ring-attention call over ``cp`` ranks: {"forward", "backward"}.

    A block is one rank's K (or V, dK, dV): (b, heads, s/cp, head_dim) elements; K and V of ``itemsize`` bytes,
    dK and dV of at least float32's 4 (accumulated in float32 for 16-bit inputs, as ring-flash-attention does).
    Forward: c-1 passes of (K, V), 2(c-1) blocks (Liu et al. 2023: each block visits every rank).
    Backward (minizero's ``_RingAttention.backward``): c-1 passes of (K, V), and c of (dK, dV), the last bringing
    every gradient block home: 2(c-1) K, V blocks + 2c gradient blocks. 0 and 0 for cp = 1 (no ring).
    The trainer's traffic ledger is checked against this (tests/test_context_parallel.py).
    """
    if cp == 1:
        return {"forward": 0, "backward": 0}
    blk = micro_batch * heads * (seq_len // cp) * head_dim
    kv = 2 * (cp - 1) * blk * itemsize
    return {"forward": kv, "backward": kv + 2 * cp * blk * max(itemsize, 4)}


def ulysses_attention_bytes(micro_batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                            itemsize: int, cp: int) -> dict:
    """Bytes one rank sends in one DeepSpeed-Ulysses attention over ``cp`` ranks: {"forward", "backward"}.

    Forward: q (``heads``), k and v (``kv_heads`` each) go from sequence to head shards and the output (``heads``)
    comes back: four all-to-alls of (b, heads, s/cp, head_dim) arrays, of which a rank keeps 1/cp, so
    (c-1)/c (2 heads + 2 kv_heads) b (s/c) head_dim itemsize (Jacobs et al. 2023, section 3.2). Backward: the
    four inverse all-to-alls, the same bytes. 0 and 0 for cp = 1. The trainer's traffic ledger is checked
    against this (tests/test_ulysses.py; minizero's GPT has kv_heads = heads).
    """
    rows = micro_batch * (seq_len // cp) * head_dim * itemsize * (2 * heads + 2 * kv_heads)
    each = (cp - 1) * rows // cp
    return {"forward": each, "backward": each}


# ---- FLOPs ------------------------------------------------------------------------------------
def korthikanti_flops(batch: int, seq_len: int, n_layer: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one step of a GPT, forward + backward (Korthikanti et al. 2022, appendix A).

    72 B s L h^2 (1 + s/(6h) + V/(12hL)), B = sequences per step. Counts matmuls only,
    2 FLOPs per multiply-add, the backward pass as twice the forward.
    """
    b, s, l, h, v = batch, seq_len, n_layer, hidden, vocab
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))


def kaplan_flops(num_params: int, tokens: int) -> float:
    """Training FLOPs by the 6N rule: 6 x parameters x tokens (Kaplan et al. 2020, section 2.1)."""
    return 6 * num_params * tokens


def model_flops_per_step(model, global_batch: int, seq_len: int | None = None, recompute: str = "none") -> float:
    """Matmul FLOPs of one step of ``global_batch`` sequences, forward + backward (+ recompute).

    Per token, forward: 2 x (each layer's matrix parameters) + 4sh per layer for QK^T and softmax x V + 2hV for the
    logits; backward = 2 x forward (Korthikanti et al. 2022, appendix A, whose counting this generalises to
    grouped-query attention, SwiGLU, MLA and MoE blocks -- the router and the top-k + shared experts a token runs; for a
    GPT shape it equals :func:`korthikanti_flops` exactly).
    ``recompute`` adds the hardware FLOPs of recomputation: "full" one more forward of every layer (not the logits) --
    96BsLh^2(1 + s/(6h) + V/(16hL)) for a GPT; "selective" one more forward of the attention core, 4Bs^2h per layer.
    """
    m = as_shape(model)
    s = seq_len or m.seq_len
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    n_mats = 3 if m.mlp == "swiglu" else 2
    if m.kv_lora_rank:  # MLA: its matrices, and QK^T over n_h (d_h + d_h^R) dims, softmax x V over n_h d_h
        a, dh, dr, dc, dq = m.n_head, m.mla_head_dim, m.qk_rope_dim, m.kv_lora_rank, m.q_lora_rank
        attn = (h * dq + dq * a * (dh + dr) if dq else h * a * (dh + dr)) + h * (dc + dr) + dc * 2 * a * dh + a * dh * h
        core = 2 * s * a * (dh + dr) + 2 * s * a * dh
    else:
        attn, core = 2 * h * h + 2 * h * kv, 4 * s * h
    dense = n_mats * h * f
    routed = h * m.experts + (m.top_k + m.shared_experts) * n_mats * h * m.expert_hidden  # router + active experts
    fwd = [2 * (attn + (routed if m.is_moe_layer(i) else dense)) + core for i in range(m.n_layer)]  # per token
    tokens = global_batch * s
    total = 3 * tokens * (sum(fwd) + 2 * h * m.vocab_size)
    if recompute == "full":
        total += tokens * sum(fwd)
    elif recompute == "selective":
        total += tokens * m.n_layer * core
    return float(total)
