"""What a small all_reduce costs, layer by layer, beside MPICH's blocking ``MPI_Allreduce`` (one run).

    python bench/profile_collective.py --launch 2        # runs itself under mpiexec -n 2
    mpiexec -n 4 python bench/profile_collective.py      # or launched directly (N a power of two)

Each row times one float32 array size (microseconds per call, median of timed runs, slowest rank), each
column one layer more of minizero's path, from the bare exchange up to the call the main job makes:

    MPI         MPICH's blocking ``MPI_Allreduce`` through mpi4py (the anchor)
    p2p         the exchanges recursive doubling makes, as bare mpi4py ``Sendrecv`` calls and a NumPy add:
                for small arrays, what any all_reduce written in Python over point-to-point messages costs at least
    message     the same log2 N exchanges as minizero's checked messages (``comm.sendrecv``: the 64-byte header
                staged with the payload, the receiver's header check, ``MPI_Test`` polls, the traffic count),
                each followed by the same NumPy add
    algorithm   ``recursive_doubling_all_reduce_`` on preallocated buffers: log2 N messages and adds
    all_reduce  ``minizero.comm.all_reduce(comm, x, out=out)`` as shipped: adds the argument checks, the traffic
                and flight-recorder entry, and the scratch buffer counted in the memory ledger

The differences between neighbouring columns are what each layer costs; the last column is
all_reduce's speed as a fraction of MPI's (MPI's time / all_reduce's; issue 33's goal below 1 MiB is 0.5).
"""
import argparse
import os
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _args  # noqa: E402
import _machine  # noqa: E402
from minizero.numerals import integer  # noqa: E402

LAYERS = ("MPI", "p2p", "message", "algorithm", "all_reduce")


def layers(comm, x):
    """{layer: callable} for the float32 (n,) ``x`` on ``comm`` (an MPICommunicator of a power-of-two size)."""
    from mpi4py import MPI

    from minizero.comm import all_reduce
    from minizero.comm.recursive_doubling import recursive_doubling_all_reduce_

    from bench_allreduce import bare_recursive_doubling

    mpi, rank, n = comm.mpi_comm, comm.rank, comm.world_size
    out, tmp = np.empty_like(x), np.empty_like(x)

    def message():  # p2p's exchanges and adds, through minizero's checked sendrecv
        out[...] = x
        mask = 1
        while mask < n:
            comm.sendrecv(out, rank ^ mask, tmp, rank ^ mask, tag=1)
            np.add(out, tmp, out=out)
            mask <<= 1
        return out

    return {"MPI": lambda: (mpi.Allreduce(x, out, op=MPI.SUM), out)[1],
            "p2p": bare_recursive_doubling(mpi, x),
            "message": message,
            "algorithm": lambda: (recursive_doubling_all_reduce_(comm, out, tmp, src=x), out)[1],
            "all_reduce": lambda: all_reduce(comm, x, out=out)}


def measure(sizes, runs, warmup):
    """Under mpiexec: {nbytes: {layer: median seconds}} (each run's time is its slowest rank's)."""
    from mpi4py import MPI

    from minizero.comm import world

    comm = world()
    results = {}
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        calls = layers(comm, x)
        reference = calls["MPI"]().copy()
        for name in ("p2p", "message", "algorithm", "all_reduce"):  # each computes the same sum (to rounding)
            if not np.allclose(calls[name](), reference, rtol=1e-5, atol=1e-5 * comm.world_size):
                raise AssertionError(f"{name} differs from MPI_Allreduce at {nbytes} bytes")
        times = {}
        for name in LAYERS:  # one layer at a time: a few thousand back-to-back calls, as a training step makes
            run = calls[name]
            for _ in range(warmup):
                run()
            t = np.empty(runs)
            for i in range(runs):
                comm.mpi_comm.Barrier()
                start = time.perf_counter()
                for _ in range(20):
                    run()
                t[i] = (time.perf_counter() - start) / 20
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            times[name] = float(np.median(t))
        results[nbytes] = times
    return comm, results


