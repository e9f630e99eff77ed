"""Tensor parallelism for LoRA and QLoRA adapters: Megatron's split of each base Linear carried to its adapter.

Subscript i: tensor rank i's shard; r: the LoRA rank. Column-parallel base (c_attn with stride 3, c_fc: output rows
split): B is split as the base's weight, A is replicated, and f (copy_to_tensor_parallel_region) sits on the rank-r
bottleneck, so its backward all-reduces dL/d(x A^T) and A's gradient, computed from that sum and the replicated x, is
the same on every tensor rank::

    y_i = base_i(x) + s f(x A^T) B_i^T         x (..., in) replicated -> (..., out/tp);  B_i (out/tp, r)

Row-parallel base (both c_proj: input columns split): A is split by columns, B replicated; g
(reduce_from_tensor_parallel_region) sums the partial bottlenecks in forward, identity in backward::

    y = base(x_i) + s g(x_i A_i^T) B^T         x_i (..., in/tp) -> (..., out) replicated;  A_i (r, in/tp)

One all-reduce of (..., r) per adapter (column: backward; row: forward), beside the base's of (..., in) or (..., out).
A and B are drawn whole with the one-process generator, in module order, then sliced: the same start as one process.
QLoRA: each rank quantizes its own shard (:class:`NF4Shard`): its runs in the whole weight's row-major order must
be whole NF4 blocks (``nf4.shard_runs``), so each element's level and block absmax are the one-process ones; the
block absmaxes are all-gathered (n_blocks/tp float32 per rank) and double-quantized as the whole weight's (its mean, its
groups of 256), so the dequantized shard is the one-process weight's rows / columns bit for bit.
Sources: Shoeybi et al., arXiv:1909.08053, section 3; Hu et al., arXiv:2106.09685; Dettmers et al., arXiv:2305.14314.
"""
from __future__ import annotations

from minizero import backend
from minizero.autograd import functional as F
from minizero.comm.collectives import all_gather
from minizero.nf4 import NF4Shard, block_absmax, shard_runs, tensor_parallel_sizes
from minizero.nn.lora import TARGETS, LoRAAdapter, LoRALinear, NF4Linear, add_lora, refuse_tied_head, wrap_linear
from minizero.nn.module import Module, Parameter
from minizero.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, mark_shard,
                                               copy_to_tensor_parallel_region, is_tensor_parallel_duplicate,
                                               reduce_from_tensor_parallel_region, shard_array, tensor_parallelize,
                                               unshard_arrays)


class ColumnParallelLoRAAdapter(LoRAAdapter):
    """``s f(x A^T) B_i^T``: x (..., in) replicated -> (..., out/tp). A (r, in) replicated; B_i (out/tp, r) the
    rows of ``whole``'s B that the base's weight shard holds (``stride``). Backward: one all-reduce of (..., r)."""

    def __init__(self, whole: LoRAAdapter, comm, stride: int = 1):
        Module.__init__(self)
        self.scale, self.comm = whole.scale, comm
        self.lora_A = whole.lora_A
        self.lora_B = mark_shard(Parameter(shard_array(whole.lora_B.data, 0, comm.rank, comm.world_size, stride)), 0,
                                 stride)

    def forward(self, x):
        return F.linear(copy_to_tensor_parallel_region(F.linear(x, self.lora_A), self.comm), self.lora_B) * self.scale


class RowParallelLoRAAdapter(LoRAAdapter):
    """``s g(x_i A_i^T) B^T``: x_i (..., in/tp) -> (..., out) replicated. A_i (r, in/tp) the columns of
    ``whole``'s A; B (out, r) replicated. Forward: one all-reduce of (..., r)."""

    def __init__(self, whole: LoRAAdapter, comm):
        Module.__init__(self)
        self.scale, self.comm = whole.scale, comm
        self.lora_A = mark_shard(Parameter(shard_array(whole.lora_A.data, 1, comm.rank, comm.world_size)), 1, 1)
        self.lora_B = whole.lora_B

    def forward(self, x):
        h = reduce_from_tensor_parallel_region(F.linear(x, self.lora_A), self.comm)
        return F.linear(h, self.lora_B) * self.scale


