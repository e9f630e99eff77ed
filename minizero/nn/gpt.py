"""A GPT-2 style decoder-only transformer, with nanoGPT's parameter names.

idx (B, T) int -> wte (V, C) + wpe (T_max, C) -> drop -> h.0 .. h.{L-1} (x + attn(ln_1(x)); x + mlp(ln_2(x)))
-> ln_f -> lm_head (tied to wte) -> logits (B, T, V). attn: c_attn (C -> 3C), H heads of D = C/H, the
``attn.core`` (causal softmax, dropout, @ v), c_proj; mlp: c_fc (C -> 4C), GELU (tanh), c_proj.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, causal_softmax, cross_entropy, gelu, no_grad, split
from minizero.autograd import functional as F
from minizero.autograd.rng import MAX_DROPOUT
from minizero.ledger import get_ledger
from minizero.nn.init import META, attach_inits, materialize_
from minizero.nn.module import Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict, ModuleList


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. Sizes are element counts; ``dtype`` is the parameter/activation dtype.

    Raises (``validate``): ValueError naming the bad field and what is allowed.
    """

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128  # maximum context length T
    vocab_size: int = 256  # byte-level tokenizer
    dropout: float = 0.0
    dtype: str = "float32"

    def validate(self) -> "GPTConfig":
        """Check every field; return self."""
        for f in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPTConfig.{f} must be a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout <= MAX_DROPOUT:  # above it float32(p) is 1: every activation dropped
            raise ValueError(f"dropout must be in [0, 1), at most {MAX_DROPOUT:.8g} (below 1 in float32, which the "
                             f"masks compare), got {self.dropout}")
        backend.get_dtype(self.dtype)
        return self

    def num_parameters(self) -> int:
        """Distinct parameters (the tied LM head counted once): 12LC^2 + 13LC + (V + T + 2)C."""
        c, l = self.n_embd, self.n_layer
        per_block = 12 * c * c + 13 * c
        return l * per_block + (self.vocab_size + self.block_size + 2) * c


#: Named model shapes. ``default`` is the main job's model (finishes in minutes on
#: 2 cores at 8 ranks); ``tiny`` is for tests; ``gpt2`` is GPT-2 small (124M) for the estimator.
PRESETS = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16),
    "small": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "default": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "deep": GPTConfig(n_layer=12, n_head=4, n_embd=128, block_size=128),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
}


def preset_sizes() -> str:
    """``--model``'s help: each preset's shape and parameter count, read from :data:`PRESETS`."""
    return "model preset: layers x heads x width, context T (parameters): " + ", ".join(
        f"{name} {c.n_layer}x{c.n_head}x{c.n_embd} T={c.block_size:,} ({c.num_parameters():,})"
        for name, c in PRESETS.items())


def get_config(name: str, **overrides) -> GPTConfig:
    """A preset with fields replaced, validated. Raises ValueError: unknown preset (allowed listed) or bad field."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}).validate()


class CausalSelfAttention(Module):
    """Multi-head causal self-attention. x (B, T, C) -> (B, T, C).

    Saves per block: c_attn input, q/k/v views, the (B, H, T, T) probabilities (and dropout mask), c_proj input.
    """

    def __init__(self, cfg: GPTConfig, rng):
        super().__init__()
        c = cfg.n_embd
        self.c_attn = Linear(c, 3 * c, dtype=cfg.dtype, rng=rng)
        self.c_proj = Linear(c, c, dtype=cfg.dtype, rng=rng, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.attn_dropout = Dropout(cfg.dropout)
        self.resid_dropout = Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.core = DenseAttentionCore()  # flash attention and context parallelism swap in their own cores

    def forward(self, x):
        b, t, c = x.shape
        h = self.n_head
        q, k, v = split(self.c_attn(x), 3, axis=-1)  # each (B, T, C)
        q, k, v = (z.reshape(b, t, h, c // h).transpose(0, 2, 1, 3) for z in (q, k, v))  # (B, H, T, D)
        y = self.attention_core(q, k, v)  # (B, H, T, D)
        y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))

    def attention_core(self, q, k, v):
        """``self.core(q, k, v, self.attn_dropout)``: (B, H, T, D) each -> (B, H, T, D)."""
        return self.core(q, k, v, self.attn_dropout)


class DenseAttentionCore(Module):
    """softmax(q k^T / sqrt(D), causal) -> dropout (None: none) -> @ v. q, k, v (B, H, T, D) -> (B, H, T, D);
    q scaled first."""

    def forward(self, q, k, v, dropout=None):
        scale = 1.0 / math.sqrt(q.shape[-1])
        att = causal_softmax(F.scaled_matmul(q, k.transpose(0, 1, 3, 2), scale))  # (B, H, T, T)
        return (att if dropout is None else dropout(att)) @ v


class MLP(Module):
    """c_fc (C -> 4C), GELU, c_proj (4C -> C), dropout. (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig, rng):
        super().__init__()
        c = cfg.n_embd
        self.c_fc = Linear(c, 4 * c, dtype=cfg.dtype, rng=rng)
        self.c_proj = Linear(4 * c, c, dtype=cfg.dtype, rng=rng, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(gelu(self.c_fc(x))))


