"""Ring all-reduce by hand vs MPI's own Allreduce: same numbers, and how fast each is.

    mpirun -n 4 python mpi_examples/ring_allreduce.py

Each rank holds its own array; afterwards every rank holds the sum. The ring
(minizero/comm/collectives.py) does it as a reduce-scatter then an all-gather, each
N-1 steps of one chunk to the right-hand neighbour, so every rank sends
2(N-1)/N of the array whatever N is (Patarasuk & Yuan, JPDC 2009). ``all_reduce`` takes the
ring above 256 KiB; at or below it, recursive doubling (minizero/comm/recursive_doubling.py),
which the "algorithm" column names (MINIZERO_SMALL_ALLREDUCE_MAX_BYTES=-1 forces the ring).

Bandwidth as nccl-tests defines it (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
    algbw = bytes / seconds                 (bytes = size of the array)
    busbw = algbw * 2(N-1)/N                (an all-reduce's normalization, whatever the algorithm)
With more ranks than cores (mpirun -n 4 on 2 cores) the ranks take turns on the cores and the
timings say little; lesson 01 shows how noisy they are.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.backend import usable_cores  # noqa: E402
from minizero.comm import all_reduce, world  # noqa: E402
from minizero.comm.recursive_doubling import all_reduce_algorithm  # noqa: E402
from _common import require_ranks  # noqa: E402  (mpi_examples/_common.py)

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
comm = world()
require_ranks(comm, comm.world_size >= 2, "at least 2", "ring_allreduce.py")  # 1 rank: no ring, nothing sent
N, rank = comm.world_size, comm.rank

# 1. Correct: the hand-written ring equals MPI_Allreduce (float64, summation order aside).
x = np.random.default_rng(rank).standard_normal(1_000_003)
ring, native = all_reduce(comm, x), all_reduce(comm, x, native=True)
assert np.allclose(ring, native, rtol=0, atol=1e-12), "ring all-reduce differs from MPI_Allreduce"
if rank == 0:
    print(f"{N} ranks: ring all-reduce of {x.size:,} float64 (the ring: above 256 KiB) == MPI_Allreduce "
          f"(max |diff| {np.abs(ring - native).max():.1e})")
    print(f"{'size':>9} {'algorithm':>18} {'minizero busbw':>15} {'MPI busbw':>10}   (GB/s, GB = 1e9 bytes)")


# 2. Fast? Median of a few timed runs, every rank starting together.
def seconds(native, x, out, iters=5):
    times = []
    for _ in range(iters + 1):  # the first run is warm-up
        comm.barrier()
        start = time.perf_counter()
        all_reduce(comm, x, native=native, out=out)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


for nbytes in [64 * 2**10, 1 * 2**20, 16 * 2**20]:
    x = np.ones(nbytes // 4, dtype=np.float32)
    out = np.empty_like(x)
    busbw = {native: nbytes / seconds(native, x, out) * 2 * (N - 1) / N / 1e9 for native in (False, True)}
    if rank == 0:
        print(f"{nbytes // 2**10:>5} KiB {all_reduce_algorithm(nbytes, N):>18} {busbw[False]:>15.2f} "
              f"{busbw[True]:>10.2f}")
if rank == 0 and N > usable_cores():
    print(f"({N} ranks on {usable_cores()} cores: the ranks take turns on the cores, so these timings say little "
          "about either side;\n bench/bench_allreduce.py measures with one core per rank)")
