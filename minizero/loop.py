"""The one training loop: every strategy (dp, tp, pp, ZeRO, recompute, FP16, offload, 8-bit Adam).

One optimizer step, the same on every rank whatever the layout (the layout lives in the
:class:`~minizero.parallel.strategy.Strategy`, never in this file)::

    S = loss scale (1 without FP16)
    loss_sum = strategy.forward_backward(micro_batches, S)   m micro-batches, gradients accumulate
    strategy.reduce_gradients()                              data-group average (+ tied embedding)
    skip = scaler.update(any rank overflowed)                FP16 only: every rank agrees
    norm = sqrt(strategy.grad_norm_sq()) / S                 the unscaled global norm
    strategy.step(lr(applied), clip(norm) / S)               1/S and clipping folded into the update
    strategy.zero_grad()

A skipped step advances neither Adam's t nor the learning-rate schedule (``applied``
counts the updates taken), as PyTorch's ``GradScaler.step`` skips ``optimizer.step``.

Fault injection for tests: ``MINIZERO_FAULT=RANK:STEP:KIND`` with KIND ``raise``
(exception), ``kill`` (SIGKILL of the process), ``stop`` (SIGSTOP: a stalled rank) or ``inf`` (this rank's
gradients become non-finite) at optimizer step STEP on rank RANK, or ``kill_in_save`` (SIGKILL while saving
the checkpoint after step STEP: its file written, the manifest not; :mod:`minizero.checkpoint`).

Checkpoints (``--save-every``, ``--resume``): :class:`~minizero.checkpoint.Checkpointer` loads the
state into the built strategy before the first step and returns the loop step to start from
(the data position) and the applied-step count (the schedule's position); it saves after a step.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import tracemalloc

import numpy as np

from minizero import backend, trace
from minizero.args import model_config
from minizero.checkpoint import Checkpointer
from minizero.comm.collectives import all_reduce
from minizero.data import DistributedSampler, check_corpus, eval_batches, load_tokens, train_val_split
from minizero.ledger import get_ledger
from minizero.memory.monitor import MemoryMonitor
from minizero.memory.offload import ActivationOffload, OptimizerStateStore
from minizero.memory.precision import DynamicLossScaler, local_overflow, overflow_anywhere
from minizero.memory.sparsity import Pruner
from minizero.memory.zero import model_state_bytes
from minizero.optim import clip_coefficient, cosine_lr
from minizero.parallel.placement import node_traffic
from minizero.parallel.schedule import bubble_formula, bubble_fraction, make_schedule, peak_in_flight, simulate
from minizero.parallel.strategy import build_strategy, describe_batch
from minizero.parallel.tracing import TraceUnits, write_trace
from minizero.progress import Progress


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm became inf/NaN without a loss scaler to skip the step."""


def check_finite_norm(step: int, norm: float) -> None:
    """Raise :class:`TrainingDiverged` before an update that would write inf/NaN into the weights."""
    if not math.isfinite(norm):
        raise TrainingDiverged(f"step {step}: the gradient norm is {norm}; training diverged (lower --lr, "
                               f"or use --precision fp16, whose loss scaler skips such steps); no update was applied")


def check_finite_loss(step: int, what: str, loss: float) -> None:
    """Raise :class:`TrainingDiverged` when a training or validation loss is inf/NaN (weights overflowed)."""
    if not math.isfinite(loss):
        raise TrainingDiverged(f"step {step}: the {what} loss is {loss}; training diverged: the weights overflowed "
                               f"(lower --lr, or use --precision fp16, whose loss scaler skips such steps)")


def check_fault(rank: int, step: int) -> bool:
    """Act on ``MINIZERO_FAULT=RANK:STEP:KIND`` here; returns True for KIND ``inf`` (poison this rank's gradients)."""
    spec = os.environ.get("MINIZERO_FAULT")
    if not spec:
        return False
    r, s, kind = spec.split(":")
    if int(r) == rank and int(s) == step and kind != "kill_in_save":  # that one fires inside the save
        if kind == "inf":
            return True
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop":  # a stalled rank: the others must time out (--comm-timeout), not hang
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected fault (MINIZERO_FAULT={spec})")
    return False


