"""The logical coordinate system of a checkpoint: which piece of which tensor a rank holds.

Every array a rank keeps is described the same way, whatever the layout that put it there::

    Slot(kind, name, shape, tp, lo, hi)
      kind   "param" | "m" | "v" | "master"      (the parameter, Adam's moments, FP16's FP32 copy)
      name   the nanoGPT name of the whole parameter ("transformer.h.0.attn.c_attn.weight")
      shape  its full (logical) shape, as one process holds it
      tp     None, or (dim, stride, index, parts): the tensor-parallel shard this rank holds
             (Megatron's partition_dim / partition_stride, tensor rank, tensor size)
      lo:hi  elements [lo, hi) of that shard laid flat (ZeRO's owned piece; 0:size when whole)

So a ZeRO-1 piece at dp 4 and a tensor-parallel shard at tp 2 are both "these elements of this
parameter": :func:`full_index` maps any slot to flat indices of the full tensor, and loading on a
new layout is, for each slot the new rank holds, "read the saved slots that overlap it" — the
idea of DeepSpeed's universal checkpoint (``ds_to_universal``: per-parameter fragments with
their offsets) and of PyTorch DCP's load-time resharding (``ChunkStorageMetadata`` offsets and
sizes, a load plan of overlaps).

:func:`slots` enumerates a :class:`~minizero.parallel.strategy.Strategy`'s slots, to save (each
element of the model exactly once over all ranks: data rank 0 without ZeRO, tensor rank 0 for
tensor-replicated parameters, not the last stage's copy of the tied embedding) or to load (every
array the rank holds, replicas included).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minizero import backend
from minizero.optim.adam8bit import QuantizedState

KINDS = ("param", "m", "v", "master")
TIED = "transformer.wte.weight"  #: the logical name of the LM head's weight (tied to the embedding)


@dataclasses.dataclass
class Slot:
    """One piece of one logical tensor on this rank (see the module docstring for the fields).

    ``array``: the live array, of ``hi - lo`` elements (any shape, written through ``[...]``),
    or a :class:`~minizero.optim.adam8bit.QuantizedState` (8-bit Adam's codes + absmax, whose
    ``offset`` is ``lo``).
    """

    kind: str
    name: str
    shape: tuple
    tp: tuple | None
    lo: int
    hi: int
    array: object


def tp_of(p, topo):
    """``(dim, stride, tp_rank, tp)`` of a tensor-parallel shard, or None for a parameter held whole."""
    if getattr(p, "tensor_model_parallel", False):
        return (int(p.partition_dim), int(p.partition_stride), topo.tp_rank, topo.tp)
    return None


def full_shape(local_shape, tp) -> tuple:
    """The whole parameter's shape from a shard's shape: ``shape[dim] *= parts``."""
    shape = [int(s) for s in local_shape]
    if tp is not None:
        shape[tp[0]] *= tp[3]
    return tuple(shape)


def same_split(a, b) -> bool:
    """True when two slots cut their parameter the same way (same dim, stride, parts; index may differ)."""
    if a is None or b is None:
        return a is None and b is None
    return tuple(a[:2]) == tuple(b[:2]) and a[3] == b[3]


def full_index(tp, shape, lo: int, hi: int):
    """Flat indices into the full tensor of elements ``[lo, hi)`` of a shard: int64 (hi - lo,).

    ``tp`` = (dim, stride, index, parts) as :func:`minizero.parallel.tensor_parallel.shard_array`
    cuts: the full dimension n is ``stride`` blocks; shard ``index`` keeps part ``index`` of
    ``parts`` of each block (b = n / (stride * parts) rows). Local coordinate c along ``dim`` is
    block ``c // b``, row ``c % b`` of it, so its full coordinate is
    ``(c // b) * (n / stride) + index * b + c % b``. Memory: O(hi - lo), never the whole tensor.
    """
    idx = np.arange(lo, hi, dtype=np.int64)
    if tp is None:
        return idx
    dim, stride, index, parts = tp
    local = list(shape)
    local[dim] //= parts
    coords = list(np.unravel_index(idx, local))
    n = shape[dim]
    b = n // (stride * parts)
    c = coords[dim]
    coords[dim] = (c // b) * (n // stride) + index * b + c % b
    return np.ravel_multi_index(coords, shape).astype(np.int64)


def _opt_states(opt, i):
    """(m, v, master) of parameter index ``i`` of a per-parameter optimizer (AdamW, Adam8bit)."""
    masters = getattr(opt, "masters", None)
    return opt.m[i], opt.v[i], None if masters is None else masters[i]


def slots(strategy, purpose: str = "save") -> list:
    """This rank's :class:`Slot` list for ``purpose`` ``"save"`` or ``"load"``.

    Without ZeRO the optimizer state is per parameter (``opt.m[i]``, ``opt.v[i]``,
    ``opt.masters[i]``); under ZeRO it is the owned piece of every unit (``st.m``, ``st.v``,
    ``st.master``, or 8-bit Adam's ``sharded_state.state``), and the parameter is the owned
    shard too (stage 3), or held whole (stages 1-2: saved as the owned piece, loaded whole).
    Raises:
        ValueError: ``purpose`` is neither "save" nor "load".
    """
    if purpose not in ("save", "load"):
        raise ValueError(f"purpose={purpose!r}; allowed: 'save', 'load'")
    save = purpose == "save"
    topo, stage, zero = strategy.topo, strategy.stage, strategy.zero
    out = []

    def keep(p):  # each element written once: tensor rank 0 for replicated ones, no tied copy
        if getattr(p, "shared_embedding_copy", False) or (tp_of(p, topo) is None and topo.tp_rank != 0):
            return not save
        return True

    def logical(name, p):
        return TIED if getattr(p, "shared_embedding_copy", False) else name

    whole_params = zero is None or not zero.shards_parameters
    if zero is None and save and topo.dp_rank != 0:
        return out  # data replicas hold the same numbers as data rank 0
    for name, p in stage.named_parameters():  # whole parameters (no ZeRO; ZeRO 1-2 on load)
        if not keep(p) or (zero is not None and (save or not whole_params)):
            continue
        tp, n = tp_of(p, topo), int(p.size)
        shape = full_shape(p.shape, tp)
        out.append(Slot("param", logical(name, p), shape, tp, 0, n, p.data))
        if zero is None:
            i = next(k for k, q in enumerate(strategy.opt.params) if q is p)
            for kind, a in zip(("m", "v", "master"), _opt_states(strategy.opt, i)):
                if a is not None:
                    out.append(Slot(kind, logical(name, p), shape, tp, 0, n, a))
    if zero is None:
        return out
    named = dict(stage.named_parameters())
    sharded = zero.sharded_state
    for st in zero.units:
        for j, pc in enumerate(st.pieces):
            p = named[pc.param]
            if not keep(p):
                continue
            tp = tp_of(p, topo)
            shape, sl = full_shape(p.shape, tp), slice(pc.shard_lo, pc.shard_lo + pc.hi - pc.lo)
            name = logical(pc.param, p)
            if save or not whole_params:
                out.append(Slot("param", name, shape, tp, pc.lo, pc.hi, st.param_shard[sl]))
            m, v = (st.m[sl], st.v[sl]) if sharded is None else sharded.state[st.index][j]
            for kind, a in (("m", m), ("v", v), ("master", None if st.master is None else st.master[sl])):
                if a is not None:
                    out.append(Slot(kind, name, shape, tp, pc.lo, pc.hi, a))
    return out


def host_arrays(slot) -> dict:
    """What a slot writes: ``{"": array}`` (flat, host), or ``{"codes": uint8, "absmax": float32}`` (8-bit)."""
    a = slot.array
    if isinstance(a, QuantizedState):
        return {"codes": np.ascontiguousarray(backend.to_host(a.codes)),
                "absmax": np.ascontiguousarray(backend.to_host(a.absmax))}
    return {"": np.ascontiguousarray(backend.to_host(a)).reshape(-1)}
