"""Optimizers: the shared interface (``Optimizer``), AdamW (functional core ``adamw_update``), LR schedule, clipping."""
from minizero.optim.base import Optimizer
from minizero.optim.adamw import (AdamW, adamw_update, clip_coefficient, clip_grad_norm_, cosine_lr,
                                  global_grad_norm_sq, state_dtype)

OPTIMIZERS = ("adamw", "adam8bit")  #: train's --optimizer choices, a checkpoint's layout.optimizer

__all__ = ["OPTIMIZERS", "Optimizer", "AdamW", "adamw_update", "clip_coefficient", "clip_grad_norm_", "cosine_lr",
           "global_grad_norm_sq", "state_dtype"]
