"""The analytic model: per-rank bytes, messages and FLOPs of training a transformer, without running it.

Every technique answers *where does each byte live, and which messages move it?*
The ledger measures the answer for minizero's own models; this module predicts it
for any transformer and any strategy, from the formulas of the papers::

    per rank = parameters + gradients + optimizer_state     model states  (ZeRO, section 3 + 5, Figure 1)
             + activations                                   saved for backward (Korthikanti et al. 2022, 4-5)
             + comm_buffers + gathered                       reduce buckets, p2p, ZeRO-3's gathered layer
             (+ offloaded: bytes moved to host memory, not on the device;
                + nvme: bytes moved to files, in no memory at all)

Units: every function returns **bytes** (Python ints) unless its name says
otherwise; sizes of tensors are *elements*. When printing, say which unit:
``GB`` = 10**9 bytes (the ZeRO paper's unit, :func:`gb`), ``GiB`` = 2**30 bytes
(what ``nvidia-smi`` and minizero's ledger print, :func:`gib`).

Symbols (Korthikanti et al. 2022, Table 1): a heads, b micro-batch size, h hidden
size, L layers, p pipeline size, s sequence length, t tensor-parallel size,
V vocabulary, f FFN size; Psi parameters, N_d data-parallel size, K optimizer
bytes per parameter (Rajbhandari et al. 2020, section 3.1).

Two accountings:

* ``"paper"`` — the papers' layouts. Activations as Korthikanti et al. 2022,
  section 4.1 count them: 16-bit (the precision's element size), 1-byte dropout
  masks, small per-row statistics ignored (reproduces ``sbh(34 + 5as/h)`` and
  Table 2); vocab-parallel embedding and head (Megatron-LM); a fixed-size reduce
  bucket; ZeRO-3 prefetching one unit ahead.
* ``"minizero"`` — exactly what minizero does: what its Functions save
  (``autograd/functional.py``, ``ops.py``, ``nn/gpt.py``: float32/float64
  elements, layer-norm mean and rstd, int64 token ids, the logits in their own
  dtype), its replicated embedding and head under tensor parallelism, its
  buffers (``parallel/data_parallel.py``, ``memory/zero.py``) and its 8-bit Adam.
  ``tests/test_estimator.py`` checks it against the ledger (data parallel, ZeRO
  1-3, tensor parallel, pipeline, recompute, dropout); ``tests/test_compare.py``
  for every strategy of ``python -m minizero.compare`` (FP16 mixed precision,
  optimizer and activation offload to cpu and nvme, and their combinations with
  ZeRO and recompute) at 1, 2 and 4 ranks.

Sources: Rajbhandari et al. 2020, "ZeRO" (arXiv:1910.02054); Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198); Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters" (arXiv:2104.04473); Huang et al. 2019 "GPipe"; Ren et
al. 2021 "ZeRO-Offload"; Rajbhandari et al. 2021 "ZeRO-Infinity"; Dettmers et al.
2022 "8-bit Optimizers via Block-wise Quantization"; Kaplan et al. 2020.
"""
from __future__ import annotations

import dataclasses
import math

#: Per-rank categories, named as in the ledger (``minizero/ledger.py``) so an
#: estimate can be set beside ``ledger.peak``. ``offloaded`` is host memory.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "gathered",
              "offloaded")
