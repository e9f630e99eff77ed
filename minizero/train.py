"""The main job: ``mpirun -n 8 python -m minizero.train`` trains a small GPT on real text.

With no flags it trains the ``default`` model (4 layers, width 128, context
128, byte-level vocabulary) data-parallel over every rank on the Python
language reference that ships with CPython, and finishes in a few minutes on a
2-core laptop. Rank 0 shows a progress bar, then prints the validation loss,
the memory summary of every rank, and a generated sample; it writes the
weights (``OUT/model.npz``, nanoGPT state_dict names) and a JSON summary.

Every argument is checked before any work, identically on every rank, so a bad
value gives one clear message and exit status 2 instead of a hang. An
exception on any rank prints ``[rank r]`` and its traceback, then aborts the
whole MPI job (``MPI_Abort``), so no rank waits forever for a dead peer.
Outputs are written to a temporary name and renamed, so a crash never leaves
a half-written file under the final name.

Fault injection for tests: ``MINIZERO_FAULT=RANK:STEP:KIND`` with KIND
``raise`` (exception) or ``kill`` (SIGKILL of the process) at optimizer step
STEP on rank RANK.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import tracemalloc
import traceback

import numpy as np

from minizero import backend
from minizero.autograd import manual_seed, no_grad
from minizero.comm.collectives import all_gather, all_reduce
from minizero.files import atomic_write
from minizero.data import DistributedSampler, check_corpus, decode, encode, eval_batches, load_tokens, train_val_split
from minizero.ledger import CATEGORIES, format_bytes, get_ledger, memory_summary
from minizero.memory.offload import ActivationOffload, OffloadError, OptimizerStateStore, check_offload_dir
from minizero.memory.precision import DynamicLossScaler, LossScaleError, local_overflow, overflow_anywhere
from minizero.memory.recompute import apply_recompute
from minizero.memory.sparsity import SCOPES, Pruner
from minizero.memory.zero import ZeroOptimizer, gather_figures, model_state_bytes
from minizero.nn import GPT, PRESETS, get_config
from minizero.optim import AdamW, clip_coefficient, cosine_lr, global_grad_norm_sq
from minizero.optim.adam8bit import Adam8bit, ShardedAdam8bit
from minizero.parallel.data_parallel import DataParallel
from minizero.parallel.three_d import resolve_parallel_args, train_3d


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm became inf/NaN without a loss scaler to skip the step."""


def check_finite_norm(step: int, norm: float) -> None:
    """Raise :class:`TrainingDiverged` before an update that would write inf/NaN into the weights."""
    if not math.isfinite(norm):
        raise TrainingDiverged(f"step {step}: the gradient norm is {norm}; training diverged (lower --lr, "
                               f"or use --precision fp16, whose loss scaler skips such steps); no update was applied")


class UsageError(ValueError):
    """A bad command-line value; the message names the value and what is allowed."""


