"""The lines rank 0 prints before training: layout, model, precision, batch, ZeRO, pipeline (a loop callback)."""
from __future__ import annotations

import os

from minizero import backend
from minizero.callbacks import Callback
from minizero.debug.replicas import has_replicas
from minizero.ledger import wrap
from minizero.memory.recompute import recomputed_blocks
from minizero.numerals import ordinal
from minizero.parallel.schedule import bubble_fraction, make_schedule, peak_in_flight, simulate
from minizero.parallel.strategy import describe_batch
from minizero.zero import stage_class


def precision_description(args) -> str:
    """The header's words for the precision: dtype, or FP16's compute/master/scale split."""
    if args.precision == "fp16":  # NumPy (and strict) widen float16 operands: backend.matmul
        compute = ("cuBLAS half GEMMs with float32 accumulation" if backend.name == "cupy"
                   else "float32 math on float16 values (emulated)")
        return (f"fp16 mixed precision: float16 stores, {compute}, float32 master weights, dynamic loss scale "
                f"{args.initial_loss_scale:g}")
    if args.precision == "bf16":  # every backend: memory/bf16.py rounds float32 arrays, float32 GEMMs
        return ("bf16 mixed precision (emulated): matmul operands and outputs rounded to bfloat16, float32 math "
                "and weights, no loss scale")
    if args.precision == "fp8":
        return (f"fp8 (emulated): E4M3 forward, E5M2 gradients, {args.fp8_scaling} per-tensor scaling, float32 "
                "accumulation and weights")
    return args.dtype


def device_description() -> str:
    """The device, and on NumPy its BLAS: ``cpu (NumPy, OpenBLAS 0.3.27 Haswell kernel, 2 threads per rank)``.
    The kernel sets float32 speed and rounding; BLAS threads competing with other work for the cores slow a step
    many-fold (the main job sets cores / ranks on the node, capped by OPENBLAS_NUM_THREADS and its kin)."""
    cpu = backend.device_description.removesuffix(")")
    if backend.name != "numpy":  # CuPy's matmuls run on the GPU; strict is for tests, not speed
        return backend.device_description
    blas = backend.blas_info()
    if not blas:
        return f"{cpu}, BLAS unknown)"
    api, threads = blas.get("internal_api", "?"), blas.get("num_threads", "?")
    kernel = f" {blas['architecture']} kernel" if blas.get("architecture") else ""
    name = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}.get(api, api)
    return f"{cpu}, {name} {blas.get('version', '?')}{kernel}, {threads} thread{'s' * (threads != 1)} per rank)"


def documents_description(args, documents: int) -> str:
    """The header's words for the text (``--data``'s file and size) and its ``documents``, --pack / --pad."""
    text = f"--data {args.data!r} ({os.path.getsize(args.data):,} bytes)" if args.data else "the embedded corpus"
    if documents == 1:  # it said "documents (ended by byte 0x03) packed" of a file with none
        pads = "; --pad pads nothing" if args.documents == "pad" else ""
        return f"{text}: one document (no 0x03 byte splits it){pads}"
    if args.documents == "pad":
        return (f"{text}: {documents:,} documents (ended by byte 0x03) padded (--pad): each window stops at its "
                "document's end, padding targets ignored, the loss normalised by the real targets of the global batch")
    return f"{text}: {documents:,} documents (ended by byte 0x03) packed (--pack): windows run across them"


def run_techniques(args) -> str:
    """A run's layout and what it changes from plain data parallelism, short, for plot titles:
    ``"dp 4 x tp 1 x pp 1, ZeRO-3, recompute full, fp32"``."""
    layout = f"dp {args.dp}" + (f" x cp {args.cp} ({args.cp_attention})" if args.cp > 1 else "")
    layout += f" (ep {args.ep})" if args.moe_experts and args.ep > 1 else ""
    words = [f"{layout} x tp {args.tp} x pp {args.pp}"]
    if args.pp > 1:
        words.append(args.schedule + (f" ({args.virtual_stages} virtual stages)" if args.virtual_stages > 1 else ""))
    hybrid = args.hybrid_sharding()
    shard = f"{args.dp_shard}" + (f" x cp {args.cp}" if args.cp > 1 else "")  # a shard group: N data ranks' cp ranks
    zero = f"ZeRO-{args.zero}" + (f" hybrid (shard {shard} x replicate {args.dp // args.dp_shard})" if hybrid else "")
    words += [w for w, here in ((zero, args.zero), ("sp", args.sequence_parallel),
                                (f"MoE {args.moe_experts} experts top-{args.moe_top_k}", args.moe_experts),
                                (f"recompute {args.recompute}" + (f" every {args.recompute_every}"
                                                                  if args.recompute_every > 1 else ""),
                                 args.recompute != "none"),
                                ("flash attention", args.attention == "flash"),
                                (f"activations offloaded to {args.offload_activations}",
                                 args.offload_activations != "none"),
                                (f"optimizer state offloaded to {args.offload_optimizer}",
                                 args.offload_optimizer != "none"),
                                (args.optimizer, args.optimizer != "adamw"), ("int8 comm", args.quantized_comm),
                                ("hierarchical all-reduce", args.allreduce == "hierarchical"),
                                (f"pruned {args.prune_sparsity:.0%}", args.prune_sparsity > 0)) if here]
    words.append(args.dtype if args.precision == "fp32" and args.dtype != "float32" else args.precision)
    return ", ".join(words)


