"""Saved activation bytes per layer and per rank (Korthikanti et al. 2022, sections 4-5).

Part of :mod:`minizero.memory.estimator` (units, symbols and sources are in its docstring).
"""
from __future__ import annotations

import dataclasses
import math

from minizero.memory.estimator.model import ACCOUNTINGS, ATTENTIONS, OFFLOAD_MIN_BYTES, PRECISIONS, Strategy, as_shape


# ---- activations: Korthikanti et al. 2022 -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Saved:
    """One array a transformer layer keeps for backward, for one micro-batch.

    ``nbytes``: the whole (unsplit) array. ``split``: "tp" — inside the tensor-parallel
    region, divided by t; "sp" — divided by t only with sequence parallelism; "rep" —
    replicated on every tensor rank.
    ``part``: "pre" (up to Q, K, V), "core" (softmax, dropout: what selective recompute
    drops), "post" (freed in backward before the attention core is recomputed),
    "held" (alive all step: the caller still holds it).
    ``arrays``: how many equal arrays the row is (Q, K and V are three views of one
    buffer; a layer norm's mean and rstd are two) -- activation offload decides per
    array whether it is small enough to stay (:data:`OFFLOAD_MIN_BYTES`).
    ``packs``: how many times each array passes through ``save_for_backward`` (minizero's
    softmax output, saved by the softmax and by ``@ v`` when there is no dropout). The
    ledger counts a buffer once, and so does activation offload (issue 19: one copy per
    buffer, however many saves), so it no longer changes a byte count; kept as a fact.
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
                    precision: str = "mixed") -> list[Saved]:
    """What one transformer layer saves for backward, one row per array (bytes, one micro-batch).

    ``"paper"`` (Korthikanti et al. 2022, section 4.1, e = 2-byte activations, 1-byte
    dropout masks), for a GPT layer::

        attention: LN input 2sbh, QKV input 2sbh, Q and K 4sbh, V 2sbh,
                   softmax output 2as^2b, its dropout mask as^2b and output 2as^2b,
                   projection input 2sbh, dropout mask sbh             = 11sbh + 5as^2b
        MLP:       LN input 2sbh, first linear input 2sbh, GeLU input 8sbh,
                   GeLU output 8sbh, dropout mask sbh                  = 19sbh + (LN counted above)
        total      sbh (34 + 5as/h)                                      (equation 1)

    Generalised with the same counting to grouped-query attention (K and V are
    kv_hidden wide) and SwiGLU (gate, SiLU output, up projection and their product,
    each sbf, as unfused PyTorch saves them); no dropout, no masks.

    ``"minizero"``: e = the precision's element size (4 for fp32, 8 for fp64), plus
    the layer norms' mean and rstd (2 x sb in at least fp32); Q, K, V are views of one
    c_attn output (counted once). Per GPT block without dropout, fp32:
    64sbh + 4as^2b + 16sb bytes.
    """
    m = as_shape(model)
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting {accounting!r} is not one of {ACCOUNTINGS}")
    e = PRECISIONS[precision][2]
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
    return rows


def saved_outside_layers(model, seq_len: int, micro_batch: int, accounting: str = "paper",
                         precision: str = "mixed") -> tuple[list[Saved], list[Saved]]:
    """What the embedding (first stage) and the head (last stage) save, one micro-batch (bytes).

    ``"paper"``, following Korthikanti et al. 2022, section 4.3: the embedding
    dropout mask sbh; the final norm input 2sbh and the output projection input
    2sbh; the logits kept in fp32 for the cross-entropy, 4sbV (vocab-parallel, split
    by t). ``"minizero"``: int64 token ids, positions and targets; the final norm's
    input and statistics, the LM head input, the logits in the activation dtype and
    the log-sum-exp (functional.py: Embedding, LayerNorm, Linear, CrossEntropy).
    Returns (embedding rows, head rows).
    """
    m = as_shape(model)
    e = PRECISIONS[precision][2]
    s, b, h, v = seq_len, micro_batch, m.hidden, m.vocab_size
    stat_e = max(e, 4)
    emb, head = [], []
    if m.dropout:
        emb.append(Saved("embedding dropout mask", s * b * h, "sp", "pre"))
    head += [Saved("final norm input", e * s * b * h, "sp", "post"),
             Saved("output projection input", e * s * b * h, "sp", "post")]
    if accounting == "minizero":
        emb.append(Saved("token ids (int64)", 8 * s * b, "sp", "pre"))
        if m.learned_pos:
            emb.append(Saved("positions (int64)", 8 * s, "sp", "pre"))
        head += [Saved("final norm mean and rstd", 2 * stat_e * s * b, "sp", "post", arrays=2),
                 Saved("logits (the LM head is replicated)", e * s * b * v, "rep", "post"),
                 Saved("log-sum-exp", stat_e * s * b, "sp", "post"),
                 Saved("targets (int64; the caller's batch, alive all step)", 8 * s * b, "sp", "held")]
    else:
        head.append(Saved("logits (fp32, for the loss)", 4 * s * b * v, "tp", "post"))
    return emb, head


def context_parallel_rows(rows: list[Saved], model, local_seq: int, micro_batch: int,
                          precision: str = "mixed", name: str = "ring attention") -> list[Saved]:
    """A layer's rows with a blockwise attention core: ``rows`` (at the local length s/c under context
    parallelism) with the core's output and log-sum-exp in place of the (s, s) "core" rows.

    Ring attention (``parallel/context_parallel.py``) and FlashAttention (``nn/flash_attention.py``, Dao et
    al. 2022) keep no (s, s) probabilities: instead of the "core" rows (Korthikanti's 5as^2b) they save
    their output (b, a, s, h/a) and the row log-sum-exp (b, a, s) in at least fp32.
    """
    m = as_shape(model)
    e = PRECISIONS[precision][2]
    s, b = local_seq, micro_batch
    return [r for r in rows if r.part != "core"] + [
        Saved(f"{name} output", e * s * b * m.hidden, "tp", "core"),
        Saved(f"{name} log-sum-exp", max(e, 4) * m.n_head * s * b, "tp", "core")]


def layer_activation_bytes(model, seq_len: int | None = None, micro_batch: int = 1, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           accounting: str = "paper", precision: str = "mixed", cp: int = 1,
                           attention: str = "dense") -> int:
    """Bytes one transformer layer keeps for backward on one of ``tp`` ranks, one micro-batch.

    Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte masks)::

        no parallelism                     sbh (34 + 5as/h)
        tensor parallel t                  sbh (10 + 24/t + 5as/(ht))
        + sequence parallel                sbh (34/t + 5as/(ht))
        tensor parallel + selective        sbh (10 + 24/t)
        + sequence parallel + selective    sbh (34/t)
        full recompute                     2sbh   (the layer input)

    One deviation from Table 2: with sequence parallelism the layer input kept by
    full recompute is itself split along s, so full recompute + SP gives 2sbh/t
    (as Megatron-LM stores it).

    ``cp`` > 1 (context parallelism): the rows of s/cp tokens, ring attention's output and
    log-sum-exp in place of the s^2 terms (:func:`context_parallel_rows`); ``attention="flash"``: the
    same two rows in place of the s^2 terms at any cp (sbh(34 + 5as/h) loses its 5as/h).
    """
    m = as_shape(model)
    rows = layer_rows(m, seq_len or m.seq_len, micro_batch, accounting, precision, cp, attention)
    return round(_layer_stored(rows, tp, sequence_parallel, recompute))


def layer_rows(model, seq_len: int, micro_batch: int, accounting: str = "paper", precision: str = "mixed",
               cp: int = 1, attention: str = "dense") -> list[Saved]:
    """One layer's saved arrays on one of ``cp`` context-parallel ranks: :func:`saved_per_layer` at s/cp
    tokens, with ring attention's core when cp > 1 and FlashAttention's with ``attention="flash"``
    (:func:`context_parallel_rows`). The one source of the per-layer rows for
    :func:`layer_activation_bytes`, :func:`activation_bytes` and the offload traffic.
    Raises: ValueError for an ``attention`` outside ``ATTENTIONS``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
    s = seq_len // cp
    rows = saved_per_layer(model, s, micro_batch, accounting, precision)
    if cp > 1 or attention == "flash":
        return context_parallel_rows(rows, model, s, micro_batch, precision,
                                     "ring attention" if cp > 1 else "flash attention")
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

    GPipe (Huang et al. 2019): all m micro-batches. 1F1B (PipeDream-Flush;
    Narayanan et al. 2021, section 2.2.1): stage i holds min(p - i, m). Interleaved
    with v chunks (section 2.2.2; Megatron-LM's warm-up count): stage i holds
    min(2(p - i - 1) + (v - 1)p + 1, mv) chunks of L/(pv) layers, which for stage 0
    is p(1 + (p-1)/(pv)) micro-batches' worth of L/p layers (Korthikanti et al.
    2022, section 4.2.3). Returns (chunks in flight, v); a chunk is L/(pv) layers.
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

    peak = (stored per layer) x (layers x micro-batches in flight, :func:`in_flight`)
         + embedding rows x micro-batches in flight (stage 0)
         + head rows (last stage, one micro-batch in flight; m under GPipe)
         + max(0, recompute transient - head): the layer being recomputed in backward
           (full: the whole layer; selective: the attention core, once the MLP is freed).
           The head's arrays are freed before the last layer is recomputed, so the two
           never coexist (checked against the ledger for minizero).
    With ``offload_activations`` the stored arrays live on the host (or in files):

    * ``"paper"``: the device holds one layer's arrays brought back plus the transient.
    * ``"minizero"`` (``memory/offload.py`` on NumPy, where the array brought back *is*
      the host copy): arrays under :data:`OFFLOAD_MIN_BYTES` stay on the device, every
      other one is copied off once per buffer (however many saves: :attr:`Saved.packs`);
      the layer recompute rebuilds in backward is not offloaded (backward runs outside
      the offload context), so device = small arrays + max(0, transient - the head's
      small arrays); host = the copies.
    """
    m = as_shape(model)
    s = seq_len or m.seq_len
    st = strategy
    t, sp = st.tp, st.sequence_parallel
    rows = layer_rows(m, s, st.micro_batch, accounting, st.precision, st.cp, st.attention)  # cp > 1: s/cp tokens
    emb_rows, head_rows = saved_outside_layers(m, s // st.cp, st.micro_batch, accounting, st.precision)
    chunks, v = in_flight(st, stage)
    layers_per_chunk = m.n_layer // (st.pp * v)
    per_layer = _layer_stored(rows, t, sp, st.recompute)
    stored = per_layer * layers_per_chunk * chunks
    head = 0.0
    if stage == 0:
        stored += sum(r.per_rank(t, sp) for r in emb_rows) * math.ceil(chunks / v)
    if stage == st.pp - 1:
        stored += sum(r.per_rank(t, sp) for r in head_rows) * (st.micro_batches if st.schedule == "gpipe" else 1)
        head = sum(r.per_rank(t, sp) for r in head_rows if r.part != "held")  # freed before the last layer's backward
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

    The recompute transient: what the recomputed segment saves again, on the device. Its
    inputs come back from the offload as the host copy (cpu: already counted as
    ``offloaded``, so not again) or as a fresh array read from the file (nvme: counted
    as activations when the recompute saves it). Full: the whole layer (its input only
    with nvme); selective: the attention core (and Q, K, V with nvme).
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
