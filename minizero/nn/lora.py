"""LoRA adapters on a frozen base, and QLoRA's NF4 base.

``y = base(x) + (alpha / r) * (x A^T) B^T``, A (r, in), B (out, r) zero-initialised.
Sources: Hu et al., arXiv:2106.09685, section 4.1; Dettmers et al., arXiv:2305.14314, section 3.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd import Function, functional as F
from minizero.ledger import get_ledger
from minizero.nn.module import Linear, Module, Parameter
from minizero.nf4 import NF4Tensor

#: the projections a GPT block has (attn.c_proj and mlp.c_proj both match c_proj)
TARGETS = ("c_attn", "c_proj", "c_fc")


class NF4Linear(Module):
    """y = x W~^T + b, W~ the NF4 weight dequantized per forward: x (..., in) -> (..., out); no weight gradient.

    The weight is counted as ``parameters`` at its NF4 bytes; the bias stays, frozen. ``weight_nf4``: the NF4
    weight when the caller quantized it (a tensor-parallel shard: ``NF4Shard``), else ``NF4Tensor`` of the weight.
    """

    def __init__(self, linear: Linear, dtype: str = "float32", weight_nf4=None):
        super().__init__()
        self.weight_nf4 = NF4Tensor(linear.weight.data) if weight_nf4 is None else weight_nf4
        for a in (self.weight_nf4.codes, self.weight_nf4.c1_codes, self.weight_nf4.c2, self.weight_nf4.c1_mean):
            get_ledger().track(a, "parameters")
        self.bias, self.dtype = linear.bias, backend.get_dtype(dtype)
        if self.bias is not None:
            self.bias.requires_grad = False

    def forward(self, x):
        args = (x, self.weight_nf4, self.dtype) + (() if self.bias is None else (self.bias,))
        return _NF4Matmul.apply(*args)

    def project(self, x):
        """x W~^T without the bias (a row-parallel shard adds it after the sum over the tensor group)."""
        return _NF4Matmul.apply(x, self.weight_nf4, self.dtype)


class _NF4Matmul(Function):
    """y = x W~^T + b, W~ the NF4 weight dequantized to ``dtype``, and again in backward for dx = g W~: no array
    saved, as bitsandbytes' ``MatMul4Bit`` (ctx keeps the :class:`NF4Tensor`, counted as ``parameters``)."""

    @staticmethod
    def forward(ctx, x, weight_nf4, dtype, bias=None):
        ctx.weight_nf4, ctx.dtype = weight_nf4, dtype
        y = backend.matmul(x, weight_nf4.dequantize(dtype).T)
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def backward(ctx, g):
        w = ctx.weight_nf4.dequantize(ctx.dtype)
        dx = backend.matmul(backend.matmul_operand(g), backend.matmul_operand(w))
        # one gradient per input, x's only: (x, weight_nf4, dtype) or (x, weight_nf4, dtype, bias), the bias frozen
        return (dx.astype(np.result_type(g.dtype, w.dtype), copy=False), None, None, None)[:len(ctx.needs_input_grad)]


