"""3D parallelism's building blocks: this rank's stage of the model, the norm, the whole model back.

::

    world (dp*tp*pp ranks, topology.py)
      └─ pipeline stage pp_rank: its blocks (pipeline.py)
           └─ each block split over the tensor group (tensor_parallel.py)
                └─ the stage's parameters replicated over the data group: DataParallel or ZeRO-1

Sources: Narayanan et al. 2021 (arXiv:2104.04473), sections 2-3 (PTD-P); Megatron-LM
``clip_grad_norm_fp32`` (tensor-parallel duplicates and the shared embedding counted once).
"""
from __future__ import annotations

import contextlib

import numpy as np

from minizero import backend
from minizero.ledger import MemoryLedger, get_ledger, set_ledger
from minizero.nn import GPT
from minizero.nn.init import attach_inits, is_meta, materialize_
from minizero.parallel.interleaved import InterleavedStage, interleave, tie_ends
from minizero.parallel.moe import MoELayer
from minizero.parallel.pipeline import PipelineStage
from minizero.parallel.sequence_parallel import sequence_parallelize
from minizero.parallel.tensor_parallel import is_tensor_parallel_duplicate, tensor_parallelize, unshard_arrays
from minizero.parallel.topology import Topology
from minizero.parallel.vocab_parallel import vocab_parallelize

_HDR_TAG, _DATA_TAG, _BIAS_TAG = 1201, 1202, 1203


@contextlib.contextmanager
def scratch_ledger():
    """Count arrays made inside the block in a throw-away ledger (the caller's ledger is untouched)."""
    real = get_ledger()
    set_ledger(MemoryLedger())
    try:
        yield
    finally:
        set_ledger(real)


def build_stage(cfg, seed: int, topo: Topology, sequence_parallel: bool = False, virtual_stages: int = 1,
                keep_meta: bool = False, v_shape: bool = False):
    """This rank's part of the model: pipeline stage ``topo.pp_rank``, split over ``topo.tp_comm``.

    Built meta (0 bytes), sliced, then only this rank's shards drawn, equal to the single process's slices.
    Elements per block: 12C^2/tp + 7C/tp + 6C; plus VC/tp + TC on the first stage and VC/tp + 2C on the last.
    ``keep_meta``: leave parameters meta (ZeRO-3 draws its own pieces). ``virtual_stages`` v > 1: this rank's
    v chunks (virtual stages c*pp + pp_rank) as an ``InterleavedStage``; ``v_shape``: chunks pp_rank and
    2pp-1-pp_rank (ZB-V).
    """
    with scratch_ledger():  # meta arrays (0 bytes) and the small arrays slicing them leaves
        parts = interleave(GPT(cfg, seed=seed, meta=True), topo.pp_rank, topo.pp, virtual_stages, v_shape)
        for part in parts:
            tensor_parallelize(part, topo.tp_comm)
            vocab_parallelize(part, topo.tp_comm)
            if sequence_parallel:
                sequence_parallelize(part, topo.tp_comm)
    for part in parts:  # each chunk's parameters keep the model's names
        attach_inits(part, seed, cfg.n_layer, topo.tp_rank, topo.tp)
    tie_ends(parts)
    stage = parts[0] if len(parts) == 1 else InterleavedStage(parts, topo.pp, v_shape)
    ledger = get_ledger()
    if not keep_meta:
        materialize_(stage)  # this rank's shard, one parameter at a time
    for p in stage.parameters():
        if not is_meta(p.data):
            ledger.track(p.data, "parameters")
    return stage


def counts_in_norm(p, topo: Topology) -> bool:
    """Whether this rank adds ``p``'s gradient to the global norm: tensor-replicated on tensor rank 0,
    tied copy once."""
    if getattr(p, "shared_embedding_copy", False):
        return False
    return topo.tp_rank == 0 or not is_tensor_parallel_duplicate(p)


def grad_norm_sq(topo: Topology, sync) -> float:
    """Collective: squared global gradient norm (float64), equal on every rank, each element counted once."""
    return sync.grad_norm_sq(lambda p: counts_in_norm(p, topo), topo.mp_comm, topo.world)


