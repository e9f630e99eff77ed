"""Modules: the Module base class, basic layers and the GPT model."""
from minizero.nn.module import (CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear, Matmul, Module, ModuleDict,
                                ModuleList, Parameter)
from minizero.nn.gpt import GPT, PRESETS, Block, CausalSelfAttention, GPTConfig, MLP, get_config

__all__ = ["CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm", "Linear", "Matmul", "Module", "ModuleDict",
           "ModuleList", "Parameter",
           "GPT", "PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "MLP", "get_config"]
