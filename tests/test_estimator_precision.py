"""The estimator knows BF16's, FP8's and QLoRA's bytes (issue 29).

* bf16 and fp8 runs: every model-state category and the activation peak of the ledger equal
  ``estimate_memory(..., accounting="minizero")`` to the byte, with recompute, flash attention and dropout.
* LoRA and QLoRA activations: the ledger's peak equals ``lora_activation_bytes`` for any targets, with
  dropout and flash attention, and is the same for both bases (an NF4 layer saves no dequantized weight).
* QLoRA: bytes per parameter are the formula: 4 bits per adapted weight + an 8-bit constant per 64 + an fp32
  per 256 constants + one fp32 mean per matrix, the rest of the base in float, 16 bytes per adapter element.
"""
import json
from fractions import Fraction

import numpy as np
import pytest

from minizero.autograd.rng import manual_seed
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.bf16 import use_bf16
from minizero.memory.estimator import (LINEAR_SAVES, Strategy, adapted_matrices, as_shape, estimate_memory,
                                       lora_activation_bytes, lora_state_bytes, nf4_bytes, saved_per_layer)
from minizero.memory.fp8 import use_fp8
from minizero.memory.recompute import apply_recompute
from minizero.nf4 import nf4_nbytes
from minizero.nn import GPT, get_config
from minizero.nn.flash_attention import use_flash_attention
from minizero.nn.lora import add_lora
from minizero.optim import AdamW

CONVERT = {"bf16": use_bf16, "fp8": lambda m: use_fp8(m, "current")}  # current scaling: allows recompute


def _ledger_peaks(cfg, precision, batch, recompute, attention):
    ledger = set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    CONVERT[precision](model)
    if attention == "flash":
        use_flash_attention(model, 32)
    apply_recompute(model, recompute)
    opt = AdamW(model.parameters())
    manual_seed(0)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    ledger.reset_peaks()
    model(x, y)[1].backward()
    opt.step()
    peak = dict(ledger.peak)
    set_ledger(MemoryLedger())
    return peak


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("preset,batch,dropout,recompute,attention", [
    ("default", 2, 0.0, "none", "dense"),
    ("small", 2, 0.1, "selective", "dense"),
    ("small", 2, 0.1, "full", "flash"),
    ("small", 3, 0.0, "none", "flash"),
])
def test_estimate_equals_the_ledger_for_bf16_and_fp8(precision, preset, batch, dropout, recompute, attention):
    cfg = get_config(preset, dropout=dropout)
    peak = _ledger_peaks(cfg, precision, batch, recompute, attention)
    st = Strategy(precision=precision, micro_batch=batch, recompute=recompute, attention=attention)
    est = estimate_memory(cfg, st, accounting="minizero").as_dict()
    for cat in ("parameters", "gradients", "optimizer_state", "activations"):
        assert est[cat] == peak[cat], cat


def test_a_linear_saves_2_bytes_per_element_in_bf16_and_1_in_fp8():
    cfg = get_config("small", dropout=0.0)
    h, s, b = cfg.n_embd, cfg.block_size, 2
    rows = {p: {r.name: r.nbytes for r in saved_per_layer(cfg, s, b, "minizero", p)} for p in ("fp32", "bf16", "fp8")}
    assert rows["fp32"]["QKV matmul input (ln_1 output)"] == 4 * s * b * h
    for p, (per, scales) in LINEAR_SAVES.items():
        assert rows[p]["QKV matmul input (ln_1 output) (%s)" % p] == per * s * b * h
        assert rows[p]["QKV matmul input (ln_1 output): its weight (%s)" % p] == per * 3 * h * h
        assert rows[p].get("QKV matmul input (ln_1 output): scales", 0) == scales
        assert rows[p]["GeLU input"] == rows["fp32"]["GeLU input"]  # not a Linear's input: float32 as before
    # a GPU's bf16 activations ("paper"): 2 bytes, the Linear's saves as in minizero
    paper = {r.name: r.nbytes for r in saved_per_layer(cfg, s, b, "paper", "bf16")}
    assert paper["GeLU input"] == 2 * s * b * 4 * h


def _lora_activation_peak(cfg, targets, base, attention):
    ledger = set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    add_lora(model, 4, 8.0, targets, base=base)
    if attention == "flash":
        use_flash_attention(model, 32)
    manual_seed(0)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (2, cfg.block_size)) for _ in range(2))
    ledger.reset_peaks()
    model(x, y)[1].backward()
    peak = ledger.peak["activations"]
    set_ledger(MemoryLedger())
    return peak


