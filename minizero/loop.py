"""The one training loop: every strategy (dp, tp, pp, ZeRO, recompute, FP16, offload, 8-bit Adam).

One step: ``strategy.forward_backward`` (m micro-batches, loss scaled by S), ``reduce_gradients``, the scaler's
update (skip on any rank's overflow), norm = sqrt(``grad_norm_sq``)/S, ``step(lr, clip/S)`` (or ``skip_step``),
``zero_grad``. A skipped step advances neither Adam's t nor the LR schedule (as DeepSpeed's engine). Everything
else is a callback at named points (:mod:`minizero.callbacks`; the main job's list:
:func:`minizero.instrumentation.default_callbacks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np

from minizero import backend
from minizero.args import model_config
from minizero.callbacks import CallbackList, StepRecord
from minizero.comm.collectives import all_reduce
from minizero.data import (DistributedSampler, check_corpus, count_documents, eval_batches, load_tokens, text_digest,
                           train_val_split)
from minizero.instrumentation import default_callbacks
from minizero.memory.offload import ActivationOffload, OptimizerStateStore
from minizero.memory.precision import local_overflow, loss_scaler, overflow_anywhere
from minizero.memory.sparsity import Pruner
from minizero.zero import model_state_bytes
from minizero.optim import clip_coefficient, cosine_lr
from minizero.parallel.placement import node_traffic
from minizero.parallel.strategy import build_strategy


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm became inf/NaN without a loss scaler to skip the step."""


def check_finite_norm(step: int, norm: float) -> None:
    """Raise :class:`TrainingDiverged` before an update that would write inf/NaN into the weights; ``step``: as the
    progress log counts (1-based: the loop's step index + 1)."""
    if not math.isfinite(norm):
        raise TrainingDiverged(f"step {step}: the gradient norm is {norm}; training diverged (lower --lr, "
                               f"or use --precision fp16, whose loss scaler skips such steps); no update was applied")


