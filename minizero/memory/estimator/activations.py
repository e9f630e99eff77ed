"""Saved activation bytes per layer and per rank (Korthikanti et al. 2022, sections 4-5; units: ``__init__.py``)."""
from __future__ import annotations

import dataclasses
import math

from minizero.memory.estimator.model import (ACCOUNTINGS, ATTENTIONS, LINEAR_SAVES, OFFLOAD_MIN_BYTES,
                                             activation_element, as_shape)
from minizero.memory.estimator.strategy import Strategy, layer_shape_and_seq_len
from minizero.memory.estimator.states import stage_layers


# ---- activations: Korthikanti et al. 2022 -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Saved:
    """One array a transformer layer keeps for backward, for one micro-batch.

    ``nbytes``: the whole (unsplit) array. ``split``: "tp" (divided by t), "sp" (by t with sequence parallelism
    only) or "rep" (replicated). ``part``: "pre", "core" (what selective recompute drops), "post" or "held".
    ``arrays``: how many equal arrays the row is (offload decides per array against :data:`OFFLOAD_MIN_BYTES`).
    ``packs``: times each array passes through ``save_for_backward`` (counted once by the ledger and offload).
    """

    name: str
    nbytes: int
    split: str
    part: str
    arrays: int = 1
    packs: int = 1

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes on one of ``tp`` ranks."""
        if self.split == "tp" or (self.split == "sp" and sequence_parallel):
            return self.nbytes / tp
        return self.nbytes


def saved_per_layer(model, seq_len: int, micro_batch: int, accounting: str = "paper",
                    precision: str = "mixed", moe: bool = False, ep: int = 1) -> list[Saved]:
    """What one transformer layer saves for backward, one row per array (bytes, one micro-batch).

    ``"paper"``: Korthikanti et al. 2022, section 4.1 (2-byte activations, 1-byte masks; a GPT layer totals
    sbh(34 + 5as/h), equation 1), extended to grouped-query attention and SwiGLU. ``"minizero"``: the precision's
    element size, plus the layer norms' mean and rstd (2 x sb, at least fp32); Q, K, V counted once (views of one
    c_attn output). ``moe``: an MoE block (``ep`` expert ranks), :func:`routed_rows` for the MLP's.
    """
    m = as_shape(model)
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting {accounting!r} is not one of {ACCOUNTINGS}")
    e = activation_element(precision, accounting)
    s, b, h, a, f, kv = seq_len, micro_batch, m.hidden, m.n_head, m.ffn_hidden, m.kv_hidden
    sbh, ass = s * b * h, a * s * s * b
    mask = 1 if m.dropout else 0
    stats = accounting == "minizero"
    stat_e = max(e, 4)
    rows = [Saved("ln_1 input (the layer input)", e * sbh, "sp", "pre")]
    if stats:
        rows.append(Saved("ln_1 mean and rstd", 2 * stat_e * s * b, "sp", "pre", arrays=2))
    rows += [Saved("QKV matmul input (ln_1 output)", e * sbh, "sp", "pre"),
             Saved("Q, K, V", e * s * b * (h + 2 * kv), "tp", "pre", arrays=3),
             Saved("softmax output", e * ass, "tp", "core", packs=2 if stats and not mask else 1)]
    if mask:
        rows += [Saved("attention dropout mask", ass, "tp", "core"),
                 Saved("attention dropout output", e * ass, "tp", "core")]
    rows.append(Saved("attention projection input", e * sbh, "tp", "post"))
    if mask:
        rows.append(Saved("attention output dropout mask", sbh, "sp", "post"))
    rows.append(Saved("ln_2 input", e * sbh, "sp", "post"))
    if stats:
        rows.append(Saved("ln_2 mean and rstd", 2 * stat_e * s * b, "sp", "post", arrays=2))
    if moe:  # the router's matmul saves ln_2's output; the experts save their dispatched rows (routed_rows)
        rows.append(Saved("router input (ln_2 output)", e * sbh, "sp", "post"))
        return narrow_linear_rows(rows, m, precision, e) + routed_rows(m, s * b, e, accounting, ep, precision)
    rows.append(Saved("MLP input (ln_2 output)", e * sbh, "sp", "post"))
    if m.mlp == "gelu":
        rows += [Saved("GeLU input", e * s * b * f, "tp", "post"),
                 Saved("GeLU output (second linear input)", e * s * b * f, "tp", "post")]
    else:
        rows += [Saved("gate projection output (SiLU input)", e * s * b * f, "tp", "post"),
                 Saved("SiLU output", e * s * b * f, "tp", "post"),
                 Saved("up projection output", e * s * b * f, "tp", "post"),
                 Saved("SiLU x up (down projection input)", e * s * b * f, "tp", "post")]
    if mask:
        rows.append(Saved("MLP dropout mask", sbh, "sp", "post"))
    return narrow_linear_rows(rows, m, precision, e)


def routed_rows(model, tokens: int, e: int, accounting: str = "paper", ep: int = 1,
                precision: str = "mixed") -> list[Saved]:
    """What an MoE block saves beyond its input for ``tokens`` routed as one group: the most there can be.

    Rows kept here R_out = min(E C, T k), rows the E/ep local experts process R_in = min(E C, ep T k). Each
    processed row keeps its input (h) and hidden rows (GeLU 2 f_e, SwiGLU 4 f_e); each kept row its expert
    output (h) and gate. Router: ``"paper"`` the (T, E) probabilities; ``"minizero"`` the softmax exponentials
    (T, E), 3 (T,) arrays (row sums, log-sum-exp in and out) and the Switch loss's (E,), at least float32 (routing
    runs in float32 under fp16), and under bf16 (GeLU experts) each expert product's input and weight as bits
    (SwiGLU experts under bf16: the float rows, a bound). Shared experts:
    dense MLP rows of width f_e. ``"minizero"`` EQUALS the ledger's activation peak when every expert fills its
    C slots on every rank (tests/test_plan_moe.py), an UPPER BOUND otherwise. Hidden rows split by tp in the paper
    accounting (Megatron-Core), whole in ``"minizero"``'s (the MoE layer replicated in the tensor group).
    """
    m = as_shape(model)
    t, h, fe, k, n = tokens, m.hidden, m.expert_hidden, m.top_k, m.experts
    r_out = min(n * m.capacity(t), t * k)
    r_in = min(n * m.capacity(t), ep * t * k)
    hidden = 2 if m.mlp == "gelu" else 4
    split = "tp" if accounting == "paper" else "rep"
    if accounting == "minizero":
        r_e = max(e, 4)
        rows = [Saved("router softmax exponentials (T, E)", r_e * t * n, "rep", "post"),
                Saved("router softmax sums, log-sum-exp input and output (T each)", 3 * r_e * t, "rep", "post",
                      arrays=3),
                Saved("Switch loss load fractions (E)", r_e * n, "rep", "post")]
    else:
        rows = [Saved("router probabilities (T, E)", e * t * n, "rep", "post")]
    if accounting == "minizero" and precision in LINEAR_SAVES and m.mlp == "gelu":  # BF16Matmul (memory/bf16.py)
        per, local = LINEAR_SAVES[precision][0], n // ep
        rows += [Saved(f"expert inputs (R_in rows, {precision})", per * r_in * h, "rep", "post"),
                 Saved("GeLU input (R_in rows)", e * r_in * fe, "rep", "post"),
                 Saved(f"GeLU output (R_in rows, {precision})", per * r_in * fe, "rep", "post"),
                 Saved(f"the local experts' weights ({precision}, one copy per call)", per * local * 2 * h * fe, "rep",
                       "post", arrays=2 * local)]
    else:
        rows += [Saved("expert inputs (R_in rows)", e * r_in * h, "rep", "post"),
                 Saved("expert hidden activations (R_in rows)", hidden * e * r_in * fe, split, "post", arrays=hidden)]
    rows.append(Saved("expert outputs and gates (R_out rows)", e * r_out * (h + 1), "rep", "post", arrays=2))
    if m.shared_experts:
        rows.append(Saved("shared experts' hidden activations", m.shared_experts * hidden * e * t * fe, split, "post",
                          arrays=m.shared_experts * hidden))
    return rows


def saved_outside_layers(model, seq_len: int, micro_batch: int, accounting: str = "paper",
                         precision: str = "mixed", tp: int = 1) -> tuple[list[Saved], list[Saved]]:
    """What the embedding (first stage) and the head (last stage) save, one micro-batch (bytes).

    ``"paper"``, following Korthikanti et al. 2022, section 4.3: the embedding dropout mask sbh; the final norm input
    2sbh and the output projection input 2sbh; the logits kept in fp32 for the cross-entropy, 4sbV (vocab-parallel,
    split by t). ``"minizero"``: int64 token ids, positions and targets; the final norm's input and statistics, the LM
    head input, the logits in the activation dtype and the log-sum-exp (functional.py: Embedding, LayerNorm, Linear,
    CrossEntropy). Under ``tp`` > 1 vocab_parallel.py's instead: each tensor rank saves token ids and targets local
    to its vocabulary (int64, new arrays, not the caller's batch) and a bool mask beside each. Returns (embedding
    rows, head rows).
    """
    m = as_shape(model)
    e = activation_element(precision, accounting)
    s, b, h, v = seq_len, micro_batch, m.hidden, m.vocab_size
    stat_e = max(e, 4)
    emb, head = [], []
    if m.dropout:
        emb.append(Saved("embedding dropout mask", s * b * h, "sp", "pre"))
    head += [Saved("final norm input", e * s * b * h, "sp", "post"),
             Saved("output projection input", e * s * b * h, "sp", "post")]
    if accounting == "minizero":
        if tp > 1:
            emb += [Saved("local token ids (int64)", 8 * s * b, "rep", "pre"),
                    Saved("in-vocabulary mask", s * b, "rep", "pre")]
            targets = [Saved("local targets (int64)", 8 * s * b, "rep", "post"),
                       Saved("own-target mask", s * b, "rep", "post")]
        else:
            emb.append(Saved("token ids (int64)", 8 * s * b, "sp", "pre"))
            targets = [Saved("targets (int64; the caller's batch, alive all step)", 8 * s * b, "sp", "held")]
        if m.learned_pos:
            emb.append(Saved("positions (int64)", 8 * s, "rep", "pre"))  # whole under sequence parallelism too
        head += [Saved("final norm mean and rstd", 2 * stat_e * s * b, "sp", "post", arrays=2),
                 Saved("logits (split by vocabulary over t)", e * s * b * v, "tp", "post"),
                 Saved("log-sum-exp", stat_e * s * b, "rep", "post"), *targets]  # the head sees the whole sequence
    else:
        head.append(Saved("logits (fp32, for the loss)", 4 * s * b * v, "tp", "post"))
    return emb, narrow_linear_rows(head, m, precision, e)


def narrow_linear_rows(rows: list[Saved], model, precision: str, e: int) -> list[Saved]:
    """``rows`` (``e`` bytes per element) with what each Linear saves under ``precision`` (:data:`LINEAR_SAVES`).

    bf16 (``memory/bf16.py``): the input and the weight as uint16 bits, 2 bytes per element, a new weight copy per
    call; fp8 (``memory/fp8.py``): their E4M3 codes, 1 byte, plus two 4-byte scales. The float32 input the
    Linear read is then saved by nobody (its row's float bytes go). SwiGLU's gate and up read one input: two copies.
    """
    if precision not in LINEAR_SAVES:
        return rows
    m = as_shape(model)
    h, f, kv, v = m.hidden, m.ffn_hidden, m.kv_hidden, m.vocab_size
    weights = {"QKV matmul input (ln_1 output)": [(h + 2 * kv) * h], "attention projection input": [h * h],
               "MLP input (ln_2 output)": [f * h] * (2 if m.mlp == "swiglu" else 1),
               "router input (ln_2 output)": [h * m.experts],
               "GeLU output (second linear input)": [h * f], "SiLU x up (down projection input)": [h * f],
               "output projection input": [v * h]}
    per, scales = LINEAR_SAVES[precision]
    out = []
    for r in rows:
        if r.name not in weights:
            out.append(r)
            continue
        n = len(weights[r.name])
        out += [Saved(f"{r.name} ({precision})", per * r.nbytes // e * n, r.split, r.part, arrays=n),
                Saved(f"{r.name}: its weight ({precision})", per * sum(weights[r.name]), "tp", r.part, arrays=n)]
        if scales:
            out.append(Saved(f"{r.name}: scales", scales * n, "rep", r.part, arrays=2 * n))
    return out


def context_parallel_rows(rows: list[Saved], model, local_seq: int, micro_batch: int,
                          precision: str = "mixed", name: str = "ring attention",
                          accounting: str = "paper") -> list[Saved]:
    """A layer's rows with a blockwise attention core: ``rows`` (at the local length s/c under context
    parallelism) with the core's output and log-sum-exp in place of the (s, s) "core" rows.

    Ring attention (``parallel/context_parallel.py``) and FlashAttention (``nn/flash_attention.py``, Dao et
    al. 2022) keep no (s, s) probabilities: instead of the "core" rows (Korthikanti's 5as^2b) they save
    their output (b, a, s, h/a) and the row log-sum-exp (b, a, s) in at least fp32.
    """
    m = as_shape(model)
    e = activation_element(precision, accounting)
    s, b = local_seq, micro_batch
    return [r for r in rows if r.part != "core"] + [
        Saved(f"{name} output", e * s * b * m.hidden, "tp", "core"),
        Saved(f"{name} log-sum-exp", max(e, 4) * m.n_head * s * b, "tp", "core")]


def layer_activation_bytes(model, seq_len: int | None = None, micro_batch: int = 1, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           accounting: str = "paper", precision: str = "mixed", cp: int = 1,
                           attention: str = "dense", cp_attention: str = "ring") -> int:
    """Bytes one transformer layer keeps for backward on one of ``tp`` ranks, one micro-batch.

    Korthikanti et al. 2022, Table 2: sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht)); + sequence
    parallel sbh(34/t + 5as/(ht)); selective drops the 5as/h term; full recompute 2sbh (2sbh/t with sequence
    parallelism). cp > 1: rows of s/cp tokens, ring attention's output and log-sum-exp replacing the s^2 terms
    (:func:`context_parallel_rows`), as ``attention="flash"`` does at any cp (Ulysses' dense core: :func:`layer_rows`).
    """
    m, s = layer_shape_and_seq_len(model, seq_len, tp=tp, cp=cp, micro_batch=micro_batch, recompute=recompute,
                                   precision=precision, cp_attention=cp_attention)
    rows = layer_rows(m, s, micro_batch, accounting, precision, cp, attention, cp_attention=cp_attention)
    return round(_layer_stored(rows, tp, sequence_parallel, recompute))


def layer_rows(model, seq_len: int, micro_batch: int, accounting: str = "paper", precision: str = "mixed",
               cp: int = 1, attention: str = "dense", moe: bool = False, ep: int = 1,
               cp_attention: str = "ring") -> list[Saved]:
    """One layer's saved arrays on one of ``cp`` context-parallel ranks: :func:`saved_per_layer` at s/cp
    tokens, with ring attention's core when cp > 1 and FlashAttention's with ``attention="flash"``
    (:func:`context_parallel_rows`); ``moe``: an MoE block's (:func:`routed_rows`). Ulysses (``cp_attention``)
    with the dense core: that core's (s, s) rows at the whole length, for H/cp heads. The one source of the
    per-layer rows for :func:`layer_activation_bytes`, :func:`activation_bytes` and the offload traffic.
    Raises: ValueError for an ``attention`` outside ``ATTENTIONS``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
    s = seq_len // cp
    rows = saved_per_layer(model, s, micro_batch, accounting, precision, moe, ep)
    if cp > 1 and cp_attention == "ulysses" and attention == "dense":  # all T tokens of H/cp heads (ulysses.py)
        whole = saved_per_layer(model, seq_len, micro_batch, accounting, precision, moe, ep)
        return [r for r in rows if r.part != "core"] + [dataclasses.replace(r, nbytes=r.nbytes // cp)
                                                        for r in whole if r.part == "core"]
    if cp > 1 or attention == "flash":
        return context_parallel_rows(rows, model, s, micro_batch, precision,
                                     "ring attention" if cp > 1 else "flash attention", accounting)
    return rows


def _layer_stored(rows, tp, sp, recompute) -> float:
    if recompute == "full":
        return rows[0].per_rank(tp, sp)  # the layer input
    return sum(r.per_rank(tp, sp) for r in rows if recompute == "none" or r.part != "core")


def _layer_transient(rows, tp, sp, recompute) -> float:
    """Extra bytes alive while one layer's backward recomputes (beyond what it stored)."""
    total = sum(r.per_rank(tp, sp) for r in rows)
    if recompute == "full":  # the whole layer again, its input shared
        return total - rows[0].per_rank(tp, sp)
    if recompute == "selective":  # the attention core again; the MLP and projection inputs are freed by then
        core = sum(r.per_rank(tp, sp) for r in rows if r.part == "core")
        post = sum(r.per_rank(tp, sp) for r in rows if r.part == "post")
        return max(0.0, core - post)
    return 0.0


def in_flight(strategy: Strategy, stage: int = 0) -> tuple[int, int]:
    """(micro-batch chunks whose activations pipeline stage ``stage`` holds at its peak, layers per chunk).

    GPipe (Huang et al. 2019): all m micro-batches. 1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2.1):
    stage i holds min(p - i, m). Interleaved with v chunks (section 2.2.2; Megatron-LM's warm-up count): stage i holds
    min(2(p - i - 1) + (v - 1)p + 1, mv) chunks of L/(pv) layers, which for stage 0 is p(1 + (p-1)/(pv)) micro-batches'
    worth of L/p layers (Korthikanti et al. 2022, section 4.2.3). Returns (chunks in flight, v).
    """
    p, m, v = strategy.pp, strategy.micro_batches, strategy.virtual_stages
    if strategy.schedule == "gpipe":
        chunks = m
    elif strategy.schedule == "interleaved":
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    else:
        chunks = min(p - stage, m)
    return chunks, v


def activation_bytes(model, strategy: Strategy, seq_len: int | None = None, accounting: str = "paper",
                     stage: int = 0) -> tuple[int, int]:
    """Peak activation bytes of pipeline stage ``stage`` on one rank: (on the device, offloaded to host).

    peak = stored per layer x layers x micro-batches in flight (:func:`in_flight`) + embedding rows (stage 0) + head
    rows (last stage) + max(0, recompute transient - head); ``"minizero"`` (not gpipe) adds the token ids and targets of
    the micro-batches already done, alive until the step ends. With ``offload_activations``: ``"paper"`` keeps one layer
    brought back plus the transient on the device; ``"minizero"`` keeps arrays under :data:`OFFLOAD_MIN_BYTES` and the
    recompute transient, the rest on the host once per buffer.
    """
    m = as_shape(model)
    s = seq_len or m.seq_len
    st = strategy
    t, sp = st.tp, st.sequence_parallel
    rows = layer_rows(m, s, st.micro_batch, accounting, st.precision, st.cp, st.attention,  # cp > 1: s/cp tokens
                      cp_attention=st.cp_attention)
    emb_rows, head_rows = saved_outside_layers(m, s // st.cp, st.micro_batch, accounting, st.precision, t)
    chunks, v = in_flight(st, stage)
    layers_per_chunk = m.n_layer // (st.pp * v)
    moe_share = 0.0  # MoE blocks per chunk (a stage's chunks each hold the mean), their rows in place of the MLP's
    if m.experts:
        moe_rows = layer_rows(m, s, st.micro_batch, accounting, st.precision, st.cp, st.attention, True, st.ep,
                              st.cp_attention)
        moe_share = sum(m.is_moe_layer(i) for i in stage_layers(m, st, stage)) / v
        if moe_share and _layer_transient(moe_rows, t, sp, st.recompute) > _layer_transient(rows, t, sp, st.recompute):
            rows, moe_rows = moe_rows, rows  # the transient of the larger block; the mix below is symmetric
            moe_share = layers_per_chunk - moe_share
    per_layer = _layer_stored(rows, t, sp, st.recompute)
    if moe_share:
        per_moe = _layer_stored(moe_rows, t, sp, st.recompute)
        stored = (per_layer * (layers_per_chunk - moe_share) + per_moe * moe_share) * chunks
        per_layer = max(per_layer, per_moe)
        if st.offload_activations and accounting == "minizero":
            dense = _offloaded_activations(rows, emb_rows, head_rows, st, stage, chunks, v,
                                           layers_per_chunk - moe_share)
            routed = _offloaded_activations(moe_rows, [], [], st, -1, chunks, v, moe_share)
            return dense[0] + routed[0], dense[1] + routed[1]
    else:
        stored = per_layer * layers_per_chunk * chunks
    head = 0.0
    if stage == 0:
        stored += sum(r.per_rank(t, sp) for r in emb_rows) * math.ceil(chunks / v)
    if stage == st.pp - 1:
        stored += sum(r.per_rank(t, sp) for r in head_rows) * (st.micro_batches if st.schedule == "gpipe" else 1)
        head = sum(r.per_rank(t, sp) for r in head_rows if r.part != "held")  # freed before the last layer's backward
    if accounting == "minizero" and st.schedule != "gpipe":  # gpipe: every micro-batch is in flight already
        # the step holds its m (x, y) pairs to its end (the loop's list; schedules index it), so the token ids and
        # targets saved by micro-batches already done stay alive, and counted, until the last one's peak
        if stage == 0:
            ids = sum(r.per_rank(t, sp) for r in emb_rows if r.name.startswith("token ids"))
            stored += ids * max(0, st.micro_batches - math.ceil(chunks / v))
        if stage == st.pp - 1:
            stored += sum(r.per_rank(t, sp) for r in head_rows if r.part == "held") * (st.micro_batches - 1)
    transient = _layer_transient(rows, t, sp, st.recompute)
    if st.offload_activations and accounting == "minizero":
        return _offloaded_activations(rows, emb_rows, head_rows, st, stage, chunks, v, layers_per_chunk)
    if st.offload_activations:
        return round(per_layer + transient), round(stored)
    return round(stored + max(0.0, transient - head)), 0


def _offload_split(row: Saved, tp: int, sp: bool) -> tuple[float, float]:
    """(bytes left on the device, bytes copied off) for one row under minizero's activation offload."""
    per = row.per_rank(tp, sp)
    if per / row.arrays < OFFLOAD_MIN_BYTES:  # ActivationOffload keeps arrays under min_bytes
        return per, 0.0
    return 0.0, per  # one copy per buffer, however many saves (memory/offload.py)


def _offloaded_activations(rows, emb_rows, head_rows, st, stage, chunks, v, layers_per_chunk):
    """(device, host) activation bytes under minizero's activation offload (see :func:`activation_bytes`).

    The recompute transient: what the recomputed segment saves again, on the device. Its inputs come back from the
    offload as the host copy (cpu: already counted as ``offloaded``, so not again) or as a fresh array read from the
    file (nvme: counted as activations when the recompute saves it). Full: the whole layer (its input only with nvme);
    selective: the attention core (and Q, K, V with nvme).
    """
    t, sp = st.tp, st.sequence_parallel
    fresh = st.offload_tier == "nvme"
    if st.recompute == "full":
        layer = [rows[0]]  # the checkpoint saves only the layer input
        again = rows if fresh else rows[1:]
    else:
        layer = [r for r in rows if st.recompute == "none" or r.part != "core"]
        again = [] if st.recompute == "none" else \
            [r for r in rows if r.part == "core" or (fresh and r.name == "Q, K, V")]
    transient = sum(r.per_rank(t, sp) for r in again)

    def split(rs):
        parts = [_offload_split(r, t, sp) for r in rs]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    dev_l, host_l = split(layer)
    device, host = dev_l * layers_per_chunk * chunks, host_l * layers_per_chunk * chunks
    head_dev = 0.0
    if stage == 0:
        d, h = split(emb_rows)
        device, host = device + d * math.ceil(chunks / v), host + h * math.ceil(chunks / v)
    if stage == st.pp - 1:
        times = st.micro_batches if st.schedule == "gpipe" else 1
        d, h = split(head_rows)
        device, host = device + d * times, host + h * times
        head_dev = split([r for r in head_rows if r.part != "held"])[0]
    return round(device + max(0.0, transient - head_dev)), round(host)