class _Parser(argparse.ArgumentParser):
    quiet = False  # ranks other than 0 print no --help

    def print_help(self, file=None):
        if not self.quiet:
            super().print_help(file)

    def error(self, message):  # raise instead of exiting, so only rank 0 prints
        raise UsageError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show ``(default: X)`` only where the help text does not already say what the default is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.train``."""
    p = _Parser(prog="python -m minizero.train", description=__doc__.split("\n\n")[0],
                formatter_class=_HelpFormatter)
    p.add_argument("--model", default="default", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--block-size", type=int, default=None, help="context length T (default: the preset's)")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the preset's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameter/compute dtype")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-steps per optimizer step (default 1, or derived from --batch-size)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global sequences per optimizer step; must equal micro-batch-size x data-parallel size x "
                        "grad-accum (grad-accum is derived when not given)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp x pp))")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size: every block's matrices split (default 1)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages: the layers split (default 1)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="pipeline micro-batches per optimizer step per data rank, the same number as --grad-accum "
                        "(default with tp x pp > 1: tp x pp, so the global batch is micro-batch-size x world size)")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="pipeline schedule")
    p.add_argument("--pp-verbose", action="store_true", help="print every pipeline message as an arrow")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/20, at least 10, at most steps)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (2-D weights)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping threshold (0 disables)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, data and dropout generators")
    p.add_argument("--data", default=None, help="UTF-8 text file to train on (default: the embedded corpus)")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches of 16 sequences each")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="data-parallel all-reduce bucket size (MiB)")
    p.add_argument("--native-comm", action="store_true", help="use MPI's own all-reduce instead of the ring")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 + gradients, 3 + parameters")
    p.add_argument("--show-shards", action="store_true", help="print the ZeRO shard map (needs --zero 1-3)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16"],
                   help="fp16: FP16 parameters/activations/gradients, FP32 master weights and Adam state, "
                        "dynamic loss scaling")
    p.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16, help="fp16: starting loss scale")
    p.add_argument("--loss-scale-window", type=int, default=2000,
                   help="fp16: clean steps before the scale doubles (PyTorch 2000, DeepSpeed 1000)")
    p.add_argument("--hysteresis", type=int, default=1,
                   help="fp16: overflows before the scale halves (PyTorch 1, DeepSpeed 2)")
    p.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the scale never goes below this")
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective"],
                   help="activation recompute: every K-th block (full) or its attention core (selective)")
    p.add_argument("--recompute-every", type=int, default=1, help="K: recompute every K-th block")
    p.add_argument("--offload-activations", default="none", choices=["none", "cpu", "nvme"],
                   help="move saved activations to host memory or to files until backward")
    p.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"],
                   help="keep master weights and Adam state (and run the update) on the host or on disk "
                        "(ZeRO-Offload / ZeRO-Infinity)")
    p.add_argument("--offload-dir", default=None, help="directory of the anonymous offload files "
                                                        "(default: the system temp directory)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam8bit"],
                   help="adam8bit: m and v as 8-bit codes + one FP32 absmax per block (Dettmers et al. 2022)")
    p.add_argument("--adam8bit-block-size", type=int, default=256, help="elements per absmax of 8-bit Adam's state")
    p.add_argument("--quantized-comm", action="store_true",
                   help="INT8 on the wire for ZeRO's gradient reduce-scatters and ZeRO-3's gathers (ZeRO++)")
    p.add_argument("--prune-sparsity", type=float, default=0.0,
                   help="fraction of the linear weights pruned by magnitude and kept at zero (0: dense)")
    p.add_argument("--prune-scope", default="layer", choices=list(SCOPES), help="rank weights per layer or globally")
    p.add_argument("--prune-step", type=int, default=0, help="optimizer step at whose start the masks are made")
    p.add_argument("--out", default="out", help="directory for model.npz and summary.json")
    p.add_argument("--json", default=None, help="path of the JSON summary (default OUT/summary.json)")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes of text to generate at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-save", action="store_true", help="write neither model.npz nor the summary")
    p.add_argument("--no-tracemalloc", action="store_true", help="skip the tracemalloc process-peak measurement")
    return p


#: upper limits that keep a typo from becoming an out-of-memory kill minutes later
MAX_MICRO_BATCH, MAX_SAMPLE_TOKENS, MAX_ADAM8BIT_BLOCK = 4096, 100_000, 1 << 16
FAULT_KINDS = ("raise", "kill", "inf")


def _check_outputs(args) -> None:
    """OUT must be (or become) a writable directory and JSON a writable file path that clobbers nothing."""
    out = args.out
    if not out:
        raise UsageError("--out must name a directory, got ''")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} exists and is not a directory")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):  # the nearest existing ancestor is where makedirs will start
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out!r} cannot be created or written (no writable parent directory)")
    js = os.path.abspath(args.json)
    if os.path.isdir(js):
        raise UsageError(f"--json {args.json!r} is a directory; give a file path")
    if js == os.path.abspath(os.path.join(out, "model.npz")) or (args.data and js == os.path.abspath(args.data)):
        raise UsageError(f"--json {args.json!r} would overwrite {'the weights' if js.endswith('model.npz') else '--data'}")
    jparent = os.path.dirname(js)
    if os.path.abspath(jparent) != os.path.abspath(out) and not (os.path.isdir(jparent) and os.access(jparent, os.W_OK)):
        raise UsageError(f"--json {args.json!r}: directory {jparent!r} does not exist or is not writable")


def _check_data(args) -> None:
    """The --data file must be readable UTF-8 text long enough for one validation window."""
    if args.data is None:
        return
    if os.path.isdir(args.data):
        raise UsageError(f"--data {args.data!r} is a directory; give a UTF-8 text file")
    if not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data!r}: no such file")
    try:
        tokens = load_tokens(args.data)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    t = args.block_size or PRESETS[args.model].block_size
    need = 10 * (t + 2)  # the last 10% validates and must hold one (T + 1)-token window
    if len(tokens) < need:
        raise UsageError(f"--data {args.data!r} has {len(tokens):,} bytes; a context of {t} needs at least "
                         f"{need:,} (the last 10% is the validation split)")


def _check_fault_spec() -> None:
    spec = os.environ.get("MINIZERO_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_KINDS:
        raise UsageError(f"MINIZERO_FAULT={spec!r}; expected RANK:STEP:KIND with KIND one of {FAULT_KINDS}")


def parse_args(argv=None, world_size: int = 1, quiet: bool = False) -> argparse.Namespace:
    """Parse and validate ``argv`` for a job of ``world_size`` ranks; fills derived fields.

    ``quiet``: print no ``--help`` (ranks other than 0).
    Raises:
        UsageError: any bad value, with the value and what is allowed.
    """
    parser = build_parser()
    parser.quiet = quiet
    args = parser.parse_args(argv)
    _check_fault_spec()
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    for name, cap in (("micro_batch_size", MAX_MICRO_BATCH), ("sample_tokens", MAX_SAMPLE_TOKENS),
                      ("adam8bit_block_size", MAX_ADAM8BIT_BLOCK)):
        if getattr(args, name) > cap:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {cap:,}, got {getattr(args, name):,}")
    positive = ["steps", "micro_batch_size", "eval_batches"]
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("grad_accum", "batch_size", "block_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("eval_every", "warmup", "sample_tokens"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive finite number, got {args.lr}")
    if args.min_lr is not None and not (0 <= args.min_lr <= args.lr):
        raise UsageError(f"--min-lr must be in [0, lr={args.lr}], got {args.min_lr}")
    if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):
        raise UsageError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if not (args.grad_clip >= 0):
        raise UsageError(f"--grad-clip must be >= 0 (0 disables), got {args.grad_clip}")
    if not (args.bucket_mb * 2 ** 20 >= 1 and math.isfinite(args.bucket_mb)):
        raise UsageError(f"--bucket-mb must be at least one byte (2**-20) and finite, got {args.bucket_mb}")
    if args.show_shards and not args.zero:
        raise UsageError("--show-shards needs --zero 1, 2 or 3 (stage 0 shards nothing)")
    if args.precision == "fp16" and args.dtype != "float32":
        raise UsageError(f"--precision fp16 trains FP16 parameters with FP32 master weights; "
                         f"--dtype must stay float32, got {args.dtype}")
    if args.precision == "fp16":
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
            raise UsageError(str(e)) from None
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    preset = PRESETS[args.model]
    if args.block_size is not None and args.block_size > preset.block_size:
        raise UsageError(f"--block-size {args.block_size} exceeds the {args.model!r} preset's "
                         f"block_size {preset.block_size}")
    try:  # --dp/--tp/--pp (one may be derived) and --micro-batches; dp = world_size unless tp or pp is given
        dp = resolve_parallel_args(args, world_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.optimizer == "adam8bit" and args.offload_optimizer != "none":
        raise UsageError("--offload-optimizer works with --optimizer adamw; 8-bit Adam's state is already 4x smaller "
                         "and stays on the device")
    if args.adam8bit_block_size < 1:
        raise UsageError(f"--adam8bit-block-size must be >= 1, got {args.adam8bit_block_size}")
    if args.quantized_comm and not args.zero:
        raise UsageError("--quantized-comm needs --zero 1, 2 or 3 (it quantizes ZeRO's reduce-scatters and ZeRO-3's "
                         "gathers; stage 0's all-reduce is not quantized)")
    if args.quantized_comm and args.native_comm:
        raise UsageError("--quantized-comm and --native-comm exclude each other (MPI's own collectives send FP32)")
    if not 0 <= args.prune_sparsity < 1:
        raise UsageError(f"--prune-sparsity must be in [0, 1), got {args.prune_sparsity}")
    if args.prune_sparsity and not 0 <= args.prune_step < args.steps:
        raise UsageError(f"--prune-step must be in [0, steps={args.steps}), got {args.prune_step}")
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
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.warmup is None:
        # at least 10: with 2 warmup steps at lr 3e-3 the default model spikes near step 18, and a
        # spike turns float32 rounding differences (another reduction order) into 1e-2 loss gaps
        args.warmup = min(args.steps, max(10, args.steps // 20))
    _check_data(args)
    if args.json is None:
        args.json = os.path.join(args.out, "summary.json")
    if not args.no_save:
        _check_outputs(args)
    args.world_size = world_size
    return args


def model_config(args):
    """The GPTConfig the arguments ask for."""
    dtype = "float16" if getattr(args, "precision", "fp32") == "fp16" else args.dtype
    return get_config(args.model, block_size=args.block_size, dropout=args.dropout, dtype=dtype)


def printable(text: str) -> str:
    """``text`` with control characters (a barely trained byte model emits them) shown as U+FFFD."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def _check_fault(rank: int, step: int) -> bool:
    """Act on ``MINIZERO_FAULT=RANK:STEP:KIND`` here; returns True for KIND ``inf`` (poison this rank's loss)."""
    spec = os.environ.get("MINIZERO_FAULT")
    if not spec:
        return False
    r, s, kind = spec.split(":")
    if int(r) == rank and int(s) == step:
        if kind == "inf":
            return True
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault (MINIZERO_FAULT={spec})")
    return False