def check_finite_loss(step: int, what: str, loss: float) -> None:
    """Raise :class:`TrainingDiverged` when a training or validation loss is inf/NaN (weights overflowed); ``step``:
    the progress log's number for that loss line (1-based; validation: the steps done)."""
    if not math.isfinite(loss):
        raise TrainingDiverged(f"step {step}: the {what} loss is {loss}; training diverged: the weights overflowed "
                               f"(lower --lr, or use --precision fp16, whose loss scaler skips such steps)")


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns (also readable as ``result["name"]``, the dict it replaces).

    ``model``: the whole GPT (the local one when tp = pp = 1, else gathered on rank 0, None elsewhere);
    ``train_losses``, ``grad_norms`` (nan for a skipped step), ``loss_scales``, ``lrs``: one per step run;
    ``skipped_at``: the steps FP16 skipped, 0-based (k is the progress log's "step k+1"), index k - ``start_step``
    into the per-step lists (they hold only this run's steps; ``start_step``, 0 unless resumed, is in summary.json);
    ``val_history``: [(step, loss)]; ``state_bytes``: ledger model-state bytes at the first step; ``traffic``: bytes
    sent per group; ``setup_peak``: the ledger's peaks before the first step; ``train_process_peak``: tracemalloc's peak
    over the steps (0 when off); ``start_step``: 0 or the resumed checkpoint's; ``applied``: optimizer steps taken in
    all; ``checkpoints``: folders saved; ``load_peak``: read-buffer bytes while resuming. ``setup_peaks`` to
    ``device_pool`` are filled by the main job after the run (figures gathered from every rank for its report).
    """
    model: object = None
    strategy: object = None
    config: object = None
    train_losses: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)
    val_history: list = dataclasses.field(default_factory=list)
    loss_scales: list = dataclasses.field(default_factory=list)
    skipped_at: list = dataclasses.field(default_factory=list)
    lrs: list = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    state_bytes: dict = dataclasses.field(default_factory=dict)
    traffic: dict = dataclasses.field(default_factory=dict)
    pruner: object = None
    setup_peak: dict = dataclasses.field(default_factory=dict)
    train_process_peak: int = 0
    memory_monitor: object = None
    start_step: int = 0
    applied: int = 0
    checkpoints: list = dataclasses.field(default_factory=list)
    load_peak: int = 0
    setup_peaks: list | None = None
    memory_timeline: object = None
    module_peaks: object = None
    device_pool: list | None = None
    loss_spikes: list = dataclasses.field(default_factory=list)  # --loss-spike (minizero.debug.anomaly.LossSpikes)
    moe: dict | None = None  # MoE: tokens per expert and drop rate over the run (ExpertLoad.summary)
    time_per_rank: dict | None = None  # --trace: rank -> ms per step (minizero.debug.timeline.rank_figures)

    @property
    def skipped_steps(self) -> int:
        return len(self.skipped_at)

    # the strategy's parts, as the dict had them
    stage = property(lambda self: self.strategy.stage)
    topo = property(lambda self: self.strategy.topo)
    engine = property(lambda self: self.strategy.engine)
    dp = property(lambda self: self.strategy.dp)
    opt = property(lambda self: self.strategy.opt)

    def __getitem__(self, name: str):
        return getattr(self, name)


@dataclasses.dataclass
class Run:
    """The loop's state as callbacks see it (:mod:`minizero.callbacks`)."""
    args: object
    comm: object
    cfg: object
    strategy: object
    scaler: object
    log: object
    result: TrainResult
    start: int = 0
    applied: int = 0
    pruner: object = None
    text_digest: str = ""  #: the training text's bytes and SHA-256, of the tokens loaded (checkpoints keep it)
    documents: int = 1  #: the documents in the training text (ended by byte 0x03), for the header


def train(args, comm, log=print, after_grads=None, callbacks=None) -> TrainResult:
    """Train per ``args`` (from :func:`minizero.args.parse_args`) on communicator ``comm``; see :class:`TrainResult`.

    Works under MPI (one process per rank) and under the in-process ThreadCommunicator (one thread
    per rank). Only rank 0 logs (``log`` receives each line). ``after_grads(step, params, opt)``, if
    given, runs once per step after the data-group reduction and before clipping (tests read the
    gradients there: ``params`` are this rank's, shards under tp; under ZeRO ``opt.grad_shards()``).
    ``callbacks``: list of :class:`~minizero.callbacks.Callback` (default: :func:`default_callbacks`).
    Raises:
        TrainingDiverged: a non-finite gradient norm or loss without FP16's loss scaler.
        LossScaleError: FP16 overflowed at the minimum loss scale too many times in a row.
    """
    cfg = model_config(args)
    tokens = load_tokens(args.data)
    train_tok, val_tok = train_val_split(tokens)
    check_corpus(val_tok, cfg.block_size, "validation split (last 10% of the text)")
    offload = ActivationOffload(args.offload_activations, args.offload_dir, rank=comm.rank)
    store = OptimizerStateStore(args.offload_optimizer, args.offload_dir)  # --offload-optimizer: state off-device
    s = build_strategy(args, comm, cfg, forward_context=offload, store=store)
    warn = (lambda note: log(f"warning: {note}")) if comm.rank == 0 else (lambda note: None)  # once per job
    scaler = loss_scaler(args.precision, args.initial_loss_scale, args.loss_scale_window, args.hysteresis,
                         args.min_loss_scale, warn)  # FP16's; None for the other precisions
    pad = args.documents == "pad"  # --pad: windows stop at document ends; the sampler and validation alike
    sampler = DistributedSampler(train_tok, cfg.block_size, args.micro_batch_size, args.grad_accum,
                                 dp_rank=s.topo.dp_rank // s.cp, dp_size=s.topo.dp // s.cp, seed=args.seed, pad=pad)
    val_set = eval_batches(val_tok, cfg.block_size, args.eval_batches, 16, seed=args.seed + 1, pad=pad)
    out = TrainResult(strategy=s, config=cfg)
    run = Run(args, comm, cfg, s, scaler, log, out, text_digest=text_digest(tokens), documents=count_documents(tokens))
    cb = CallbackList(default_callbacks(run) if callbacks is None else callbacks)
    cb.setup(run)  # the header; --resume sets run.start, run.applied, run.pruner
    out.val_history.append((run.start, s.evaluate(val_set)))
    cb.on_eval(run, run.start, out.val_history[0][1])
    cb.on_train_start(run)
    backend.synchronize()  # a GPU's queued work belongs to the set-up, not to the timed steps
    t_start = time.perf_counter()
    for step in range(run.start, args.steps):
        cb.on_step_start(run, step)
        if args.prune_sparsity and step == args.prune_step:  # masks from the full weights, same on every rank
            with s.full_parameters():
                run.pruner = Pruner(s.stage, args.prune_sparsity, args.prune_scope)
            run.pruner.prune_(s.opt)
        scale = scaler.scale if scaler is not None else 1.0
        with np.errstate(over="ignore", invalid="ignore") if scaler is not None else contextlib.nullcontext():
            # FP16 overflow is expected now and then: the loss scaler detects it and skips the step
            loss_sum = s.forward_backward(list(sampler.micro_batches(step)), loss_scale=scale)
            s.reduce_gradients()
        if run.pruner is not None:  # pruned entries get no gradient: not in the norm, not in Adam's m and v
            run.pruner.mask_gradients_(s.opt)
        if after_grads is not None:
            after_grads(step, s.params, s.opt)
        if step == run.start:
            out.state_bytes = model_state_bytes()
        skip = False
        if scaler is not None:  # every rank must agree, even when only one saw an inf
            skip = scaler.update(overflow_anywhere(local_overflow(s.local_grads()), comm))
            out.loss_scales.append(scale)
        lr = cosine_lr(run.applied, args.lr, args.warmup, args.steps, args.min_lr)
        out.lrs.append(lr)
        norm = math.nan
        if skip:
            out.skipped_at.append(step)
            s.skip_step()
        else:  # clipping on the unscaled global norm, folded with 1/scale into the update
            norm = math.sqrt(s.grad_norm_sq()) / scale
            check_finite_norm(step + 1, norm)  # the log's step number
            s.step(lr, grad_scale=clip_coefficient(norm, args.grad_clip) / scale)
            run.applied += 1
            if run.pruner is not None:  # Adam's momentum (and any state from before pruning) must not revive them
                run.pruner.mask_weights_(s.opt)
        out.grad_norms.append(norm)
        s.zero_grad()
        mine = loss_sum / args.grad_accum if s.holds_loss else 0.0
        with comm.traffic.op("metrics"):
            mean_loss = float(backend.to_host(all_reduce(comm, backend.to_device(np.array([mine]))))[0]) / s.topo.dp
        out.train_losses.append(mean_loss)
        if scaler is None:  # FP16 may see an inf loss on a step it skips; FP32 has no such excuse
            check_finite_loss(step + 1, "training", mean_loss)
        cb.on_step_end(run, step, StepRecord(mean_loss, lr, scale, norm, len(out.skipped_at)))
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            out.val_history.append((step + 1, s.evaluate(val_set)))
            cb.on_eval(run, step + 1, out.val_history[-1][1])
            if scaler is None:
                check_finite_loss(step + 1, "validation", out.val_history[-1][1])
    backend.synchronize()  # kernels are queued asynchronously: time them finished
    out.elapsed_s = time.perf_counter() - t_start
    out.tokens_per_s = args.batch_size * cfg.block_size * (args.steps - run.start) / max(out.elapsed_s, 1e-9)
    cb.on_train_end(run)
    out.val_history.append((args.steps, s.evaluate(val_set)))
    offload.close()
    cb.teardown(run)
    if scaler is None:
        check_finite_loss(args.steps, "validation", out.val_history[-1][1])
    out.traffic, out.pruner, out.applied = s.traffic(), run.pruner, run.applied
    ran = args.steps - run.start  # this job's steps (a resumed run: fewer than --steps; every rank alike)
    for line in node_traffic(s.topo, ran, s.dp, args.allreduce, s.cp, args.cp_attention, args.ep,
                                         s.edp_comm) if ran else ():
        log(line)
    out.model = s.full_model()
    return out