def zero_line(args, topo, opt) -> str:
    """The header's ZeRO line: what is sharded over which ranks (plain, hybrid, the experts'), what overlaps."""
    sharded = stage_class(args.zero).shards
    hybrid, experts = args.hybrid_sharding(), ""
    if args.moe_experts and args.ep > 1:  # an expert is sharded over the ranks that hold it
        holders = (args.dp_shard * args.cp if hybrid else topo.dp) // args.ep
        experts = (f" (the experts' over the {holders} rank(s) "
                   + ("of a group that hold them)" if hybrid else "of their expert-data group)"))
    group = f"the {topo.dp} rank(s) of the data group"
    if hybrid:
        cp = f" x their cp {args.cp} = {args.dp_shard * args.cp} ranks" if args.cp > 1 else ""
        group = (f"groups of {args.dp_shard} consecutive data rank(s){cp}, replicated across the "
                 f"{args.dp // args.dp_shard} groups (hybrid sharding: gradients reduce-scattered in a group, "
                 "then all-reduced across)")
    return (f"ZeRO stage {args.zero}: {sharded} sharded over {group}{experts}"
            + "".join(f"; {w}" for w in opt.overlap_words()))


def moe_line(args, cfg, dp: int, moe) -> str:
    """The header's MoE line: parameters, blocks, routing, losses and the expert groups over ``dp`` data ranks."""
    ep = args.ep
    total, active = moe.parameters(cfg)
    line = (f"MoE: {total:,} parameters, {active:,} active per token; blocks {moe.layers(cfg.n_layer)}, "
            f"{moe.experts} experts, top-{moe.top_k}, capacity factor {moe.capacity_factor:g} per micro-batch; "
            f"losses: Switch x {moe.aux_loss:g}, z x {moe.z_loss:g}"
            f"{f'; bias update {moe.bias_update:g}' if moe.bias_update else ''}; ep {ep}")
    if ep == 1:
        return line
    summed = (f"expert gradients summed over {dp // ep} data ranks" if dp > ep
              else "expert gradients not summed (each expert is on one data rank)")
    return (line + f": {dp // ep} expert group{'s' * (dp > ep)} of {ep} data ranks, "
            f"{moe.experts // ep} expert{'s' * (moe.experts > ep)} each, {summed}")


def pipeline_line(args, p: int) -> str:
    """The header's pipeline line over ``p`` stages: the simulated bubble, the closed form with the run's numbers."""
    m, v = args.grad_accum, args.virtual_stages
    sched = make_schedule(args.schedule, p, m, v)
    closed = f"(p-1)/({'v m' if v > 1 else 'm'}+p-1) = ({p}-1)/({f'{v}x{m}' if v > 1 else m}+{p}-1)"
    formula = (" (idle share of the schedule, F = B = W)" if args.schedule.startswith("zb") else
               f" (idle share of the schedule) = {closed}")
    return (f"pipeline: {args.schedule}, {m} micro-batches, bubble {bubble_fraction(simulate(sched)):.3f}"
            f"{formula}"
            f"{f' ({v} virtual stages)' if v > 1 else ''}, micro-batches in flight per stage "
            f"{[peak_in_flight(ops) for ops in sched]}")


def note_lines(args, topo, opt, world: int) -> list[str]:
    """The header's notes: flags asked for that do nothing on this layout (the run goes on)."""
    notes = []
    fp16 = args.precision == "fp16" and world > 1  # ReplicaCheck compares the loss scaler over the world too
    scaler, also = ("; FP16's loss scaler is compared over all ranks", " and FP16's loss scaler") if fp16 else ("", "")
    if args.zero and topo.dp == 1:
        notes.append(f"note: --zero {args.zero} over 1 data rank shards nothing (the shard is the whole model); "
                     "running anyway")
    if args.zero and args.dp_shard == 1 and args.cp == 1 and topo.dp > 1:  # with cp a group shards over its cp ranks
        notes.append(f"note: --dp-shard 1 shards nothing: each ZeRO group is one rank, which holds all of "
                     f"ZeRO-{args.zero}'s states; running anyway")
    if args.check_replicas and not has_replicas(topo.dp, args.dp_shard * args.cp, args.zero):  # asked for: off here
        why = ("1 data rank" if topo.dp == 1 else "plain ZeRO-3 (each shard is held once: it compares only the "
               "gathered parameters, equal by construction)")
        notes.append(f"note: --check-replicas {args.check_replicas} with {why} has no replica to compare{scaler}; "
                     "running anyway")
    elif args.check_replicas and opt.state_replicas(topo.dp_comm) is None:  # plain ZeRO 1-2
        notes.append(f"note: --check-replicas {args.check_replicas} under ZeRO-{args.zero} compares parameters{also} "
                     "only: each optimizer shard is held once")
    if args.optimizer == "adam8bit" and topo.tp > 1:  # the grid of 256-element blocks is each shard's
        notes.append(f"note: --optimizer adam8bit with --tp {topo.tp} quantizes m and v in blocks of each tensor "
                     "shard, not of the whole tensor: the results differ from --tp 1's at 8-bit rounding")
    return notes