DEVICE_CATEGORIES = CATEGORIES[:-1]

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
#: bytes per element: (parameters, gradients, activations, fp32 master copy, one Adam moment)
PRECISIONS = {"fp64": (8, 8, 8, 0, 8), "fp32": (4, 4, 4, 0, 4), "mixed": (2, 2, 2, 4, 4)}
OPTIMIZERS = ("adam", "adam8bit")
OFFLOAD = ("none", "optimizer", "params")
#: where offloaded bytes go: "cpu" host memory (the ledger's ``offloaded``), "nvme" files (not in memory)
OFFLOAD_TIERS = ("cpu", "nvme")
#: minizero.memory.offload.ActivationOffload keeps saved arrays under this many bytes on the device
OFFLOAD_MIN_BYTES = 1024
SCHEDULES = ("1f1b", "gpipe", "interleaved")
ACCOUNTINGS = ("paper", "minizero")
#: block-wise 8-bit Adam: one fp32 absmax per block of elements per moment. Dettmers et al. 2022
#: used 2048; bitsandbytes (and minizero.optim.adam8bit) use 256. Tensors under 4096 elements
#: keep their moments in fp32 (bitsandbytes' min_8bit_size; counted in the "minizero" accounting).
QUANT_BLOCK, MIN_8BIT_SIZE = 256, 4096


def gb(nbytes: float) -> float:
    """Bytes -> GB, 1 GB = 10**9 bytes (the ZeRO paper's unit)."""
    return nbytes / 1e9


def gib(nbytes: float) -> float:
    """Bytes -> GiB, 1 GiB = 2**30 bytes."""
    return nbytes / 2 ** 30


def precision_for_dtype(dtype) -> str:
    """The :class:`Strategy` precision of a minizero training dtype: float64 -> "fp64", float32 -> "fp32"."""
    name = getattr(dtype, "name", str(dtype))
    table = {"float64": "fp64", "float32": "fp32", "float16": "mixed"}
    if name not in table:
        raise ValueError(f"no precision for dtype {name!r}; allowed: {sorted(table)}")
    return table[name]


