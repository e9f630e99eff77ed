"""The command line of ``python -m minizero.train``: every flag, checked before any work.

:func:`parse_args` checks every value identically on every rank (one message naming the value and what is
allowed, exit status 2) and fills the derived fields (dp/tp/pp, grad-accum, batch size, warmup, min-lr).
Global batch B = micro-batch-size b x dp x micro-batches k; k defaults to pp.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from minizero.autograd.rng import MAX_DROPOUT
from minizero.checkpoint import CheckpointError, read_manifest, resolve, run_layout, verify
from minizero.checkpoint.fields import MAX_STEPS  # a manifest's step is refused beyond it
from minizero.checkpoint.format import MANIFEST, TMP, folder_name
from minizero.config import TrainConfig
from minizero.comm.recursive_doubling import threshold_from_env
from minizero.data import describe_non_file, load_tokens, prompt_problem
from minizero.faults import spec_problem
from minizero.temporaries import check_writable_folder, unwritable
from minizero.layout_checks import (check_attention, check_bf16, check_context_parallel, check_cp_world,
                                    check_interleaved, check_moe, check_sequence_parallel, check_zero,
                                    check_zero_bubble, offloads_optimizer, resolve_sizes)
from minizero.memory.offload import OffloadError, check_offload_dir
from minizero.memory.plots import plots_on
from minizero.memory.precision import SCALE_RANGE, DynamicLossScaler
from minizero.nn import PRESETS, get_config
from minizero.zero.collectives import debug_collectives
from minizero.output_checks import (check_outputs, check_resume_source, check_save_dir, check_trace,
                                     outside_checkpoints)

from minizero.flags import (MAX_ADAM8BIT_BLOCK, MAX_FLIGHT_RECORDS, MAX_MICRO_BATCH, MAX_SAMPLE_TOKENS,  # noqa: F401
                            LATE_DEFAULTS, UsageError, build_parser, refuse_idle_flags)


MAX_EVAL_BATCHES = 10_000
#: micro-batches per step and sequences per step (the data of one step is held at once)
MAX_GRAD_ACCUM, MAX_BATCH_SIZE = 1024, 65_536
MAX_INITIAL_LOSS_SCALE = 2 ** 24
MAX_BUCKET_MB = 2 ** 20  #: --bucket-mb: 1 TiB, far above any model here; a larger float overflows the byte count
MIN_COMM_TIMEOUT_S = 1.0  #: --comm-timeout's floor: below it, set-up and ordinary steps already time out


def _check_data(args) -> None:
    """The --data file must be readable UTF-8 text long enough for one validation window."""
    if args.data is None:
        return
    what = describe_non_file(args.data)
    if what:
        raise UsageError(f"--data {args.data!r}{what}; give a UTF-8 text file")
    try:
        tokens = load_tokens(args.data)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    t = args.block_size or PRESETS[args.model].block_size
    need = 10 * (t + 2)  # the last 10% validates and must hold one (T + 1)-token window
    if len(tokens) < need:
        raise UsageError(f"--data {args.data!r} has {len(tokens):,} bytes; a context of {t} needs at least "
                         f"{need:,} (the last 10% is the validation split)")


def check_fault_spec(world_size: int | None = None, steps: int | None = None, save_every: int | None = None,
                     start: int = 0) -> None:
    """``MINIZERO_FAULT`` checked by :func:`minizero.faults.spec_problem` (the main job gives its sizes and
    ``start``, a resumed run's first step; other callers of :func:`parse_args`, compare's estimates, only get the
    syntax checked). Raises UsageError naming the spec and what this job allows."""
    spec = os.environ.get("MINIZERO_FAULT")
    if spec and (problem := spec_problem(spec, world_size, steps, save_every, start)):
        raise UsageError(problem)


def _check_loss_scaling(args) -> None:
    """The --precision fp16 loss-scaling flags, by their flag names (PyTorch GradScaler's rules)."""
    s0, mn = args.initial_loss_scale, args.min_loss_scale
    if not (0 < s0 < math.inf):
        raise UsageError(f"--initial-loss-scale must be a finite number > 0; got --initial-loss-scale={s0}")
    if s0 > MAX_INITIAL_LOSS_SCALE:  # each step above what FP16 needs is a skipped step (halved on overflow)
        raise UsageError(f"--initial-loss-scale must be <= 2**24 = {MAX_INITIAL_LOSS_SCALE:,}; got "
                         f"--initial-loss-scale={s0:g}")
    if not (SCALE_RANGE[0] <= mn <= s0):  # below 2**-24 every FP16 gradient flushes to 0
        raise UsageError(f"--min-loss-scale must be in [2**-24, --initial-loss-scale={s0:g}]; "
                         f"got --min-loss-scale={mn}")
    if args.loss_scale_window < 1:
        raise UsageError(f"--loss-scale-window must be >= 1; got --loss-scale-window={args.loss_scale_window}")
    if args.hysteresis < 1:
        raise UsageError(f"--hysteresis must be >= 1; got --hysteresis={args.hysteresis}")


def _check_lr(args) -> None:
    """--lr must be a normal number of the weights' dtype (--dtype; FP16 keeps FP32 master weights)."""
    # below finfo.tiny it is subnormal or 0 there (1e-320 is 0 in float32: nothing trains); above finfo.max, inf
    # (1e308 overflowed into a "gradient norm is nan" stop). A huge lr the dtype holds is left to the divergence
    # diagnosis (tests/test_train.py provokes it): any lower cap would be a guess about the model
    info = np.finfo(args.dtype)
    if not (float(info.tiny) <= args.lr <= float(info.max)):  # also NaN; Python floats: no overflow warning
        raise UsageError(f"--lr must be a normal {args.dtype} number, in [{info.tiny:.4g}, {info.max:.4g}] "
                         f"(--dtype {args.dtype}), got {args.lr}")


def _check_comm(args) -> None:
    """Resolve ``--comm`` (nccl on --device cuda, else mpi); nccl needs --device cuda (issue #15) and a
    schedule whose pipeline sends can block (not ``interleaved``: NcclCommunicator has no isend/irecv)."""
    device = args.device
    if args.comm is None:
        args.comm = "nccl" if device == "cuda" else "mpi"
    if args.comm == "nccl" and device != "cuda":
        raise UsageError(f"--comm nccl moves device memory between GPUs and needs --device cuda; "
                         f"got --device {device}, which takes --comm mpi (its default)")
    if args.comm == "nccl" and args.schedule == "interleaved":
        raise UsageError("--schedule interleaved sends with isend/irecv, which --comm nccl does not have; "
                         "use --comm mpi, or --schedule 1f1b or gpipe")


def parse_args(argv=None, world_size: int = 1, quiet: bool = False) -> TrainConfig:
    """Parse and validate ``argv`` for a job of ``world_size`` ranks; fills derived fields; returns the
    :class:`~minizero.config.TrainConfig`.

    ``quiet``: print no ``--help`` (ranks other than 0).
    Raises:
        UsageError: any bad value, with the value and what is allowed.
    """
    parser = build_parser()
    parser.quiet = quiet
    args = TrainConfig.from_namespace(parser.parse_args(argv))
    check_fault_spec()
    try:
        threshold_from_env()  # the all-reduce size rule's override (benchmarks, tests)
        debug_collectives()  # MINIZERO_DEBUG_COLLECTIVES: "0" or "1", never a silent "off"
        plots_on()  # MINIZERO_PLOTS: "0" or "1"
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_comm(args)
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    for name, cap in (("micro_batch_size", MAX_MICRO_BATCH), ("sample_tokens", MAX_SAMPLE_TOKENS),
                      ("adam8bit_block_size", MAX_ADAM8BIT_BLOCK), ("steps", MAX_STEPS),
                      ("eval_batches", MAX_EVAL_BATCHES)):
        if vars(args)[name] > cap:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {cap:,}, got {vars(args)[name]:,}")
    positive = ["steps", "micro_batch_size", "eval_batches"]
    for name in positive:
        if vars(args)[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {vars(args)[name]}")
    if args.no_progress and args.progress not in ("auto", "none"):  # auto: the default, not a choice
        raise UsageError(f"--no-progress is --progress none, but --progress {args.progress} is given too; give one")
    if args.no_progress:
        args.progress = "none"
    if args.ulysses is not None:  # DeepSpeed-Ulysses' own spelling of --cp N --cp-attention ulysses
        if args.ulysses < 2:
            raise UsageError(f"--ulysses must be >= 2 (the ranks one sequence is split over), got {args.ulysses}")
        said = f"--cp {args.cp}" if args.cp not in (1, args.ulysses) else \
            "--cp-attention ring" if args.cp_attention == "ring" else None  # given: its default is resolved below
        if said:
            raise UsageError(f"--ulysses {args.ulysses} with {said}: --ulysses N means --cp N --cp-attention ulysses; "
                             "give one of them")
        args.cp, args.cp_attention = args.ulysses, "ulysses"
    if prompt_problem(args.prompt):
        raise UsageError(prompt_problem(args.prompt))
    for name in ("grad_accum", "batch_size", "block_size", "log_every"):
        v = vars(args)[name]
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name, cap in (("grad_accum", MAX_GRAD_ACCUM), ("micro_batches", MAX_GRAD_ACCUM),
                      ("batch_size", MAX_BATCH_SIZE), ("flight_records", MAX_FLIGHT_RECORDS)):
        v = vars(args)[name]
        if v is not None and v > cap:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {cap:,}, got {v:,}")
    for name in ("eval_every", "warmup", "sample_tokens", "flight_records", "check_replicas"):
        v = vars(args)[name]
        if v is not None and v < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if not (MIN_COMM_TIMEOUT_S <= args.comm_timeout and math.isfinite(args.comm_timeout)):
        raise UsageError(f"--comm-timeout must be a finite number of seconds > 0 and at least {MIN_COMM_TIMEOUT_S:g} "
                         f"(a shorter wait times out ordinary start-up and steps, blaming a healthy peer), got "
                         f"{args.comm_timeout}")
    if args.warmup is not None and args.warmup > args.steps:
        raise UsageError(f"--warmup {args.warmup} is longer than --steps {args.steps}; the learning rate would never "
                         "reach --lr (give --warmup <= --steps)")
    _check_lr(args)
    if args.min_lr is not None and not (0 <= args.min_lr <= args.lr):
        raise UsageError(f"--min-lr must be in [0, lr={args.lr}], got {args.min_lr}")
    if not (args.weight_decay >= 0 and args.weight_decay * args.lr < 1):  # AdamW: p *= 1 - lr * wd every step
        raise UsageError(f"--weight-decay must be >= 0 with --lr x --weight-decay < 1 (each step scales the decayed "
                         f"weights by 1 - lr x wd), got {args.weight_decay} at --lr {args.lr}")
    if not (args.loss_spike == 0 or (args.loss_spike > 1 and math.isfinite(args.loss_spike))):
        raise UsageError(f"--loss-spike must be 0 (off) or a finite factor > 1, got {args.loss_spike}")
    if not (args.grad_clip >= 0):
        raise UsageError(f"--grad-clip must be >= 0 (0 disables), got {args.grad_clip}")
    if not (args.bucket_mb * 2 ** 20 >= 1 and args.bucket_mb <= MAX_BUCKET_MB):
        raise UsageError(f"--bucket-mb must be at least one byte (2**-20) and at most {MAX_BUCKET_MB:,} "
                         f"(1 TiB), got {args.bucket_mb}")
    if args.show_shards and not args.zero:
        raise UsageError("--show-shards needs --zero 1, 2 or 3 (stage 0 shards nothing)")
    if args.precision == "fp16" and args.dtype != "float32":
        raise UsageError(f"--precision fp16 trains FP16 parameters with FP32 master weights; "
                         f"--dtype must stay float32, got {args.dtype}")
    if args.precision == "fp16":
        _check_loss_scaling(args)
        try:
            DynamicLossScaler(args.initial_loss_scale, growth_interval=args.loss_scale_window,
                              hysteresis=args.hysteresis, min_scale=args.min_loss_scale)
        except ValueError as e:
            raise UsageError(f"loss scaling flags: {e}") from None
    if args.recompute_every < 1:
        raise UsageError(f"--recompute-every must be >= 1, got {args.recompute_every}")
    if args.offload_dir is not None:
        if "nvme" not in (args.offload_activations, args.offload_optimizer):
            raise UsageError("--offload-dir is only used with --offload-activations nvme or --offload-optimizer nvme")
        try:
            check_offload_dir(args.offload_dir)
        except OffloadError as e:
            # the message, without "[Errno N]", in the flag's words
            raise UsageError((e.strerror or str(e)).replace("offload folder", "--offload-dir", 1)) from None
    if args.dropout is not None and not 0 <= args.dropout <= MAX_DROPOUT:  # float32(p) = 1 dropped everything
        raise UsageError(f"--dropout must be in [0, 1), at most {MAX_DROPOUT:.8g} in float32, got {args.dropout}")
    preset = PRESETS[args.model]
    if args.block_size is not None and args.block_size > preset.block_size:
        raise UsageError(f"--block-size {args.block_size} exceeds the {args.model!r} preset's "
                         f"block_size {preset.block_size}")
    try:  # --dp/--tp/--pp (one may be derived) and --micro-batches; dp = world_size unless tp or pp is given
        dp = resolve_parallel_args(args, world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    refuse_idle_flags(args)  # after the sizes: --schedule and --pp-verbose need the resolved pp
    for name, value in LATE_DEFAULTS.items():  # flags parsed as None so that a given value shows (until here)
        if vars(args)[name] is None:
            setattr(args, name, value)
    if args.offload_optimizer != "none" and not offloads_optimizer(args.optimizer):
        raise UsageError("--offload-optimizer works with --optimizer adamw; 8-bit Adam's state is already 4x smaller "
                         "and stays on the device")
    if args.adam8bit_block_size < 1:
        raise UsageError(f"--adam8bit-block-size must be >= 1, got {args.adam8bit_block_size}")
    if args.quantized_comm and args.allreduce == "hierarchical":
        raise UsageError("--quantized-comm and --allreduce hierarchical exclude each other (the hierarchical "
                         "all-reduce sends FP32)")
    if args.allreduce == "hierarchical" and (args.zero or args.native_comm):
        raise UsageError("--allreduce hierarchical is the data-parallel gradient all-reduce: not with --zero "
                         "(ZeRO reduce-scatters) nor --native-comm (MPI's own all-reduce)")
    if args.quantized_comm and args.native_comm:
        raise UsageError("--quantized-comm and --native-comm exclude each other (MPI's own collectives send FP32)")
    if not 0 <= args.prune_sparsity < 1:
        raise UsageError(f"--prune-sparsity must be in [0, 1), got {args.prune_sparsity}")
    if args.prune_sparsity and not 0 <= args.prune_step < args.steps:
        raise UsageError(f"--prune-step must be in [0, steps={args.steps}) (the steps trained dense before the masks "
                         f"are made), got {args.prune_step}")
    args.derived = tuple(k for k in ("batch_size", "warmup", "min_lr") if vars(args)[k] is None)  # for notes
    per_step = args.micro_batch_size * dp
    if args.batch_size is not None:
        if args.batch_size % per_step:
            raise UsageError(f"--batch-size {args.batch_size} is not divisible by micro-batch-size x data-parallel "
                             f"size = {args.micro_batch_size} x {dp} = {per_step}")
        derived = args.batch_size // per_step
        if args.grad_accum is not None and args.grad_accum != derived:
            raise UsageError(f"--batch-size {args.batch_size} != micro-batch-size x data-parallel size x grad-accum "
                             f"= {args.micro_batch_size} x {dp} x {args.grad_accum} = {per_step * args.grad_accum}")
        args.grad_accum = derived
    if args.grad_accum is None:
        args.grad_accum = 1
    args.batch_size = per_step * args.grad_accum
    args.micro_batches = args.grad_accum
    if args.schedule == "interleaved" and args.grad_accum % args.pp:  # m derived from --batch-size
        raise UsageError(f"--schedule interleaved needs the micro-batches per step ({args.grad_accum}) "
                         f"to be a multiple of --pp {args.pp}")
    if args.min_lr is None:
        args.min_lr = float(f"{args.lr / 10:.15g}")  # 0.0003, shown as such (3e-3 / 10 is 0.00030000000000000003)
    if args.warmup is None:
        # steps/10: with 15 warmup steps (steps/20) at lr 3e-3 the default 300-step run's loss jumped 2.2 nats
        # at step 17, and a spike turns float32 rounding differences into 1e-2 loss gaps (bench/bench_defaults.py)
        args.warmup = min(args.steps, max(10, args.steps // 10))
    _check_data(args)
    if args.json is None:
        args.json = os.path.join(args.out, "summary.json")
    if not args.no_save:
        check_outputs(args)
    check_trace(args)
    args.world_size = world_size
    _check_checkpoint(args)
    return args


def _check_checkpoint(args) -> None:
    """--save-every/--keep in range; --resume a complete checkpoint of this model and optimizer
    (files present, sizes and SHA-256 as the manifest says), checked on every rank before any work."""
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0 (0: no checkpoints), got {args.save_every}")
    if args.keep < 1:
        raise UsageError(f"--keep must be >= 1, got {args.keep}")
    args.save_dir = os.path.join(args.out, "checkpoints") if args.save_dir is None else args.save_dir
    if args.save_every:  # the first save comes after N steps: a folder that takes no file is refused now
        if not args.save_dir:
            raise UsageError("--save-dir must name a folder, got ''")
        if os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
            raise UsageError(f"--save-dir {args.save_dir!r} exists and is not a directory")
        outside_checkpoints("--save-dir", os.path.join(args.save_dir, "x"), args.save_dir)
        try:
            check_writable_folder(args.save_dir, os.path.join(TMP + folder_name(MAX_STEPS), MANIFEST))  # the longest
        except OSError as e:
            raise UsageError(unwritable("--save-dir", args.save_dir, e, what="folder")) from None
    if args.resume == "":
        raise UsageError("--resume '': expected a checkpoint folder or a save dir")
    if args.resume:
        check_resume_source(args)  # not a running job's save dir: its pruning would race our reads
        try:
            verify(args.resume, dataclasses.asdict(model_config(args)), run_layout(args))
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    check_save_dir(args)


def check_steps_left(args) -> int:
    """The main job's rule for ``--resume``: the checkpoint's step is below ``--steps`` (the total, the steps
    already run included), so that the job trains and has steps to report. The library's ``train`` accepts a
    resume with nothing left (it returns at once); the job's report has no step to describe. Returns the step
    the run starts from (0 without ``--resume``).

    Raises:
        UsageError: naming the checkpoint's step and ``--steps``.
    """
    if not args.resume:
        return 0
    try:
        man = read_manifest(resolve(args.resume))
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    step = man.get("step")
    if isinstance(step, int) and step >= args.steps:
        raise UsageError(f"--resume {args.resume!r} was saved after step {step}; --steps {args.steps} leaves nothing "
                         f"to train (give --steps > {step}, the total including the steps already run)")
    _check_resumed_pruning(args, man.get("pruning"), step)
    return step if isinstance(step, int) else 0


def _check_resumed_pruning(args, pruned: dict | None, step) -> None:
    """A pruned checkpoint resumes with its --prune-sparsity and --prune-scope (its masks keep applying); an unpruned
    one with a --prune-step still ahead of it (the loop prunes at that step only: one already passed never comes)."""
    if pruned:
        if (args.prune_sparsity, args.prune_scope) != (pruned.get("sparsity"), pruned.get("scope")):
            raise UsageError(f"--resume {args.resume!r} was pruned to sparsity {pruned.get('sparsity')} (scope "
                             f"{pruned.get('scope')}), this run asks for --prune-sparsity {args.prune_sparsity} "
                             f"--prune-scope {args.prune_scope}; its masks keep applying: resume with --prune-sparsity "
                             f"{pruned.get('sparsity')} --prune-scope {pruned.get('scope')}")
    elif args.prune_sparsity and isinstance(step, int) and args.prune_step < step:
        raise UsageError(f"--prune-step {args.prune_step} (0-based) is before --resume {args.resume!r}, saved after "
                         f"step {step} unpruned: the run would never prune; give --prune-step in [{step}, "
                         f"{args.steps})")


def model_config(args):
    """The GPTConfig the arguments ask for."""
    dtype = "float16" if args.precision == "fp16" else args.dtype
    return get_config(args.model, block_size=args.block_size, dropout=args.dropout, dtype=dtype)


def resolve_parallel_args(args, world_size: int) -> int:
    """Fill ``args.dp/tp/pp`` (and ``grad_accum`` from ``--micro-batches``) and check them; returns dp.

    Called by :func:`parse_args` before the batch arithmetic. Rules: one of --dp/--tp/--pp left out is derived from the
    world size (:func:`resolve_sizes`); ``--micro-batches`` is the pipeline's name for ``--grad-accum`` (micro-batches
    per optimizer step per data rank, k) and defaults to pp, so the global batch is b x dp x k: tensor parallelism never
    changes it, and a pipeline of p stages gets p micro-batches to fill with.
    Raises:
        ValueError naming the numbers: sizes (see :func:`resolve_sizes`), --micro-batches < 1
        or different from --grad-accum, ZeRO 2/3 with --pp > 1, a bad --dp-shard (:func:`check_zero`).
    """
    cfg, cp = PRESETS[args.model], args.cp
    check_cp_world(args, cfg, world_size)
    args.dp, args.tp, args.pp = resolve_sizes(world_size // cp, args.dp, args.tp, args.pp, n_head=cfg.n_head,
                                              n_embd=cfg.n_embd, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                                              ranks=cp > 1 and f"world size {world_size} / cp {cp} = {world_size//cp}",
                                              cp=cp)
    m = args.micro_batches
    if m is not None:
        if m < 1:
            raise ValueError(f"--micro-batches must be >= 1, got {m}")
        if args.grad_accum is not None and args.grad_accum != m:
            raise ValueError(f"--micro-batches {m} and --grad-accum {args.grad_accum} name the same number "
                             "(micro-batches per optimizer step per data rank); give one")
        args.grad_accum = m
    elif args.grad_accum is None and args.batch_size is None:
        args.grad_accum = args.pp  # one rule: k = pp (1 without a pipeline); tensor parallelism never changes B
    if args.prune_sparsity and args.tp * args.pp > 1:
        raise ValueError(f"--prune-sparsity with --tp {args.tp} --pp {args.pp} is not supported: magnitude "
                         "pruning ranks whole weights, which tensor and pipeline parallelism split across ranks; "
                         "use --tp 1 --pp 1 (--dp, --zero and --cp compose with pruning)")
    check_zero(args)
    check_sequence_parallel(args, cfg)
    check_interleaved(args, cfg)
    check_zero_bubble(args, cfg)
    check_context_parallel(args, cfg)
    check_attention(args)
    check_bf16(args)
    check_moe(args)
    return args.dp
