"""bench/profile_collective.py: its table, its refusals, and a short run under mpiexec whose layers agree with MPI."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, mpi_env

SCRIPT = os.path.join(REPO_ROOT, "bench", "profile_collective.py")
sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import profile_collective  # noqa: E402  (bench/ is no package; an import error fails, never skips)


def test_table_gives_each_layer_in_microseconds_and_mpis_time_over_all_reduces():
    t = {"MPI": 5e-6, "p2p": 4e-6, "message": 2e-5, "algorithm": 2.5e-5, "all_reduce": 4e-5}
    rows = profile_collective.table({4096: t}).splitlines()
    assert rows[0].startswith("| size | MPI, us | p2p, us | message, us | algorithm, us | all_reduce, us |")
    assert rows[2] == "| 4 KiB | 5.0 | 4.0 | 20.0 | 25.0 | 40.0 | 0.12 |"


@pytest.mark.parametrize("argv, said", [(["--launch", "3"], "--launch 3"), (["--sizes", "6"], "--sizes: '6'"),
                                        (["--sizes", "4096,x"], "--sizes: '4096,x'"),
                                        (["--sizes", str(2 ** 30)], "up to 262144"), (["--runs", "0"], "--runs: '0'")])
def test_bad_arguments_are_refused_before_any_run(argv, said):
    r = subprocess.run([sys.executable, SCRIPT] + argv, capture_output=True, text=True, timeout=60, env=mpi_env())
    assert r.returncode == 2 and r.stderr.startswith("profile_collective.py: error: ") and said in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_a_short_run_at_two_ranks_prints_every_layer(mpiexec):
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, SCRIPT, "--sizes", "4096,16384", "--runs", "1",
                        "--warmup", "1"], capture_output=True, text=True, timeout=110, env=mpi_env())
    assert r.returncode == 0, r.stderr  # the script checks each layer's sum against MPI_Allreduce first
    assert "all_reduce layer by layer, N=2" in r.stdout and "kernel" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 4 KiB") or line.startswith("| 16 KiB")]
    assert len(rows) == 2 and all(len(row.split("|")) == 9 for row in rows)
