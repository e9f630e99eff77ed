"""All-reduce bus bandwidth: minizero's hand-written all-reduce (ring, recursive doubling) vs MPI's Allreduce.

    mpiexec -n 4 python bench/bench_allreduce.py          # one world size, table of it
    python bench/bench_allreduce.py --launch 2,4,8        # runs itself under mpiexec per size

Prints a Markdown table of bus bandwidth in GB/s (GB = 1e9 bytes), as nccl-tests
defines it (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):

    algbw = S / t                    S = bytes of the array, t = time of one all-reduce
    busbw = algbw * 2(N-1)/N         the per-link rate; the ring's bytes per rank over t

Timing: float32 arrays, warm-up runs, then several timed runs, each preceded by a
barrier; a run's time is the slowest rank's; the table shows the median run.
Results are checked (ring == native) at every size before timing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing

GB = 1e9


def sizes(min_bytes, max_bytes):
    """Powers of 4 from ``min_bytes`` up to ``max_bytes``."""
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 4
    return out


def iterations(nbytes):
    """Timed runs per size: many for small arrays (noisy), few for large ones (slow)."""
    return int(np.clip(2**26 // nbytes, 5, 50))


def fmt_size(nbytes):
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


IMPLS = {"auto": None, "ring": -1, "rd": 2**62, "native": None}  #: name -> SMALL_ALLREDUCE_MAX_BYTES to force


def measure(min_bytes, max_bytes, warmup):
    """Under mpiexec: {nbytes: {impl: seconds}} (median slowest-rank time), impl in :data:`IMPLS`.

    ``auto`` is ``all_reduce`` as shipped (recursive doubling up to the measured threshold, then
    the ring); ``ring`` and ``rd`` force one algorithm; ``native`` is MPI_Allreduce. The four
    alternate run by run, each first in turn, so a noisy machine slows all of them alike.
    """
    from mpi4py import MPI

    from minizero.comm import all_reduce, recursive_doubling, world

    comm = world()
    N = comm.world_size
    shipped = recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES
    results = {}

    def run(impl, x, out):
        recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES = shipped if IMPLS[impl] is None else IMPLS[impl]
        all_reduce(comm, x, native=impl == "native", out=out)
        recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES = shipped

    for nbytes in sizes(min_bytes, max_bytes):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        native = all_reduce(comm, x, native=True)
        for impl in ("ring", "rd"):
            run(impl, x, out)
            if not np.allclose(out, native, rtol=1e-5, atol=1e-5 * N):
                raise AssertionError(f"{impl} all-reduce differs from MPI_Allreduce at {nbytes} bytes")
        for _ in range(warmup):
            for impl in IMPLS:
                run(impl, x, out)
        times = {impl: np.empty(iterations(nbytes)) for impl in IMPLS}
        names = list(IMPLS)
        for i in range(iterations(nbytes)):
            for impl in names[i % len(names):] + names[:i % len(names)]:  # each goes first in turn
                comm.barrier()
                start = time.perf_counter()
                run(impl, x, out)
                times[impl][i] = time.perf_counter() - start
        results[nbytes] = {}
        for impl, t in times.items():
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)  # a run ends when its slowest rank does
            results[nbytes][impl] = float(np.median(t))
    return N, results


def busbw(nbytes, seconds, world_size):
    return nbytes / seconds * 2 * (world_size - 1) / world_size / GB


def table(runs):
    """Markdown table from {world_size: {nbytes: {impl: s}}}: busbw per implementation, and auto / MPI."""
    world_sizes = sorted(runs)
    head = "| size | " + " | ".join(f"N={n} auto | N={n} ring | N={n} rec. doubling | N={n} MPI | N={n} auto/MPI"
                                     for n in world_sizes) + " |"
    rule = "|---:|" + "---:|---:|---:|---:|---:|" * len(world_sizes)
    rows = [head, rule]
    for nbytes in sorted(next(iter(runs.values()))):
        cells = []
        for n in world_sizes:
            t = runs[n][nbytes]
            cells += [f"{busbw(nbytes, t[impl], n):.3g}" for impl in ("auto", "ring", "rd", "native")]
            cells.append(f"{t['native'] / t['auto']:.2f}")
        rows.append(f"| {fmt_size(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _threshold():
    from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES

    return SMALL_ALLREDUCE_MAX_BYTES


def launch(world_sizes, args):
    """Driver: run this script under ``mpiexec -n N`` for each N; return {N: results}."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO_ROOT, env.get("PYTHONPATH")] if p)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in world_sizes:
            path = os.path.join(tmp, f"n{n}.json")
            cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--json", path,
                   "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
                   "--warmup", str(args.warmup), "--quiet"]
            print(f"running {' '.join(cmd[:3])} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, check=True, timeout=600)
            with open(path) as f:
                runs[n] = {int(k): v for k, v in json.load(f)["results"].items()}
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launch", metavar="N,N,...", help="driver mode: run under mpiexec at these world sizes")
    parser.add_argument("--min-bytes", type=int, default=4 * 2**10, help="smallest array (default 4 KiB)")
    parser.add_argument("--max-bytes", type=int, default=64 * 2**20, help="largest array (default 64 MiB)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per size and implementation")
    parser.add_argument("--json", metavar="PATH", help="also write the timings as JSON (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="do not print the table (driver mode uses --json)")
    args = parser.parse_args()

    if args.launch:
        runs = launch([int(n) for n in args.launch.split(",")], args)
    else:
        n, results = measure(args.min_bytes, args.max_bytes, args.warmup)
        from minizero.comm import world

        if world().rank != 0:
            return
        runs = {n: results}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "results": results}, f)
        if args.quiet:
            return
    print(f"All-reduce bus bandwidth, GB/s (float32, busbw = bytes/time * 2(N-1)/N, median of timed runs); "
          f"auto = minizero.comm.all_reduce as shipped (recursive doubling up to "
          f"{_threshold()} bytes, then the ring), ring / rec. doubling forced, MPI = MPI_Allreduce; "
          f"auto/MPI = MPI's time / auto's ({os.cpu_count()} CPU cores)\n")
    print(table(runs))


if __name__ == "__main__":
    main()
