"""The logical coordinate system of a checkpoint: which piece of which tensor a rank holds.

Every array a rank keeps is described the same way, whatever the layout that put it there::

    Slot(kind, name, shape, tp, lo, hi)
      kind   "param" | "m" | "v" | "master"      (the parameter, Adam's moments, FP16's FP32 copy)
      name   the nanoGPT name of the whole parameter ("transformer.h.0.attn.c_attn.weight")
      shape  its full (logical) shape, as one process holds it
      tp     None, or (dim, stride, index, parts): the tensor-parallel shard (or expert-parallel slice) it holds
      lo:hi  elements [lo, hi) of that shard laid flat (ZeRO's owned piece; 0:size when whole)

Loading on a new layout reads, for each slot, the saved slots that overlap it (DeepSpeed's
``ds_to_universal``; PyTorch DCP's load-time resharding).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minizero import backend
from minizero.nn.init import TIED
from minizero.optim.adam8bit import state_arrays

KINDS = ("param", "m", "v", "master")
#: the optimizer-state kinds each optimizer (train's ``--optimizer``, a manifest's layout.optimizer) keeps for every
#: parameter: both are Adam (8-bit Adam's small parameters keep dense m and v, the same kinds)
OPTIMIZER_KINDS = {"adamw": ("m", "v"), "adam8bit": ("m", "v")}
#: the precisions that keep an FP32 master of every parameter (``build_strategy``'s ``master_weights``)
MASTER_PRECISIONS = ("fp16",)


def saved_kinds(optimizer: str, precision: str) -> tuple:
    """The kinds a checkpoint holds for every parameter (each element in some piece, over the ranks): the values,
    ``optimizer``'s state (:data:`OPTIMIZER_KINDS`), the master under ``precision`` in :data:`MASTER_PRECISIONS`
    (frozen parameters do not exist in the main job, the one writer). Raises KeyError: an unknown optimizer."""
    return ("param",) + OPTIMIZER_KINDS[optimizer] + (("master",) if precision in MASTER_PRECISIONS else ())


@dataclasses.dataclass
class Slot:
    """One piece of one logical tensor on this rank; ``array``: ``hi - lo`` elements,
    or 8-bit Adam's ``QuantizedState``."""

    kind: str
    name: str
    shape: tuple
    tp: tuple | None
    lo: int
    hi: int
    array: object


def tp_of(p, topo):
    """``(dim, stride, index, parts)`` of a shard: a tensor-parallel one, an expert-parallel slice of the experts
    (``p.expert_shard``, parallel/expert_parallel.py; experts are whole in the tensor group), or None (whole)."""
    if getattr(p, "tensor_model_parallel", False):
        return (int(p.partition_dim), int(p.partition_stride), topo.tp_rank, topo.tp)
    return getattr(p, "expert_shard", None)


def _written_here(p, topo, shards_state: bool) -> bool:
    """Whether this rank writes ``p``'s slots, so that each element is written once: tensor rank 0 for what the
    tensor group replicates; data rank 0 for what the data group replicates (every data rank where the
    optimizer shards its state), the first expert group for an expert slice (data ranks 0..ep-1)."""
    if getattr(p, "shared_embedding_copy", False):
        return False
    if not getattr(p, "tensor_model_parallel", False) and topo.tp_rank != 0:
        return False
    expert = getattr(p, "expert_shard", None)
    return shards_state or topo.dp_rank < (expert[3] if expert is not None else 1)


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
    """Flat indices into the full tensor of elements ``[lo, hi)`` of a shard: int64 (hi - lo,), O(hi - lo) memory.

    ``tp`` = (dim, stride, index, parts) as ``shard_array`` cuts; local coordinate c maps to
    ``(c // b) * (n / stride) + index * b + c % b``, b = n / (stride * parts).
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


def slots(strategy, purpose: str = "save") -> list:
    """This rank's :class:`Slot` list to ``"save"`` (each model element once over all ranks) or ``"load"``
    (all it holds).

    Raises ValueError: another ``purpose``.
    """
    if purpose not in ("save", "load"):
        raise ValueError(f"purpose={purpose!r}; allowed: 'save', 'load'")
    save = purpose == "save"
    topo, opt = strategy.topo, strategy.opt
    names = {id(p): name for name, p in strategy.stage.named_parameters()}
    out = []
    for kind, p, lo, hi, a in opt.state_views(save):
        if save and not _written_here(p, topo, opt.shards_state):
            continue
        name = TIED if getattr(p, "shared_embedding_copy", False) else names[id(p)]
        tp = tp_of(p, topo)
        out.append(Slot(kind, name, full_shape(p.shape, tp), tp, lo, hi, a))
    return out


def host_arrays(slot) -> dict:
    """What a slot writes: ``{"": array}`` (flat, host), or ``{"codes": uint8, "absmax": float32}`` (8-bit)."""
    return {part: np.ascontiguousarray(backend.to_host(x)).reshape(-1) for part, x in state_arrays(slot.array).items()}
