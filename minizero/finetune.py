"""``python -m minizero.finetune``: fine-tune a trained GPT fully, with LoRA, or with QLoRA, and compare.

``full`` trains every parameter; ``lora`` trains adapters (:mod:`minizero.nn.lora`) on frozen float weights;
``qlora`` on NF4 weights (:mod:`minizero.nf4`). ``--table`` prints per method the validation loss before and
after, trainable parameters and the ledger's bytes; ``--out DIR`` writes the merged model. Under ``mpirun`` the
trained parameters (the adapters alone under LoRA and QLoRA) are data-parallel (``DataParallel``) or, with ``--zero
1|2|3``, ZeRO-sharded: each ``LoRAAdapter`` is one ZeRO unit, so the frozen base is never reduced, sharded or
gathered. ``--tp N`` splits the blocks and their adapters over N tensor ranks (:mod:`minizero.parallel.lora_tp`);
data parallelism and ZeRO then run over the world / N data ranks. Rank 0 locks ``--out`` and ``--json`` for the
run (another job on them: exit 2, one line naming it); set-up is bounded as the main job's (``guard_set_up``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback

import numpy as np

from minizero import backend, jsons, streams
from minizero.flags import flags_refusal, inputs_refusal, job_environment
from minizero.autograd import backward
from minizero.autograd.rng import batch_rows, manual_seed, reserve
from minizero.data import data_digest, eval_batches, global_batch, load_tokens, min_data_bytes, train_val_split
from minizero.args import MAX_BATCH_SIZE, MAX_EVAL_BATCHES, MAX_STEPS, MIN_COMM_TIMEOUT_S, check_fault_spec
from minizero.comm.base import DEFAULT_TIMEOUT_S
from minizero.comm.collectives import all_reduce
from minizero.faults import STEP_START_KINDS, FaultInjector
from minizero.finetune_report import EVAL_SEQUENCES, format_table, header, rose_note
from minizero.files import FolderLock, WriteError, atomic_write, content_digest, lock_outputs, release_all
from minizero.overwrite import check_output, checkpoint_holding, refuse_inputs
from minizero.temporaries import check_writable_folder, unwritable
from minizero.layout_checks import check_model_sizes, check_tensor_parallel, launch
from minizero.ledger import MemoryLedger, get_ledger, set_ledger
from minizero.numerals import (DefaultsOnce, OneLineParser, description, error_lines, integer,
                               negative_values_reach_checks, real)
from minizero.nn.lora import TARGETS, adapters, add_lora, merged_state_dict, trainable_parameters
from minizero.nn.module import ModuleList
from minizero.optim import AdamW, clip_grad_norm_
from minizero.progress import MODES, Progress
from minizero.parallel.data_parallel import DataParallel
from minizero.parallel.lora_tp import counts_in_norm, gather_merged, tensor_parallel_lora
from minizero.parallel.tensor_parallel import is_tensor_parallel_duplicate
from minizero.parallel.topology import Topology
from minizero.quantized_model import evaluate_loss
from minizero.saved_model import SIDECAR, refuse_replacing, save_model
from minizero.weights import load_trained, read_sidecar
from minizero.zero import zero_optimizer
from minizero.zero.collectives import debug_collectives
from minizero.interrupts import WHOLE, Interrupts, end_set_up, every_rank_ends, guard_set_up, interruptible

METHODS = ("full", "lora", "qlora")


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    p = negative_values_reach_checks(OneLineParser(
        prog="python -m minizero.finetune", description=description(__doc__), formatter_class=DefaultsOnce))
    p.quiet = quiet  # ranks other than 0 (OneLineParser)
    p.add_argument("--weights", default=os.path.join("out", "model.npz"), help="model.npz written by minizero.train")
    p.add_argument("--data", default=None, help="text to fine-tune on (default: the embedded corpus)")
    p.add_argument("--method", default="qlora", choices=METHODS, help="what is trained: full (every parameter), "
                   "lora (adapters on frozen float weights), qlora (adapters on frozen NF4 weights)")
    p.add_argument("--table", action="store_true", help="run every method on the same data and print one table")
    p.add_argument("--lora-rank", type=integer, default=8, help="adapter rank r")
    p.add_argument("--lora-alpha", type=real, default=16.0, help="adapter scale numerator (scale = alpha / r)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated Linear names to adapt")
    p.add_argument("--steps", type=integer, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=integer, default=8, help="sequences per step")
    p.add_argument("--lr", type=real, default=1e-3, help="AdamW learning rate (constant, no warmup: a few steps "
                   "can end above the starting loss, and the table then says so)")
    p.add_argument("--eval-batches", type=integer, default=4, help=f"validation batches of {EVAL_SEQUENCES} sequences")
    p.add_argument("--zero", type=integer, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the trained parameters (0: data parallelism, every rank the whole state)")
    p.add_argument("--tp", type=integer, default=1, help="tensor-parallel ranks (lora, qlora): each block's "
                   "matrices and adapters split over them; the other ranks / tp are data parallel")
    p.add_argument("--seed", type=integer, default=0, help="seed of the batches, the adapters' A and the dropout masks")
    p.add_argument("--comm-timeout", type=real, default=DEFAULT_TIMEOUT_S, help="under mpirun: seconds (at least 1) "
                   "any one message or collective may wait for a peer before the job is ended, naming the rank")
    p.add_argument("--out", default=None, help="write the merged model here (DIR/model.npz, DIR/model.json)")
    p.add_argument("--json", default=None, help="write the measurements here")
    p.add_argument("--progress", default="auto", choices=MODES, help="rank 0's live progress: a bar on a terminal "
                   "(auto), else about 15 lines per run (log), or none")
    return p


def check(args) -> None:
    """Raise ValueError naming the first bad value and what is allowed (before any work)."""
    for flag, v, lo in (("--lora-rank", args.lora_rank, 1), ("--steps", args.steps, 1),
                        ("--batch-size", args.batch_size, 1), ("--eval-batches", args.eval_batches, 1),
                        ("--seed", args.seed, 0), ("--tp", args.tp, 1)):
        if v < lo:
            raise ValueError(f"{flag} must be >= {lo}, got {v}")
    for flag, v, hi in (("--steps", args.steps, MAX_STEPS), ("--batch-size", args.batch_size, MAX_BATCH_SIZE)):
        if v > hi:  # as train's bounds: a batch of 10^8 sequences was killed by the kernel, without a word
            raise ValueError(f"{flag} must be <= {hi:,} as train's, got {v:,}")
    tiny = float(np.finfo(np.float32).tiny)  # below it 0 or subnormal in float32 weights: nothing trains, silently
    for flag, v in (("--lr", args.lr), ("--lora-alpha", args.lora_alpha)):
        if not (v > 0 and np.isfinite(v)):
            raise ValueError(f"{flag} must be a positive number, got {v}")
        if v < tiny:
            raise ValueError(f"{flag} {v:g} is below float32's smallest normal number {tiny:.4g}: 0 or subnormal in "
                             "the weights, nothing would train; give a larger one")
    if not (MIN_COMM_TIMEOUT_S <= args.comm_timeout < np.inf):
        raise ValueError(f"--comm-timeout must be a finite number of seconds >= {MIN_COMM_TIMEOUT_S:g}, "
                         f"got {args.comm_timeout}")
    names = args.targets.split(",")
    bad = [t for t in names if t not in TARGETS]
    if bad or not args.targets:
        raise ValueError(f"--targets {args.targets!r}: allowed names are {', '.join(TARGETS)}")
    twice = [t for t in TARGETS if names.count(t) > 1]
    if twice:
        raise ValueError(f"--targets {args.targets!r} names {twice[0]!r} twice; give each of {', '.join(TARGETS)} "
                         "at most once")
    default = build_parser().get_default
    if args.table and args.method != default("method"):
        raise ValueError(f"--table runs every method ({', '.join(METHODS)}) and ignores --method; "
                         f"got --method {args.method}: give one of them")
    lora = [f"--{k.replace('_', '-')}" for k in ("lora_rank", "lora_alpha", "targets") if vars(args)[k] != default(k)]
    if args.tp > 1 and (args.table or args.method == "full"):
        raise ValueError(f"--tp {args.tp} splits the adapters (--method lora or qlora); --method full and --table "
                         "run on data parallelism only (leave --tp out)")
    if lora and args.method == "full" and not args.table:
        raise ValueError(f"{', '.join(lora)} only apply(ies) with --method lora or qlora (adapters); "
                         "--method full trains every parameter")
    debug_collectives()  # MINIZERO_DEBUG_COLLECTIVES, read by ZeRO (--zero): "0" or "1", else ValueError
    if not 1 <= args.eval_batches <= MAX_EVAL_BATCHES:
        raise ValueError(f"--eval-batches must be in [1, {MAX_EVAL_BATCHES:,}] as train's, got {args.eval_batches:,}")
    inputs = {"--weights": args.weights, "--weights' config": os.path.join(os.path.dirname(args.weights), SIDECAR),
              "--data": args.data}
    if args.out is not None:
        if not args.out or (os.path.exists(args.out) and not os.path.isdir(args.out)):  # '': as train refuses it
            raise ValueError(f"--out {args.out!r} exists and is not a folder" if args.out else
                             "--out must name a directory, got ''")
        for name in ("model.npz", SIDECAR):  # what --out receives: never the input, never inside a checkpoint
            written = os.path.join(args.out, name)
            refuse_inputs("--out", args.out, written, inputs, "give another folder for the fine-tuned model")
            if held := checkpoint_holding(os.path.realpath(written)):
                raise ValueError(f"--out {args.out!r} is inside the checkpoint folder {held!r}; give one outside it")
            refuse_replacing(written, f"--out {args.out!r}")  # a folder there, or the user's file of that name
            inputs[f"--out's {name}"] = written
        inputs["--out"] = args.out  # the folder made after training: a --json there would fail after the work
        try:  # the folder is made after training: refuse now one that cannot be made or written
            check_writable_folder(args.out)
        except OSError as e:
            raise ValueError(unwritable("--out", args.out, e, what="folder")) from None
    if args.json is not None:  # '' too: refused
        check_output(args.json, inputs=inputs)


def finetune(args, method: str, tokens, comm=None, progress=None) -> tuple[dict, object, dict]:
    """Fine-tune one copy of the weights by ``method``; returns (the table row, the model, its merged state dict).

    ``comm``: None (one process) or a Communicator (collective: every rank calls): each rank takes its B/N rows
    of every batch; the trained parameters' gradients are all-reduced (mean) or, with ``args.zero``, handed to
    ZeRO, whose units are the adapters (LoRA, QLoRA) or the model's (full). ``args.tp`` > 1: N/tp data ranks
    of tp tensor ranks each (:mod:`minizero.parallel.lora_tp`). The merged state dict (host arrays, nanoGPT
    names) is whole on every rank, ZeRO-3 and tp included. Raises ValueError: ``args.tp`` > 1 not dividing comm's size.
    """
    if args.tp > 1 and (comm is None or comm.world_size % args.tp):
        raise ValueError(f"--tp {args.tp} must divide the {1 if comm is None else comm.world_size} ranks")
    outer = get_ledger()
    set_ledger(MemoryLedger())  # this method's bytes only (the caller's ledger is back on return)
    try:
        return _finetune(args, method, tokens, comm, progress)
    finally:
        set_ledger(outer)


def _optimizer(args, model, method, comm, tp=False):
    """(gradient synchroniser or None, optimizer): DataParallel + AdamW, or ZeRO's sharded AdamW (it is both).
    ``comm``: the data-parallel group; ``tp``: tensor parallel (a synchroniser even on one data rank: the norm)."""
    params = trainable_parameters(model)
    if args.zero:
        trained = model if method == "full" else ModuleList(adapters(model))
        sync = opt = zero_optimizer(trained, comm, args.zero, lr=args.lr, weight_decay=0.0)
        return sync, opt
    sync = DataParallel(params, comm) if comm is not None and (comm.world_size > 1 or tp) else None
    return sync, AdamW(params, lr=args.lr, weight_decay=0.0)


def _finetune(args, method, tokens, comm, progress):
    model, _ = load_trained(args.weights)
    cfg = model.config
    train_tok, val_tok = train_val_split(tokens)
    val = eval_batches(val_tok, cfg.block_size, args.eval_batches, EVAL_SEQUENCES, seed=args.seed + 1)
    before, n_params = evaluate_loss(model, val), model.num_parameters()
    topo = None if args.tp == 1 else Topology(comm, comm.world_size // args.tp, args.tp)
    if topo is not None:
        tensor_parallel_lora(model, topo.tp_comm, args.lora_rank, args.lora_alpha, tuple(args.targets.split(",")),
                             base="nf4" if method == "qlora" else "float", seed=args.seed)
    elif method != "full":
        add_lora(model, args.lora_rank, args.lora_alpha, tuple(args.targets.split(",")),
                 base="nf4" if method == "qlora" else "float", seed=args.seed)
    base = evaluate_loss(model, val) if method == "qlora" else before  # B = 0: the adapted model is its base
    params = trainable_parameters(model)
    ledger = get_ledger()
    frozen = ledger.current["parameters"] - sum(int(p.data.nbytes) for p in params)
    sync_comm = comm if topo is None else topo.dp_comm
    sync, opt = _optimizer(args, model, method, sync_comm, topo is not None)
    world, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
    dp_world, dp_rank = (world, rank) if topo is None else (topo.dp, topo.dp_rank)
    rows = slice(dp_rank * args.batch_size // dp_world, (dp_rank + 1) * args.batch_size // dp_world)
    fault = FaultInjector.from_environment(rank, params)  # MINIZERO_FAULT, as in the main job's loop
    manual_seed(args.seed * 1000)  # dropout: one generator everywhere, masks addressed by site and row (rng.py)
    if progress is not None:
        progress.start_clock()  # tok/s and ETA from the first step, as the main job's
    for step in range(args.steps):
        fault.on_step_start(None, step)
        x, y = global_batch(train_tok, step, args.batch_size, cfg.block_size, args.seed)
        with batch_rows(rows.start, args.batch_size):  # one process's masks for these rows
            _, loss = model(backend.to_device(x[rows]), backend.to_device(y[rows]))
        backward(loss)
        reserve(1)  # the next step's masks
        if sync is not None:
            sync.reduce_gradients()
        norm_sq = None if topo is None else sync.grad_norm_sq(counts_in_norm(topo.tp_comm), topo.tp_comm, comm)
        if args.zero:
            opt.clip_grad_norm_(1.0, norm_sq)
        else:
            clip_grad_norm_(params, 1.0, norm_sq)
        opt.step()
        opt.zero_grad()
        if progress is not None:  # the step's loss, the mean over the data ranks (one all-reduce of a float)
            mean = backend.to_host(loss.data).reshape(1) / dp_world
            progress.step(step, float(mean[0] if dp_world == 1 else all_reduce(sync_comm, mean)[0]), args.lr)
        Interrupts.check()  # a Ctrl-C dropped in a weakref callback (the ledger's releases) stops here
    whole = [p.size * (1 if topo is None or is_tensor_parallel_duplicate(p) else args.tp) for p in params]
    row = {"method": method, "zero": args.zero, "trainable_parameters": int(sum(whole)),  # the model's, not a shard's
           "num_parameters": n_params, "frozen_bytes": int(frozen),
           "trainable_bytes": int(ledger.current["parameters"] - frozen),  # this rank's (a ZeRO-3 shard)
           "optimizer_bytes": int(ledger.peak["optimizer_state"]), "ledger_peak_bytes": int(ledger.peak_total),
           "grad_sync_bytes_per_step": 0.0 if sync is None else float(sync.bytes_per_step(args.steps)),
           "val_before": before, "val_base": base, "val_after": evaluate_loss(model, val)}
    with sync.full_parameters() if sync is not None else contextlib.nullcontext():
        merged = merged_state_dict(model)
        if topo is not None:
            merged = gather_merged(merged, model, topo.tp_comm)
    return row, model, merged


def _world(zero: int, timeout: float):
    """The MPI communicator when launched on several ranks or under ZeRO, else None (one process, no MPI needed)."""
    from mpi4py import MPI
    from minizero.comm import MPICommunicator
    return MPICommunicator(MPI.COMM_WORLD, timeout=timeout) if MPI.COMM_WORLD.Get_size() > 1 or zero else None


def main(argv=None) -> int:
    """Entry point; returns the exit status: 0, 2 bad arguments or an output in use by another job (every rank,
    before any work), 1 a rank failed (every rank ended). Set-up is bounded as the main job's
    (:func:`~minizero.interrupts.guard_set_up`): a stalled rank ends the job after --comm-timeout, a signal ends it."""
    guard_set_up(argv, DEFAULT_TIMEOUT_S, MIN_COMM_TIMEOUT_S, "minizero.finetune")
    try:
        from mpi4py import MPI

        with every_rank_ends("minizero.finetune", WHOLE, MPI.COMM_WORLD):  # one rank failing ends them all
            return _main(argv, MPI.COMM_WORLD)
    finally:
        end_set_up(install=False)  # a refusal before set-up's end: the timer goes too


def _lock(args, world) -> tuple[list, str | None]:
    """Rank 0 locks --out (:class:`FolderLock`) and a regular --json file (``.NAME.lock`` beside it) for the run and
    broadcasts the verdict (collective): two jobs writing one output would mix or replace each other's files."""
    locks, refusal = [], None
    if world.Get_rank() == 0:
        wanted = [] if args.out is None else [("--out", FolderLock(args.out))]
        if args.json and streams.lockable(args.json):  # not /dev/null nor /dev/stdout
            wanted.append(("--json", FolderLock.for_file(args.json)))
        locks, refusal = lock_outputs(wanted)
    return locks, world.bcast(refusal, root=0) if world.Get_size() > 1 else refusal


