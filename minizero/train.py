"""The main job: ``mpirun -n 8 python -m minizero.train`` trains a small GPT on real text.

Flags and checks: :mod:`minizero.args`; the loop: :mod:`minizero.loop`; the report: :mod:`minizero.report`. Writes
``OUT/model.npz`` (nanoGPT names) and a JSON summary. Bad arguments: one message and exit status 2 on every rank, before
any work. An exception on any rank prints ``[rank r]`` and its traceback and aborts the job (``MPI_Abort``); a wait past
``--comm-timeout`` does the same, naming the operation and peer. Rank 0 locks OUT (a second job on it exits 2).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc

import numpy as np

from minizero import backend
from minizero.args import (MIN_COMM_TIMEOUT_S, UsageError, build_parser, check_fault_spec,  # noqa: F401
                           check_steps_left, model_config, parse_args)
from minizero.data import data_digest
from minizero.flags import flags_refusal, inputs_refusal, job_environment
from minizero.checkpoint import CheckpointError, checkpoint_digest
from minizero.comm import CommTimeoutError, MPICommunicator
from minizero.comm.base import DEFAULT_TIMEOUT_S
from minizero.comm.flight import CollectiveMismatchError, FlightRecorder, check_collectives, run_id
from minizero.debug.anomaly import AnomalyError
from minizero.debug.replicas import ReplicaMismatchError
from minizero.comm.nodes import NodeTrafficCommunicator
from minizero.files import FolderLock, WriteError, lock_outputs, release_all
from minizero.instrumentation import Interrupts
from minizero.interrupts import (Terminated, end_set_up, guard_set_up, stdout_reader_gone, stdout_unwritable,
                                 watch_stdout)
from minizero.launcher import launched_rank, launcher_connected, launcher_mismatch
from minizero.ledger import get_ledger
from minizero.loop import TrainingDiverged, train
from minizero.memory.offload import OffloadError, ram_backed
from minizero.memory.monitor import gather_module_peaks, gather_timeline
from minizero.memory.precision import LossScaleError
from minizero.numerals import error_lines, is_count, wrapped
from minizero.output_checks import clear_flight, earlier_results, not_a_folder, still_earlier
from minizero.streams import lockable
from minizero.zero import gather_figures
from minizero.report import gather_stats, report

#: errors that are a diagnosis, not a bug: one line, no traceback
DIAGNOSES = (TrainingDiverged, LossScaleError, WriteError, OffloadError, CommTimeoutError, CheckpointError,
             CollectiveMismatchError, ReplicaMismatchError, AnomalyError)
MEMORY_HINT = "lower --micro-batch-size, or use --recompute, --zero, --offload-activations or more ranks"
_ABORT_GRACE_S = 0.5  # after writing its message a failing rank waits this long, so a peer's message lands too
_FORWARD_S = 0.2  # an interrupted rank 0's wait between its line and MPI_Abort (< the others' 1 s)


def use_tracemalloc(args) -> bool:
    """True when ``--tracemalloc`` was asked for and ``--no-tracemalloc`` was not (off by default)."""
    return bool(args.tracemalloc) and not args.no_tracemalloc


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``getrusage`` ru_maxrss: KiB on Linux, bytes on macOS): the
    whole process's lifetime high-water mark (interpreter, libraries, set-up and training), counted by the kernel."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)

def _cores() -> int:
    return backend.usable_cores()


#: the variables a user sets to cap BLAS threads: the first one set is honoured as an upper bound (when it is
#: a positive integer; OpenMP's list form "4,2" and other values leave cores / ranks)
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _blas_threads(local_ranks: int) -> int:
    """BLAS threads per rank: cores / ranks on this node, at least 1 (more would oversubscribe the cores), and
    no more than a positive integer the user set in :data:`BLAS_THREAD_VARIABLES` (the first one set)."""
    threads = max(1, _cores() // max(1, local_ranks))
    for name in BLAS_THREAD_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return min(threads, int(value)) if is_count(value) and int(value) > 0 else threads
    return threads


def _start_flight(comm, args, run: str) -> None:
    """This rank's flight recorder as --flight-records and --debug-collectives ask, its records named ``run``;
    SIGUSR1 dumps it."""
    comm.traffic.recorder = FlightRecorder(args.flight_records, run) if args.flight_records else None
    if args.debug_collectives:
        check_collectives(comm)
    if comm.traffic.recorder is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _dump_flight(comm, args, "SIGUSR1"))


def _dump_flight(comm, args, reason: str) -> str | None:
    """This rank's flight record into OUT/flight/rank_R.json (``python -m minizero.debug hang OUT/flight``); not
    with --no-save. Returns the folder, or None."""
    recorder = comm.traffic.active_recorder()
    if recorder is not None and not args.no_save:
        folder = os.path.join(args.out, "flight")
        try:
            why = not_a_folder(folder)  # made after the checks: said in words, not as errno 17
            if why is None:
                return os.path.dirname(recorder.dump(folder, comm.rank, comm.world_size, reason))
            why += ": flight records not written"
        except Exception as e:  # a full disk, or a record that does not serialize: the abort must still come
            why = f"flight record not written: {e}"
        _write_stderr(wrapped(f"[rank {comm.rank}] {why}") + "\n")
    return None


def _write_stderr(text: str) -> None:
    """Write ``text`` to stderr as one ``write`` (one chunk through mpiexec's forwarding, not interleaved)."""
    sys.stderr.flush()
    data = text.encode("utf-8", "replace")
    while data:
        data = data[os.write(2, data):]


def _lock_output(args, comm, mpi_world):
    """Rank 0 locks OUT and, when it saves checkpoints, --save-dir (:class:`FolderLock` each; OUT/checkpoints too),
    and a --json or --trace file outside OUT (:meth:`FolderLock.for_file`), then broadcasts the verdict
    (collective): two jobs on one folder would delete each other's files, on one file replace each other's.
    Then it removes the previous run's flight records from OUT/flight (this run's replace them, as its other outputs
    do), or refuses a file there that minizero did not write (:func:`~minizero.output_checks.clear_flight`), and
    names the run (:func:`~minizero.comm.flight.run_id`, in the same broadcast).
    Returns (the locks held on rank 0, the refusal message every rank shares or None, the run id)."""
    locks, refusal, run = [], None, None
    if comm.rank == 0:
        out = os.path.realpath(args.out)
        wanted = [] if args.no_save else [("--out", FolderLock(args.out))]
        save = os.path.realpath(args.save_dir) if args.save_every and args.save_dir else None
        if save and (args.no_save or save != out):  # inside OUT too: --out o2 --save-dir o/ck
            wanted.append(("--save-dir", FolderLock(args.save_dir)))
        for flag, path in (("--json", args.json), ("--trace", args.trace)):
            if path and (args.no_save or os.path.dirname(os.path.realpath(path)) != out) and lockable(path):
                wanted.append((flag, FolderLock.for_file(path)))
        locks, refusal = lock_outputs(wanted)
        if refusal is None and not args.no_save:  # OUT is this job's now: no second job is in it
            refusal = clear_flight(args)
            if refusal:  # refused before any work, as a lock would be
                release_all(locks)
                locks = []
        run = run_id()
    return locks, *mpi_world.bcast((refusal, run), root=0)


def _parse_everywhere(argv, comm, mpi_world):
    """Every rank parses and checks ``argv`` (:func:`parse_args`), then the ranks compare verdicts (collective).

    Returns ``(args, None, None)`` when every rank accepted, else ``(None, exit status, message or None)``: status 2
    and the first refusing rank's message (an unexpected exception counts, its traceback printed by its rank), or
    ``--help``'s status 0 when every rank printed (rank 0) or skipped the help.
    """
    args, verdict, inputs = None, None, None
    try:
        args = parse_args(argv, comm.world_size, quiet=comm.rank != 0)
        check_fault_spec(comm.world_size, args.steps, args.save_every, start=check_steps_left(args))
        inputs = data_digest(args.data)  # what this rank read under --data's name (each node has its own disk)
        inputs.update(checkpoint_digest(args.resume) if args.resume else {})  # and found under --resume's
    except (UsageError, CheckpointError) as e:  # CheckpointError: --resume's changed since check_steps_left read it
        verdict = str(e)
    except SystemExit as e:  # --help
        verdict = e.code or 0
    except Exception as e:  # a bug: its rank shows where, every rank stops
        _write_stderr(f"[rank {comm.rank}] " + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        verdict = f"{type(e).__name__}: {e}"
    flags = None if verdict is not None else (vars(build_parser().parse_args(argv)), dataclasses.asdict(args),
                                              job_environment())
    verdicts, every_flags, every_inputs = zip(*mpi_world.allgather((verdict, flags, inputs)))
    if all(v is None for v in verdicts):
        refusal = flags_refusal(every_flags) or inputs_refusal(every_inputs)
        return (None, 2, refusal) if refusal else (args, None, None)
    if all(isinstance(v, int) for v in verdicts):
        return None, verdicts[0], None
    bad = [r for r, v in enumerate(verdicts) if isinstance(v, str)]
    if bad:
        return None, 2, verdicts[0] if bad[0] == 0 else f"[rank {bad[0]}] {verdicts[bad[0]]}"
    helped = [r for r, v in enumerate(verdicts) if v is not None]
    return None, 2, f"--help was given to rank(s) {helped} only; give every rank the same arguments"


def failure_text(e: BaseException, rank: int, mpi_exception=()) -> str:
    """What rank ``rank`` prints for the exception that ends its run: one line for a diagnosis (:data:`DIAGNOSES`),
    for running out of memory and for an MPI library error (a survivor whose peer died: MPICH's error stack is dozens
    of lines, the launcher's report names the dead rank), a traceback for anything else (a bug)."""
    if isinstance(e, DIAGNOSES):  # a diagnosis, not a bug: no traceback
        verb = "stopped" if isinstance(e, (TrainingDiverged, LossScaleError)) else "failed"
        text = str(e.strerror if isinstance(e, OSError) and e.strerror else e)
        if isinstance(e, CommTimeoutError):  # the technique says "the communicator's timeout": name the flag
            text = text.replace("the communicator's timeout", "--comm-timeout")
        return f"[rank {rank}] minizero.train {verb}: {text}\n"
    if isinstance(e, MemoryError):  # this machine's limit, not a bug: NumPy's text names the array
        return f"[rank {rank}] minizero.train failed: out of memory ({str(e) or 'MemoryError'}); {MEMORY_HINT}\n"
    if mpi_exception and isinstance(e, mpi_exception):
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (f"[rank {rank}] minizero.train failed: the MPI library reported an error, most likely a peer rank "
                f"died (see the launcher's report): {first}\n")
    return (f"[rank {rank}] minizero.train failed: {type(e).__name__}: {e}\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))


def _earlier_note(earlier: dict) -> str:
    """``; out/model.npz, ... are an earlier run's`` for the result files a failed run left as they were (rank 0)."""
    stale = still_earlier(earlier)
    verb = "is" if len(stale) == 1 else "are"
    return f"; {', '.join(stale)} {verb} an earlier run's, not this one's" if stale else ""


def _select_device(args, comm, mpi_world) -> str | None:
    """Every rank selects ``--device`` (:func:`minizero.backend.set_device`); collective.

    The GPU of a rank is its rank on its node (the communicator's ``MPI_COMM_TYPE_SHARED`` split, right under any
    launcher) modulo the GPUs it sees. Returns None, or the first failing rank's message on every rank (CuPy missing, no
    GPU; ``--comm nccl`` with a CuPy that has no NCCL, or with more ranks on a node than GPUs: NCCL takes one GPU per
    rank), so that the whole job stops before any work.
    """
    from minizero.comm import nccl  # noqa: PLC0415  (imports without CuPy; CuPy's NCCL is looked for below)

    try:
        backend.set_device(args.device, comm.nodes.local_rank(comm.rank))
        error = None
        if args.comm == "nccl":
            gpus, here = nccl.import_nccl()[1].runtime.getDeviceCount(), comm.nodes.local_size(comm.rank)
            if here > gpus:
                error = (f"--comm nccl takes one GPU per rank: {here} ranks on this node, {gpus} GPU(s) visible; "
                         "use --comm mpi (device arrays staged through the host) or fewer ranks per node")
    except (backend.DeviceError, ImportError) as e:
        error = str(e)
    errors = mpi_world.allgather(error)
    bad = [r for r, e in enumerate(errors) if e]
    return f"[rank {bad[0]}] {errors[bad[0]]}" if bad else None


def _warn_ram_offload(args) -> None:
    if "nvme" in (args.offload_activations, args.offload_optimizer):
        d = args.offload_dir or tempfile.gettempdir()
        fs = ram_backed(d)
        if fs:
            print(wrapped(f"warning: --offload-dir {d!r} is on {fs}, a file system in RAM: the offloaded bytes stay "
                          "in memory (they only leave the ledger); give a folder on a disk"), file=sys.stderr)


def nccl_world(comm: NodeTrafficCommunicator, timeout: float) -> NodeTrafficCommunicator:
    """``comm``'s ranks over NCCL (``--comm nccl``): each rank takes GPU local rank % GPUs, then an
    :class:`~minizero.comm.nccl.NcclCommunicator` set up through ``comm``'s MPI, with its node layout.

    Collective. Raises: ImportError without CuPy/NCCL; RuntimeError without a visible GPU.
    """
    from minizero.comm.nccl import NcclCommunicator, use_local_device  # noqa: PLC0415  (CuPy on demand)

    use_local_device(comm.nodes.local_rank(comm.rank))
    return NodeTrafficCommunicator(NcclCommunicator(comm.inner, timeout=timeout), nodes=comm.nodes)


def main(argv=None) -> int:
    """Entry point of ``python -m minizero.train``; returns the exit status.

    0 success; 2 bad arguments or --out in use by another job (every rank, before any work); 1 a rank failed (its
    message, then ``MPI_Abort`` of the whole job); 130/143 Ctrl-C/SIGTERM (one ``interrupted`` line for the job;
    before set-up ends, the signal's default action, SIGTERM's for SIGINT on one of several MPICH ranks: mpiexec's
    status, no line).
    Mirrors ``torchrun``'s contract: a failing or stalled rank (``--comm-timeout``) ends the whole job.
    """
    guard_set_up(argv, DEFAULT_TIMEOUT_S, MIN_COMM_TIMEOUT_S, "minizero.train")  # a stalled, signalled rank ends all
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    mismatch = launcher_mismatch(MPI.COMM_WORLD.Get_size(), " ".join(MPI.Get_library_version().split("\n")[0].split()))
    if mismatch:  # PMI_SIZE=4 without mpiexec, or another MPI's: each process trained alone, as rank 0 of 1
        if launched_rank() == 0 or not launcher_connected():
            print(error_lines("python -m minizero.train", mismatch), file=sys.stderr, flush=True)
        end_set_up(install=False)
        return 2
    comm = NodeTrafficCommunicator(MPICommunicator(MPI.COMM_WORLD))  # knows each rank's node (collective)
    rank = comm.rank
    args, code, refusal = _parse_everywhere(argv, comm, MPI.COMM_WORLD)
    if code is not None:
        if rank == 0 and refusal:
            # a damaged manifest: one line per problem; a long one goes on over indented lines of <= 120 columns
            print(error_lines("python -m minizero.train", refusal), file=sys.stderr, flush=True)
        end_set_up(install=False)
        return code
    refusal = _select_device(args, comm, MPI.COMM_WORLD)
    if refusal:
        if rank == 0:
            print(error_lines("python -m minizero.train", refusal), file=sys.stderr, flush=True)
        end_set_up(install=False)
        return 2
    comm.inner.timeout = args.comm_timeout  # the MPI communicator under the node-aware wrapper
    if not args.default_malloc:
        backend.keep_freed_memory()  # temporaries reuse freed memory instead of faulting in fresh pages
    locks, refusal, run = _lock_output(args, comm, MPI.COMM_WORLD)
    earlier = earlier_results(args) if rank == 0 and not refusal else {}  # a failed run names what it did not replace
    end_set_up(install=not refusal)  # from here SIGINT and SIGTERM unwind through the except below
    if refusal:
        if rank == 0:
            print(error_lines("python -m minizero.train", refusal), file=sys.stderr, flush=True)
        return 2
    try:
        if rank == 0:
            _warn_ram_offload(args)
        if args.comm == "nccl":  # the same ranks and node layout, messages over NCCL (set up through MPI)
            comm = nccl_world(comm, args.comm_timeout)
        _start_flight(comm, args, run)
        local_ranks = comm.nodes.local_size(rank)  # ranks on this rank's node (MPI_COMM_TYPE_SHARED)
        threads = _blas_threads(local_ranks)
        threadpool_limits(limits=threads)
        if use_tracemalloc(args):
            tracemalloc.start()
        with np.errstate(over="ignore", invalid="ignore"):  # a diverging run: the loop's own one-line diagnosis
            result = train(args, comm, log=lambda s: print(s, flush=True))
        Interrupts.check()  # dropped in the final evaluation or the traffic table: not a finished run
        process_peak = (result.train_process_peak or tracemalloc.get_traced_memory()[1]
                        if tracemalloc.is_tracing() else peak_rss_bytes())
        strategy, opt = result.strategy, result.opt
        per_step = strategy.model_state_bytes_per_step(max(1, args.steps - result.start_step))  # this job's steps
        stats = gather_stats(comm, process_peak, strategy.traffic_by_kind())
        # optimizer state in files (--offload-optimizer nvme): in no ledger category
        store = getattr(opt, "store", None)
        zero = gather_figures(comm, dict(result.state_bytes, gathered_peak=get_ledger().peak["gathered"],
                                         bytes_sent_per_step=per_step,
                                         optimizer_disk_bytes=getattr(store, "disk_bytes", 0)))
        result.setup_peaks = gather_figures(comm, result.setup_peak)  # every rank's set-up peaks
        result.memory_timeline = gather_timeline(comm, result.memory_monitor.timeline)
        result.module_peaks = gather_module_peaks(comm)  # activation peak bytes per module, per rank
        pool_peak = result.memory_monitor.device_pool_peak  # CuPy's pool high-water, or None on the CPU
        result.device_pool = None if pool_peak is None else gather_figures(comm, pool_peak)
        # ZeRO-3: gather for saving and sampling; a gathered copy (tp, pp, expert groups) was gathered in train()
        local = strategy.model is not None and strategy.ep_comm is None
        with strategy.full_parameters() if local else contextlib.nullcontext():
            if rank == 0:
                report(args, result, stats, threads, local_ranks, _cores(), zero)
    except BaseException as e:  # any rank: show the cause, then take the whole job down
        if isinstance(e, SystemExit) and not e.code:
            raise
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not cut this short: no abort, peers wait
            signal.signal(sig, signal.SIG_IGN)
        flight = _dump_flight(comm, args, {KeyboardInterrupt: "SIGINT", Terminated: "SIGTERM"}.get(
            type(e), f"{type(e).__name__}: {e}"[:300]))
        release_all(locks)
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            code, name = (143, "SIGTERM") if isinstance(e, Terminated) else (130, "SIGINT")
            if rank != 0:  # every rank got the signal from mpiexec: rank 0 speaks for the job
                time.sleep(2 * _ABORT_GRACE_S)
            _write_stderr(wrapped(f"{'' if rank == 0 else f'[rank {rank}] '}minizero.train: interrupted ({name}); "
                                  f"files already written are left as they were{_earlier_note(earlier)}") + "\n")
            if comm.world_size > 1:  # one process has no peer to stop (MPICH would add an "Abort(130)" line)
                time.sleep(_FORWARD_S)  # MPI_Abort at once: mpiexec killed all before forwarding the line (1 in 50)
                comm.abort(code)
            return code
        if stdout_reader_gone(e):  # | head -2: the Unix way, no traceback, 141 = 128 + SIGPIPE; the abort ends every
            # rank now. One line, as the run ended early (the tools, whose product is their output, end quietly, 0)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the exit's flush of stdout goes nowhere, quietly
            _write_stderr(wrapped(f"[rank {rank}] minizero.train stopped: standard output's reader went away (broken "
                                  "pipe); files already written are left as they were") + "\n")
            if comm.world_size > 1:
                comm.abort(141)
            return 141
        full = stdout_unwritable(e)  # > /dev/full: print's OSError is no bug
        text = (f"[rank {rank}] minizero.train failed: cannot write standard output ({e.strerror or e}); "
                "files already written are left as they were\n" if full else failure_text(e, rank, MPI.Exception))
        if flight and isinstance(e, (CommTimeoutError, CollectiveMismatchError)):  # every rank's record says who
            text = text.rstrip("\n") + f" (who hung where: python -m minizero.debug hang {flight})\n"
        said, _, where = text.partition("\n")  # the diagnosis over lines of <= 120 columns; a bug's traceback as is
        said += _earlier_note(earlier)
        _write_stderr(wrapped(said) + "\n" + where)
        if comm.world_size > 1:
            time.sleep(_ABORT_GRACE_S)
            comm.abort(1)
        return 1
    release_all(locks)
    return 0


if __name__ == "__main__":
    watch_stdout("minizero.train")
    sys.exit(main())
