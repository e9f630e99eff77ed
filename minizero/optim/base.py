"""The optimizer interface AdamW and 8-bit Adam share (PyTorch's ``torch.optim.Optimizer`` shape).

Subclasses write :meth:`Optimizer._update`; decay follows nanoGPT's grouping; a parameter whose ``.grad``
is None is skipped entirely, as PyTorch's AdamW.
"""
from __future__ import annotations

import math
import numbers

import numpy as np


def _real(v):  # a real number, NumPy's scalars and 0-d real arrays too (PyTorch-style code passes them), as a float
    if (isinstance(v, numbers.Real) and not isinstance(v, bool)) or (
            isinstance(v, np.ndarray) and v.shape == () and v.dtype.kind in "iuf"):
        return float(v)
    return v  # bools, strings, complex, arrays with elements: refused by the caller


def check_hyper_parameters(owner: str, lr, betas, eps, weight_decay) -> tuple:
    """``(lr, betas, eps, weight_decay)`` as floats; ValueError naming ``owner`` and the values, unless they are the
    finite numbers the message says."""
    is_pair = isinstance(betas, (tuple, list)) or (isinstance(betas, np.ndarray) and betas.ndim == 1)
    pair = tuple(map(_real, betas)) if is_pair else ()  # betas=0.9 or lr='1e-3': named as well
    lr_, eps_, wd_ = map(_real, (lr, eps, weight_decay))
    if not (len(pair) == 2 and all(type(v) is float for v in (lr_, eps_, wd_, *pair))
            and 0 <= lr_ < math.inf and 0 <= pair[0] < 1 and 0 <= pair[1] < 1
            and 0 < eps_ < math.inf and 0 <= wd_ < math.inf):  # written so that NaN fails every comparison
        raise ValueError(f"{owner}: need finite lr >= 0, 0 <= betas < 1 (a pair), eps > 0, weight_decay >= 0; "
                         f"got lr={lr!r}, betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r}")
    return lr_, pair, eps_, wd_


class Optimizer:
    """Base of :class:`~minizero.optim.AdamW` and :class:`~minizero.optim.adam8bit.Adam8bit`.

    Args: lr >= 0; betas in [0, 1); eps > 0; weight_decay >= 0. Attributes: step_count (Adam's t).
    Raises ValueError: a hyper-parameter out of range (naming the class and values).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        lr, betas, eps, weight_decay = check_hyper_parameters(type(self).__name__, lr, betas, eps, weight_decay)
        self.params = list(params)
        seen = {}
        for i, p in enumerate(self.params):  # a parameter listed twice was updated twice per step, silently
            if not hasattr(p, "grad"):
                raise TypeError(f"{type(self).__name__}: params[{i}] is a {type(p).__name__}; allowed: Parameters "
                                "(model.parameters())")
            if seen.setdefault(id(p), i) != i:
                raise ValueError(f"{type(self).__name__}: params[{i}] is params[{seen[id(p)]}] again; list each "
                                 "parameter once")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0

    @staticmethod
    def decays(p) -> bool:
        """nanoGPT's rule: weight decay on parameters with 2 or more dims (matmul weights, embeddings)."""
        return p.ndim >= 2

    def set_lr(self, lr: float) -> None:
        """Set the learning rate for the next step."""
        self.lr = lr

    def set_step(self, n: int) -> None:
        """Set Adam's t to ``n`` applied steps (a resumed checkpoint's); the next step is ``n + 1``."""
        self.step_count = n

    def step(self, grad_scale: float = 1.0) -> None:
        """Apply one update to every parameter that has a gradient (using ``grad * grad_scale``)."""
        self.step_count += 1
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._update(i, p, self.weight_decay if self.decays(p) else 0.0, grad_scale)

    def _update(self, i: int, p, weight_decay: float, grad_scale: float) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop gradients (``set_to_none``): the next backward allocates fresh ones."""
        for p in self.params:
            p.grad = None

    #: whether each data rank holds only its own part of the state (ZeRO); here every rank holds all
    shards_state = False

    def state_replicas(self, data_comm):  # the ranks holding this state bitwise equal: every data rank
        return data_comm

    def views(self, which: str):
        """``(param, lo, hi, array)`` for what this rank holds of ``which`` ("param", "grad", "master"):
        here the whole arrays (lo = 0, hi = param.size, ``array`` in the parameter's shape)."""
        return whole_views(self.params, which, getattr(self, "masters", None))

    def state_views(self, save: bool = True):
        """``(kind, param, lo, hi, array)``, kind in "param", "m", "v", "master": what a checkpoint writes
        (``save``) or reads on this rank, per parameter in order (``m[i]``, ``v[i]``, ``masters[i]``)."""
        masters = getattr(self, "masters", None)
        for i, p in enumerate(self.params):
            for kind, a in (("param", p.data), ("m", self.m[i]), ("v", self.v[i]),
                            ("master", None if masters is None else masters[i])):
                if a is not None:
                    yield kind, p, 0, int(p.size), a


def whole_views(params, which: str, masters=None):
    """``(param, 0, param.size, array)`` per param holding ``which`` ("param", "grad", "master"); else ValueError."""
    if which not in ("param", "grad", "master"):
        raise ValueError(f"which={which!r}; allowed: 'param', 'grad', 'master'")
    for i, p in enumerate(params):
        a = {"param": p.data, "grad": p.grad, "master": None if masters is None else masters[i]}[which]
        if a is not None:
            yield p, 0, int(p.size), a