def header_lines(args, cfg, s, world: int, documents: int = 1) -> list[str]:
    """What the run is: ``args`` (the parsed flags), ``cfg`` (GPTConfig), ``s`` (the built Strategy), ``documents``
    (in the training text)."""
    topo = s.topo
    dp = f"dp {topo.dp // s.cp} x cp {s.cp}" if s.cp > 1 else f"dp {topo.dp}"
    if args.moe_experts and args.ep > 1:
        dp += f" (ep {args.ep} inside)"  # expert groups of ep data ranks
    moe = args.moe_config()
    n_params = cfg.num_parameters() if moe is None else moe.parameters(cfg)[0]  # MoE: with every expert
    lines = [f"minizero: {world} rank(s) as {dp} x tp {topo.tp} x pp {topo.pp}, model {args.model!r} "
             f"({n_params:,} parameters{', MoE' if moe is not None else ''}, {cfg.n_layer} layers, width {cfg.n_embd}, "
             f"context {cfg.block_size}), {precision_description(args)}",
             f"device {device_description()}; messages over {args.comm or 'mpi'}",
             describe_batch(args, cfg), topo.describe_nodes(), *topo.placement_warnings()]
    if args.data or args.documents == "pad":
        lines.append(documents_description(args, documents))
    if args.zero:
        lines.append(zero_line(args, topo, s.opt))
    k, n = args.recompute_every, cfg.n_layer // topo.pp  # a stage's blocks 0, k, 2k, ... (it said "every 2-th")
    which = f" (every {ordinal(k)} block: {recomputed_blocks(n, k)} of {'each stage' if topo.pp > 1 else 'the model'}"
    also = [w for w, here in (
        (f"activation recompute {args.recompute}" + (f"{which}'s {n})" if k > 1 else ""), args.recompute != "none"),
        (f"saved activations offloaded to {args.offload_activations}", args.offload_activations != "none"),
        (f"optimizer state and update offloaded to {args.offload_optimizer}", args.offload_optimizer != "none"),
        (f"8-bit Adam (an absmax per {args.adam8bit_block_size} elements)", args.optimizer == "adam8bit"),
        ("INT8 on the wire for " + (stage_class(args.zero).quantized_collectives if args.zero
                                    else "the gradient all-reduce"), args.quantized_comm),
        ("hierarchical all-reduce", args.allreduce == "hierarchical"),
        (f"magnitude pruning to {args.prune_sparsity:.0%} ({args.prune_scope}"
         f"{f', masks made after step {args.prune_step}' if args.prune_step else ''})", args.prune_sparsity > 0),
    ) if here]
    if also:  # the techniques no other header line names
        lines.append("also: " + "; ".join(also))
    if args.attention == "flash":
        lines.append(f"attention: flash, blocks of {args.attention_block} rows (online softmax; keeps the output and "
                     "the row log-sum-exp, no (T, T) array)")
    if args.sequence_parallel:
        lines.append(f"sequence parallel: layer norms, dropouts and residuals on 1/{topo.tp} of the sequence per "
                     "tensor rank (all-gather in, reduce-scatter out)")
    if s.cp > 1:
        lines.append(f"context parallel: cp {s.cp} (the mesh's data groups of {topo.dp} ranks are dp "
                     f"{topo.dp // s.cp} x cp {s.cp}), each rank 2 of {2 * s.cp} sequence chunks, "
                     + ("Ulysses attention (all-to-all from sequence shards to head shards and back)"
                        if args.cp_attention == "ulysses" else "ring attention"))
    if topo.tp * topo.pp > 1:
        lines.append(topo.describe(s.cp))
    if topo.pp > 1:
        lines.append(pipeline_line(args, topo.pp))
    if moe is not None:
        lines.append(moe_line(args, cfg, topo.dp, moe))
    return lines + note_lines(args, topo, s.opt, world)


class Header(Callback):
    """At ``setup``: rank 0 logs :func:`header_lines` (and the ZeRO shard map with ``--show-shards``)."""

    def setup(self, run):
        if run.comm.rank != 0:
            return
        lines = header_lines(run.args, run.cfg, run.strategy, run.comm.world_size, run.documents)
        for row in (w for line in lines for part in line.split("\n") for w in wrap(part)):  # the mesh: several rows
            run.log(row)  # at 100 columns, as the report
        if run.args.show_shards:
            run.log(run.strategy.opt.shard_map.format(width=100))