class LoRAAdapter(Module):
    """``scale * (x A^T) B^T``, A (r, in) ~ N(0, 1/r), B (out, r) = 0: the trained part of a :class:`LoRALinear`,
    a module of its own so that DP and ZeRO take the adapters alone (one ZeRO unit each)."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, rng, dtype="float32"):
        super().__init__()
        dt = backend.get_dtype(dtype)
        self.scale = alpha / r
        self.lora_A = Parameter(backend.to_device(rng.normal(0.0, r ** -0.5, (r, in_features)).astype(dt)))
        self.lora_B = Parameter(backend.xp.zeros((out_features, r), dt))

    def forward(self, x):
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


class LoRALinear(Module):
    """``base(x) + (alpha / r) * (x A^T) B^T``; A (r, in) ~ N(0, 1/r), B (out, r) = 0; only A and B train.

    ``adapter``: the trained part when given (a tensor-parallel shard, minizero/parallel/lora_tp.py), else a
    :class:`LoRAAdapter` drawn from ``rng``; ``in_features``, ``out_features``: the whole matrix's.
    Raises ValueError: r < 1, r > min(in, out), or alpha <= 0.
    """

    def __init__(self, base, in_features: int, out_features: int, r: int, alpha: float, rng, dtype="float32",
                 adapter=None):
        super().__init__()
        if r < 1 or not alpha > 0:
            raise ValueError(f"LoRA needs rank r >= 1 and alpha > 0, got r={r}, alpha={alpha}")
        if r > min(in_features, out_features):  # B A would then have more parameters than the full update
            raise ValueError(f"LoRA rank r={r} is above min(in, out) = {min(in_features, out_features)} of a "
                             f"({out_features}, {in_features}) Linear; allowed: 1..{min(in_features, out_features)}")
        self.base, self.r = base, r
        self.adapter = LoRAAdapter(in_features, out_features, r, alpha, rng, dtype) if adapter is None else adapter

    lora_A = property(lambda self: self.adapter.lora_A)
    lora_B = property(lambda self: self.adapter.lora_B)

    def forward(self, x):
        return self.base(x) + self.adapter(x)

    def delta(self):
        """The adapter as a dense (out, in) array: scale * B A."""
        return self.adapter.scale * (self.lora_B.data @ self.lora_A.data)


def refuse_tied_head(targets) -> None:
    """Raise ValueError when ``targets`` names ``lm_head``: an adapter on the head alone would untie it from
    transformer.wte (one weight) in :func:`merged_state_dict`."""
    if "lm_head" in targets:
        raise ValueError(f"targets={tuple(targets)}: lm_head is tied to transformer.wte (one weight) and is not "
                         f"adapted; allowed: the blocks' Linear names, e.g. {', '.join(TARGETS)}")


def add_lora(model: Module, r: int, alpha: float, targets=TARGETS, base: str = "nf4", seed: int = 0,
             wrap=None) -> list:
    """Freeze ``model`` and put a :class:`LoRALinear` on every Linear named ``*targets`` (not the tied head).

    ``base``: "nf4" or "float". ``wrap(child, r, alpha, rng, dtype, nf4)``: the LoRALinear for a chosen child, or
    None to leave it (default :func:`wrap_linear`; tensor parallelism's shards: minizero/parallel/lora_tp.py).
    Returns the names. Raises ValueError: unknown base or :func:`refuse_tied_head` (before any change); no Linear
    matched (the model is frozen by then).
    """
    if base not in ("nf4", "float"):
        raise ValueError(f"unknown LoRA base {base!r}; allowed: 'nf4', 'float'")
    refuse_tied_head(targets)
    for p in model.parameters():
        p.requires_grad = False
    rng, dtype, wrap = np.random.default_rng(seed), model.config.dtype, wrap or wrap_linear
    chosen = {id(m) for n, m in model.named_modules() if n.rpartition(".")[2] in targets}

    def adapted(child):  # called once per module, in module order: the adapters draw from rng in that order
        return wrap(child, r, alpha, rng, dtype, base == "nf4") if id(child) in chosen else None
    done = model.swap_modules(adapted)
    if not done:
        raise ValueError(f"no Linear named one of {tuple(targets)} to adapt")
    return done


def wrap_linear(child, r: int, alpha: float, rng, dtype, nf4: bool):
    """The one-process :class:`LoRALinear` around a :class:`Linear` (its NF4 copy when ``nf4``); None for others."""
    if not isinstance(child, Linear):
        return None
    out_f, in_f = child.weight.shape
    return LoRALinear(NF4Linear(child, dtype) if nf4 else child, in_f, out_f, r, alpha, rng, dtype)


def adapters(model: Module) -> list:
    """Every :class:`LoRAAdapter` of ``model``, in module order (what data parallelism and ZeRO synchronise)."""
    return [m for _, m in model.named_modules() if isinstance(m, LoRAAdapter)]


def trainable_parameters(model: Module) -> list:
    """The parameters that still require gradients (after :func:`add_lora`: the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def merged_state_dict(model: Module) -> dict:
    """The plain model's state dict (nanoGPT names) with every adapter folded in: W~ + scale * B A (host arrays)."""
    out = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            b = mod.base
            w = b.weight_nf4.dequantize(mod.lora_A.dtype) if isinstance(b, NF4Linear) else b.weight.data
            out[f"{prefix}.weight"] = backend.to_host(w + mod.delta())
            if b.bias is not None:
                out[f"{prefix}.bias"] = backend.to_host(b.bias.data)
    for name, p in model.named_parameters(remove_duplicate=False):  # every name, the tied head's alias too
        if ".lora_" not in name and ".base." not in name:
            out[name] = backend.to_host(p.data)
    return out
