"""``Module`` and the basic layers: Linear, Matmul, LayerNorm, Embedding, Dropout, CrossEntropyLoss, containers.

Mirrors ``torch.nn.Module``: ``named_parameters`` (shared ones once), ``state_dict`` (shared ones under every
name), ``load_state_dict``, ``train``/``eval``, forward pre- and post-hooks.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, functional as F
from minizero.autograd.rng import MaskStream
from minizero.ledger import get_ledger
from minizero.nn.init import META, is_meta, meta


class Parameter(Tensor):
    """A leaf Tensor (any shape, float) that requires grad, counted as ``parameters`` in the ledger."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)
        if not is_meta(self.data):  # a meta array holds no bytes (nn/init.py); its drawn values are tracked
            get_ledger().track(self.data, "parameters")

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class Module:
    """Base class for layers and models: Parameters and Modules set as attributes; calls run pre-hooks, forward,
    hooks."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    # ---- traversal ------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        """Yield ``(dotted_name, module)`` for this module and every descendant."""
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def swap_modules(self, fn, memo=None) -> list[str]:
        """Replace every descendant ``child`` for which ``fn(child)`` is a Module by it, under each name that
        holds it (one replacement per shared child; ``memo`` {id: (child, new)} shares them across calls, and a
        replacement from an earlier call is neither replaced nor searched: it may hold the child it replaced).

        Returns the dotted names replaced.
        """
        memo = {} if memo is None else memo
        made = {id(new) for _, new in memo.values() if new is not None}

        def walk(prefix, module):  # named_modules, not into an earlier call's replacement
            yield prefix, module
            for name, child in module._modules.items():
                if id(child) not in made:
                    yield from walk(f"{prefix}.{name}" if prefix else name, child)

        done = []
        for prefix, parent in list(walk("", self)):
            for name, child in list(parent._modules.items()):
                if id(child) not in memo:
                    memo[id(child)] = (child, fn(child))
                new = memo[id(child)][1]
                if new is not None:
                    memo[id(new)] = (new, None)  # a replacement is not replaced again
                    setattr(parent, name, new)
                    done.append(f"{prefix}.{name}" if prefix else name)
        return done

    def map_wrapped(self, fn) -> "Module":
        """``fn(self)``: the Module replacing this one (``fn`` must return one, never None); a wrapper (recompute's)
        returns a new wrapper around ``inner.map_wrapped(fn)``: a technique replaces a wrapped module unnamed."""
        return fn(self)

    def children(self):
        """The direct sub-modules."""
        return list(self._modules.values())

    def named_children(self):
        """Yield ``(name, module)`` for each direct sub-module, in registration order."""
        yield from self._modules.items()

    def _named_parameters_all(self, prefix="", recurse=True):
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, m in self._modules.items() if recurse else ():
            yield from m._named_parameters_all(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, recurse: bool = True, remove_duplicate: bool = True):
        """Yield ``(dotted_name, Parameter)``; a shared parameter appears once, under its first name (every name
        with ``remove_duplicate=False``); ``recurse=False``: this module's own parameters only."""
        seen = set()
        for name, p in self._named_parameters_all(recurse=recurse):
            if not remove_duplicate or id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> list:
        """All distinct Parameters, in registration order."""
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        """Number of distinct parameter elements."""
        return int(sum(p.size for p in self.parameters()))

    # ---- state ------------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Name -> host array copy, every name including aliases of shared parameters."""
        return OrderedDict((name, backend.to_host(p.data).copy())
                           for name, p in self.named_parameters(remove_duplicate=False))

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays into the parameters in place, keeping dtype.

        Raises KeyError: ``strict`` and names missing or unexpected; ValueError: a shape differs.
        """
        own = dict(self.named_parameters(remove_duplicate=False))
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, p in own.items():
            if name not in state:
                continue
            value = state[name]
            if not isinstance(value, backend.xp.ndarray):  # host data (a file, a list): one explicit copy in
                value = backend.to_device(np.asarray(value))
            if value.shape != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {value.shape}, the model expects {p.shape}")
            p.data[...] = value.astype(p.dtype, copy=False)

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``set_to_none`` semantics)."""
        for p in self.parameters():
            p.grad = None

    # ---- modes and hooks ------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode (dropout active) on this module and all descendants."""
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        """Set evaluation mode (dropout off)."""
        return self.train(False)

    def register_forward_pre_hook(self, hook):
        """``hook(module, args) -> None | new_args`` runs before forward. Returns a remover."""
        self._forward_pre_hooks.append(hook)
        return lambda: self._forward_pre_hooks.remove(hook)

    def register_forward_hook(self, hook):
        """``hook(module, args, output) -> None | new_output`` runs after forward. Returns a remover."""
        self._forward_hooks.append(hook)
        return lambda: self._forward_hooks.remove(hook)

    def __call__(self, *args):
        for hook in self._forward_pre_hooks:
            new = hook(self, args)
            if new is not None:
                args = new if isinstance(new, tuple) else (new,)
        out = self.forward(*args)
        for hook in self._forward_hooks:
            new = hook(self, args, out)
            if new is not None:
                out = new
        return out

    def forward(self, *args):  # pragma: no cover - abstract
        raise NotImplementedError


class ModuleList(Module):
    """A list of modules named ``0``, ``1``, ... (as ``torch.nn.ModuleList``)."""

    def __init__(self, modules=()):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, i):
        return list(self._modules.values())[i]


