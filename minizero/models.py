"""Shapes of real models, for the estimator and ``python -m minizero.plan``; and minizero's own.

Each entry is a :class:`~minizero.memory.estimator.ModelShape` (sizes in elements) with its source; parameter
counts follow from the shapes (:meth:`ModelShape.num_parameters`). LLaMA: SwiGLU, RMSNorm, no biases, rotary,
untied head, no dropout. GPT: GeLU MLP of 4h, LayerNorm, biases, learned positions, tied head, dropout.
``minizero-<preset>`` are the presets of :mod:`minizero.nn.gpt`.

MoE: ``mixtral-8x7b``, ``deepseek-v3`` at capacity factor 1.0 (both drop no tokens; 1.0 counts balanced
routing's T k rows). DeepSeek-V3's MLA: parameters and FLOPs exact, activations and traffic APPROXIMATED as
128 heads of 56 dims; its multi-token prediction module (14B, outside the 671B) left out.
"""
from __future__ import annotations

from minizero.memory.estimator import ModelShape
from minizero.nn.gpt import PRESETS as GPT_PRESETS

_LLAMA = dict(mlp="swiglu", norm="rmsnorm", bias=False, learned_pos=False, tied_embeddings=False, dropout=False)
_LLAMA2 = ("Touvron et al. 2023, 'Llama 2', Table 1 (context 4096, GQA for 70B); shapes from the "
           "released config.json (meta-llama/Llama-2-{}-hf)")
_LLAMA3 = ("Meta Llama 3 model card and config.json (meta-llama/Meta-Llama-3-{}); Llama Team 2024, "
           "'The Llama 3 Herd of Models', Table 3 (vocabulary 128,000; config.json's 128,256 adds special tokens)")

REAL_MODELS = {
    "gpt3-175b": ModelShape(
        "gpt3-175b", n_layer=96, hidden=12288, n_head=96, n_kv_head=96, ffn_hidden=4 * 12288, vocab_size=50257,
        seq_len=2048,
        source="Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1 (96 layers, d_model 12288, "
               "96 heads) and section 2.1 (context 2048); FFN 4 d_model and the 50257-token GPT-2 BPE "
               "(Radford et al. 2019)"),
    "llama2-7b": ModelShape("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, source=_LLAMA2.format("7b"), **_LLAMA),
    "llama2-13b": ModelShape("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, source=_LLAMA2.format("13b"),
                             **_LLAMA),
    "llama2-70b": ModelShape("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, source=_LLAMA2.format("70b"),
                             **_LLAMA),
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, source=_LLAMA3.format("8B"), **_LLAMA),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, source=_LLAMA3.format("70B"),
                             **_LLAMA),
    "megatron-1t": ModelShape(
        "megatron-1t", n_layer=128, hidden=25600, n_head=160, n_kv_head=160, ffn_hidden=4 * 25600, vocab_size=51200,
        seq_len=2048,
        source="Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', Table 1 (1008 B: 128 layers, hidden 25600, 160 heads) and section "
               "5.1 (vocabulary 51200, sequence 2048)"),
    "mixtral-8x7b": ModelShape(
        "mixtral-8x7b", n_layer=32, hidden=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, vocab_size=32000,
        seq_len=32768, experts=8, top_k=2,
        source="Jiang et al. 2024, 'Mixtral of Experts', arXiv:2401.04088, Table 1 (32 layers, dim 4096, 32 heads, "
               "8 KV heads, hidden 14336, context 32768, vocabulary 32000, 8 experts, top-2) and the released "
               "config.json (mistralai/Mixtral-8x7B-v0.1); Mistral AI's announcement: 46.7B total, 12.9B per token",
        **_LLAMA),
    "deepseek-v3": ModelShape(
        "deepseek-v3", n_layer=61, hidden=7168, n_head=128, n_kv_head=128, ffn_hidden=18432, vocab_size=129280,
        seq_len=4096, experts=256, top_k=8, shared_experts=1, dense_layers=3, expert_ffn=2048,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, mla_head_dim=128,
        source="DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', arXiv:2412.19437, section 4.2 (61 layers, hidden "
               "7168, 128 heads of 128 dims, MLA d_c 512, d_c' 1536, d_h^R 64; the first 3 FFNs dense; 1 shared and "
               "256 routed experts of 2048, 8 routed per token; 671B total, 37B activated; pre-training sequence "
               "4096) and the released config.json (deepseek-ai/DeepSeek-V3: dense FFN 18432, vocabulary 129280)",
        **_LLAMA),
}

#: Every model the planner knows: the real ones and ``minizero-<preset>`` for minizero's presets.
MODELS = {**REAL_MODELS,
          **{f"minizero-{k}": ModelShape.from_gpt_config(cfg, name=f"minizero-{k}") for k, cfg in GPT_PRESETS.items()}}


def get_model(name: str) -> ModelShape:
    """The :class:`ModelShape` called ``name``.

    Raises:
        ValueError: unknown name (the allowed names are listed).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(sorted(MODELS))}")
    return MODELS[name]