def _nf4_shard(weight, comm, row_parallel: bool, stride: int):
    """Collective over the tensor group: this rank's :class:`NF4Shard` of a column-parallel (out/tp, in) (Q/K/V
    ``stride``) or row-parallel (out, in/tp) weight shard; its block absmax all-gathered (n_blocks/tp float32 per rank,
    traffic ``all_gather``) into the whole weight's order, for the whole weight's double quantization."""
    tp = comm.world_size
    out_f, in_f = weight.shape
    whole_shape = (out_f, in_f * tp) if row_parallel else (out_f * tp, in_f)
    runs = shard_runs(whole_shape, stride, row_parallel, tp, comm.rank, "the adapted")  # (first, pitch, count, length)
    gathered = backend.xp.split(all_gather(comm, block_absmax(weight)), tp)
    if row_parallel:  # (rows, blocks per row) side by side
        blocks_per_row = runs[3]  # a row-parallel shard's run: one row's in/tp columns
        whole = unshard_arrays([g.reshape(out_f, blocks_per_row) for g in gathered], 1).reshape(-1)
    else:  # each rank's Q, K, V runs: interleaved as the rows are
        whole = unshard_arrays(gathered, 0, stride)
    return NF4Shard(weight, whole, runs)


class ColumnParallelNF4Linear(NF4Linear):
    """QLoRA's frozen column-parallel shard: f(x) W~_i^T + b_i, W~_i this rank's (out/tp, in) shard as NF4
    (quantized as the whole weight's blocks: :func:`_nf4_shard`, a collective)."""

    partition_dim = 0

    def __init__(self, linear: ColumnParallelLinear, dtype: str = "float32"):
        stride = linear.weight.partition_stride
        super().__init__(linear, dtype, _nf4_shard(linear.weight.data, linear.comm, False, stride))
        self.comm, self.partition_stride = linear.comm, stride

    def forward(self, x):
        return super().forward(copy_to_tensor_parallel_region(x, self.comm))


class RowParallelNF4Linear(NF4Linear):
    """QLoRA's frozen row-parallel shard: g(x_i W~_i^T) + b, W~_i this rank's (out, in/tp) shard as NF4
    (quantized as the whole weight's blocks: :func:`_nf4_shard`, a collective)."""

    partition_dim, partition_stride = 1, 1

    def __init__(self, linear: RowParallelLinear, dtype: str = "float32"):
        super().__init__(linear, dtype, _nf4_shard(linear.weight.data, linear.comm, True, 1))
        self.comm = linear.comm

    def forward(self, x):
        y = reduce_from_tensor_parallel_region(self.project(x), self.comm)
        return y + self.bias if self.bias is not None else y


class TensorParallelWrap:
    """``add_lora``'s ``wrap`` for a tensor-parallel model: a :class:`LoRALinear` of this rank's shards around a
    Column- or RowParallelLinear (its NF4 copy when ``nf4``); the whole adapter is drawn first, then sliced."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, child, r, alpha, rng, dtype, nf4):
        tp = self.comm.world_size
        if isinstance(child, ColumnParallelLinear):
            (out_f, in_f), stride = child.weight.shape, child.weight.partition_stride
            out_f *= tp
            adapter = ColumnParallelLoRAAdapter(LoRAAdapter(in_f, out_f, r, alpha, rng, dtype), self.comm, stride)
            base = ColumnParallelNF4Linear(child, dtype) if nf4 else child
        elif isinstance(child, RowParallelLinear):
            out_f, in_f = child.weight.shape
            in_f *= tp
            adapter = RowParallelLoRAAdapter(LoRAAdapter(in_f, out_f, r, alpha, rng, dtype), self.comm)
            base = RowParallelNF4Linear(child, dtype) if nf4 else child
        else:
            return wrap_linear(child, r, alpha, rng, dtype, nf4)
        return LoRALinear(base, in_f, out_f, r, alpha, rng, dtype, adapter=adapter)


def _adapted_splits(cfg, targets) -> list[tuple[str, tuple[int, int], int, bool]]:
    """(name, (out, in), stride, row_parallel) of each weight of ``cfg``'s GPT block that ``targets`` adapt."""
    c = cfg.n_embd
    return [(name, shape, stride, row) for key, name, shape, stride, row in (
        ("c_attn", "attn.c_attn", (3 * c, c), 3, False), ("c_proj", "attn.c_proj", (c, c), 1, True),
        ("c_fc", "mlp.c_fc", (4 * c, c), 1, False), ("c_proj", "mlp.c_proj", (c, 4 * c), 1, True)) if key in targets]


