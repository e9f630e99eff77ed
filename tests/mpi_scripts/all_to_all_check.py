"""Run under ``mpiexec -n N``: minizero's all_to_all / all_to_all_v beside MPI_Alltoall / MPI_Alltoallv.

Usage: mpiexec -n N python tests/mpi_scripts/all_to_all_check.py OUTDIR
Rank r writes ``OUTDIR/rank{r}.npz`` (keys ``<case>:mine`` and ``<case>:mpi``); tests/test_all_to_all.py compares.
"""
import sys

import numpy as np
from mpi4py import MPI

from minizero.comm import world
from minizero.comm.all_to_all import all_to_all, all_to_all_v


def main(outdir):
    comm, mpi = world(), MPI.COMM_WORLD
    n, r = comm.world_size, comm.rank
    out = {}
    for dtype in ("float64", "float32", "int64"):
        x = (np.random.default_rng([r, 1]).standard_normal((3 * n, 5)) * 100).astype(dtype)
        ref = np.empty_like(x)
        mpi.Alltoall(x, ref)
        out[f"equal-{dtype}:mine"], out[f"equal-{dtype}:mpi"] = all_to_all(comm, x), ref
        counts = np.random.default_rng([r, 2]).integers(0, 4, n)  # ragged, zeros included
        counts[r % n] = 0 if n > 2 else counts[r % n]
        y = (np.random.default_rng([r, 3]).standard_normal((int(counts.sum()), 2)) * 100).astype(dtype)
        got, recv_counts = all_to_all_v(comm, y, counts)
        theirs = np.empty(n, np.int64)
        mpi.Alltoall(counts.astype(np.int64), theirs)
        ref = np.empty((int(theirs.sum()), 2), dtype)
        row = 2
        mpi.Alltoallv([y, counts * row, np.concatenate([[0], np.cumsum(counts)[:-1]]) * row, MPI._typedict[y.dtype.char]],
                      [ref, theirs * row, np.concatenate([[0], np.cumsum(theirs)[:-1]]) * row, MPI._typedict[ref.dtype.char]])
        out[f"ragged-{dtype}:mine"], out[f"ragged-{dtype}:mpi"] = got, ref
        out[f"ragged-{dtype}:counts-mine"], out[f"ragged-{dtype}:counts-mpi"] = np.array(recv_counts), theirs
    np.savez(f"{outdir}/rank{r}.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1])
