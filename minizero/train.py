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
from minizero.data import DistributedSampler, check_corpus, decode, encode, eval_batches, load_tokens, train_val_split
from minizero.memory.ledger import CATEGORIES, format_bytes, get_ledger, memory_summary
from minizero.nn import GPT, PRESETS, get_config
from minizero.optim import AdamW, clip_grad_norm_, cosine_lr
from minizero.parallel.data_parallel import DataParallel


class UsageError(ValueError):
    """A bad command-line value; the message names the value and what is allowed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of exiting, so only rank 0 prints
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.train``."""
    p = _Parser(prog="python -m minizero.train", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/20)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (2-D weights)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping threshold (0 disables)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, data and dropout generators")
    p.add_argument("--data", default=None, help="UTF-8 text file to train on (default: the embedded corpus)")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches of 16 sequences each")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="data-parallel all-reduce bucket size (MiB)")
    p.add_argument("--native-comm", action="store_true", help="use MPI's own all-reduce instead of the ring")
    p.add_argument("--out", default="out", help="directory for model.npz and summary.json")
    p.add_argument("--json", default=None, help="path of the JSON summary (default OUT/summary.json)")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes of text to generate at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-save", action="store_true", help="write neither model.npz nor the summary")
    p.add_argument("--no-tracemalloc", action="store_true", help="skip the tracemalloc process-peak measurement")
    return p


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """Parse and validate ``argv`` for a job of ``world_size`` ranks; fills derived fields.

    Raises:
        UsageError: any bad value, with the value and what is allowed.
    """
    args = build_parser().parse_args(argv)
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
    if not (args.bucket_mb > 0 and math.isfinite(args.bucket_mb)):
        raise UsageError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    preset = PRESETS[args.model]
    if args.block_size is not None and args.block_size > preset.block_size:
        raise UsageError(f"--block-size {args.block_size} exceeds the {args.model!r} preset's "
                         f"block_size {preset.block_size}")
    dp = world_size
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
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.data is not None and not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data!r}: no such file")
    if args.json is None:
        args.json = os.path.join(args.out, "summary.json")
    args.world_size = world_size
    return args


def model_config(args):
    """The GPTConfig the arguments ask for."""
    return get_config(args.model, block_size=args.block_size, dropout=args.dropout, dtype=args.dtype)


def atomic_write(path: str, write) -> None:
    """Call ``write(tmp_path)`` then rename to ``path``; a crash leaves the old file intact."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _check_fault(rank: int, step: int) -> None:
    spec = os.environ.get("MINIZERO_FAULT")
    if not spec:
        return
    r, s, kind = spec.split(":")
    if int(r) == rank and int(s) == step:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault (MINIZERO_FAULT={spec})")


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
            if len(xs):
                _, loss = model(backend.to_device(xs), backend.to_device(ys))
                total += [loss.item() * len(xs), len(xs)]
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
    ``after_grads(step, params)``, if given, runs once per optimizer step after
    the gradients are averaged across ranks and before clipping (tests read
    the gradients there).
    Result keys: model, dp, train_losses, grad_norms, val_history
    [(step, loss)], elapsed_s, tokens_per_s, config.
    """
    rank, world = comm.rank, comm.world_size
    rank0 = rank == 0
    cfg = model_config(args)
    tokens = load_tokens(args.data)
    train_tok, val_tok = train_val_split(tokens)
    check_corpus(val_tok, cfg.block_size, "validation split (last 10% of the text)")
    manual_seed(args.seed * 1000 + rank)  # dropout masks differ per rank, reproducibly
    model = GPT(cfg, seed=args.seed)
    params = model.parameters()
    dp = DataParallel(params, comm, bucket_bytes=int(args.bucket_mb * 2 ** 20), native=args.native_comm)
    opt = AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
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

        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    tokens_per_step = args.batch_size * cfg.block_size
    t_start = time.perf_counter()
    for step in range(args.steps):
        _check_fault(rank, step)
        loss_sum = 0.0
        for x, y in sampler.micro_batches(step):
            loss = model(backend.to_device(x), backend.to_device(y))[1]  # logits not kept alive in backward
            (loss * (1.0 / args.grad_accum)).backward()
            loss_sum += loss.item()
        dp.allreduce_gradients()
        if after_grads is not None:
            after_grads(step, params)
        grad_norms.append(clip_grad_norm_(params, args.grad_clip))
        opt.set_lr(cosine_lr(step, args.lr, args.warmup, args.steps, args.min_lr))
        opt.step()
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
    if bar is not None:
        bar.close()
    val_history.append((args.steps, evaluate(model, val_set, comm)))
    return dict(model=model, dp=dp, train_losses=train_losses, grad_norms=grad_norms, val_history=val_history,
                elapsed_s=elapsed, tokens_per_s=tokens_per_step * args.steps / elapsed, config=cfg)


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
        args = parse_args(argv, comm.world_size)
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
        process_peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
        stats = _gather_stats(comm, process_peak, result["dp"].bytes_sent)
        if rank == 0:
            _report(args, result, stats, threads, local_ranks)
    except BaseException as e:  # any rank: show the cause, then take the whole job down
        if isinstance(e, SystemExit) and not e.code:
            raise
        sys.stderr.write(f"[rank {rank}] minizero.train failed: {type(e).__name__}: {e}\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.abort(1)
        return 1
    return 0


def _report(args, result, stats, threads, local_ranks) -> None:
    model, cfg = result["model"], result["config"]
    val0, val = result["val_history"][0][1], result["val_history"][-1][1]
    print(f"\nvalidation loss: {val:.4f} nats/byte (start {val0:.4f}; ln 256 = {math.log(256):.4f}) "
          f"after {args.steps} steps, {result['elapsed_s']:.1f} s, {result['tokens_per_s']:,.0f} tokens/s")
    notes = [f"BLAS threads per rank: {threads} ({local_ranks} rank(s) on this node, {_cores()} core(s))",
             "bytes sent per rank: " + ", ".join(f"r{r} {format_bytes(s['bytes_sent'])}" for r, s in enumerate(stats))]
    print(memory_summary(stats, [s["process_peak"] for s in stats] if not args.no_tracemalloc else None, notes))
    prompt = "The "
    out = model.generate(encode(prompt)[None, :].astype(np.int64), args.sample_tokens, temperature=0.8,
                         rng=np.random.default_rng(args.seed))
    print("\nsample:\n" + decode(out[0]) + "\n")
    if args.no_save:
        return
    state = model.state_dict()
    atomic_write(os.path.join(args.out, "model.npz"), lambda p: np.savez(open(p, "wb"), **state))
    summary = {
        "world_size": args.world_size,
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
        "process_peak_bytes": [s["process_peak"] for s in stats],
        "bytes_sent": [s["bytes_sent"] for s in stats],
        "bytes_sent_grad_allreduce": [s["bytes_sent_grad_allreduce"] for s in stats],
        "sample": decode(out[0]),
    }
    atomic_write(args.json, lambda p: open(p, "w").write(json.dumps(summary, indent=1)))
    print(f"wrote {os.path.join(args.out, 'model.npz')} and {args.json}")


if __name__ == "__main__":
    sys.exit(main())