def gather_full_model(stage: PipelineStage, topo: Topology, cfg, root: int = 0, make_model=None):
    """Collective: world rank ``root`` (at dp 0, tp 0, pp 0) assembles the whole GPT; None elsewhere.

    Data rank 0's ranks send a header (int64 [partition_dim, stride]) and each array; traffic ``gather_model``:
    the model's bytes once (:func:`gather_routing_biases` adds MoE's bias tables under the same label).
    ``make_model``: builds the empty whole model on the root (default ``GPT(cfg)``; MoE: expert_parallel.py).
    Raises ValueError: ``root`` is not the rank at (0, 0, 0).
    """
    comm = topo.world
    if root != topo.rank_of(0, 0, 0):
        raise ValueError(f"root {root} must be the rank at dp 0, tp 0, pp 0 ({topo.rank_of(0, 0, 0)})")
    if topo.dp_rank == 0 and comm.rank != root:
        with comm.traffic.op("gather_model"):
            for _, p in stage.named_parameters():
                if getattr(p, "shared_embedding_copy", False) or (_header(p)[0] < 0 and topo.tp_rank != 0):
                    continue
                comm.send(np.array(_header(p), dtype=np.int64), root, tag=_HDR_TAG)
                comm.send(backend.xp.ascontiguousarray(p.data), root, tag=_DATA_TAG)
    if comm.rank != root:
        return None
    with scratch_ledger():
        full = GPT(cfg, seed=0) if make_model is None else make_model()
    local = dict(stage.named_parameters())
    for name, p in full.named_parameters():
        if name.startswith("transformer.h."):
            s = stage.rank_of_layer(int(name.split(".")[2]))
        else:  # ln_f beside the last block, the embeddings beside the first
            s = stage.rank_of_layer(cfg.n_layer - 1 if name.startswith("transformer.ln_f") else 0)
        shards, dim, stride = [], -1, 1
        for t in range(topo.tp):
            src = topo.rank_of(0, t, s)
            if src == root:
                hdr, data = _header(local[name]), local[name].data
            else:
                hdr = comm.recv(np.empty(2, dtype=np.int64), src, tag=_HDR_TAG).tolist()
                shape = list(p.shape)
                if hdr[0] >= 0:
                    shape[hdr[0]] //= topo.tp
                data = comm.recv(backend.xp.empty(tuple(shape), p.dtype), src, tag=_DATA_TAG)
            dim, stride = hdr
            shards.append(data)
            if dim < 0:
                break
        p.data[...] = shards[0] if dim < 0 else unshard_arrays(shards, dim, stride)
    return full


def gather_routing_biases(stage, whole, topo: Topology, moe_layers: list, experts: int):
    """Collective over the world: ``whole`` (:func:`gather_full_model`'s GPT on the root, None elsewhere) gets each MoE
    layer's routing bias (not a parameter) from the stage holding it: the ranks at dp 0, tp 0 of the other stages
    send a (MoE layers, E) float64 table, their layers' rows, to the root (traffic ``gather_model``). Returns
    ``whole``. ``moe_layers``: the model's MoE block indices."""
    mine = {int(n.split(".")[2]): m.bias for n, m in stage.named_modules() if isinstance(m, MoELayer)}
    table = np.array([mine.get(i, np.zeros(experts)) for i in moe_layers], dtype=np.float64).reshape(-1, experts)
    comm, root = topo.world, topo.rank_of(0, 0, 0)
    if topo.dp_rank == 0 and topo.tp_rank == 0 and comm.rank != root:
        with comm.traffic.op("gather_model"):
            comm.send(table, root, tag=_BIAS_TAG)
    if comm.rank != root:
        return None
    tables = [table] + [comm.recv(np.empty_like(table), topo.rank_of(0, 0, s), tag=_BIAS_TAG)
                        for s in range(1, topo.pp)]
    layers = {int(n.split(".")[2]): m for n, m in whole.named_modules() if isinstance(m, MoELayer)}
    for row, i in enumerate(moe_layers):
        layers[i].bias = tables[stage.rank_of_layer(i)][row].copy()
    return whole


def _header(p) -> list:  # gather_full_model's [partition_dim, stride] of p's shards; [-1, 1]: p is whole
    return [-1, 1] if is_tensor_parallel_duplicate(p) else [p.partition_dim, p.partition_stride]


def traffic_by_group(topo: Topology) -> dict:
    """``{group: comm.traffic.snapshot()}`` for the tp, dp, pp and embedding groups, and ``world``."""
    out = {name: c.traffic.snapshot() for name, c in topo.groups().items()}
    out["world"] = topo.world.traffic.snapshot()
    return out
