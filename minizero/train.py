"""The main job: ``mpirun -n 8 python -m minizero.train`` trains a small GPT on real text.

With no flags it trains the ``default`` model (4 layers, width 128, context 128,
byte-level vocabulary) data-parallel over every rank on the Python language reference
that ships with CPython, and finishes in a few minutes on a 2-core laptop. Rank 0 shows
progress (a bar on a terminal, log lines under ``mpirun``), then prints the validation
loss, the memory summary of every rank, and a generated sample; it writes the weights
(``OUT/model.npz``, nanoGPT state_dict names) and a JSON summary.

This file is the command line and ``main``: the flags and their checks are in
:mod:`minizero.args`, the one training loop in :mod:`minizero.loop` (strategies from
:mod:`minizero.parallel.strategy`), the final report in :mod:`minizero.report`.

Every argument is checked before any work, identically on every rank, so a bad value
gives one clear message and exit status 2 instead of a hang. An exception on any rank
prints ``[rank r]`` and its traceback, then aborts the whole MPI job (``MPI_Abort``), so
no rank waits forever for a dead peer.
"""
from __future__ import annotations

import os
import sys
import traceback
import tracemalloc

from minizero.args import UsageError, build_parser, model_config, parse_args  # noqa: F401 (the public API)
from minizero.comm import MPICommunicator
from minizero.ledger import get_ledger
from minizero.loop import TrainingDiverged, check_finite_norm, train  # noqa: F401 (the public API)
from minizero.memory.monitor import gather_module_peaks, gather_timeline
from minizero.memory.precision import LossScaleError
from minizero.memory.zero import gather_figures
from minizero.report import gather_stats, printable, report  # noqa: F401 (the public API)


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
        strategy, opt = result["strategy"], result["opt"]
        per_step = strategy.model_state_bytes_per_step(args.steps)
        stats = gather_stats(comm, process_peak, per_step * args.steps)
        store = getattr(opt, "store", None)  # optimizer state in files (--offload-optimizer nvme): in no ledger category
        zero = gather_figures(comm, dict(result["state_bytes"], gathered_peak=get_ledger().peak["gathered"],
                                         bytes_sent_per_step=per_step,
                                         optimizer_disk_bytes=getattr(store, "disk_bytes", 0)))
        result["setup_peaks"] = gather_figures(comm, result["setup_peak"])  # every rank's set-up peaks
        result["memory_timeline"] = gather_timeline(comm, result["memory_monitor"].timeline)
        result["module_peaks"] = gather_module_peaks(comm)  # activation peak bytes per module, per rank
        with strategy.full_parameters():  # ZeRO-3: gather for saving and sampling
            if rank == 0:
                report(args, result, stats, threads, local_ranks, _cores(), zero)
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


if __name__ == "__main__":
    sys.exit(main())