class Block(Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)). (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig, rng):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, dtype=cfg.dtype, rng=rng)
        self.attn = CausalSelfAttention(cfg, rng)
        self.ln_2 = LayerNorm(cfg.n_embd, dtype=cfg.dtype, rng=rng)
        self.mlp = MLP(cfg, rng)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def check_ids(idx, vocab_size: int, block_size: int) -> None:
    """ValueError naming the first problem unless ``idx`` is (B, T) integers, 1 <= T <= block_size, in [0, V)."""
    shape = getattr(idx, "shape", None)
    if shape is None or len(shape) != 2 or 0 in shape:
        raise ValueError(f"GPT: idx must be a (B, T) array of token ids, B and T >= 1, got shape {shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"GPT: idx must hold integer token ids, got dtype {idx.dtype}")
    if shape[1] > block_size:
        raise ValueError(f"sequence length {shape[1]} exceeds block_size {block_size}")
    bad = backend.xp.flatnonzero((idx < 0) | (idx >= vocab_size))  # a negative id would index from the end
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"GPT: token ids must lie in [0, {vocab_size}); id {int(idx.reshape(-1)[i])} at position "
                         f"{divmod(i, shape[1])} (batch, time) is outside ({int(bad.size)} bad in all)")


class GPT(Module):
    """The decoder. ``model(idx)`` -> logits (B, T, V); ``model(idx, targets)`` -> (logits, mean loss).

    ``seed``: the init generators' seed (same weights on every rank and dtype); ``meta``: 0-byte meta parameters.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0, meta: bool = False):
        super().__init__()
        cfg.validate()
        self.config = cfg
        rng = META
        self.transformer = ModuleDict(dict(
            wte=Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype, rng=rng),
            wpe=Embedding(cfg.block_size, cfg.n_embd, dtype=cfg.dtype, rng=rng),
            drop=Dropout(cfg.dropout),
            h=ModuleList([Block(cfg, rng) for _ in range(cfg.n_layer)]),
            ln_f=LayerNorm(cfg.n_embd, dtype=cfg.dtype, rng=rng),
        ))
        # weight tying (Press & Wolf 2017; nanoGPT): the LM head reuses wte's (V, C) matrix
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=cfg.dtype,
                              weight=self.transformer["wte"].weight)
        drops = (m for _, m in self.named_modules() if isinstance(m, Dropout))
        for site, m in enumerate(drops):  # each dropout's mask address under rng.batch_rows, the same in every layout
            m.site = site
        attach_inits(self, seed, cfg.n_layer)
        if not meta:
            materialize_(self, get_ledger())

    def forward(self, idx, targets=None):
        """idx: (B, T) ints, T <= block_size; targets (B, T) or None. Raises ValueError (:func:`check_ids`)."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        cfg = self.config
        check_ids(idx, cfg.vocab_size, cfg.block_size)
        tg = targets.data if isinstance(targets, Tensor) else targets
        if tg is not None and getattr(tg, "shape", None) != idx.shape:  # the loss pairs them by position
            raise ValueError(f"GPT: targets must have idx's shape {idx.shape}, got {getattr(tg, 'shape', type(tg))}")
        b, t = idx.shape
        tr = self.transformer
        pos = backend.xp.arange(t)
        x = tr["drop"](tr["wte"](idx) + tr["wpe"](pos))
        for block in tr["h"]:
            x = block(x)
        logits = self.lm_head(tr["ln_f"](x))  # (B, T, V)
        if targets is None:
            return logits
        loss = cross_entropy(logits.reshape(b * t, cfg.vocab_size), tg.reshape(b * t))
        return logits, loss

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, rng=None):
        """Sample ``max_new_tokens`` tokens (no grad; temperature 0: greedy): (B, T) ints -> (B, T + new)."""
        if not (isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool)  # np.int64 too
                and max_new_tokens >= 0  # not True for 1, nor '1.0' for a temperature (comm's check_int's rule)
                and isinstance(temperature, numbers.Real) and 0 <= temperature < math.inf):
            raise ValueError(f"GPT.generate: max_new_tokens must be an int >= 0 and temperature a finite number >= 0 "
                             f"(0: greedy), got {max_new_tokens!r} and {temperature!r}")
        rng = rng if rng is not None else np.random.default_rng(0)
        idx = np.asarray(backend.to_host(idx))
        check_ids(idx[:, -self.config.block_size:] if idx.ndim == 2 else idx, self.config.vocab_size,
                  self.config.block_size)  # forward's message, before any sampling; a long prompt is cropped
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.config.block_size:]
                logits = backend.to_host(self(backend.to_device(ctx)).data[:, -1, :]).astype(np.float64)
                if temperature == 0:
                    nxt = logits.argmax(axis=-1)
                else:
                    p = np.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature)
                    p /= p.sum(axis=-1, keepdims=True)
                    nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
                idx = np.concatenate([idx, nxt[:, None]], axis=1)
        self.train(was_training)
        return idx