def precision_description(args) -> str:
    """The header's words for the precision: dtype, or FP16's compute/master/scale split."""
    if args.precision == "fp16":
        return (f"fp16 mixed precision: float16 compute, float32 master weights, dynamic loss scale "
                f"{args.initial_loss_scale:g}")
    return args.dtype


def documents_description(args) -> str:
    """The header's words for --pack / --pad."""
    if args.documents == "pad":
        return ("documents (ended by byte 0x03) padded (--pad): each window stops at its document's end, padding "
                "targets ignored, the loss normalised by the real targets of the global batch")
    return "documents (ended by byte 0x03) packed (--pack): windows run across them"


def _header(args, cfg, s, world: int) -> list[str]:
    topo = s.topo
    dp = f"dp {topo.dp // s.cp} x cp {s.cp}" if s.cp > 1 else f"dp {topo.dp}"
    lines = [f"minizero: {world} rank(s) as {dp} x tp {topo.tp} x pp {topo.pp}, model {args.model!r} "
             f"({cfg.num_parameters():,} parameters, {cfg.n_layer} layers, width {cfg.n_embd}, "
             f"context {cfg.block_size}), {precision_description(args)}",
             f"device {backend.device_description}; messages over {getattr(args, 'comm', None) or 'mpi'}",
             describe_batch(args, cfg), topo.describe_nodes(), *topo.placement_warnings()]
    if args.data or args.documents == "pad":
        lines.append(documents_description(args))
    if args.zero:
        sharded = {1: "optimizer state", 2: "optimizer state and gradients",
                   3: "optimizer state, gradients and parameters"}[args.zero]
        lines.append(f"ZeRO stage {args.zero}: {sharded} sharded over the {topo.dp} rank(s) of the data group"
                     + ("; reduce-scatters overlap backward" + ("; the next unit's all-gather is prefetched"
                                                              if args.zero == 3 else "")
                        if args.zero >= 2 and getattr(args, "overlap", True) else ""))
    if getattr(args, "sequence_parallel", False):
        lines.append(f"sequence parallel: layer norms, dropouts and residuals on 1/{topo.tp} of the sequence per "
                     "tensor rank (all-gather in, reduce-scatter out)")
    if topo.tp * topo.pp > 1:
        lines.append(topo.describe())
    if s.cp > 1:
        lines.append(f"context parallel: cp {s.cp} (the data groups of {topo.dp} ranks are dp {topo.dp // s.cp} x cp "
                     f"{s.cp}), each rank 2 of {2 * s.cp} sequence chunks, ring attention")
    if topo.pp > 1:
        m, v = args.grad_accum, getattr(args, "virtual_stages", 1)
        sched = make_schedule(args.schedule, topo.pp, m, v)
        formula = (" (simulated, F = B = W)" if args.schedule.startswith("zb") else
                   f" = (p-1)/({'v m' if v > 1 else 'm'}+p-1) = {bubble_formula(topo.pp, m, v):.3f}")
        lines.append(f"pipeline: {args.schedule}, {m} micro-batches, bubble {bubble_fraction(simulate(sched)):.3f}"
                     f"{formula}"
                     f"{f' ({v} virtual stages)' if v > 1 else ''}, micro-batches in flight per stage "
                     f"{[peak_in_flight(ops) for ops in sched]}")
    if args.zero and topo.dp == 1:
        lines.append(f"note: --zero {args.zero} over 1 data rank shards nothing (the shard is the whole model); "
                     "running anyway")
    return lines