def evaluate(model, batches, comm) -> float:
    """Mean validation loss (nats per token) over ``batches``, the rows split across ranks.

    Each rank evaluates rows ``rank::world_size`` of every batch; the sums are
    all-reduced, so the value does not depend on the world size.
    """
    was_training = model.training
    model.eval()
    total = np.zeros(2)  # [sum of per-sequence mean losses, number of sequences]
    with no_grad():
        for x, y in batches:
            xs, ys = x[comm.rank::comm.world_size], y[comm.rank::comm.world_size]
            # a rank without rows still runs the forward (on one row, not counted): under ZeRO-3 the
            # forward's all-gathers are collectives that every rank must join
            n = len(xs)
            xs, ys = (xs, ys) if n else (x[:1], y[:1])
            loss = model(backend.to_device(xs), backend.to_device(ys))[1]
            total += [loss.item() * n, n]
    with comm.traffic.op("metrics"):
        total = all_reduce(comm, total)
    model.train(was_training)
    return float(total[0] / total[1])


def _gather_stats(comm, process_peak: int, grad_bytes: int) -> list[dict]:
    """Every rank's ledger snapshot, process peak and bytes sent, via the hand-written all-gather."""
    snap = get_ledger().snapshot()
    traffic = comm.traffic.snapshot()
    vec = np.array([snap["current"][c] for c in CATEGORIES] + [snap["peak"][c] for c in CATEGORIES]
                   + [snap["peak_total"], process_peak, traffic["bytes_sent"], grad_bytes],
                   dtype=np.float64)
    k = len(CATEGORIES)
    with comm.traffic.op("metrics"):
        allv = all_gather(comm, vec).reshape(comm.world_size, -1)
    out = []
    for row in allv:
        row = [int(v) for v in row]
        out.append({"current": dict(zip(CATEGORIES, row[:k])), "peak": dict(zip(CATEGORIES, row[k:2 * k])),
                    "peak_total": row[2 * k], "process_peak": row[2 * k + 1], "bytes_sent": row[2 * k + 2],
                    "bytes_sent_grad_allreduce": row[2 * k + 3]})
    return out


