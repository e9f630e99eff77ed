"""Bus bandwidth of minizero's hand-written collectives beside MPICH's blocking ones, in one run.

    mpiexec -n 4 python bench/bench_allreduce.py                 # all_reduce at one world size
    python bench/bench_allreduce.py --launch 2,4 --op all      # every op, under mpiexec per size

Prints a Markdown table of bus bandwidth in GB/s (GB = 1e9 bytes), as nccl-tests
defines it (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md), S = bytes of the whole array:

    all_reduce:                 busbw = S / t * 2(N-1)/N
    reduce_scatter, all_gather, all_to_all: busbw = S / t * (N-1)/N

The anchor is what an mpi4py user calls: the *blocking* ``MPI_Allreduce``,
``MPI_Reduce_scatter_block``, ``MPI_Allgather`` and ``MPI_Alltoall`` (``comm.mpi_comm.Allreduce`` ...), not
wrapped in minizero's waits. Timing: float32 arrays, warm-up runs, then timed runs, each preceded
by a barrier, the implementations alternating (each first in turn); a run's time is the slowest
rank's; the table shows the median. Results are checked against MPI's before timing.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402
import _args  # noqa: E402

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


IMPLS = {"auto": None, "ring": -1, "rd": 2**62}  #: all_reduce: name -> SMALL_ALLREDUCE_MAX_BYTES to force
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def implementations(op, comm, x):
    """{name: callable} for ``op`` on the float32 (n,) ``x``: minizero's, then ``"MPI"``, MPICH's blocking call."""
    from mpi4py import MPI

    from minizero.comm import all_gather, all_reduce, recursive_doubling, reduce_scatter

    mpi, N, n = comm.mpi_comm, comm.world_size, x.size
    if op == "all_reduce":
        out = np.empty_like(x)
        shipped = recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES

        def ours(threshold):
            def run():
                recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES = shipped if threshold is None else threshold
                try:
                    return all_reduce(comm, x, out=out)
                finally:
                    recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES = shipped
            return run

        impls = {name: ours(t) for name, t in IMPLS.items()}
        if N & (N - 1) == 0:  # a power of two: recursive doubling has no fold
            impls["p2p"] = bare_recursive_doubling(mpi, x)
        mpi_out = np.empty_like(x)
        impls["MPI"] = lambda: (mpi.Allreduce(x, mpi_out, op=MPI.SUM), mpi_out)[1]
    elif op == "reduce_scatter":
        mpi_out = np.empty(n // N, dtype=x.dtype)
        impls = {"ring": lambda: reduce_scatter(comm, x),
                 "MPI": lambda: (mpi.Reduce_scatter_block(x, mpi_out, op=MPI.SUM), mpi_out)[1]}
    elif op == "all_to_all":  # equal splits: n // N elements to each rank
        from minizero.comm.all_to_all import all_to_all
        mpi_out = np.empty_like(x)
        impls = {"pairwise": lambda: all_to_all(comm, x),
                 "MPI": lambda: (mpi.Alltoall(x, mpi_out), mpi_out)[1]}
    else:
        shard = np.ascontiguousarray(x[:n // N])
        out, mpi_out = np.empty(n, dtype=x.dtype), np.empty(n, dtype=x.dtype)  # both sides gather into an array
        impls = {"ring": lambda: all_gather(comm, shard, out=out),  # allocated once (all_gather_into_tensor)
                 "MPI": lambda: (mpi.Allgather(shard, mpi_out), mpi_out)[1]}
    return impls


def bare_recursive_doubling(mpi, x):
    """The exchanges of minizero's recursive doubling (log2 N ``Sendrecv`` of the whole array, each followed by
    one NumPy add) as bare mpi4py calls: none of minizero's checks, headers, waits or records. For small arrays,
    the least an all_reduce written in Python over point-to-point messages costs (for large ones the blocking
    ``Sendrecv`` and the separate add make it slower than minizero's own); N a power of two."""
    out, tmp = np.empty_like(x), np.empty_like(x)
    rank, n = mpi.Get_rank(), mpi.Get_size()

    def run():
        out[...] = x
        mask = 1
        while mask < n:
            mpi.Sendrecv(out, rank ^ mask, 0, tmp, rank ^ mask, 0)
            np.add(out, tmp, out=out)
            mask <<= 1
        return out
    return run


def measure(op, min_bytes, max_bytes, warmup):
    """Under mpiexec: {nbytes: {impl: seconds}} (median slowest-rank time) for ``op``."""
    from mpi4py import MPI

    from minizero.comm import world

    comm = world()
    N = comm.world_size
    results = {}
    for nbytes in sizes(min_bytes, max_bytes):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        impls = implementations(op, comm, x)
        reference = impls["MPI"]().copy()
        for name, run in impls.items():
            if not np.allclose(run(), reference, rtol=1e-5, atol=1e-5 * N):
                raise AssertionError(f"{op} {name} differs from MPI's at {nbytes} bytes")
        for _ in range(warmup):
            for run in impls.values():
                run()
        names = list(impls)
        times = {name: np.empty(iterations(nbytes)) for name in names}
        for i in range(iterations(nbytes)):
            for name in names[i % len(names):] + names[:i % len(names)]:  # each goes first in turn
                comm.mpi_comm.Barrier()
                start = time.perf_counter()
                impls[name]()
                times[name][i] = time.perf_counter() - start
        results[nbytes] = {}
        for name, t in times.items():
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)  # a run ends when its slowest rank does
            results[nbytes][name] = float(np.median(t))
    return N, results


def busbw(op, nbytes, seconds, world_size):
    factor = 2 if op == "all_reduce" else 1
    return nbytes / seconds * factor * (world_size - 1) / world_size / GB