class ModuleDict(Module):
    """Modules under string keys (as ``torch.nn.ModuleDict``)."""

    def __init__(self, modules: dict):
        super().__init__()
        for k, m in modules.items():
            setattr(self, k, m)

    def __getitem__(self, key):
        return self._modules[key]


class Linear(Module):
    """y = x W^T + b. W: (out_features, in_features), b: (out_features,).

    ``rng``: generator for W ~ N(0, std^2) (b = 0), or ``nn.init.META``; ``weight``: an existing (out, in) Parameter.
    Raises ValueError: sizes not ints >= 0, std not finite >= 0, ``weight`` of the wrong shape, x of another width.
    """

    def __init__(self, in_features, out_features, bias=True, dtype="float32", rng=None, std=0.02, weight=None):
        super().__init__()
        # bool is an int subclass; 0 is allowed: zero-width layers work, as in PyTorch (test_faults)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"Linear: {name} must be an integer >= 0, got {v!r}")
        if isinstance(std, bool) or not isinstance(std, (int, float, np.number)) or not 0 <= std < np.inf:
            raise ValueError(f"Linear: std must be a finite number >= 0, got {std!r}")
        dt = backend.get_dtype(dtype)
        if weight is not None:  # share an existing Parameter (weight tying); no init drawn
            if weight.shape != (out_features, in_features):
                raise ValueError(f"shared weight has shape {weight.shape}, expected {(out_features, in_features)}")
            self.weight = weight
        elif rng is META:  # shapes only (nn/init.py draws the values, or a shard of them)
            self.weight = Parameter(meta((out_features, in_features), dt))
        else:
            rng = rng if rng is not None else np.random.default_rng(0)
            w = rng.normal(0.0, std, size=(out_features, in_features))
            self.weight = Parameter(backend.to_device(w.astype(dt)))
        zeros = meta if rng is META else backend.xp.zeros
        self.bias = Parameter(zeros(out_features, dt)) if bias else None
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x):
        if x.shape[-1:] != (self.in_features,):  # named here, not deep in the matmul
            raise ValueError(f"Linear(in_features={self.in_features}): x's last dimension is "
                             f"{x.shape[-1] if x.shape else None} (x has shape {x.shape})")
        return F.linear(x, self.weight, self.bias)


class Matmul(Module):
    """y = x @ w, x (N, in), w (in, out) held by the owner (the MoE layer); a child module so that a precision
    converts it as it converts :class:`Linear` (``swap_modules``: memory/bf16.py's BF16Matmul)."""

    def forward(self, x, w):
        return x @ w


class LayerNorm(Module):
    """Layer norm over the last axis with learned weight (ones) and bias (zeros), shape (C,).

    ``rng=nn.init.META`` gives 0-byte meta parameters (values drawn later by nn/init.py).
    """

    def __init__(self, n, eps=1e-5, dtype="float32", rng=None):
        super().__init__()
        dt = backend.get_dtype(dtype)
        ones, zeros = (meta, meta) if rng is META else (backend.xp.ones, backend.xp.zeros)
        self.weight = Parameter(ones(n, dt))
        self.bias = Parameter(zeros(n, dt))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(Module):
    """Lookup table W: (num_embeddings, dim), init N(0, std^2) (``rng=nn.init.META``: a 0-byte meta array)."""

    def __init__(self, num_embeddings, dim, dtype="float32", rng=None, std=0.02):
        super().__init__()
        if rng is META:
            self.weight = Parameter(meta((num_embeddings, dim), backend.get_dtype(dtype)))
            return
        rng = rng if rng is not None else np.random.default_rng(0)
        w = rng.normal(0.0, std, size=(num_embeddings, dim)).astype(backend.get_dtype(dtype))
        self.weight = Parameter(backend.to_device(w))

    def forward(self, idx):
        ids = idx.data if isinstance(idx, Tensor) else idx
        ids = ids if isinstance(ids, backend.xp.ndarray) else np.asarray(ids)
        n = self.weight.shape[0]
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"Embedding: ids must be integers in [0, {n}), got dtype {ids.dtype}")
        # ids on the host (NumPy's, or given so) are range-checked; a device's would cost a sync per forward
        if isinstance(ids, np.ndarray) and ids.size and not (ids.min() >= 0 and ids.max() < n):  # -1: from the end
            i = int(np.flatnonzero((ids.reshape(-1) < 0) | (ids.reshape(-1) >= n))[0])
            at = tuple(int(j) for j in np.unravel_index(i, ids.shape))
            raise ValueError(f"Embedding({n}, ...): ids must lie in [0, {n}); id {int(ids.reshape(-1)[i])} at "
                             f"position {at} is outside")
        return F.embedding(ids, self.weight)


class Dropout(Module):
    """Dropout with probability p while training (identity in eval mode). ``site``: its number in the model
    (GPT numbers its dropouts in module order), which addresses its mask inside ``rng.batch_rows``."""

    def __init__(self, p=0.0, site=None):
        super().__init__()
        self.p, self.site = p, site

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.site)

    def reserve_mask(self, shape):
        """The mask ``forward`` would draw for an array of ``shape``, as a :class:`MaskStream` read by
        block (FlashAttention), the generator advanced as ``forward`` advances it; None if none is drawn."""
        return None if not self.training or self.p == 0.0 else MaskStream.reserve(shape, self.p, site=self.site)


class CrossEntropyLoss(Module):
    """Mean cross-entropy: logits (N, V), targets (N,) -> () (:func:`~minizero.autograd.functional.cross_entropy`)."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets)