def _main(argv, world) -> int:
    prog = "python -m minizero.finetune"
    args, verdict, env, inputs = None, None, {}, {}
    try:  # every check on every rank, then one verdict for all: no rank waits for one that stopped
        args = build_parser(quiet=world.Get_rank() != 0).parse_args(argv)  # --help, a bad flag: once, by rank 0
        check(args)
        check_fault_spec(world.Get_size(), args.steps)
        spec = os.environ.get("MINIZERO_FAULT") or "::raise"  # parsed above; fine-tunes call on_step_start only
        if spec.rpartition(":")[2] not in STEP_START_KINDS:
            raise ValueError(f"MINIZERO_FAULT={spec!r} never fires in a fine-tune; allowed KIND: "
                             f"{', '.join(STEP_START_KINDS)}")
        if args.tp > 1 and (side := read_sidecar(args.weights)):  # model.json: the model's rules before the launch's
            check_model_sizes(args.tp, None, n_head=side.get("n_head"), n_embd=side.get("n_embd"))
        if world.Get_size() % args.tp:
            raise ValueError(f"--tp {args.tp} must divide the {world.Get_size()} ranks" + launch(args.tp, "finetune"))
        dp = world.Get_size() // args.tp
        if args.batch_size % dp:
            raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {dp} data-parallel ranks")
        tokens = load_tokens(args.data)
        model0, _ = load_trained(args.weights)
        need = min_data_bytes(model0.config.block_size)
        if len(tokens) < need:
            raise ValueError(f"--data {args.data!r} has {len(tokens):,} bytes; needs at least {need:,} (its last 10% "
                             f"validates and must hold block_size + 2 = {model0.config.block_size + 2} tokens)")
        if (args.table or args.method != "full") and args.lora_rank > model0.config.n_embd:
            raise ValueError(f"--lora-rank {args.lora_rank} is above the model's width {model0.config.n_embd}, "
                             f"min(in, out) of every adapted Linear; allowed: 1..{model0.config.n_embd}")
        check_tensor_parallel(model0.config, args.tp, world.Get_size(), args.method, args.targets.split(","))
        env = job_environment()  # the MINIZERO_ settings the ranks must share (the all-reduce size rule)
        inputs = dict(data_digest(args.data), **{f"--weights {args.weights!r}": content_digest(args.weights)})
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2), its message printed by this rank
        verdict = e.code if isinstance(e.code, int) else 2
    except (FileNotFoundError, ValueError) as e:
        verdict = str(e)
    except Exception as e:  # a bug: its rank shows where, every rank stops
        traceback.print_exc()
        verdict = f"{type(e).__name__}: {e}"
    verdicts = [verdict]
    if world.Get_size() > 1:  # one rank refusing, or the ranks started with different flags, end them all
        verdicts, flags, every_inputs = zip(*world.allgather((verdict, None if args is None else (vars(args), {}, env),
                                                               inputs)))
        if all(v is None for v in verdicts) and (flags_refusal(flags) or inputs_refusal(every_inputs)):
            verdicts = [flags_refusal(flags) or inputs_refusal(every_inputs)]
    rank = world.Get_rank()
    said = [(r, v) for r, v in enumerate(verdicts) if isinstance(v, str)]
    if said:
        if rank == 0:
            r, v = said[0]
            print(error_lines(prog, v if r == 0 else f"[rank {r}] {v}"), file=sys.stderr)
        return 2
    if any(v is not None for v in verdicts):  # argparse's exits: --help everywhere is 0, else 2
        return 0 if all(v == 0 for v in verdicts) else 2
    locks, refusal = _lock(args, world)
    if refusal:
        if rank == 0:
            print(error_lines(prog, refusal), file=sys.stderr)
        return 2
    try:
        return _run(args, world, tokens, model0)
    finally:
        release_all(locks)