def train(args, comm, log=print, after_grads=None) -> dict:
    """Train per ``args`` (from :func:`minizero.args.parse_args`) on communicator ``comm``.

    Works under MPI (one process per rank) and under the in-process ThreadCommunicator
    (one thread per rank). Only rank 0 logs (``log`` receives each line).
    ``after_grads(step, params, opt)``, if given, runs once per optimizer step after the
    gradients are averaged over the data group and before clipping (tests read them
    there: ``params`` are this rank's parameters — shards under tp, the stage's under pp;
    under ZeRO the gradients are in ``opt.grad_shards()``).
    Returns a dict: model (the whole GPT: the local one when tp = pp = 1, else gathered on
    rank 0 and None elsewhere), stage, topo, engine, dp (None under ZeRO), opt, strategy,
    train_losses, grad_norms (nan for a skipped step), val_history [(step, loss)],
    loss_scales, skipped_steps, skipped_at, elapsed_s, tokens_per_s, config, state_bytes
    (ledger model-state bytes at the first optimizer step), traffic (per group), pruner,
    setup_peak, train_process_peak, memory_monitor (:class:`~minizero.memory.monitor.MemoryMonitor`);
    lrs (the learning rate of each step run), start_step (the loop
    step this run began at: 0, or the resumed checkpoint's), applied (optimizer steps taken in all),
    checkpoints (folders saved), load_peak (bytes of read buffers while resuming, ledger peak).
    Raises:
        TrainingDiverged: a non-finite gradient norm without FP16's loss scaler.
        LossScaleError: FP16 overflowed at the minimum loss scale too many times in a row.
    """
    rank0 = comm.rank == 0
    cfg = model_config(args)
    train_tok, val_tok = train_val_split(load_tokens(args.data))
    check_corpus(val_tok, cfg.block_size, "validation split (last 10% of the text)")
    offload = ActivationOffload(args.offload_activations, args.offload_dir, rank=comm.rank)
    store = OptimizerStateStore(args.offload_optimizer, args.offload_dir)  # --offload-optimizer: state off-device
    s = build_strategy(args, comm, cfg, forward_context=offload, store=store)
    fp16 = args.precision == "fp16"
    scaler = DynamicLossScaler(args.initial_loss_scale, growth_interval=args.loss_scale_window,
                               hysteresis=args.hysteresis, min_scale=args.min_loss_scale) if fp16 else None
    pad = args.documents == "pad"  # --pad: windows stop at document ends; the sampler and validation alike
    sampler = DistributedSampler(train_tok, cfg.block_size, args.micro_batch_size, args.grad_accum,
                                 dp_rank=s.topo.dp_rank // s.cp, dp_size=s.topo.dp // s.cp, seed=args.seed, pad=pad)
    val_set = eval_batches(val_tok, cfg.block_size, args.eval_batches, 16, seed=args.seed + 1, pad=pad)
    if rank0:
        for line in _header(args, cfg, s, comm.world_size):
            log(line)
        if args.show_shards:
            log(s.zero.shard_map.format())
    tokens_per_step = args.batch_size * cfg.block_size
    ckpt = Checkpointer(args, comm, cfg, log if rank0 else (lambda line: None))
    # applied: optimizer steps taken (a skipped, overflowing step advances neither Adam nor the schedule);
    # start: loop steps done, which is the data position (step k draws global batch (seed, k))
    start, applied, pruner = ckpt.resume(s, scaler)
    progress = Progress(getattr(args, "progress", "auto") if rank0 else "none", args.steps, tokens_per_step,
                        every=getattr(args, "log_every", None), fp16=fp16, start_step=start)
    monitor = MemoryMonitor(s.stage, progress.every, args.steps)  # per-module attribution, live memory
    val_history = [(start, s.evaluate(val_set))]
    progress.validation(start, val_history[0][1])
    train_losses, grad_norms, loss_scales, skipped_at, state_bytes, lrs = [], [], [], [], {}, []
    # the ledger's peaks cover the training steps from here on; set-up (building the model, then ZeRO
    # copying it into flat buffers or shards, one unit beside the old arrays) is kept apart as setup_peak
    setup_peak = dict(get_ledger().peak, peak_total=get_ledger().peak_total)
    get_ledger().reset_peaks()
    if tracemalloc.is_tracing():  # likewise the measured process peak: training steps only
        tracemalloc.reset_peak()
    tracer = trace.Tracer(comm.rank) if getattr(args, "trace", None) else None
    trace.set_tracer(tracer)  # --trace: this rank's timeline (forward/backward per unit, collectives, step)
    units = TraceUnits(s.stage) if tracer is not None else None
    backend.synchronize()  # a GPU's queued work belongs to the set-up, not to the timed steps
    t_start = time.perf_counter()
    progress.start_clock()
    for step in range(start, args.steps):
        poison = check_fault(comm.rank, step)
        monitor.begin_step()
        if args.prune_sparsity and step == args.prune_step:  # masks from the full weights, same on every rank
            with s.full_parameters():
                pruner = Pruner(s.stage, args.prune_sparsity, args.prune_scope)
            pruner.prune_(s.zero)
        scale = scaler.scale if scaler is not None else 1.0
        with np.errstate(over="ignore", invalid="ignore") if fp16 else contextlib.nullcontext():
            # FP16 overflow is expected now and then: the loss scaler detects it and skips the step
            loss_sum = s.forward_backward(list(sampler.micro_batches(step)), loss_scale=scale, poison=poison)
            if poison:  # MINIZERO_FAULT=r:s:inf: this rank's gradients become non-finite
                for g in s.local_grads():
                    g *= g.dtype.type(math.inf)
            s.reduce_gradients()
        if pruner is not None:  # pruned entries get no gradient: not in the norm, not in Adam's m and v
            pruner.mask_gradients_(s.zero)
        if after_grads is not None:
            after_grads(step, s.params, s.opt)
        if step == start:
            state_bytes = model_state_bytes()
        skip = False
        if scaler is not None:  # every rank must agree, even when only one saw an inf
            skip = scaler.update(overflow_anywhere(local_overflow(s.local_grads()), comm))
            loss_scales.append(scale)
        lr = cosine_lr(applied, args.lr, args.warmup, args.steps, args.min_lr)
        lrs.append(lr)
        if skip:
            grad_norms.append(math.nan)
            skipped_at.append(step)
        else:  # clipping on the unscaled global norm, folded with 1/scale into the update
            norm = math.sqrt(s.grad_norm_sq()) / scale
            grad_norms.append(norm)
            check_finite_norm(step, norm)
            s.step(lr, grad_scale=clip_coefficient(norm, args.grad_clip) / scale)
            applied += 1
            if pruner is not None:  # Adam's momentum (and any state from before pruning) must not revive them
                pruner.mask_weights_(s.zero)
        s.zero_grad()
        mine = loss_sum / args.grad_accum if s.holds_loss else 0.0
        with comm.traffic.op("metrics"):
            mean_loss = float(backend.to_host(all_reduce(comm, backend.to_device(np.array([mine]))))[0]) / s.topo.dp
        train_losses.append(mean_loss)
        if scaler is None:  # FP16 may see an inf loss on a step it skips; FP32 has no such excuse
            check_finite_loss(step, "training", mean_loss)
        progress.step(step, mean_loss, lr, scale, len(skipped_at), extra=monitor.end_step(comm, step))
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val_history.append((step + 1, s.evaluate(val_set)))
            progress.validation(step + 1, val_history[-1][1])
            if scaler is None:
                check_finite_loss(step + 1, "validation", val_history[-1][1])
        ckpt.maybe_save(step, s, applied, scaler, pruner)
    backend.synchronize()  # kernels are queued asynchronously: time them finished
    elapsed = time.perf_counter() - t_start
    if tracer is not None:
        trace.set_tracer(None)
        units.remove()
        write_trace(comm, tracer, args.trace)
        if rank0:
            log(f"wrote {args.trace} (Chrome trace-event JSON, one row per rank; open in https://ui.perfetto.dev)")
    train_process_peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    progress.close()
    val_history.append((args.steps, s.evaluate(val_set)))
    offload.close()
    monitor.close()
    if scaler is None:
        check_finite_loss(args.steps, "validation", val_history[-1][1])
    traffic = s.traffic()
    for line in node_traffic(s.topo, args.steps, s.dp, getattr(args, "allreduce", "ring"), s.cp):  # collective
        log(line)
    full = s.full_model()
    return dict(model=full, stage=s.stage, topo=s.topo, engine=s.engine, dp=s.dp, opt=s.opt, strategy=s,
                train_losses=train_losses, grad_norms=grad_norms, val_history=val_history, loss_scales=loss_scales,
                skipped_steps=len(skipped_at), skipped_at=skipped_at, elapsed_s=elapsed,
                tokens_per_s=tokens_per_step * (args.steps - start) / max(elapsed, 1e-9), config=cfg,
                state_bytes=state_bytes, traffic=traffic, pruner=pruner, setup_peak=setup_peak,
                train_process_peak=train_process_peak, memory_monitor=monitor, lrs=lrs, start_step=start,
                applied=applied, checkpoints=ckpt.saved, load_peak=ckpt.load_peak)
