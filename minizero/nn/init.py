"""Parameter initialisation that can produce any slice of any parameter without the rest.

Row r of a parameter is drawn by ``Philox(key = blake2b(seed, name), counter = [0, 0, r, 0])`` as N(0, std^2)
in float64, then cast, so every layout starts from the same bits. Rules (GPT-2): 2-D weights N(0, 0.02^2),
``c_proj.weight`` N(0, (0.02/sqrt(2L))^2), layer-norm weights 1, biases 0.
Mirrors: Megatron-LM ``_initialize_affine_weight_cpu``; PyTorch's meta device; NumPy's ``Philox``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from minizero import backend

#: pass as ``rng`` to Linear / Embedding / LayerNorm to get meta (0-byte) parameters
META = "meta"
TIED = "transformer.wte.weight"  #: the logical name of the LM head's weight (tied to the embedding)


#: (array module name, dtype) -> the one 0-d zero every meta array of that module and dtype views
_META_ZEROS: dict = {}


def _meta_zero(xp, dtype):
    """The shared 0-d zero behind every meta array of ``xp`` and ``dtype`` (made on first use)."""
    key = (xp.__name__, np.dtype(dtype).str)
    if key not in _META_ZEROS:
        _META_ZEROS[key] = xp.zeros((), dtype)
    return _META_ZEROS[key]


def meta(shape, dtype):
    """A 0-byte array of ``shape`` and ``dtype`` (a broadcast of one shared zero): never write into one."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    xp = backend.xp
    return xp.broadcast_to(_meta_zero(xp, dtype), shape)


def is_meta(a) -> bool:
    """True for an array made by :func:`meta`: more than 0 dimensions, all strides 0, and its base the
    shared zero of its module and dtype (``broadcast_to`` placeholders of other values are not meta)."""
    if a.ndim == 0 or any(a.strides):
        return False
    return any(a.base is z for z in _META_ZEROS.values())


def copy_or_meta(a):
    """A copy of ``a``, or ``a`` itself when it is a meta array (nothing to copy)."""
    return a if is_meta(a) else a.copy()


def rule(name: str, ndim: int, n_layer: int) -> tuple:
    """``("normal", std)``, ``("ones",)`` or ``("zeros",)`` for a nanoGPT parameter name."""
    if ndim >= 2:
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
        return ("normal", std)
    if name.endswith(".weight"):  # layer norms
        return ("ones",)
    return ("zeros",)


def _key(seed: int, name: str) -> np.ndarray:
    """Philox key (2 uint64) of one parameter: blake2b of ``"seed:name"``."""
    h = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=16).digest()
    return np.frombuffer(h, dtype=np.uint64).copy()


def full_rows(seed: int, name: str, ncols: int, std: float, rows) -> np.ndarray:
    """Rows ``rows`` (ints) of the full (R, ncols) N(0, std^2) parameter ``name``: float64 (len(rows), ncols)."""
    bits = np.random.Philox(key=_key(seed, name))
    gen, state = np.random.Generator(bits), bits.state  # one generator, its counter set per row (no new seeding)
    out = np.empty((len(rows), ncols), dtype=np.float64)
    for i, r in enumerate(rows):
        state["state"]["counter"] = np.array([0, 0, int(r), 0], dtype=np.uint64)
        bits.state = state  # the buffer stays empty: the row's first draw is its counter's first block
        gen.standard_normal(ncols, out=out[i])
    out *= std
    return out


def _full_coord(c, n: int, stride: int, index: int, parts: int):
    """Full coordinate of local coordinate(s) ``c`` along a dimension of full size ``n`` split as
    ``tensor_parallel.shard_array`` splits it: ``stride`` blocks, part ``index`` of ``parts`` of each."""
    b = n // (stride * parts)
    return (c // b) * (n // stride) + index * b + c % b


@dataclasses.dataclass(frozen=True)
class ParamInit:
    """How to draw any flat piece of one parameter shard (``name``, full ``shape``, ``rule``, ``tp``, ...)."""

    seed: int
    name: str
    shape: tuple
    rule: tuple
    dtype: object
    tp: tuple | None = None
    ROWS_PER_DRAW = 256  #: rows drawn per call of :func:`full_rows` (bounds the float64 scratch)

    @property
    def local_shape(self) -> tuple:
        s = list(self.shape)
        if self.tp is not None:
            s[self.tp[0]] //= self.tp[3]
        return tuple(s)

    def flat(self, lo: int, hi: int):
        """Elements ``[lo, hi)`` of this shard laid flat, (hi - lo,) ``dtype`` on the device; ValueError outside."""
        local = self.local_shape
        size = int(np.prod(local))
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"{self.name}: piece [{lo}, {hi}) outside a shard of {size} elements")
        dt = np.dtype(self.dtype)
        if self.rule[0] != "normal":
            fill = 1.0 if self.rule[0] == "ones" else 0.0
            return backend.xp.full(hi - lo, fill, dtype=dt)
        ncols_local, ncols = local[-1], self.shape[-1]
        out = np.empty(hi - lo, dtype=dt)
        r0, r1 = lo // ncols_local, -(-hi // ncols_local)
        cols = slice(0, ncols_local)  # the local columns of each full row: a view, or an index array under tp
        if self.tp is not None and self.tp[0] == 1:
            cols = _full_coord(np.arange(ncols_local), ncols, self.tp[1], self.tp[2], self.tp[3])
        for c0 in range(r0, r1, self.ROWS_PER_DRAW):  # a block of local rows at a time: its slice of [lo, hi)
            c1 = min(r1, c0 + self.ROWS_PER_DRAW)
            rows = range(c0, c1) if self.tp is None or self.tp[0] != 0 else [
                _full_coord(r, self.shape[0], *self.tp[1:]) for r in range(c0, c1)]
            block = full_rows(self.seed, self.name, ncols, self.rule[1], rows)[:, cols].reshape(-1)
            a, b = max(lo, c0 * ncols_local), min(hi, c1 * ncols_local)
            out[a - lo:b - lo] = block[a - c0 * ncols_local:b - c0 * ncols_local]
        return backend.to_device(out)


def attach_inits(module, seed: int, n_layer: int, tp_rank: int = 0, tp: int = 1) -> None:
    """Set ``p.init`` on every parameter of ``module``; ``tensor_model_parallel`` ones as their shard."""
    for name, p in module.named_parameters():
        split = None
        if getattr(p, "tensor_model_parallel", False):
            split = (int(p.partition_dim), int(p.partition_stride), tp_rank, tp)
        shape = list(p.shape)
        if split is not None:
            shape[split[0]] *= tp
        logical = TIED if getattr(p, "shared_embedding_copy", False) else name
        p.init = ParamInit(seed, logical, tuple(shape), rule(logical, len(shape), n_layer), p.dtype, split)


def materialize_(module, ledger=None) -> None:
    """Replace every meta parameter of ``module`` by its drawn values (``ledger``: tracked as ``parameters``).

    Raises AttributeError: a meta parameter without ``init``.
    """
    for _, p in module.named_parameters():
        if is_meta(p.data):
            p.data = p.init.flat(0, p.size).reshape(p.shape)
            if ledger is not None:
                ledger.track(p.data, "parameters")