def _run(args, world, tokens, model0) -> int:
    """Fine-tune (every rank) and write the outputs (rank 0): :func:`main` after its checks and locks."""
    prog, rank = "python -m minizero.finetune", world.Get_rank()
    comm = _world(args.zero, args.comm_timeout)
    end_set_up()  # set-up is over: the communicator's timeouts bound every wait, signals unwind
    try:
        rows, state = [], None
        said = header(args, model0.config, model0.num_parameters(), world.Get_size()) if rank == 0 else []
        if said:  # the validation passes before the first step take a while
            print("\n".join(said), flush=True)
        with np.errstate(over="ignore", invalid="ignore"):  # a diverging run: the one-line NaN diagnosis below
            for method in (METHODS if args.table else (args.method,)):
                shown = Progress(args.progress if rank == 0 else "none", args.steps,
                                 args.batch_size * model0.config.block_size)
                if args.table and shown.mode != "none":
                    print(f"--method {method}", flush=True)  # the table's runs one after another
                row, _, state = finetune(args, method, tokens, comm, progress=shown)
                shown.close()
                rows.append(row)
    except (FileNotFoundError, ValueError) as e:  # the same on every rank: the checks ran before any message
        if world.Get_size() > 1:  # unless it is not: every_rank_ends names the rank and ends the job
            raise
        if rank == 0:
            print(error_lines(prog, str(e)), file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    print("\n".join([format_table(rows)] + rose_note(rows, args.lr, args.steps)))
    bad = sorted(k for k, v in (state or {}).items() if v.dtype.kind == "f" and not np.isfinite(v).all())
    if args.out is not None and bad:  # diverged (a huge --lr or --lora-alpha): nothing written
        said = f"({bad[0]}{', ...' if len(bad) > 1 else ''}): the run diverged; {args.out!r} is not written"
        print(error_lines(prog, f"the fine-tuned weights hold NaN or inf {said} (lower --lr or --lora-alpha)"),
              file=sys.stderr)
        return 1
    try:  # a full disk or a device such as /dev/full: each file is written whole or not at all (atomic_write)
        if args.out is not None:
            os.makedirs(args.out, exist_ok=True)
            save_model(args.out, state, model0.config)
            method = rows[-1]["method"]  # --table: the last method of the table
            what = "every parameter trained" if method == "full" else "adapters merged"
            print(f"wrote {os.path.join(args.out, 'model.npz')} (--method {method}, {what}"
                  f"{'; --table writes its last method' if args.table else ''}) and {SIDECAR}")
        if args.json:
            atomic_write(args.json, lambda f: f.write(json.dumps(jsons.summary({"rows": rows}), indent=1)), mode="w")
    except BrokenPipeError:
        raise
    except OSError as e:
        print(error_lines(prog, str(e.strerror if isinstance(e, WriteError) else e)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(interruptible("minizero.finetune", WHOLE, main, guarded=True))