@pytest.mark.parametrize("preset,dropout,targets,attention", [
    ("default", 0.0, ("c_attn", "c_proj", "c_fc"), "dense"),
    ("small", 0.1, ("c_attn", "c_proj", "c_fc"), "flash"),
    ("small", 0.1, ("c_attn",), "dense"),
    ("small", 0.1, ("c_proj",), "flash"),
    ("small", 0.1, ("c_fc",), "dense"),
])
def test_lora_and_qlora_activations_equal_the_estimate(preset, dropout, targets, attention):
    cfg = get_config(preset, dropout=dropout)
    want = lora_activation_bytes(cfg, 4, cfg.block_size, 2, targets, attention=attention)
    assert _lora_activation_peak(cfg, targets, "nf4", attention) == want
    assert _lora_activation_peak(cfg, targets, "float", attention) == want


def test_nf4_bytes_are_the_stored_bytes():
    for n in (1, 63, 64, 65, 64 * 256, 64 * 256 + 1, 3 * 128 * 128):
        assert nf4_bytes(n) == nf4_nbytes(n)


@pytest.mark.parametrize("preset", ["default", "gpt2"])
def test_qlora_bytes_per_parameter_are_the_formula(preset):
    cfg = get_config(preset)
    r = 8
    est = lora_state_bytes(cfg, r, base="nf4")
    mats = adapted_matrices(cfg)
    psi = as_shape(cfg).num_parameters()
    adapted = sum(o * i for o, i in mats)
    # NF4: 4 bits + 8 bits per 64 + 32 bits per 64 x 256 (all adapted sizes here are multiples of 64 x 256) + a mean
    assert all(o * i % (64 * 256) == 0 for o, i in mats)
    nf4 = Fraction(adapted) * (Fraction(4) + Fraction(8, 64) + Fraction(32, 64 * 256)) / 8 + 4 * len(mats)
    lora = sum(r * (o + i) for o, i in mats)
    want = (nf4 + 4 * (psi - adapted) + (4 + 4 + 8) * lora) / psi
    assert Fraction(est["parameters"] + est["gradients"] + est["optimizer_state"], psi) == want
    assert est["bytes_per_parameter"] == pytest.approx(float(want), rel=1e-15)
    full = lora_state_bytes(cfg, r, base="float")
    assert est["bytes_per_parameter"] < full["bytes_per_parameter"] < 16  # QLoRA < LoRA < full fine-tuning's 16


def test_lora_state_bytes_refuses_bad_input():
    with pytest.raises(ValueError, match="rank=0"):
        lora_state_bytes(get_config("tiny"), 0)
    with pytest.raises(ValueError, match="allowed names are c_attn, c_proj, c_fc"):
        lora_state_bytes(get_config("tiny"), 4, targets=("wte",))


def test_the_planner_plans_a_qlora_fine_tune(capsys):
    from minizero.models import get_model
    from minizero.plan import main
    assert main(["--model", "llama3-8b", "--gpus", "2", "--seq-len", "1024", "--finetune", "qlora", "--lora-rank",
                 "16", "--attention", "flash", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    model = get_model("llama3-8b")
    acts = lora_activation_bytes(model, 16, 1024, 1, precision="mixed", attention="flash")
    for r in rows:
        est = lora_state_bytes(model, 16, base="nf4", element=2, dp=2, zero=r["zero"], optimizer_bytes=12)
        assert r["total"] == est["parameters"] + est["gradients"] + est["optimizer_state"] + acts
    assert rows[3]["total"] < rows[0]["total"] and rows[0]["frozen"] == rows[3]["frozen"]  # only adapters shard
    assert main(["--model", "llama3-8b", "--gpus", "2", "--finetune", "lora", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["frozen"] < lora[0]["frozen"] / 2.5  # NF4 ~4.1 bits where bf16 holds 16; embeddings stay bf16
    with pytest.raises(SystemExit):
        main(["--model", "llama3-8b", "--gpus", "2", "--finetune", "qlora", "--strategy", "dp2"])
    assert "--strategy does not apply" in capsys.readouterr().err


def test_lora_gradients_are_sharded_from_zero_2_and_padded_units_from_zero_1():
    """tiny, r 8, float64: a layer's adapters 8 (16 + 48) + 8 (16 + 16) + 8 (16 + 64) + 8 (64 + 16) = 2048; over 3
    ranks each unit pads to 513 + 258 + 642 + 642 = 2055, a shard holds 171 + 86 + 214 + 214 = 685; 2 layers.
    ZeRO-1 keeps every (padded) gradient, ZeRO-2 and 3 a shard's."""
    from minizero.memory.estimator import lora_state_bytes
    grads = [lora_state_bytes(get_config("tiny"), 8, element=8, dp=3, zero=z)["gradients"] for z in range(4)]
    assert grads == [8 * 2 * 2048, 8 * 2 * 2055, 8 * 2 * 685, 8 * 2 * 685]