# ---- the model --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape; sizes are element counts.

    ``mlp``: ``"gelu"`` (two matrices h x f, GPT) or ``"swiglu"`` (three, LLaMA;
    Shazeer 2020). ``norm``: ``"layernorm"`` (weight and bias) or ``"rmsnorm"``
    (weight). ``learned_pos``: a learned position table of ``seq_len`` rows (GPT)
    instead of rotary embeddings (LLaMA). ``tied_embeddings``: the LM head reuses
    the token embedding. ``dropout``: dropout layers are active (their 1-byte masks
    are saved; Korthikanti et al. count them, LLaMA trains without).
    ``seq_len`` is the model's context, the default sequence length.
    """

    name: str
    n_layer: int
    hidden: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    learned_pos: bool = True
    tied_embeddings: bool = True
    dropout: bool = True
    source: str = ""

    def validate(self) -> "ModelShape":
        """Check every field; return self. Raises ValueError naming the field and what is allowed."""
        for f in ("n_layer", "hidden", "n_head", "n_kv_head", "ffn_hidden", "vocab_size", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{f} must be a positive integer, got {v!r}")
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp {self.mlp!r} is not one of ('gelu', 'swiglu')")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm {self.norm!r} is not one of ('layernorm', 'rmsnorm')")
        return self

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): n_kv_head * head_dim (= hidden without grouped-query attention)."""
        return self.n_kv_head * (self.hidden // self.n_head)

    def layer_parameters(self, tp: int = 1) -> int:
        """Parameters of one transformer layer held by one of ``tp`` tensor-parallel ranks (elements).

        Matrices and the column-parallel biases are split by t; the row-parallel
        output biases and the norms are replicated (Shoeybi et al. 2019, section 3).
        GPT (t = 1): 12h^2 + 13h.
        """
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_hidden
        n_mats = 3 if self.mlp == "swiglu" else 2
        split = 2 * h * h + 2 * h * kv + n_mats * h * f  # Wq, Wo, Wk, Wv, MLP matrices
        replicated = 2 * (2 * h if self.norm == "layernorm" else h)
        if self.bias:
            split += h + 2 * kv + (n_mats - 1) * f  # qkv bias, fc (gate, up) biases
            replicated += 2 * h  # attention and MLP output biases
        return split // tp + replicated

    def embedding_parameters(self, tp: int = 1, vocab_parallel: bool = True) -> int:
        """Token table plus the learned position table, on one tensor rank (elements).

        Vocab-parallel (Megatron-LM; Shoeybi et al. 2019, section 3): ceil(V/t) rows per
        rank; otherwise replicated (minizero's tensor parallelism).
        """
        rows = math.ceil(self.vocab_size / tp) if vocab_parallel else self.vocab_size
        return rows * self.hidden + (self.seq_len * self.hidden if self.learned_pos else 0)

    def head_parameters(self, tp: int = 1, pp: int = 1, vocab_parallel: bool = True) -> int:
        """Final norm plus the output matrix on the last stage, on one tensor rank (elements).

        A tied head adds nothing when one stage holds both ends; with pp > 1 the last
        stage keeps its own copy of the embedding (Megatron-LM; Narayanan et al. 2021).
        """
        norm = 2 * self.hidden if self.norm == "layernorm" else self.hidden
        has_matrix = not self.tied_embeddings or pp > 1
        rows = math.ceil(self.vocab_size / tp) if vocab_parallel else self.vocab_size
        return norm + (rows * self.hidden if has_matrix else 0)

    def tensor_sizes(self) -> list[int]:
        """Element counts of every parameter tensor (t = 1), in model order; Q, K, V fused as in GPT-2."""
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_hidden
        norm = [h, h] if self.norm == "layernorm" else [h]
        layer = norm + [(h + 2 * kv) * h] + ([h + 2 * kv] if self.bias else []) + [h * h] + ([h] if self.bias else [])
        layer += norm
        if self.mlp == "gelu":
            layer += [f * h] + ([f] if self.bias else []) + [h * f] + ([h] if self.bias else [])
        else:
            layer += [f * h, f * h, h * f] + ([f, f, h] if self.bias else [])
        sizes = [self.vocab_size * h] + ([self.seq_len * h] if self.learned_pos else [])
        sizes += layer * self.n_layer + norm
        if not self.tied_embeddings:
            sizes.append(self.vocab_size * h)
        return sizes

    def num_parameters(self) -> int:
        """All distinct parameters Psi (tied head counted once). GPT: 12Lh^2 + 13Lh + (V + s + 2)h."""
        return self.n_layer * self.layer_parameters() + self.embedding_parameters() + self.head_parameters()

    @classmethod
    def from_gpt_config(cls, cfg, name: str = "minizero") -> "ModelShape":
        """The shape of a :class:`minizero.nn.gpt.GPTConfig` (GELU MLP of 4C, LayerNorm, biases, tied head)."""
        return cls(name=name, n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_head,
                   ffn_hidden=4 * cfg.n_embd, vocab_size=cfg.vocab_size, seq_len=cfg.block_size,
                   dropout=cfg.dropout > 0, source="minizero/nn/gpt.py").validate()


def as_shape(model) -> ModelShape:
    """A :class:`ModelShape` from a ModelShape or a minizero ``GPTConfig``."""
    if isinstance(model, ModelShape):
        return model.validate()
    if hasattr(model, "n_embd"):
        return ModelShape.from_gpt_config(model)
    raise TypeError(f"expected a ModelShape or a GPTConfig, got {type(model).__name__}")


# ---- the strategy -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the training job is laid out, for one optimizer step.

    World size = dp * tp * pp. Each rank runs ``micro_batches`` (m) micro-batches
    of ``micro_batch`` (b) sequences per step, so the global batch is dp * b * m
    sequences.

    Fields:
        dp, tp, pp: data-, tensor- and pipeline-parallel sizes.
        zero: ZeRO-DP stage over the dp ranks: 0 none, 1 P_os, 2 P_os+g, 3 P_os+g+p.
        sequence_parallel: split the layer norms and dropouts along s over the
            tensor group (Korthikanti et al. 2022, section 4.2.2); needs tp > 1.
        recompute: "none", "selective" (attention core; section 5) or "full" (keep
            only each layer's input; Chen et al. 2016).
        precision: "mixed" (16-bit params/grads/activations, fp32 master + Adam,
            K = 12), "fp32" (K = 8) or "fp64" (minizero's test dtype, K = 16).
        optimizer: "adam" or "adam8bit" (block-wise 8-bit moments).
        offload: "none"; "optimizer" (ZeRO-Offload: optimizer state and gradient
            shard in host memory, Ren et al. 2021, which builds on ZeRO-2; minizero's
            ``--offload-optimizer`` moves the optimizer state -- FP32 masters, m, v -- at
            any ZeRO stage, and its gradients stay on the device); "params"
            (ZeRO-Infinity: parameters too; needs zero 3, Rajbhandari et al. 2021).
        offload_activations: saved activations live in host memory between
            forward and backward (ZeRO-R P_a+cpu, section 6.1; minizero.memory.offload).
        offload_tier: where offloaded bytes go: "cpu" (host memory,
            ``MemoryEstimate.offloaded``) or "nvme" (files, ``MemoryEstimate.nvme``;
            ZeRO-Infinity's NVMe tier, Rajbhandari et al. 2021, section 5).
        schedule: pipeline schedule "1f1b" (PipeDream-Flush), "gpipe", or
            "interleaved" with ``virtual_stages`` model chunks per rank.
        bucket_bytes: size of the gradient reduce buffer; None means one flat
            buffer as large as all gradients (what minizero's DataParallel keeps).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "mixed"
    optimizer: str = "adam"
    offload: str = "none"
    offload_activations: bool = False
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    bucket_bytes: int | None = None
    offload_tier: str = "cpu"

    @property
    def world_size(self) -> int:
        """dp * tp * pp ranks."""
        return self.dp * self.tp * self.pp

    def validate(self, model: ModelShape | None = None) -> "Strategy":
        """Check every field (and divisibility by ``model``'s shape); return self.

        Raises:
            ValueError: naming the bad field, its value, and what is allowed.
        """
        for f in ("dp", "tp", "pp", "micro_batch", "micro_batches", "virtual_stages"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Strategy.{f} must be a positive integer, got {v!r}")
        choices = [("zero", ZERO_STAGES), ("recompute", RECOMPUTE), ("precision", tuple(PRECISIONS)),
                   ("optimizer", OPTIMIZERS), ("offload", OFFLOAD), ("schedule", SCHEDULES),
                   ("offload_tier", OFFLOAD_TIERS)]
        for f, allowed in choices:
            if getattr(self, f) not in allowed:
                raise ValueError(f"Strategy.{f}={getattr(self, f)!r} is not one of {allowed}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it splits along s over the tensor group)")
        if self.offload == "params" and self.zero != 3:
            raise ValueError(f"offload='params' needs zero=3 (ZeRO-Infinity), got zero={self.zero}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved'")
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 or None, got {self.bucket_bytes}")
        if model is not None:
            chunks = self.pp * self.virtual_stages
            if model.n_layer % chunks:
                raise ValueError(f"{model.n_layer} layers do not split into pp x virtual_stages = {chunks} "
                                 f"equal pipeline chunks")
            for f in ("n_head", "n_kv_head", "ffn_hidden"):
                if getattr(model, f) % self.tp:
                    raise ValueError(f"tp={self.tp} does not divide {f}={getattr(model, f)}")
        return self


def _bytes(strategy: Strategy) -> tuple[int, int, int, float]:
    """(param, grad, activation, optimizer-state K) bytes per element for the strategy's precision."""
    p, g, act, master, moment = PRECISIONS[strategy.precision]
    if strategy.optimizer == "adam8bit":
        k = master + 2 * (1 + 4 / QUANT_BLOCK)
    else:
        k = master + 2 * moment
    return p, g, act, k


# ---- model states: ZeRO -----------------------------------------------------------------------
def model_state_bytes(num_params: int, dp: int = 1, zero: int = 0, precision: str = "mixed",
                      optimizer: str = "adam") -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO-DP.

    Formula (Rajbhandari et al. 2020, section 5, Figure 1), Psi = ``num_params``,
    N_d = ``dp``, 2 bytes per 16-bit parameter and gradient, K bytes of optimizer
    state per parameter (mixed-precision Adam: fp32 master, momentum and variance,
    K = 12; section 3.1)::

        stage 0 (baseline)   (2 + 2 + K) Psi
        stage 1 (P_os)       2 Psi + 2 Psi + K Psi / N_d
        stage 2 (P_os+g)     2 Psi + (2 + K) Psi / N_d
        stage 3 (P_os+g+p)   (2 + 2 + K) Psi / N_d

    A shard is ceil(Psi / N_d) elements (the flat buffer padded to a multiple of
    N_d). fp32 training: 4 + 4 + 8; fp64: 8 + 8 + 16; 8-bit Adam: K = master +
    2 x (1 byte + 4/256 for the block-wise fp32 absmax; Dettmers et al. 2022, section 2,
    with bitsandbytes' block of 256).
    Returns {"parameters", "gradients", "optimizer_state"} in bytes.
    """
    s = Strategy(dp=dp, zero=zero, precision=precision, optimizer=optimizer).validate()
    pb, gbytes, _, k = _bytes(s)
    shard = math.ceil(num_params / dp)
    return {"parameters": pb * (shard if zero >= 3 else num_params),
            "gradients": gbytes * (shard if zero >= 2 else num_params),
            "optimizer_state": round(k * (shard if zero >= 1 else num_params))}


def stage_parameters(model, strategy: Strategy, stage: int = 0, vocab_parallel: bool = True) -> int:
    """Parameters (elements) of one pipeline stage on one tensor-parallel rank, before ZeRO sharding.

    Stage i holds L/p layers; stage 0 also the embeddings, stage p-1 the final norm and
    head (Narayanan et al. 2021, section 2.2). ``vocab_parallel``: the embedding and the
    head are split by t (Megatron-LM) or replicated (minizero).
    """
    m = as_shape(model)
    p, t = strategy.pp, strategy.tp
    n = (m.n_layer // p) * m.layer_parameters(t)
    if stage == 0:
        n += m.embedding_parameters(t, vocab_parallel)
    if stage == p - 1:
        n += m.head_parameters(t, p, vocab_parallel)
    return n


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
    ``packs``: how many times each array passes through ``save_for_backward``. The
    ledger counts a buffer once, but offload copies it once per save (minizero's
    softmax output, saved by the softmax and by ``@ v`` when there is no dropout).
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


def layer_activation_bytes(model, seq_len: int | None = None, micro_batch: int = 1, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           accounting: str = "paper", precision: str = "mixed") -> int:
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
    """
    m = as_shape(model)
    rows = saved_per_layer(m, seq_len or m.seq_len, micro_batch, accounting, precision)
    return round(_layer_stored(rows, tp, sequence_parallel, recompute))


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
      other one is copied off once per ``save_for_backward`` (:attr:`Saved.packs`);
      the layer recompute rebuilds in backward is not offloaded (backward runs outside
      the offload context), so device = small arrays + max(0, transient - the head's
      small arrays); host = the copies.
    """
    m = as_shape(model)
    s = seq_len or m.seq_len
    st = strategy
    t, sp = st.tp, st.sequence_parallel
    rows = saved_per_layer(m, s, st.micro_batch, accounting, st.precision)
    emb_rows, head_rows = saved_outside_layers(m, s, st.micro_batch, accounting, st.precision)
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
    return 0.0, per * row.packs


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


# ---- the whole rank ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes by ledger category, for one pipeline stage.

    ``offloaded`` is host memory; ``nvme`` is bytes in files (offload tier "nvme"), in
    neither the device total nor the ledger's memory categories (minizero reports them as
    the optimizer store's ``disk_bytes``).
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

    @property
    def total(self) -> int:
        """Device bytes: every category except ``offloaded``."""
        return sum(getattr(self, c) for c in DEVICE_CATEGORIES)

    def as_dict(self) -> dict:
        """{category: bytes} in :data:`CATEGORIES` order (the ledger's names)."""
        return {c: getattr(self, c) for c in CATEGORIES}


def _stage_estimate(m: ModelShape, st: Strategy, s: int, accounting: str, stage: int) -> MemoryEstimate:
    pb, gbytes, e, _ = _bytes(st)
    vocab_parallel = accounting == "paper"
    psi = stage_parameters(m, st, stage, vocab_parallel)
    states = model_state_bytes(psi, st.dp, st.zero, st.precision, st.optimizer)
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
    largest_unit = m.layer_parameters(st.tp)  # ZeRO gathers and reduces unit by unit: a layer (or the embedding)
    if stage == 0:
        largest_unit = max(largest_unit, m.embedding_parameters(st.tp, vocab_parallel))
    comm = gathered = 0
    if accounting == "minizero":
        # minizero's own buffers (parallel/data_parallel.py, memory/zero.py): stage 0 keeps flat
        # buckets for every gradient; stages 2-3 open one unit's full-size gradient bucket at a
        # time, and stage 3 gathers one unit at a time -- plus the tied token embedding, which is
        # used at both ends of the model and stays open (gathered) in between.
        tied = m.vocab_size * m.hidden if m.tied_embeddings and st.pp == 1 else 0
        if st.dp > 1 and st.zero == 0:
            comm += full_grads if st.bucket_bytes is None else min(st.bucket_bytes, full_grads)
        if st.zero >= 2:  # ZeroOptimizer runs (and opens its buckets) over one rank too
            comm += gbytes * (m.layer_parameters(st.tp) + tied)
        if st.zero == 3:
            gathered = pb * (m.layer_parameters(st.tp) + tied)
    else:
        if st.dp > 1 or st.offload != "none":  # the reduce (or copy-to-host) bucket; ZeRO-R section 6.2
            comm += full_grads if st.bucket_bytes is None else min(st.bucket_bytes, full_grads)
        if st.zero == 3 and (st.dp > 1 or st.offload == "params"):
            gathered = 2 * pb * largest_unit  # the unit running and the prefetched next one (section 5.3)
    if st.pp > 1:
        split = st.tp if st.sequence_parallel else 1
        boundary = e * s * st.micro_batch * m.hidden // split  # one (b, s, h) activation between stages
        if accounting == "minizero":  # parallel/pipeline.py: the dL/d(input) buffer it sends back (not stage 0);
            # two at once when backwards run back to back with no receive to flush the pending send
            # (the last stage under GPipe)
            back_to_back = stage == st.pp - 1 and st.schedule == "gpipe" and st.micro_batches > 1
            comm += (2 if back_to_back else 1) * boundary if stage > 0 else 0
        else:  # receive buffers: the activation forward, the gradient backward
            comm += 2 * boundary
    if st.offload_tier == "nvme":  # every offloaded byte goes to files instead of host memory
        return MemoryEstimate(params, grads, optim, act, comm, gathered, 0, stage, nvme=host)
    return MemoryEstimate(params, grads, optim, act, comm, gathered, host, stage)


def estimate_stages(model, strategy: Strategy, seq_len: int | None = None, accounting: str = "paper") -> list:
    """:class:`MemoryEstimate` of the first and the last pipeline stage (one entry when pp = 1).

    Every middle stage needs less than the first (fewer micro-batches in flight, no
    embedding), so these two bound every rank: a plan fits when both do.
    """
    return [estimate_memory(model, strategy, seq_len, accounting, stage=i) for i in sorted({0, strategy.pp - 1})]


def estimate_memory(model, strategy: Strategy, seq_len: int | None = None, accounting: str = "paper",
                    stage: int | None = None) -> MemoryEstimate:
    """Per-rank bytes of every category for ``model`` trained under ``strategy``.

    Args:
        model: a :class:`ModelShape` or a minizero ``GPTConfig``.
        strategy: the :class:`Strategy`; with a GPTConfig its precision must match the
            config's dtype (:func:`precision_for_dtype`).
        seq_len: tokens per sequence s (default: the model's context).
        accounting: "paper" or "minizero" (see the module docstring).
        stage: pipeline stage; None picks the stage with the largest device total
            (the first or the last: stage 0 holds the most micro-batches in flight and
            the embedding, the last holds the head).
    Returns:
        :class:`MemoryEstimate` (bytes). Model states: :func:`model_state_bytes` of
        the stage's parameters (:func:`stage_parameters`); activations:
        :func:`activation_bytes`. ``"paper"``: ``comm_buffers`` = the gradient reduce
        bucket (dp > 1, ``bucket_bytes``; ZeRO-R section 6.2) + pipeline receive buffers
        for an activation and a gradient (pp > 1); ``gathered`` = ZeRO-3's working set of
        two units (the one running and the prefetched next one). ``"minizero"``: its own
        buffers -- DataParallel's flat buckets over every gradient (ZeRO 0), one unit's
        gradient bucket (ZeRO 2-3) and one gathered unit (ZeRO 3), each plus the tied
        embedding, and the pipeline's dL/d(input) send buffer (stages > 0).
        Offload: ``"paper"`` moves the gradient and optimizer shards (ZeRO-Offload) and
        the parameter shard (``params``); ``"minizero"`` moves the optimizer state only
        (its ``OptimizerStateStore``). Offloaded bytes are ``offloaded`` (tier "cpu")
        or ``nvme`` (tier "nvme").
    Raises:
        ValueError: an invalid strategy or one that does not fit the shape (named).
    """
    m = as_shape(model)
    st = strategy.validate(m)
    if hasattr(model, "dtype") and not isinstance(model, ModelShape):
        want = precision_for_dtype(model.dtype)
        if st.precision != want:
            raise ValueError(f"strategy precision {st.precision!r} does not match the config's dtype "
                             f"{model.dtype!r} (use precision={want!r})")
    s = seq_len or m.seq_len
    if s < 1:
        raise ValueError(f"seq_len must be >= 1, got {s}")
    if stage is not None:
        if not 0 <= stage < st.pp:
            raise ValueError(f"stage must be in [0, {st.pp}), got {stage}")
        return _stage_estimate(m, st, s, accounting, stage)
    ests = [_stage_estimate(m, st, s, accounting, i) for i in sorted({0, st.pp - 1})]
    return max(ests, key=lambda x: x.total)


# ---- communication per step -------------------------------------------------------------------
def _ring(n: int) -> float:
    """Fraction of the buffer a rank sends in a ring reduce-scatter or all-gather: (n - 1)/n."""
    return (n - 1) / n


def comm_bytes_per_step(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0,
                        accounting: str = "paper") -> dict:
    """Bytes one rank of pipeline stage ``stage`` sends per optimizer step, by parallelism.

    With ring collectives (bytes *sent* per rank, as minizero's traffic ledger counts
    them), Psi_r = the stage's parameters on this rank, P/G their bytes, m micro-batches:

    * ``dp`` (Rajbhandari et al. 2020, section 7): ZeRO 0 all-reduce 2(N-1)/N G;
      ZeRO 1 reduce-scatter G + all-gather P, (N-1)/N each, once per step; ZeRO 2
      reduce-scatter every micro-batch, m(N-1)/N G + (N-1)/N P; ZeRO 3 per micro-batch
      all-gather P for forward and again for backward and reduce-scatter G:
      m(N-1)/N (2P + G) -- 1.5x the baseline at m = 1.
    * ``tp`` (Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section 4.2.2):
      per layer and micro-batch 2 all-reduces forward and 2 backward of sbh activations,
      2(t-1)/t sbh e each (sequence parallelism swaps each for an all-gather plus a
      reduce-scatter: the same bytes); full recompute repeats the forward's 2; plus
      one all-reduce for the vocab-parallel embedding (stage 0) and one for the head
      (last stage) -- not with ``accounting="minizero"``, whose embedding and head are
      replicated.
    * ``pp`` (Narayanan et al. 2021, section 4.1, scatter/gather): per micro-batch and
      model chunk, the activation forward and its gradient backward, sbh e / t each;
      a tied embedding split across stages all-reduces its gradient between the first
      and the last stage once per step.
    * ``pcie``: host <-> device traffic of offloading (gradients down, parameters up;
      parameters fetched twice per micro-batch with ``params``; activations down and
      back up).
    Returns {"dp", "tp", "pp", "pcie"} in bytes.
    """
    m = as_shape(model)
    st = strategy.validate(m)
    s = seq_len or m.seq_len
    pb, gbytes, e, _ = _bytes(st)
    n, t, mb = st.dp, st.tp, st.micro_batches
    vocab_parallel = accounting == "paper"
    psi = stage_parameters(m, st, stage, vocab_parallel)
    P, G = pb * psi, gbytes * psi
    if n == 1:
        dp = 0.0
    elif st.zero == 0:
        dp = 2 * _ring(n) * G
    elif st.zero == 1:
        dp = _ring(n) * (G + P)
    elif st.zero == 2:
        dp = _ring(n) * (mb * G + P)
    else:
        dp = mb * _ring(n) * (2 * P + G)
    x = e * s * st.micro_batch * m.hidden  # one (b, s, h) activation, bytes
    layers = m.n_layer // st.pp
    tp = 0.0
    if t > 1:
        per_layer = 4 + (2 if st.recompute == "full" else 0)
        ends = ((stage == 0) + (stage == st.pp - 1)) if vocab_parallel else 0
        tp = mb * (layers * per_layer + ends) * 2 * _ring(t) * x
    pp = 0.0
    if st.pp > 1:
        boundaries = (1 if stage in (0, st.pp - 1) else 2) * st.virtual_stages
        pp = mb * boundaries * x / t
        if m.tied_embeddings and stage in (0, st.pp - 1):
            pp += gbytes * m.vocab_size * m.hidden / (t if vocab_parallel else 1)  # 2-rank all-reduce
    pcie = 0.0
    shard = math.ceil(psi / n)
    if st.offload in ("optimizer", "params"):
        pcie += (gbytes + pb) * shard
    if st.offload == "params":
        pcie += 2 * mb * pb * shard
    if st.offload_activations:  # every micro-batch's saved arrays go down in forward and come back in backward
        rows = saved_per_layer(m, s, st.micro_batch, "paper", st.precision)
        pcie += 2 * mb * layers * _layer_stored(rows, t, st.sequence_parallel, st.recompute)
    return {"dp": round(dp), "tp": round(tp), "pp": round(pp), "pcie": round(pcie)}


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

    Per token, forward: 2 x (each layer's matrix parameters) + 4sh per layer for QK^T
    and softmax x V + 2hV for the logits; backward = 2 x forward (Korthikanti et al.
    2022, appendix A, whose counting this generalises to grouped-query attention and
    SwiGLU; for a GPT shape it equals :func:`korthikanti_flops` exactly).
    ``recompute`` adds the hardware FLOPs of recomputation: "full" one more forward of
    every layer (not the logits) -- 96BsLh^2(1 + s/(6h) + V/(16hL)) for a GPT;
    "selective" one more forward of the attention core, 4Bs^2h per layer.
    """
    m = as_shape(model)
    s = seq_len or m.seq_len
    h, kv, f = m.hidden, m.kv_hidden, m.ffn_hidden
    mats = 2 * h * h + 2 * h * kv + (3 if m.mlp == "swiglu" else 2) * h * f
    layer_fwd = 2 * mats + 4 * s * h  # per token
    tokens = global_batch * s
    total = 3 * tokens * (m.n_layer * layer_fwd + 2 * h * m.vocab_size)
    if recompute == "full":
        total += tokens * m.n_layer * layer_fwd
    elif recompute == "selective":
        total += tokens * m.n_layer * 4 * s * h
    return float(total)