def table(op, runs):
    """Markdown table from {world_size: {nbytes: {impl: s}}}: busbw per implementation, and ratios to MPI."""
    world_sizes = sorted(runs)
    names = list(dict.fromkeys(name for r in runs.values() for t in r.values() for name in t))  # p2p: not every N
    ours = [name for name in names if name != "MPI"]
    main = "auto" if "auto" in ours else ours[0]
    ratios = [main] + (["p2p"] if "p2p" in ours else [])
    head = "| size | " + " | ".join(" | ".join(f"N={n} {name}" for name in names) + "".join(
        f" | N={n} {r}/MPI" for r in ratios) for n in world_sizes) + " |"
    rule = "|---:|" + ("---:|" * (len(names) + len(ratios))) * len(world_sizes)
    rows = [head, rule]
    for nbytes in sorted(next(iter(runs.values()))):
        cells = []
        for n in world_sizes:
            t = runs[n][nbytes]
            cells += [f"{busbw(op, nbytes, t[name], n):.3g}" if name in t else "-" for name in names]
            cells += [f"{t['MPI'] / t[r]:.2f}" if r in t else "-" for r in ratios]
        rows.append(f"| {fmt_size(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _threshold():
    from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES

    return SMALL_ALLREDUCE_MAX_BYTES


def launch(world_sizes, args):
    """Driver: run this script under ``mpiexec -n N`` for each N; return {N: results}."""
    from minizero.interrupts import run_group

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO_ROOT, env.get("PYTHONPATH")] if p)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in world_sizes:
            path = os.path.join(tmp, f"n{n}.json")
            cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--json", path, "--op", args.op,
                   "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
                   "--warmup", str(args.warmup), "--quiet"] + (["--default-malloc"] if args.default_malloc else [])
            print(f"running {' '.join(cmd[:3])} ...", file=sys.stderr, flush=True)
            run_group(cmd, env=env, check=True, timeout=600, capture_output=False)  # SIGTERM: its ranks killed
            with open(path) as f:
                runs[n] = {int(k): v for k, v in json.load(f)["results"].items()}
    return runs


def main():
    parser = _args.parser(__doc__.split("\n")[0])
    parser.add_argument("--op", choices=OPS + ("all",), default="all_reduce", help="collective (default all_reduce)")
    parser.add_argument("--launch", metavar="N,N,...", type=_args.world_sizes,
                        help="driver mode: run under mpiexec at these world sizes")
    parser.add_argument("--min-bytes", type=_args.count, default=4 * 2**10, help="smallest array (default 4 KiB)")
    parser.add_argument("--max-bytes", type=_args.in_memory, default=16 * 2**20, help="largest array (default 16 MiB)")
    parser.add_argument("--warmup", type=_args.at_least(0), default=2, help="untimed runs per size and implementation")
    parser.add_argument("--json", metavar="PATH", type=_args.file_path, help="also write the timings as JSON (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="do not print the table (driver mode uses --json)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory, as the main job does)")
    args = parser.parse_args()
    _args.check_environment(parser)
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} > --max-bytes {args.max_bytes}; allowed: "
                     "1 <= --min-bytes <= --max-bytes")
    if args.op == "all" and not args.launch:
        parser.error("--op all needs --launch")
    if args.json and args.launch:
        parser.error("--json writes the timings of the one world size this process runs; with --launch (which "
                     "gives each run its own) it would write nothing: drop one of them")
    if args.json:
        _args.check_output_path(parser, "--json", args.json)
    malloc = _machine.set_malloc(args.default_malloc)  # every rank, both sides (MPI's calls too)

    if args.op == "all":
        for op in OPS:
            runs = launch(args.launch, argparse.Namespace(**{**vars(args), "op": op}))
            if op != OPS[0]:
                print()  # a blank line between the tables (none above the first)
            report(op, runs, malloc)
        return
    if args.launch:
        runs = launch(args.launch, args)
    else:
        from minizero.interrupts import start_mpi

        start_mpi()  # a stale launcher: one line, not MPICH's error stack; SIGTERM or time ends a stalled MPI_Init
        n, results = measure(args.op, args.min_bytes, args.max_bytes, args.warmup)
        from minizero.comm import world

        if world().rank != 0:
            return
        runs = {n: results}
        if args.json:
            from minizero import jsons
            from minizero.files import atomic_write

            text = json.dumps(jsons.summary({"world_size": n, "results": results}))
            atomic_write(args.json, lambda f: f.write(text), mode="w")  # a crash leaves the previous file whole
        if args.quiet:
            return
    report(args.op, runs, malloc)


def report(op, runs, malloc):
    oversubscribed = [n for n in runs if n > _machine.cores()]
    print(f"{op} bus bandwidth, GB/s | {_machine.header()} | {malloc} | "
          + (f"oversubscribed at N={oversubscribed}" if oversubscribed else "one core per rank or more"))
    print("busbw per nccl-tests; median of timed runs, slowest rank; MPI = MPICH's blocking call through mpi4py; "
          + (f"auto = minizero.comm.all_reduce as shipped (recursive doubling up to {_threshold()} bytes, then the "
             f"ring), ring / rd forced; p2p = the same exchanges as recursive doubling in bare mpi4py calls (Sendrecv "
             f"and a NumPy add, nothing of minizero's; N a power of two): for small arrays, the least a collective "
             f"written in Python over point-to-point costs; " if op == "all_reduce" else
             "ring = minizero's, into a preallocated out as MPI's; " if op == "all_gather" else
             "pairwise = minizero's; " if op == "all_to_all" else "ring = minizero's; ")
          + "X/MPI = MPI's time / X's (above 1: minizero faster)\n")
    print(table(op, runs))


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
