"""Magnitude pruning to a target sparsity, and training with the mask held fixed.

Exactly ``round(sparsity * n)`` of the linear layers' weights of smallest |w| go, per matrix (``"layer"``) or under
one threshold (``"global"``); pruned gradients are zeroed before clipping, pruned weights after the update. Masks are
bitmaps (1 bit per element, in the ledger's ``parameters``). Sources: Han et al. 2015, arXiv:1506.02626, section 3;
Zhu & Gupta 2017, arXiv:1710.01878.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.ledger import get_ledger
from minizero.nn.module import Linear
from minizero.optim.base import whole_views

SCOPES = ("global", "layer")


def prunable_weights(model) -> dict:
    """``{name: Parameter}`` of every Linear weight that no other module shares (not the tied LM head)."""
    owners = {}
    for _, m in model.named_modules():
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {f"{name}.weight" if name else "weight": m.weight for name, m in model.named_modules()
            if isinstance(m, Linear) and owners[id(m.weight)] == 1}


def _check(sparsity, scope):
    if not (0.0 <= sparsity < 1.0):
        raise ValueError(f"sparsity={sparsity!r}; allowed: 0 <= sparsity < 1")
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r}; allowed: {', '.join(SCOPES)}")


def _prune_smallest(magnitude, k: int):
    """Bool keep-mask of flat ``magnitude`` with exactly its ``k`` smallest entries False (stable ties)."""
    xp = backend.array_module(magnitude)
    keep = xp.ones(magnitude.size, bool)
    keep[xp.argsort(magnitude, kind="stable")[:k]] = False
    return keep


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # element 8i is the high bit of byte i, as np.packbits


def packbits(mask):
    """Flat bool ``mask`` (n,) -> uint8 (ceil(n/8),), element 8i in the high bit (``np.packbits``'
    big-endian layout), computed with the mask's array module (so on the device)."""
    xp = backend.array_module(mask)
    bits = xp.zeros(-(-mask.size // 8) * 8, np.uint8)
    bits[:mask.size] = mask.reshape(-1)
    return (bits.reshape(-1, 8) * xp.asarray(np.array(_BIT_WEIGHTS, np.uint8))).sum(axis=1, dtype=np.uint8)


def unpackbits(packed, n: int):
    """Inverse of :func:`packbits`: the first ``n`` bits of uint8 ``packed`` as a bool (n,)."""
    xp = backend.array_module(packed)
    shifts = xp.asarray(np.arange(7, -1, -1, dtype=np.uint8))
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:n].astype(bool)


def magnitude_masks(weights: dict, sparsity: float, scope: str = "global") -> dict:
    """Keep-masks ``{name: bool of the weight's shape}`` pruning ``sparsity`` of the entries with the smallest |w|.

    ``scope``: ``"global"`` or ``"layer"``. Raises ValueError: sparsity outside [0, 1), unknown scope, non-finite.
    """
    _check(sparsity, scope)
    mags = {k: abs(w.astype(np.float64)).reshape(-1) for k, w in weights.items()}
    for k, a in mags.items():
        if not backend.host_scalar(backend.array_module(a).isfinite(a).all()):
            raise ValueError(f"{k} has non-finite weights; cannot rank them by magnitude")
    shapes = {k: tuple(w.shape) for k, w in weights.items()}
    if scope == "layer":
        return {k: _prune_smallest(a, int(round(sparsity * a.size))).reshape(shapes[k]) for k, a in mags.items()}
    names = list(mags)
    flat = backend.array_module(mags[names[0]]).concatenate([mags[k] for k in names]) if names else np.zeros(0)
    keep = _prune_smallest(flat, int(round(sparsity * flat.size)))
    out, off = {}, 0
    for k in names:
        out[k] = keep[off:off + mags[k].size].reshape(shapes[k])
        off += mags[k].size
    return out


def compressed_nbytes(mask, value_bytes: int = 4, index_bytes: int = 4) -> dict:
    """``{"nnz": kept elements, "dense", "csr", "bitmap": bytes}`` of a 2-D keep-mask's matrix: dense all values;
    CSR the kept values, a column index each and rows + 1 row pointers; bitmap 1 bit per element + the kept values."""
    mask = mask if hasattr(mask, "dtype") else np.asarray(mask, bool)
    rows = mask.shape[0] if mask.ndim >= 1 else 1
    n, nnz = mask.size, int(backend.host_scalar(mask.sum()))
    return {"nnz": nnz, "dense": n * value_bytes, "csr": nnz * (value_bytes + index_bytes) + (rows + 1) * index_bytes,
            "bitmap": -(-n // 8) + nnz * value_bytes}


class Pruner:
    """Fixed pruning masks for a model's :func:`prunable_weights`
    (full weights: under ZeRO-3 inside ``full_parameters()``)::

        pruner.prune_(opt)             # once: zero the pruned weights
        pruner.mask_gradients_(opt)    # after the gradient reduction, before clipping
        pruner.mask_weights_(opt)      # after opt.step()

    ``opt``: any optimizer (through its ``views(which)``) or None (the model's weights). Raises ValueError: as
    :func:`magnitude_masks`.
    """

    def __init__(self, model, sparsity: float, scope: str = "global"):
        self.params = prunable_weights(model)
        self._names = {id(p): k for k, p in self.params.items()}
        masks = magnitude_masks({k: p.data for k, p in self.params.items()}, sparsity, scope)
        self.sparsity, self.scope = sparsity, scope
        self.shapes = {k: m.shape for k, m in masks.items()}
        self.packed = {k: packbits(m) for k, m in masks.items()}
        for a in self.packed.values():
            get_ledger().track(a, "parameters")

    @classmethod
    def from_masks(cls, model, packed: dict, shapes: dict, sparsity: float, scope: str) -> "Pruner":
        """A Pruner with saved masks (a resumed checkpoint): ``packed`` name -> uint8 :func:`packbits` of the flat bool
        keep-mask (host arrays, copied to the device here), ``shapes`` name -> the weight's shape. Raises KeyError for a
        name ``model`` has no prunable weight of."""
        self = cls.__new__(cls)
        weights = prunable_weights(model)
        self.params = {k: weights[k] for k in packed}
        self._names = {id(p): k for k, p in self.params.items()}
        self.sparsity, self.scope = sparsity, scope
        self.shapes = dict(shapes)
        self.packed = {k: backend.to_device(np.asarray(v, dtype=np.uint8)) for k, v in packed.items()}
        for a in self.packed.values():
            get_ledger().track(a, "parameters")
        return self

    def mask(self, name: str):
        """The bool keep-mask of parameter ``name`` (unpacked, the weight's shape), on the device."""
        shape = self.shapes[name]
        n = int(np.prod(shape))
        return unpackbits(self.packed[name], n).reshape(shape)

    def _mask_(self, opt, which: str) -> None:
        """Zero the pruned entries of ``which`` ("param", "grad", "master") wherever this rank holds them:
        the optimizer's :meth:`views` (whole arrays, or a ZeRO rank's owned pieces), or ``p.data`` /
        ``p.grad`` of the model's weights without an optimizer."""
        views = opt.views(which) if opt is not None else whole_views(self.params.values(), which)
        for p, lo, hi, a in views:
            name = self._names.get(id(p))
            if name is not None:
                a *= self.mask(name).reshape(-1)[lo:hi].reshape(a.shape)

    def mask_gradients_(self, opt=None) -> None:
        """Zero the gradients of pruned entries (``.grad``; a ZeRO rank's owned gradient shards)."""
        self._mask_(opt, "grad")

    def mask_weights_(self, opt=None) -> None:
        """Set pruned weights to zero: the parameters and an optimizer's FP32 master copies, if any
        (a ZeRO rank's owned pieces; its whole parameters where it holds them)."""
        self._mask_(opt, "param")
        if opt is not None:
            self._mask_(opt, "master")

    prune_ = mask_weights_  #: pruning is masking the weights once

    def report(self) -> dict:
        """Measured sparsity and storage: ``{"pruned", "total", "sparsity", "dense", "csr", "bitmap", "mask_bytes",
        "layers": {name: {...}}}`` (bytes for FP32 values, int32 indices)."""
        layers = {k: dict(compressed_nbytes(self.mask(k).reshape(self.shapes[k][0], -1)),
                          sparsity=1 - float(backend.host_scalar(self.mask(k).mean()))) for k in self.packed}
        total = sum(int(np.prod(s)) for s in self.shapes.values())
        nnz = sum(v["nnz"] for v in layers.values())
        out = {"pruned": total - nnz, "total": total, "sparsity": (total - nnz) / max(total, 1), "layers": layers,
               "mask_bytes": int(sum(a.nbytes for a in self.packed.values()))}
        for fmt in ("dense", "csr", "bitmap"):
            out[fmt] = sum(v[fmt] for v in layers.values())
        return out