def table(results) -> str:
    head = "| size | " + " | ".join(f"{name}, us" for name in LAYERS) + " | all_reduce / MPI speed |"
    rows = [head, "|---:|" + "---:|" * (len(LAYERS) + 1)]
    for nbytes, t in results.items():
        cells = [f"{t[name] * 1e6:.1f}" for name in LAYERS] + [f"{t['MPI'] / t['all_reduce']:.2f}"]
        rows.append(f"| {nbytes // 1024} KiB | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def float32_sizes(text) -> list[int]:
    """``type=``: comma-separated array sizes in bytes, positive multiples of 4 (float32) up to the largest
    all_reduce still sends by recursive doubling."""
    from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES

    try:
        sizes = [integer(v) for v in str(text).split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(0 < s <= SMALL_ALLREDUCE_MAX_BYTES and s % 4 == 0 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: allowed: comma-separated sizes in bytes, positive multiples of 4 (float32) up to "
            f"{SMALL_ALLREDUCE_MAX_BYTES} (above it all_reduce runs the ring, not the recursive doubling profiled "
            "here), e.g. 4096,16384")
    return sizes


def launch(n: int, sizes, runs: int, warmup: int) -> int:
    """Runs this script under ``mpiexec -n n`` with the same flags; its exit status."""
    from minizero.interrupts import run_group

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(n), sys.executable,
           os.path.abspath(__file__), "--sizes", ",".join(map(str, sizes)), "--runs", str(runs),
           "--warmup", str(warmup)]
    return run_group(cmd, env=env, timeout=600, capture_output=False).returncode  # SIGTERM: its ranks killed


def profile(sizes, runs: int, warmup: int) -> None:
    """Under mpiexec: measure every layer at each size; rank 0 prints the table."""
    from minizero.comm import world
    from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES

    malloc = _machine.set_malloc(False)  # as the main job
    n = world().world_size
    if n < 2 or n & (n - 1):
        raise SystemExit(f"profile_collective.py: run it on a power-of-two number of ranks >= 2, got {n}")
    comm, results = measure(sizes, runs, warmup)
    if comm.rank == 0:
        cores = _machine.cores()
        print(f"all_reduce layer by layer, N={n} | {_machine.header()} | {malloc} | "
              + ("one core per rank or more" if n <= cores else f"oversubscribed ({n} ranks, {cores} cores)"))
        print("microseconds per call, median of runs of 20 back-to-back calls, slowest rank; recursive doubling "
              f"(minizero's all_reduce up to {SMALL_ALLREDUCE_MAX_BYTES} bytes)\n")
        print(table(results))


def main():
    parser = _args.parser(__doc__)
    parser.add_argument("--launch", type=_args.world_size, metavar="N",
                        help="run this script under mpiexec -n N (a power of two)")
    parser.add_argument("--sizes", type=float32_sizes, default="4096,16384,65536",
                        help="comma-separated array sizes in bytes (multiples of 4)")
    parser.add_argument("--runs", type=_args.count, default=50, help="timed runs of 20 calls per layer and size")
    parser.add_argument("--warmup", type=_args.at_least(0), default=200, help="untimed calls per layer and size")
    args = parser.parse_args()
    _args.check_environment(parser)
    if args.launch is not None:
        if args.launch < 2 or args.launch & (args.launch - 1):
            parser.error(f"--launch {args.launch}: needs a power of two >= 2 (recursive doubling without a fold)")
        sys.exit(launch(args.launch, args.sizes, args.runs, args.warmup))
    from minizero.interrupts import start_mpi

    start_mpi()  # a stale launcher: one line, not MPICH's error stack; SIGTERM or time ends a stalled MPI_Init
    profile(args.sizes, args.runs, args.warmup)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
