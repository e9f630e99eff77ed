"""What the dtype/shape check of ``MPICommunicator`` costs a point-to-point message, by size.

    mpiexec -n 2 python bench/bench_header.py            # 4 KiB, 64 KiB, 1 MiB, 16 MiB
    mpiexec -n 4 python bench/bench_header.py --sizes 4096,65536

Every rank exchanges a float32 array with its ring neighbours (send right, receive from
the left, as the ring all-reduce does) in two ways, alternated run by run (each first in
turn), with a barrier before each run:

* ``checked``: ``comm.sendrecv`` as shipped (the 64-byte dtype/shape header travels with
  the payload and is checked against the receive buffer, ``minizero/comm/mpi.py``);
* ``bare``: the payload alone, ``MPI_Isend`` + ``MPI_Irecv`` of the same bytes, completed
  by the same sleep-polling wait (``MPICommunicator._wait``) -- no header, no check.

Printed: microseconds per exchange (median of the slowest rank's times) and checked / bare.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing


def size_label(nbytes: int) -> str:
    """``nbytes`` in the table: "16 MiB", "4 KiB", "100 B" (the unit that shows it whole)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes:,} B"


def exchange(sizes: list, runs: int, comm_timeout: float = 600.0) -> None:
    """Under mpiexec: time both ways at each of ``sizes`` (bytes); rank 0 prints the table."""
    from minizero.comm import world
    from minizero.interrupts import mpi_start_guarded

    with mpi_start_guarded("bench_header.py", timeout_s=comm_timeout):  # SIGTERM or time ends a stalled MPI_Init
        from mpi4py import MPI

        comm = world()
    r, n = comm.rank, comm.world_size
    if n < 2:
        sys.exit("run under mpiexec -n N, N >= 2")
    right, left = (r + 1) % n, (r - 1) % n

    def checked(x, y):
        comm.sendrecv(x, right, y, left, tag=3)

    def bare(x, y):
        reqs = [comm.mpi_comm.Irecv([y, MPI.BYTE], source=left, tag=4),
                comm.mpi_comm.Isend([x, MPI.BYTE], dest=right, tag=4)]
        comm._wait(reqs, "bare sendrecv")

    ways = {"checked": checked, "bare": bare}
    if r == 0:
        print(_machine.header(), flush=True)  # date, CPU, BLAS library, kernel, threads
        print(f"{n} ranks on {_machine.cores()} cores; microseconds per ring exchange (median of the slowest rank's); "
              f"checked = comm.sendrecv as shipped, bare = the payload alone\n")
        print("| size | checked (us) | bare (us) | checked / bare |")
        print("|---:|---:|---:|---:|")
    for nbytes in sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        y = np.empty_like(x)
        n_runs = max(10, min(runs, runs * 2**20 // max(nbytes, 1)))
        times = {w: np.empty(n_runs) for w in ways}
        names = list(ways)
        for fn in ways.values():  # warm-up
            for _ in range(3):
                fn(x, y)
        for i in range(n_runs):
            for w in names[i % 2:] + names[:i % 2]:
                comm.barrier()
                t = time.perf_counter()
                ways[w](x, y)
                times[w][i] = time.perf_counter() - t
        med = {}
        for w, t in times.items():
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            med[w] = float(np.median(t))
        if r == 0:
            print(f"| {size_label(nbytes)} | {med['checked'] * 1e6:.1f} | {med['bare'] * 1e6:.1f} | "
                  f"{med['checked'] / med['bare']:.2f} |", flush=True)


def main():
    p = _args.parser(description=__doc__.split("\n")[0] + " Run it under mpiexec -n N, N >= 2.")
    p.add_argument("--sizes", type=_args.byte_sizes, default="4096,65536,1048576,16777216",
                   help="comma list of message bytes")
    p.add_argument("--runs", type=_args.count, default=200, help="timed exchanges per size and way (fewer above 1 MiB)")
    p.add_argument("--comm-timeout", type=_args.positive_real, default=600.0, help="seconds MPI's start may take")
    args = p.parse_args()
    if not 1 <= args.comm_timeout < 600_000:  # before: another value became 600 s, silently
        p.error(f"--comm-timeout {args.comm_timeout:g}: allowed: seconds in [1, 600000)")
    exchange(args.sizes, args.runs, args.comm_timeout)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
