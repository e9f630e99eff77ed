"""The model the estimator takes (its strategy: ``strategy.py``; states: ``states.py``; units: ``__init__.py``)."""
from __future__ import annotations

import dataclasses
import math


#: Per-rank categories, named as in the ledger (``minizero/ledger.py``) so an
#: estimate can be set beside ``ledger.peak``. ``offloaded`` is host memory.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "comm_scratch",
              "gathered", "offloaded")
DEVICE_CATEGORIES = CATEGORIES[:-1]

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
ATTENTIONS = ("dense", "flash")  #: the attention core: (s, s) probabilities kept, or FlashAttention's O and L
CP_ATTENTIONS = ("ring", "ulysses")  #: how a split sequence attends: ring attention or DeepSpeed-Ulysses' all-to-all
#: bytes per element: (parameters, gradients, activations, fp32 master copy, one Adam moment). "bf16" and "fp8" are
#: torch.autocast's recipe (memory/bf16.py, fp8.py): FP32 weights (the masters), gradients and Adam state, 2-byte
#: activations on a GPU (float32 arrays in minizero: :func:`activation_element`) but what a Linear saves
#: (:data:`LINEAR_SAVES`). Megatron's bf16 (bf16 weights, FP32 masters) is "mixed".
PRECISIONS = {"fp64": (8, 8, 8, 0, 8), "fp32": (4, 4, 4, 0, 4), "mixed": (2, 2, 2, 4, 4),
              "bf16": (4, 4, 2, 0, 4), "fp8": (4, 4, 2, 0, 4)}
#: what a Linear saves for backward, per precision: (bytes per element of its input and of its weight, bytes of
#: scales per call): bf16 the uint16 bits of x and W; fp8 the E4M3 codes of x and W and their two fp32 scales
LINEAR_SAVES = {"bf16": (2, 0), "fp8": (1, 8)}
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
    """The :class:`Strategy` precision of a training dtype: float64 "fp64", float32 "fp32", float16 "mixed"."""
    name = getattr(dtype, "name", str(dtype))
    table = {"float64": "fp64", "float32": "fp32", "float16": "mixed"}  # bf16 and fp8 keep float32 weights
    if name not in table:
        raise ValueError(f"no precision for dtype {name!r}; allowed: {sorted(table)}")
    return table[name]


def activation_element(precision: str, accounting: str) -> int:
    """Bytes of one saved activation element: the precision's, but 4 for bf16 and fp8 in ``"minizero"``'s
    accounting (their values live in float32 arrays there; a GPU keeps bf16 tensors)."""
    return 4 if accounting == "minizero" and precision in LINEAR_SAVES else PRECISIONS[precision][2]


