"""All-to-all by pairwise exchange (comm/all_to_all.py): equal and ragged splits, bytes, MPI_Alltoallv.

Threads: every rank's result equals the pieces the others addressed to it, in rank order, for 1-5
ranks, float and int dtypes, zero-size pieces; the ledger's bytes are exactly the rows sent to other
ranks (and 8 bytes per peer for the counts). mpiexec at 2-4 ranks: equal to MPI_Alltoall/Alltoallv.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.comm.all_to_all import all_to_all, all_to_all_v
from minizero.comm.flight import CollectiveMismatchError, check_collectives
from tests.conftest import REPO_ROOT, mpi_env


def _x(r, rows, dtype="float64", cols=3):
    return (np.random.default_rng([r, rows]).standard_normal((rows, cols)) * 100).astype(dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", ["float64", "float16", "int32"])
def test_equal_splits_deliver_piece_r_of_every_rank_in_rank_order(n, dtype):
    m = 2

    def body(comm):
        comm.traffic.reset()
        got = all_to_all(comm, _x(comm.rank, n * m, dtype))
        return got, comm.traffic.snapshot()["by_op"]

    for r, (got, by_op) in enumerate(run_in_threads(n, body)):
        want = np.concatenate([_x(i, n * m, dtype)[r * m:(r + 1) * m] for i in range(n)])
        np.testing.assert_array_equal(got, want)
        x_bytes = _x(r, n * m, dtype).nbytes
        assert by_op.get("all_to_all", 0) == (n - 1) * x_bytes // n  # every piece but its own


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ragged_splits_with_empty_pieces(n):
    def counts_of(r):
        c = np.random.default_rng([r, 7]).integers(0, 4, n)
        c[(r + 1) % n] = 0  # an empty piece on every rank
        return c

    def body(comm):
        c = counts_of(comm.rank)
        comm.traffic.reset()
        got, recv = all_to_all_v(comm, _x(comm.rank, int(c.sum())), c)
        return got, recv, comm.traffic.snapshot()["by_op"]

    for r, (got, recv, by_op) in enumerate(run_in_threads(n, body)):
        pieces, counts = [], []
        for i in range(n):
            c = counts_of(i)
            lo = int(c[:r].sum())
            pieces.append(_x(i, int(c.sum()))[lo:lo + c[r]])
            counts.append(int(c[r]))
        np.testing.assert_array_equal(got, np.concatenate(pieces))
        assert recv == counts
        mine = counts_of(r)
        assert by_op["all_to_all_counts"] == 8 * (n - 1)
        assert by_op.get("all_to_all", 0) == int(mine.sum() - mine[r]) * 3 * 8


@pytest.mark.timeout(60)
def test_the_descriptor_check_passes_ragged_splits_and_catches_another_row_shape():
    """--debug-collectives' check (comm/flight.py): ranks send different row counts by design, so the ragged
    exchange is described by its row; before, rank 0's (3, 2) against rank 1's (4, 2) raised a mismatch."""
    def body(comm, cols):
        check_collectives(comm)
        counts = [1, 2] if comm.rank == 0 else [3, 1]
        return all_to_all_v(comm, np.zeros((sum(counts), cols[comm.rank])), counts)[1]

    assert run_in_threads(2, body, [2, 2], timeout=10) == [[1, 3], [2, 1]]
    with pytest.raises(CollectiveMismatchError) as e:  # another row shape is still caught
        run_in_threads(2, body, [2, 3], timeout=10)
    assert "all_to_all #2 (shape (2,)" in str(e.value) and "all_to_all #2 (shape (3,)" in str(e.value), str(e.value)


def test_bad_splits_are_refused_before_any_message():
    def body(comm):
        x = np.zeros((5, 2))
        with pytest.raises(ValueError, match=r"send_counts \[3, 3\] must be 2 non-negative ints summing to x.shape\[0\] = 5"):
            all_to_all_v(comm, x, [3, 3])
        with pytest.raises(ValueError, match=r"send_counts \[6, -1\]"):
            all_to_all_v(comm, x, [6, -1])
        with pytest.raises(ValueError, match="divisible by world_size=2, got shape \\(5, 2\\)"):
            all_to_all(comm, x)
        return comm.traffic.bytes_sent

    assert run_in_threads(2, body) == [0, 0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_equal_to_mpi_alltoall_and_alltoallv(n, mpiexec, tmp_path):
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "all_to_all_check.py")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, script, str(tmp_path)], env=mpi_env(),
                          capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(n):
        with np.load(tmp_path / f"rank{r}.npz") as data:
            arrays = dict(data)
        cases = {k.rsplit(":", 1)[0] for k in arrays}
        assert len(cases) == 6
        for case in cases:
            np.testing.assert_array_equal(arrays[f"{case}:mine"], arrays[f"{case}:mpi"], err_msg=f"rank {r} {case}")
            if case.startswith("ragged"):
                np.testing.assert_array_equal(arrays[f"{case}:counts-mine"], arrays[f"{case}:counts-mpi"])