def nf4_shard_refusal(cfg, tp: int, targets=TARGETS) -> str | None:
    """None, or one line (:func:`minizero.nf4.shard_runs`): an adapted weight of ``cfg``'s GPT whose shards at
    ``tp`` are not whole NF4 blocks, which QLoRA would quantize across shards (every rank checks the same config)."""
    for name, shape, stride, row in _adapted_splits(cfg, targets):
        try:
            shard_runs(shape, stride, row, tp, name=f"the {name}")
        except ValueError as e:
            return f"{e}: QLoRA would quantize blocks across shards"
    return None


def nf4_tensor_parallel_sizes(cfg, world: int, targets=TARGETS) -> list[int]:
    """The tensor-parallel sizes QLoRA can take on ``world`` ranks for ``cfg``'s GPT: those dividing the ranks and
    the heads whose shards are whole NF4 blocks (:func:`minizero.nf4.tensor_parallel_sizes`); 1 always."""
    return tensor_parallel_sizes(world, (cfg.n_head,), _adapted_splits(cfg, targets))


def tensor_parallel_lora(model: Module, comm, r: int, alpha: float, targets=TARGETS, base: str = "nf4",
                         seed: int = 0) -> list:
    """Split ``model``'s blocks over the tensor group ``comm`` (:func:`tensor_parallelize`), then adapt its shards
    (:func:`add_lora` with :class:`TensorParallelWrap`). Returns the adapted names.
    Raises ValueError (before the split): ``lm_head`` in ``targets``, tp does not divide the heads or hidden sizes, or
    :func:`nf4_shard_refusal` (``base`` nf4)."""
    refuse_tied_head(targets)  # add_lora's refusal, which would come after the split
    refusal = nf4_shard_refusal(model.config, comm.world_size, targets) if base == "nf4" else None
    if refusal:
        raise ValueError(refusal)
    tensor_parallelize(model, comm)
    return add_lora(model, r, alpha, targets, base, seed, wrap=TensorParallelWrap(comm))


def counts_in_norm(comm):
    """The predicate of the gradient norm's sum: split parameters on every tensor rank, replicated ones on rank 0."""
    return lambda p: comm.rank == 0 or not is_tensor_parallel_duplicate(p)


def gather_merged(merged: dict, model: Module, comm) -> dict:
    """Collective over the tensor group: ``merged`` (this rank's :func:`merged_state_dict`) with every split array
    whole (all-gather of each shard, in ``merged``'s order; traffic ``all_gather``). Host arrays."""
    split = {}
    for name, p in model.named_parameters():
        if not is_tensor_parallel_duplicate(p) and ".lora_" not in name:
            split[name.replace(".base.", ".")] = (p.partition_dim, p.partition_stride)
    for prefix, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelNF4Linear, RowParallelNF4Linear)):
            split[f"{prefix.removesuffix('.base')}.weight"] = (mod.partition_dim, mod.partition_stride)
    out = {}
    for name, a in merged.items():
        if name not in split:
            out[name] = a
            continue
        flat = all_gather(comm, backend.to_device(a).reshape(-1).copy())
        dim, stride = split[name]
        shards = [s.reshape(a.shape) for s in backend.xp.split(flat, comm.world_size)]
        out[name] = backend.to_host(unshard_arrays(shards, dim, stride))
    return out