def train(args, comm, log=print, after_grads=None) -> dict:
    """Train per ``args`` (from :func:`parse_args`) on communicator ``comm``; returns a result dict.

    Works under MPI (one process per rank) and under the in-process
    ThreadCommunicator (one thread per rank). Only rank 0 logs.
    ``after_grads(step, params, opt)``, if given, runs once per optimizer step after
    the gradients are averaged across ranks and before clipping (tests read
    the gradients there; with ``--zero`` 1-3 they are in ``opt.grad_shards()``).
    ``--zero`` 1-3 replaces DataParallel + AdamW by :class:`ZeroOptimizer`; over one
    rank it runs (sharding over 1 rank saves nothing) and says so.
    Result keys: model, dp (None under ZeRO), opt, train_losses, grad_norms, val_history
    [(step, loss)], elapsed_s, tokens_per_s, config, state_bytes (ledger model-state
    bytes at the first optimizer step).
    With ``--tp`` or ``--pp`` above 1 the 3D loop of :func:`minizero.parallel.three_d.train_3d` runs.
    """
    if args.tp * args.pp > 1:
        return train_3d(args, comm, log=log, after_grads=after_grads)
    rank, world = comm.rank, comm.world_size
    rank0 = rank == 0
    cfg = model_config(args)
    tokens = load_tokens(args.data)
    train_tok, val_tok = train_val_split(tokens)
    check_corpus(val_tok, cfg.block_size, "validation split (last 10% of the text)")
    manual_seed(args.seed * 1000 + rank)  # dropout masks differ per rank, reproducibly
    model = GPT(cfg, seed=args.seed)
    apply_recompute(model, args.recompute, args.recompute_every)
    offload = ActivationOffload(args.offload_activations, args.offload_dir, rank=rank)
    params = model.parameters()
    fp16 = args.precision == "fp16"
    store = OptimizerStateStore(args.offload_optimizer, args.offload_dir)
    if args.zero:
        state = None
        if args.optimizer == "adam8bit":  # the 8-bit state is what gets sharded
            def state(shard_map):
                return ShardedAdam8bit(shard_map, comm, cfg.dtype, block_size=args.adam8bit_block_size)
        dp, opt = None, ZeroOptimizer(model, comm, args.zero, lr=args.lr, weight_decay=args.weight_decay,
                                      native=args.native_comm, sharded_state=state,
                                      quantized_comm=args.quantized_comm, master_weights=fp16, store=store)
        if rank0 and args.show_shards:
            log(opt.shard_map.format())
        if rank0 and world == 1:
            log(f"note: --zero {args.zero} over 1 rank shards nothing (the shard is the whole model); running anyway")
    else:
        dp = DataParallel(params, comm, bucket_bytes=int(args.bucket_mb * 2 ** 20), native=args.native_comm)
        if args.optimizer == "adam8bit":
            opt = Adam8bit(params, lr=args.lr, weight_decay=args.weight_decay, block_size=args.adam8bit_block_size,
                           master_weights=fp16)
        else:
            opt = AdamW(params, lr=args.lr, weight_decay=args.weight_decay, master_weights=fp16, store=store)
    # FP16: the loss is scaled by S before backward; overflowing steps are skipped on every rank
    scaler = DynamicLossScaler(args.initial_loss_scale, growth_interval=args.loss_scale_window,
                               hysteresis=args.hysteresis, min_scale=args.min_loss_scale) if fp16 else None
    applied = 0  # optimizer steps actually taken: skipped steps advance neither Adam's t nor the LR schedule
    loss_scales = []
    pruner = None
    sampler = DistributedSampler(train_tok, cfg.block_size, args.micro_batch_size, args.grad_accum,
                                 dp_rank=rank, dp_size=world, seed=args.seed)
    val_set = eval_batches(val_tok, cfg.block_size, args.eval_batches, 16, seed=args.seed + 1)
    if rank0:
        log(f"minizero: {world} rank(s), model {args.model!r} ({model.num_parameters():,} parameters, "
            f"{cfg.n_layer} layers, width {cfg.n_embd}, context {cfg.block_size}), {args.dtype}, "
            f"global batch {args.batch_size} x {cfg.block_size} tokens "
            f"(micro-batch {args.micro_batch_size} x {world} ranks x {args.grad_accum} accumulation)")
    val_history = [(0, evaluate(model, val_set, comm))]
    train_losses, grad_norms = [], []
    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        # disable=None: no bar when stdout is not a terminal (a log file gets no carriage-return spam)
        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout, disable=None)
    tokens_per_step = args.batch_size * cfg.block_size
    # the ledger's peaks cover the training steps from here on; set-up (building the full model, then ZeRO
    # copying it into flat buffers or shards, one unit beside the old arrays) is kept apart as setup_peak
    setup_peak = dict(get_ledger().peak, peak_total=get_ledger().peak_total)
    get_ledger().reset_peaks()
    if tracemalloc.is_tracing():  # likewise the measured process peak: training steps only
        tracemalloc.reset_peak()
    t_start = time.perf_counter()
    for step in range(args.steps):
        poison = _check_fault(rank, step)  # MINIZERO_FAULT=r:s:inf makes this rank's gradients non-finite
        if args.prune_sparsity and step == args.prune_step:  # masks from the full weights, same on every rank
            with opt.full_parameters() if dp is None else contextlib.nullcontext():
                pruner = Pruner(model, args.prune_sparsity, args.prune_scope)
            pruner.prune_(opt if dp is None else None)
        scale = scaler.scale if scaler is not None else 1.0
        loss_sum = 0.0
        for x, y in sampler.micro_batches(step):
            with offload():
                loss = model(backend.to_device(x), backend.to_device(y))[1]  # logits not kept alive in backward
            with np.errstate(over="ignore", invalid="ignore") if fp16 else contextlib.nullcontext():
                # FP16 overflow is expected now and then: the loss scaler detects it and skips the step
                (loss * (scale * (math.inf if poison else 1.0) / args.grad_accum)).backward()
            loss_sum += loss.item()
        quiet = np.errstate(over="ignore", invalid="ignore") if fp16 else contextlib.nullcontext()
        if dp is not None:
            with quiet:  # summing scaled FP16 gradients may overflow: detected below, the step skipped
                dp.allreduce_gradients()
            if pruner is not None:  # pruned entries get no gradient: not in the norm, not in Adam's m and v
                pruner.mask_gradients_()
            if after_grads is not None:
                after_grads(step, params, opt)
        else:  # ZeRO: each rank holds its gradient shard; the norm needs one all-reduce
            with quiet:
                opt.reduce_gradients()
            if pruner is not None:
                pruner.mask_gradients_(opt)
            if after_grads is not None:
                after_grads(step, params, opt)
        if step == 0:
            state_bytes = model_state_bytes()
        skip = False
        if scaler is not None:  # every rank must agree, even when only one saw an inf (ZeRO holds shards)
            local = local_overflow([p.grad for p in params] if dp is not None else opt.grad_shards())
            skip = scaler.update(overflow_anywhere(local, comm))
            loss_scales.append(scale)
        if skip:
            grad_norms.append(math.nan)
        else:
            # clipping on the unscaled gradients; 1/S and the clipping coefficient are folded into the
            # update (grad_scale), so FP16 gradients are never multiplied in FP16
            norm = (math.sqrt(global_grad_norm_sq(p.grad for p in params)) / scale if dp is not None
                    else opt.grad_norm(1.0 / scale))
            grad_norms.append(norm)
            check_finite_norm(step, norm)
            opt.set_lr(cosine_lr(applied, args.lr, args.warmup, args.steps, args.min_lr))
            opt.step(grad_scale=clip_coefficient(norm, args.grad_clip) / scale)
            applied += 1
            if pruner is not None:  # Adam's momentum (and any state from before pruning) must not revive them
                pruner.mask_weights_(opt if dp is None else None)
        opt.zero_grad()
        with comm.traffic.op("metrics"):
            mean_loss = float(all_reduce(comm, np.array([loss_sum / args.grad_accum]))[0]) / world
        train_losses.append(mean_loss)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val_history.append((step + 1, evaluate(model, val_set, comm)))
        if bar is not None:
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tokens_per_step * (step + 1) / elapsed:,.0f}")
            bar.update(1)
    elapsed = time.perf_counter() - t_start
    train_process_peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    if bar is not None:
        bar.close()
    val_history.append((args.steps, evaluate(model, val_set, comm)))
    offload.close()
    return dict(model=model, dp=dp, opt=opt, train_losses=train_losses, grad_norms=grad_norms, val_history=val_history,
                loss_scales=loss_scales, skipped_steps=scaler.skipped if scaler is not None else 0,
                elapsed_s=elapsed, tokens_per_s=tokens_per_step * args.steps / elapsed, config=cfg,
                state_bytes=state_bytes, pruner=pruner, setup_peak=setup_peak, train_process_peak=train_process_peak)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _blas_threads(local_ranks: int) -> int:
    """BLAS threads per rank: cores / ranks on this node, at least 1 (GUIDE: 8.5x slower oversubscribed)."""
    return max(1, _cores() // max(1, local_ranks))


def main(argv=None) -> int:
    """Entry point of ``python -m minizero.train``; returns the exit status."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from minizero.comm import MPICommunicator

    comm = MPICommunicator(MPI.COMM_WORLD)
    rank = comm.rank
    try:
        args = parse_args(argv, comm.world_size, quiet=rank != 0)
    except UsageError as e:
        if rank == 0:
            print(f"python -m minizero.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        local_ranks = local.Get_size()
        local.Free()
        threads = _blas_threads(local_ranks)
        threadpool_limits(limits=threads)
        if not args.no_tracemalloc:
            tracemalloc.start()
        result = train(args, comm, log=lambda s: print(s, flush=True))
        process_peak = result.get("train_process_peak") or (
            tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0)
        dp, opt = result["dp"], result["opt"]
        per_step = dp.bytes_sent / args.steps if dp is not None else opt.bytes_per_step()
        stats = _gather_stats(comm, process_peak, per_step * args.steps)
        store = getattr(opt, "store", None)  # optimizer state in files (--offload-optimizer nvme): in no ledger category
        zero = gather_figures(comm, dict(result["state_bytes"], gathered_peak=get_ledger().peak["gathered"],
                                         bytes_sent_per_step=per_step,
                                         optimizer_disk_bytes=getattr(store, "disk_bytes", 0)))
        if "setup_peak" in result:  # every rank's ledger peaks during set-up, by category
            result["setup_peaks"] = gather_figures(comm, result["setup_peak"])
        with opt.full_parameters() if dp is None else contextlib.nullcontext():  # stage 3: gather for saving
            if rank == 0:
                _report(args, result, stats, threads, local_ranks, zero)
    except BaseException as e:  # any rank: show the cause, then take the whole job down
        if isinstance(e, SystemExit) and not e.code:
            raise
        if isinstance(e, (TrainingDiverged, LossScaleError)):  # a diagnosis, not a bug: no traceback
            sys.stderr.write(f"[rank {rank}] minizero.train stopped: {e}\n")
            sys.stderr.flush()
            comm.abort(1)
            return 1
        if isinstance(e, KeyboardInterrupt):
            sys.stderr.write(f"[rank {rank}] interrupted; files already written are left as they were\n")
            sys.stderr.flush()
            comm.abort(130)
            return 130
        sys.stderr.write(f"[rank {rank}] minizero.train failed: {type(e).__name__}: {e}\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.abort(1)
        return 1
    return 0


def _json_safe(x):
    """``x`` with NaN/inf floats as None, so the summary is strict JSON (a skipped FP16 step has no norm)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _report(args, result, stats, threads, local_ranks, zero) -> None:
    model, cfg = result["model"], result["config"]
    val0, val = result["val_history"][0][1], result["val_history"][-1][1]
    print(f"\nvalidation loss: {val:.4f} nats/byte (start {val0:.4f}; ln 256 = {math.log(256):.4f}) "
          f"after {args.steps} steps, {result['elapsed_s']:.1f} s, {result['tokens_per_s']:,.0f} tokens/s")
    notes = [f"BLAS threads per rank: {threads} ({local_ranks} rank(s) on this node, {_cores()} core(s))",
             "bytes sent per rank: " + ", ".join(f"r{r} {format_bytes(s['bytes_sent'])}" for r, s in enumerate(stats))]
    notes.append(f"ZeRO stage {args.zero}: model states per rank at the optimizer step " + ", ".join(
        f"r{r} {format_bytes(z['parameters'] + z['gradients'] + z['optimizer_state'])}" for r, z in enumerate(zero)))
    if result.get("setup_peaks"):
        notes.append("peaks above: the training steps; set-up (model built, then re-homed) peaked at " + ", ".join(
            f"r{r} {format_bytes(sp['peak_total'])}" for r, sp in enumerate(result["setup_peaks"])))
    if result.get("pruner") is not None:
        rep = result["pruner"].report()
        notes.append(f"pruned {rep['pruned']:,} of {rep['total']:,} linear weights ({rep['sparsity']:.1%}, "
                     f"{args.prune_scope}): stored dense {format_bytes(rep['dense'])} (NumPy keeps the zeros); "
                     f"would be CSR {format_bytes(rep['csr'])}, bitmap {format_bytes(rep['bitmap'])}")
    print(memory_summary(stats, [s["process_peak"] for s in stats] if not args.no_tracemalloc else None, notes))
    if not args.no_save:  # the weights first: an interrupted sample must not cost the training run
        state = model.state_dict()
        bad = [k for k, v in state.items() if not np.isfinite(v).all()]
        if bad:
            raise FloatingPointError(f"not saving: {len(bad)} tensor(s) hold inf/NaN (first: {bad[0]}); "
                                     f"the previous {os.path.join(args.out, 'model.npz')} is left as it was")
        atomic_write(os.path.join(args.out, "model.npz"), lambda p: np.savez(open(p, "wb"), **state))
    prompt = "The "
    out = model.generate(encode(prompt)[None, :].astype(np.int64), args.sample_tokens, temperature=0.8,
                         rng=np.random.default_rng(args.seed))
    print("\nsample:\n" + printable(decode(out[0])) + "\n")
    if args.no_save:
        return
    summary = {
        "world_size": args.world_size,
        "dp": args.dp, "tp": args.tp, "pp": args.pp, "micro_batches": args.micro_batches,
        "schedule": args.schedule,
        "config": {"model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                   "train": {k: v for k, v in vars(args).items()}},
        "num_parameters": model.num_parameters(),
        "train_loss": result["train_losses"],
        "grad_norm": result["grad_norms"],
        "val_loss": val,
        "val_history": result["val_history"],
        "elapsed_s": result["elapsed_s"],
        "tokens_per_s": result["tokens_per_s"],
        "blas_threads_per_rank": threads,
        "ledger_peak_bytes": [s["peak"] for s in stats],
        "ledger_peak_total_bytes": [s["peak_total"] for s in stats],
        "ledger_setup_peak_bytes": result.get("setup_peaks"),
        "process_peak_bytes": [s["process_peak"] for s in stats],
        "bytes_sent": [s["bytes_sent"] for s in stats],
        "bytes_sent_grad_allreduce": [s["bytes_sent_grad_allreduce"] for s in stats],
        "zero": {"stage": args.zero, "per_rank": zero},
        "optimizer": args.optimizer, "quantized_comm": args.quantized_comm,
        "pruning": None if result.get("pruner") is None else {
            k: v for k, v in result["pruner"].report().items() if k != "layers"},
        "sample": decode(out[0]),
    }
    atomic_write(args.json, lambda p: open(p, "w").write(json.dumps(_json_safe(summary), indent=1, allow_nan=False)))
    print(f"wrote {os.path.join(args.out, 'model.npz')} and {args.json}")


if __name__ == "__main__":
    sys.exit(main())
