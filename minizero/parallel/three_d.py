"""3D parallelism: data x tensor x pipeline, composed from the three single-technique files.

::

    world (dp*tp*pp ranks, topology.py)
      └─ pipeline stage pp_rank: its blocks (pipeline.py)
           └─ each block split over the tensor group (tensor_parallel.py)
                └─ the stage's parameters replicated over the data group: DataParallel or ZeRO-1

One optimizer step on every rank::

    PipelineEngine.forward_backward(m micro-batches)   activations/gradients to the neighbour stages
                                                         (tensor all-reduces inside every block)
    allreduce_tied_embedding_grads                      wte (first stage) + its copy (last stage)
    DataParallel.allreduce_gradients / ZeRO reduce      over the data group only
    global gradient norm                                sum of squares over the model-parallel group,
                                                         each tensor-replicated parameter counted once
    AdamW (or ZeRO's sharded AdamW) with grad_scale = clipping coefficient / loss scale

Building: every rank builds the whole GPT from the seed, keeps its stage and shards it
(:func:`build_stage`), so the split model starts from exactly the single-process weights;
the whole model lives in a scratch memory ledger and is freed at once, so this rank's
ledger shows only what it keeps. (Frameworks avoid even the transient copy by building on
a "meta" device; for these model sizes the copy is harmless.)

ZeRO with pipeline parallelism: stage 1 (optimizer state sharded over the data group) is
supported. Stages 2 and 3 are refused with pp > 1, as DeepSpeed refuses them: they reduce
gradients (and, for 3, gather parameters) inside every backward, and the pipeline runs
m backwards per step, multiplying that traffic by m.

Sources: Narayanan et al. 2021 (arXiv:2104.04473), sections 2-3 (PTD-P); Megatron-LM
``finalize_model_grads`` (data-parallel reduce, then the embedding group) and
``clip_grad_norm_fp32`` (tensor-parallel duplicates and the shared embedding counted once).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import tracemalloc

import numpy as np

from minizero import backend
from minizero.autograd import manual_seed
from minizero.comm.collectives import all_reduce
from minizero.ledger import MemoryLedger, get_ledger, set_ledger
from minizero.nn import GPT
from minizero.optim import AdamW, clip_coefficient, cosine_lr
from minizero.parallel.data_parallel import DataParallel
from minizero.parallel.pipeline import PipelineEngine, PipelineStage, allreduce_tied_embedding_grads, stage_layers
from minizero.parallel.schedule import bubble_formula, bubble_fraction, make_schedule, peak_in_flight, simulate
from minizero.parallel.tensor_parallel import is_tensor_parallel_duplicate, tensor_parallelize, unshard_arrays
from minizero.parallel.topology import Topology, resolve_sizes
from minizero.parallel.vocab_parallel import vocab_parallelize

_HDR_TAG, _DATA_TAG = 1201, 1202


@contextlib.contextmanager
def scratch_ledger():
    """Count arrays made inside the block in a throw-away ledger (the caller's ledger is untouched)."""
    real = get_ledger()
    set_ledger(MemoryLedger())
    try:
        yield
    finally:
        set_ledger(real)


def build_stage(cfg, seed: int, topo: Topology) -> PipelineStage:
    """This rank's part of the model: pipeline stage ``topo.pp_rank``, split over ``topo.tp_comm``.

    The full GPT is built from ``seed`` (same weights as a single process), sliced and
    sharded; only the kept arrays enter this rank's ledger (as ``parameters``).
    Elements kept, per block: 12C^2/tp + 7C/tp + 6C (c_attn, c_fc and the two projection
    weights split; ln_1, ln_2 and the two projection biases whole); plus VC/tp + TC on the
    first stage (wte split by vocabulary, wpe whole) and VC/tp + 2C on the last (its copy of
    the tied head's shard, ln_f) — the two are one shard when the stage is both.
    """
    with scratch_ledger():
        stage = PipelineStage(GPT(cfg, seed=seed), topo.pp_rank, topo.pp)
        tensor_parallelize(stage, topo.tp_comm)
        vocab_parallelize(stage, topo.tp_comm)
    ledger = get_ledger()
    for p in stage.parameters():
        ledger.track(p.data, "parameters")
    return stage


def counts_in_norm(p, topo: Topology) -> bool:
    """Whether this rank adds ``p``'s gradient to the global norm (each element counted exactly once).

    Tensor-replicated parameters count on tensor rank 0 only; the last stage's copy of the
    tied embedding does not count (the first stage's does).
    """
    if getattr(p, "shared_embedding_copy", False):
        return False
    return topo.tp_rank == 0 or not is_tensor_parallel_duplicate(p)


def grad_norm_sq(stage: PipelineStage, topo: Topology, opt=None) -> float:
    """Squared global gradient norm of the whole model (float64), the same on every rank.

    Without ZeRO: this rank's counted gradients, summed over the model-parallel group (one
    all-reduce of one float64). With a ZeroOptimizer ``opt``: the owned gradient pieces,
    summed over the whole world (data x model-parallel), since each data rank owns a slice.
    """
    local = 0.0
    if opt is None:
        for p in stage.parameters():
            if p.grad is not None and counts_in_norm(p, topo):
                local += float((p.grad.astype(np.float64) ** 2).sum())
        comm = topo.mp_comm
    else:  # ZeRO: the pieces of parameters inside this rank's gradient shards (padding excluded)
        named, shards = dict(stage.named_parameters()), opt.grad_shards()
        for pc in opt.shard_map.pieces(topo.dp_rank):
            if counts_in_norm(named[pc.param], topo):
                g = shards[pc.unit][pc.shard_lo:pc.shard_lo + pc.hi - pc.lo].astype(np.float64)
                local += float((g * g).sum())
        comm = topo.world
    with comm.traffic.op("grad_norm"):
        return float(backend.to_host(all_reduce(comm, backend.xp.asarray([local])))[0])


def evaluate_3d(engine: PipelineEngine, batches, topo: Topology) -> float:
    """Mean validation loss over ``batches``: rows split over the data group, each slice piped through.

    The same number as ``train.evaluate`` gives for the single process.
    """
    stage = engine.stage
    was_training = stage.training
    stage.eval()
    total = np.zeros(2)
    for x, y in batches:
        xs, ys = x[topo.dp_rank::topo.dp], y[topo.dp_rank::topo.dp]
        if len(xs):
            loss = engine.forward_only(xs, ys)
            if stage.is_last and topo.tp_rank == 0:
                total += [loss * len(xs), len(xs)]
    with topo.world.traffic.op("metrics"):
        total = all_reduce(topo.world, total)
    stage.train(was_training)
    return float(total[0] / total[1])


def gather_full_model(stage: PipelineStage, topo: Topology, cfg, root: int = 0):
    """Collective: world rank ``root`` (at dp 0, tp 0, pp 0) assembles the whole GPT; None elsewhere.

    Every rank of data rank 0 sends, in its own parameter order, a header (int64
    [partition_dim, stride], or [-1, 1] for a whole array; tensor rank 0 only for those) and
    the array; the root receives in the full model's order and joins the shards
    (:func:`unshard_arrays`). Traffic label ``gather_model``: the model's bytes once.
    Raises:
        ValueError: ``root`` is not the rank at (0, 0, 0).
    """
    comm = topo.world
    if root != topo.rank_of(0, 0, 0):
        raise ValueError(f"root {root} must be the rank at dp 0, tp 0, pp 0 ({topo.rank_of(0, 0, 0)})")
    if topo.dp_rank == 0 and comm.rank != root:
        with comm.traffic.op("gather_model"):
            for _, p in stage.named_parameters():
                split = not is_tensor_parallel_duplicate(p)
                if getattr(p, "shared_embedding_copy", False) or (not split and topo.tp_rank != 0):
                    continue
                hdr = [p.partition_dim, p.partition_stride] if split else [-1, 1]
                comm.send(np.array(hdr, dtype=np.int64), root, tag=_HDR_TAG)
                comm.send(backend.xp.ascontiguousarray(p.data), root, tag=_DATA_TAG)
    if comm.rank != root:
        return None
    with scratch_ledger():
        full = GPT(cfg, seed=0)
    local = dict(stage.named_parameters())
    for name, p in full.named_parameters():
        if name.startswith("transformer.h."):
            layer = int(name.split(".")[2])
            s = next(k for k in range(topo.pp) if layer in stage_layers(cfg.n_layer, topo.pp, k))
        else:
            s = topo.pp - 1 if name.startswith("transformer.ln_f") else 0
        shards, dim, stride = [], -1, 1
        for t in range(topo.tp):
            src = topo.rank_of(0, t, s)
            if src == root:
                q = local[name]
                hdr = [q.partition_dim, q.partition_stride] if not is_tensor_parallel_duplicate(q) else [-1, 1]
                data = q.data
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


def traffic_by_group(topo: Topology) -> dict:
    """``{group: comm.traffic.snapshot()}`` for the tp, dp, pp and embedding groups, and ``world``."""
    out = {name: c.traffic.snapshot() for name, c in topo.groups().items()}
    out["world"] = topo.world.traffic.snapshot()
    return out


def resolve_parallel_args(args, world_size: int) -> int:
    """Fill ``args.dp/tp/pp`` (and ``grad_accum`` from ``--micro-batches``) and check them; returns dp.

    Called by ``train.parse_args`` before the batch arithmetic. Rules: one of --dp/--tp/--pp
    left out is derived from the world size (:func:`resolve_sizes`); ``--micro-batches`` is
    the pipeline's name for ``--grad-accum`` (micro-batches per optimizer step per data
    rank), and with tp x pp > 1 it defaults to tp x pp, so the global batch is
    micro-batch-size x world size however the world is split (``--dp 2 --tp 2 --pp 2``
    trains on the batches of ``--dp 8``).
    Raises:
        ValueError naming the numbers: sizes (see :func:`resolve_sizes`), --micro-batches < 1
        or different from --grad-accum, ZeRO 2/3 with --pp > 1.
    """
    from minizero.nn import PRESETS

    cfg = PRESETS[args.model]
    args.dp, args.tp, args.pp = resolve_sizes(world_size, args.dp, args.tp, args.pp, n_head=cfg.n_head,
                                              n_embd=cfg.n_embd, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size)
    m = args.micro_batches
    if m is not None:
        if m < 1:
            raise ValueError(f"--micro-batches must be >= 1, got {m}")
        if args.grad_accum is not None and args.grad_accum != m:
            raise ValueError(f"--micro-batches {m} and --grad-accum {args.grad_accum} name the same number "
                             "(micro-batches per optimizer step per data rank); give one")
        args.grad_accum = m
    elif args.grad_accum is None and args.batch_size is None and args.tp * args.pp > 1:
        args.grad_accum = args.tp * args.pp
    if getattr(args, "prune_sparsity", 0) and args.tp * args.pp > 1:
        raise ValueError(f"--prune-sparsity with --tp {args.tp} --pp {args.pp} is not supported: magnitude "
                         "pruning ranks whole weights, which tensor and pipeline parallelism split across ranks")
    zero = getattr(args, "zero", 0)
    if zero >= 2 and args.pp > 1:
        raise ValueError(f"--zero {zero} with --pp {args.pp} is not supported: ZeRO-{zero} reduces gradients"
                         f"{' and gathers parameters' if zero == 3 else ''} in every backward, and a pipeline runs "
                         "one backward per micro-batch (DeepSpeed refuses this combination too); use --zero 1")
    return args.dp


def train_3d(args, comm, log=print, after_grads=None) -> dict:
    """The training loop of ``python -m minizero.train`` when ``--tp`` or ``--pp`` is above 1.

    ``args`` from ``train.parse_args`` (with ``dp``, ``tp``, ``pp``, ``micro_batches``,
    ``schedule``). Same contract and the same step as ``train.train``: ``after_grads(step,
    params, opt)`` runs after the gradients are complete and averaged over the data group,
    before clipping (``params``: this rank's stage parameters, i.e. shards; under ZeRO the
    gradients are in ``opt.grad_shards()``); ``--precision fp16`` scales the loss, skips
    overflowing steps on every rank and folds 1/scale and the clipping coefficient into the
    update; ``--optimizer``, ``--zero``, ``--quantized-comm``, ``--recompute``,
    ``--offload-activations`` and ``--offload-optimizer`` act per stage.
    Result keys: model (the whole GPT, gathered on rank 0; None elsewhere), stage, topo,
    engine, dp, opt, train_losses, grad_norms, val_history, loss_scales, skipped_steps,
    elapsed_s, tokens_per_s, config, state_bytes, traffic (per group).
    """
    from minizero.data import DistributedSampler, check_corpus, eval_batches, load_tokens, train_val_split
    from minizero.memory.offload import ActivationOffload, OptimizerStateStore
    from minizero.memory.precision import DynamicLossScaler, local_overflow, overflow_anywhere
    from minizero.memory.recompute import apply_recompute
    from minizero.memory.zero import ZeroOptimizer, model_state_bytes
    from minizero.optim.adam8bit import Adam8bit, ShardedAdam8bit
    from minizero.train import _check_fault, check_finite_norm, model_config

    cfg = model_config(args)
    topo = Topology(comm, args.dp, args.tp, args.pp)
    rank0 = comm.rank == 0
    tokens = load_tokens(args.data)
    train_tok, val_tok = train_val_split(tokens)
    check_corpus(val_tok, cfg.block_size, "validation split (last 10% of the text)")
    # dropout: one generator per (data rank, stage), shared by the tensor group (replicated activations
    # must get identical masks; split heads take their slice of a full mask, tensor_parallel.py)
    manual_seed(args.seed * 1000 + topo.dp_rank + topo.dp * topo.pp_rank)
    stage = build_stage(cfg, args.seed, topo)
    apply_recompute(stage, args.recompute, args.recompute_every)
    params = stage.parameters()
    fp16 = args.precision == "fp16"
    store = OptimizerStateStore(args.offload_optimizer, args.offload_dir)  # --offload-optimizer: Adam state off-device
    if args.zero:
        state = None
        if args.optimizer == "adam8bit":  # the 8-bit state is what gets sharded
            def state(shard_map):
                return ShardedAdam8bit(shard_map, topo.dp_comm, cfg.dtype, block_size=args.adam8bit_block_size)
        dp, opt = None, ZeroOptimizer(stage, topo.dp_comm, args.zero, lr=args.lr, weight_decay=args.weight_decay,
                                      native=args.native_comm, sharded_state=state,
                                      quantized_comm=args.quantized_comm, master_weights=fp16, store=store)
        if rank0 and args.show_shards:
            log(opt.shard_map.format())
    else:
        dp = DataParallel(params, topo.dp_comm, bucket_bytes=int(args.bucket_mb * 2 ** 20), native=args.native_comm)
        if args.optimizer == "adam8bit":
            opt = Adam8bit(params, lr=args.lr, weight_decay=args.weight_decay, block_size=args.adam8bit_block_size,
                           master_weights=fp16)
        else:
            opt = AdamW(params, lr=args.lr, weight_decay=args.weight_decay, master_weights=fp16, store=store)
    scaler = DynamicLossScaler(args.initial_loss_scale, growth_interval=args.loss_scale_window,
                               hysteresis=args.hysteresis, min_scale=args.min_loss_scale) if fp16 else None
    offload = ActivationOffload(args.offload_activations, args.offload_dir, rank=comm.rank)
    verbose = args.pp_verbose and topo.tp_rank == 0 and topo.dp_rank == 0  # one pipeline speaks
    engine = PipelineEngine(stage, topo.pp_comm, args.schedule, verbose=verbose,
                            log=lambda s: print(f"[rank {comm.rank}] {s}", flush=True), forward_context=offload)
    m = args.micro_batches
    sampler = DistributedSampler(train_tok, cfg.block_size, args.micro_batch_size, m,
                                 dp_rank=topo.dp_rank, dp_size=topo.dp, seed=args.seed)
    val_set = eval_batches(val_tok, cfg.block_size, args.eval_batches, 16, seed=args.seed + 1)
    if rank0:
        sched = make_schedule(args.schedule, topo.pp, m)
        log(f"minizero: {comm.world_size} rank(s) as dp {topo.dp} x tp {topo.tp} x pp {topo.pp}, model "
            f"{args.model!r} ({cfg.num_parameters():,} parameters, {cfg.n_layer} layers, width {cfg.n_embd}, "
            f"context {cfg.block_size}), {cfg.dtype}, global batch {args.batch_size} x {cfg.block_size} tokens "
            f"(micro-batch {args.micro_batch_size} x {topo.dp} data ranks x {m} micro-batches)")
        log(topo.describe())
        if topo.pp > 1:
            log(f"pipeline: {args.schedule}, {m} micro-batches, bubble {bubble_fraction(simulate(sched)):.3f} "
                f"= (p-1)/(m+p-1) = {bubble_formula(topo.pp, m):.3f}, micro-batches in flight per stage "
                f"{[peak_in_flight(ops) for ops in sched]}")
    val_history = [(0, evaluate_3d(engine, val_set, topo))]
    train_losses, grad_norms, loss_scales, state_bytes = [], [], [], {}
    applied = 0  # optimizer steps taken: a skipped (overflowing) step advances neither Adam nor the schedule
    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout, disable=None)
    tokens_per_step = args.batch_size * cfg.block_size
    # as in train.train: ledger and process peaks cover the training steps; set-up is kept apart
    setup_peak = dict(get_ledger().peak, peak_total=get_ledger().peak_total)
    get_ledger().reset_peaks()
    if tracemalloc.is_tracing():
        tracemalloc.reset_peak()
    t_start = time.perf_counter()
    for step in range(args.steps):
        poison = _check_fault(comm.rank, step)  # MINIZERO_FAULT=r:s:inf makes this rank's gradients non-finite
        scale = scaler.scale if scaler is not None else 1.0
        loss_sum = engine.forward_backward(list(sampler.micro_batches(step)), loss_scale=scale)
        if poison:
            for g in ([p.grad for p in params if p.grad is not None] if dp is not None else opt.grad_shards()):
                g *= g.dtype.type(math.inf)
        allreduce_tied_embedding_grads(stage, topo.embed_comm)
        if dp is not None:
            dp.allreduce_gradients()
        else:
            opt.reduce_gradients()
        if after_grads is not None:
            after_grads(step, params, opt)
        if step == 0:
            state_bytes = model_state_bytes()
        skip = False
        if scaler is not None:  # every rank of the world must agree: one stage's overflow poisons all
            local = local_overflow([p.grad for p in params] if dp is not None else opt.grad_shards())
            skip = scaler.update(overflow_anywhere(local, comm))
            loss_scales.append(scale)
        if skip:
            grad_norms.append(math.nan)
        else:  # clipping on the unscaled global norm, folded with 1/scale into the update
            norm = math.sqrt(grad_norm_sq(stage, topo, opt if dp is None else None)) / scale
            grad_norms.append(norm)
            check_finite_norm(step, norm)
            opt.set_lr(cosine_lr(applied, args.lr, args.warmup, args.steps, args.min_lr))
            opt.step(grad_scale=clip_coefficient(norm, args.grad_clip) / scale)
            applied += 1
        opt.zero_grad()
        mine = loss_sum / m if stage.is_last and topo.tp_rank == 0 else 0.0
        with comm.traffic.op("metrics"):
            mean_loss = float(all_reduce(comm, np.array([mine]))[0]) / topo.dp
        train_losses.append(mean_loss)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val_history.append((step + 1, evaluate_3d(engine, val_set, topo)))
        if bar is not None:
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tokens_per_step * (step + 1) / elapsed:,.0f}")
            bar.update(1)
    elapsed = time.perf_counter() - t_start
    train_process_peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    if bar is not None:
        bar.close()
    val_history.append((args.steps, evaluate_3d(engine, val_set, topo)))
    offload.close()
    traffic = traffic_by_group(topo)
    with opt.full_parameters() if args.zero == 3 else contextlib.nullcontext():  # ZeRO-3 holds shards only
        full = gather_full_model(stage, topo, cfg)
    return dict(model=full, stage=stage, topo=topo, engine=engine, dp=dp, opt=opt, train_losses=train_losses,
                grad_norms=grad_norms, val_history=val_history, loss_scales=loss_scales,
                skipped_steps=scaler.skipped if scaler is not None else 0, elapsed_s=elapsed,
                tokens_per_s=tokens_per_step * args.steps / elapsed, config=cfg, state_bytes=state_bytes,
                traffic=traffic, setup_peak=setup_peak, train_process_peak=train_process_peak)
