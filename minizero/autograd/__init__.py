"""Tape-based autograd: Tensor, Function, backward, no_grad, saved_tensors_hooks, and the ops."""
from minizero.autograd.engine import (Context, Function, Tensor, backward, enable_grad, is_grad_enabled, no_grad,
                                      saved_tensors_hooks)
from minizero.autograd import ops
from minizero.autograd.ops import concat, split, unbroadcast

Tensor.ops = ops  # the Functions behind Tensor's operators (engine.py cannot import ops: ops imports it)
from minizero.autograd import functional
from minizero.autograd.functional import (causal_softmax, cross_entropy, dropout, embedding, gelu, layer_norm, linear,
                                          manual_seed)

__all__ = ["Context", "Function", "Tensor", "backward", "enable_grad", "is_grad_enabled", "no_grad",
           "saved_tensors_hooks", "concat", "split", "unbroadcast", "functional", "causal_softmax", "cross_entropy",
           "dropout", "embedding", "gelu", "layer_norm", "linear", "manual_seed"]