# ---- the model --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape; sizes are element counts.

    ``mlp``: ``"gelu"`` (two matrices h x f, GPT) or ``"swiglu"`` (three, LLaMA; Shazeer 2020). ``norm``:
    ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight). ``learned_pos``: a learned position table of
    ``seq_len`` rows (GPT) instead of rotary embeddings (LLaMA). ``tied_embeddings``: the LM head reuses the token
    embedding. ``dropout``: dropout layers are active (their 1-byte masks are saved; Korthikanti et al. count them,
    LLaMA trains without). ``seq_len`` is the model's context, the default sequence length.

    MoE (``experts`` > 0): block i's MLP is a router (h x E) and ``experts`` bias-free experts of width
    ``expert_ffn`` (0: ``ffn_hidden``), ``top_k`` per token, plus ``shared_experts``, when i >= ``dense_layers``
    and i % ``moe_every`` == ``moe_every`` - 1 (minizero's ``MoEConfig.layers``); C = ceil(cf T k / E) slots.
    MLA (``kv_lora_rank`` > 0; DeepSeek-V2, arXiv:2405.04434, section 2.1): parameters and FLOPs exact;
    activations and attention traffic APPROXIMATED as multi-head attention of head dim hidden / n_head.
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
    experts: int = 0  #: routed experts per MoE layer (0: every MLP dense)
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float = 1.0
    shared_experts: int = 0
    dense_layers: int = 0  #: the first blocks keep a dense MLP (DeepSeek-V3: 3)
    expert_ffn: int = 0  #: an expert's hidden width (0: ``ffn_hidden``)
    q_lora_rank: int = 0  #: MLA: query compression rank (0 with kv_lora_rank > 0: an uncompressed query)
    kv_lora_rank: int = 0  #: MLA: key-value compression rank d_c (0: standard or grouped-query attention)
    qk_rope_dim: int = 0  #: MLA: the decoupled rotary key/query dims per head d_h^R
    mla_head_dim: int = 0  #: MLA: per-head dims of the non-rotary query/key and of the value d_h

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
        for f in ("experts", "shared_experts", "dense_layers", "expert_ffn", "q_lora_rank", "kv_lora_rank",
                  "qk_rope_dim", "mla_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelShape.{f} must be an integer >= 0, got {v!r}")
        e, k, every = self.experts, self.top_k, self.moe_every
        for bad, why in [
                (e and not (isinstance(k, int) and 1 <= k <= e),
                 f"ModelShape.top_k must be in 1..experts={e}, got {k!r}"),
                (e and not (isinstance(every, int) and every >= 1),
                 f"ModelShape.moe_every must be >= 1, got {every!r}"),
                (e and not 0 < self.capacity_factor < math.inf,
                 f"ModelShape.capacity_factor must be a finite number > 0, got {self.capacity_factor!r}"),
                (not e and (self.shared_experts or self.dense_layers or self.expert_ffn),
                 "shared_experts, dense_layers and expert_ffn need experts > 0"),
                (self.kv_lora_rank and not (self.mla_head_dim and self.qk_rope_dim),
                 "MLA (kv_lora_rank > 0) needs mla_head_dim > 0 and qk_rope_dim > 0"),
                (self.q_lora_rank and not self.kv_lora_rank, "q_lora_rank needs kv_lora_rank > 0 (MLA)")]:
            if bad:
                raise ValueError(why)
        if e and not self.moe_layers():
            raise ValueError(f"{self.name}: experts={e} but no block has an MoE layer")
        return self

    # ---- mixture of experts -------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` has an MoE layer (see the class docstring)."""
        return bool(self.experts) and i >= self.dense_layers and i % self.moe_every == self.moe_every - 1

    def moe_layers(self) -> list[int]:
        """The block indices with an MoE layer (empty for a dense model)."""
        return [i for i in range(self.n_layer) if self.is_moe_layer(i)]

    @property
    def expert_hidden(self) -> int:
        """An expert's hidden width f_e."""
        return self.expert_ffn or self.ffn_hidden

    def expert_parameters(self, tp: int = 1) -> int:
        """One expert's parameters on one of ``tp`` ranks: its 2 (GeLU) or 3 (SwiGLU) h x f_e matrices, no biases."""
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * self.expert_hidden // tp

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a group of ``tokens``: ceil(capacity_factor x tokens x top_k / experts)."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)

    def attention_parameters(self, tp: int = 1) -> tuple[int, int]:
        """(split by tp, replicated) parameters of one attention block, norms excluded: Wq, Wo, Wk, Wv (+ biases);
        MLA: W^DQ (h x d_c') + norm, W^UQ (d_c' x n_h(d_h + d_h^R)), W^DKV+W^KR (h x (d_c + d_h^R)) + norm,
        W^UK, W^UV (d_c x 2 n_h d_h), W^O (n_h d_h x h), the down-projections replicated."""
        h, kv = self.hidden, self.kv_hidden
        if self.kv_lora_rank:
            a, dh, dr, dc, dq = self.n_head, self.mla_head_dim, self.qk_rope_dim, self.kv_lora_rank, self.q_lora_rank
            q_split = dq * a * (dh + dr) if dq else h * a * (dh + dr)
            replicated = (h * dq + dq if dq else 0) + h * (dc + dr) + dc
            split = q_split + dc * 2 * a * dh + a * dh * h
            return split // tp, replicated
        split, replicated = 2 * h * h + 2 * h * kv, 0
        if self.bias:
            split += h + 2 * kv
            replicated += h
        return split // tp, replicated

    @property
    def norm_size(self) -> int:
        """Elements of one norm: weight and bias (LayerNorm, 2h) or weight (RMSNorm, h)."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def vocab_shard(self, tp: int = 1) -> int:
        """Elements of the token table (or an untied head) on one of ``tp`` vocab-parallel ranks: ceil(V/t) rows."""
        return math.ceil(self.vocab_size / tp) * self.hidden

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): n_kv_head * head_dim (= hidden without grouped-query attention)."""
        return self.n_kv_head * (self.hidden // self.n_head)

    def layer_parameters(self, tp: int = 1, index: int | None = None, ep: int = 1, expert_tp: int | None = None) -> int:
        """Parameters of transformer block ``index`` held by one of ``tp`` tensor-parallel ranks (elements).

        Matrices and the column-parallel biases are split by t; the row-parallel
        output biases and the norms are replicated (Shoeybi et al. 2019, section 3).
        GPT (t = 1): 12h^2 + 13h. An MoE block: router, E/``ep`` routed and the shared experts, split by
        ``expert_tp`` (None: t, Megatron-Core's; 1: minizero's trainer keeps them whole). ``index`` None: the largest.
        """
        if index is None:
            return max(self.layer_parameters(tp, i, ep, expert_tp) for i in sorted({0, *self.moe_layers()[:1]}))
        h, f = self.hidden, self.ffn_hidden
        split, replicated = self.attention_parameters(tp)
        replicated += 2 * self.norm_size
        if self.is_moe_layer(index):
            one = self.expert_parameters(tp if expert_tp is None else expert_tp)
            return split + replicated + h * self.experts + (self.experts // ep + self.shared_experts) * one
        n_mats = 3 if self.mlp == "swiglu" else 2
        mlp = n_mats * h * f + ((n_mats - 1) * f if self.bias else 0)  # matrices, fc (gate, up) biases
        if self.bias:
            replicated += h  # the MLP output bias
        return split + mlp // tp + replicated

    def embedding_parameters(self, tp: int = 1, vocab_parallel: bool = True) -> int:
        """Token table plus the learned position table, on one tensor rank (elements).

        Vocab-parallel (Megatron-LM; Shoeybi et al. 2019, section 3): ceil(V/t) rows per
        rank; otherwise replicated (minizero's tensor parallelism).
        """
        table = self.vocab_shard(tp if vocab_parallel else 1)
        return table + (self.seq_len * self.hidden if self.learned_pos else 0)

    def head_parameters(self, tp: int = 1, pp: int = 1, vocab_parallel: bool = True) -> int:
        """Final norm plus the output matrix on the last stage, on one tensor rank (elements).

        A tied head adds nothing when one stage holds both ends; with pp > 1 the last
        stage keeps its own copy of the embedding (Megatron-LM; Narayanan et al. 2021).
        """
        has_matrix = not self.tied_embeddings or pp > 1
        return self.norm_size + (self.vocab_shard(tp if vocab_parallel else 1) if has_matrix else 0)

    def tensor_sizes(self, ep: int = 1, part: str = "all") -> list[int]:
        """Element counts of every parameter tensor (t = 1), in model order; Q, K, V fused as in GPT-2; an MoE
        block's router and each matrix of its E/``ep`` experts as one tensor (``MoELayer``). ``part``: "all",
        "dense" (no routed expert) or "experts" (only theirs: ``ExpertDataParallel``'s two sets)."""
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_hidden
        norm = [h, h] if self.norm == "layernorm" else [h]
        if self.kv_lora_rank:
            attn = [sum(self.attention_parameters())]  # MLA: counted as one tensor here
        else:
            attn = [(h + 2 * kv) * h] + ([h + 2 * kv] if self.bias else []) + [h * h] + ([h] if self.bias else [])
        layer = norm + attn + norm
        if self.mlp == "gelu":
            dense = [f * h] + ([f] if self.bias else []) + [h * f] + ([h] if self.bias else [])
        else:
            dense = [f * h, f * h, h * f] + ([f, f, h] if self.bias else [])
        mats, fe = (3 if self.mlp == "swiglu" else 2), self.expert_hidden
        routed = [self.experts // ep * h * fe] * mats
        if part == "experts":
            return [n for i in self.moe_layers() for n in routed]
        moe = [h * self.experts] + ([] if part == "dense" else routed) + [self.shared_experts * h * fe] * mats * bool(
            self.shared_experts)
        sizes = [self.vocab_size * h] + ([self.seq_len * h] if self.learned_pos else [])
        for i in range(self.n_layer):
            sizes += layer + (moe if self.is_moe_layer(i) else dense)
        sizes += norm
        if not self.tied_embeddings:
            sizes.append(self.vocab_size * h)
        return sizes

    def num_parameters(self) -> int:
        """All distinct parameters Psi (tied head counted once; every expert). GPT: 12Lh^2 + 13Lh + (V + s + 2)h."""
        layers = sum(self.layer_parameters(1, i) for i in range(self.n_layer))
        return layers + self.embedding_parameters() + self.head_parameters()

    def active_parameters(self) -> int:
        """Parameters one token uses: the total less the E - k routed experts it skips per MoE block."""
        return self.num_parameters() - len(self.moe_layers()) * (self.experts - self.top_k) * self.expert_parameters()

    @classmethod
    def from_gpt_config(cls, cfg, name: str = "minizero", moe=None) -> "ModelShape":
        """The shape of a :class:`minizero.nn.gpt.GPTConfig` (GELU MLP of 4C, LayerNorm, biases, tied head);
        ``moe``: a ``MoEConfig``'s MoE layers."""
        extra = {} if moe is None else dict(experts=moe.experts, top_k=moe.top_k, moe_every=moe.every,
                                            capacity_factor=moe.capacity_factor)
        return cls(name=name, n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_head,
                   ffn_hidden=4 * cfg.n_embd, vocab_size=cfg.vocab_size, seq_len=cfg.block_size,
                   dropout=cfg.dropout > 0, source="minizero/nn/gpt.py", **extra).validate()


def as_shape(model) -> ModelShape:
    """A :class:`ModelShape` from a ModelShape or a minizero ``GPTConfig``."""
    if isinstance(model, ModelShape):
        return model.validate()
    if hasattr(model, "n_embd"):
        return ModelShape.from_gpt_config(model)
    raise TypeError(f"expected a ModelShape or a GPTConfig, got {type(model).__name__}")
