"""The mpi_examples programs: --help, and a wrong rank count ends at once with a message and status 2."""
import glob
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, mpi_env

EXAMPLES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO_ROOT, "mpi_examples", "[!_]*.py")))


def run_example(name, *argv, timeout=30):
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "mpi_examples", name), *argv], env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def test_every_example_is_covered():
    assert len(EXAMPLES) >= 6 and "pipeline.py" in EXAMPLES and "_common.py" not in EXAMPLES


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", EXAMPLES)
def test_one_rank_exits_at_once_with_a_message(name):
    """At one rank (no mpirun) each example stops within 30 s: status 0, or 2 with 'needs N ranks'."""
    proc = run_example(name)  # subprocess.TimeoutExpired fails the test: a spin or a hang
    assert proc.returncode in (0, 2), proc.stdout + proc.stderr
    if proc.returncode == 2:
        line = proc.stderr.strip()
        assert line.count("\n") == 0 and "needs" in line and "got 1" in line and "mpirun -n" in line, line
        assert "Traceback" not in proc.stderr and "nan" not in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", EXAMPLES)
def test_help(name):
    proc = run_example(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "-h, --help" in proc.stdout


@pytest.mark.timeout(120)
def test_lines_of_several_ranks_stay_whole(mpiexec):
    """tensor_parallel.py at 2 ranks: each rank's block printed whole, in rank order."""
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "mpi_examples/tensor_parallel.py"], env=mpi_env(),
                          capture_output=True, text=True, timeout=100, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    starts = [i for i, l in enumerate(lines) if l.startswith("rank ")]
    assert [lines[i][:8] for i in starts] == ["rank 0/2", "rank 1/2"]
    assert starts[1] - starts[0] == 5 and all(l.startswith("  ") for l in lines[1:5] + lines[6:10])


@pytest.mark.timeout(120)
def test_ring_allreduce_names_the_algorithm_each_size_ran(mpiexec):
    """64 KiB takes recursive doubling, not the ring: the table must not call its row the ring's."""
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "mpi_examples/ring_allreduce.py"], env=mpi_env(),
                          capture_output=True, text=True, timeout=100, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[2] for line in proc.stdout.splitlines() if line.strip().endswith(
        tuple("0123456789")) and " KiB " in line}
    assert rows == {"64": "recursive_doubling", "1024": "ring", "16384": "ring"}, proc.stdout
    from minizero.backend import usable_cores
    assert ("2 ranks on 1 cores: the ranks take turns" in proc.stdout) == (usable_cores() < 2), proc.stdout


@pytest.mark.timeout(240)
def test_ring_allreduce_says_when_its_ranks_share_cores(mpiexec):
    from minizero.backend import usable_cores
    n = usable_cores() + 1
    if n > 5:
        pytest.skip(f"{n} ranks to oversubscribe {n - 1} cores: too many for the suite")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, "mpi_examples/ring_allreduce.py"], env=mpi_env(),
                          capture_output=True, text=True, timeout=200, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"({n} ranks on {n - 1} cores: the ranks take turns on the cores" in proc.stdout, proc.stdout
    assert max(map(len, proc.stdout.splitlines())) <= 120, proc.stdout  # before: the note was one line of 160


@pytest.mark.timeout(200)
def test_zero_stages_says_it_runs_without_prefetch(mpiexec):
    """Its 'one block plus the embedding' holds only because it runs --no-overlap; it says so, and what the default
    (prefetch) holds."""
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "mpi_examples/zero_stages.py", "--model", "tiny"],
                          env=mpi_env(), capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runs with --no-overlap (blocking gathers): stage 3 holds at most one block plus the embedding" in proc.stdout
    said = " ".join(proc.stdout.split())
    assert "default (prefetch" in said and "holds two blocks plus the embedding" in said
    assert max(map(len, proc.stdout.splitlines())) <= 120, proc.stdout  # before: four lines of 143 to 152


@pytest.mark.timeout(200)
def test_pipeline_lines_stay_within_120_columns_and_name_each_schedule_before_its_arrows(mpiexec):
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, "mpi_examples/pipeline.py", "--micro-batches", "4",
                           "--verbose"], env=mpi_env(), capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1: 4 micro-batch(es) in flight" in proc.stdout and "sent 0 activations (0 B), 4 gradients" in (
        proc.stdout)
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 120, proc.stdout  # before: 123 for the middle stages
    gpipe, f1b = (next(i for i, line in enumerate(lines) if line.startswith(f"{name}: bubble"))
                  for name in ("gpipe", "1f1b"))
    arrows = [i for i, line in enumerate(lines) if line.startswith("[rank ") and "stage" in line]
    # before: every GPipe arrow came before the line naming GPipe
    assert arrows and gpipe < min(arrows) and any(gpipe < i < f1b for i in arrows) and max(arrows) > f1b, (
        proc.stdout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,argv,said", [
    ("zero_stages.py", ["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    ("zero_stages.py", ["--model", "tiny", "--grad-accum", "0"], "--grad-accum must be >= 1, got 0"),
    ("memory_compression.py", ["--model", "tiny", "--steps", "0"], "--steps must be >= 1, got 0"),
    ("pipeline.py", ["--micro-batches", "0"], "--micro-batches must be in 1..1,024"),
    ("zero_stages.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("memory_compression.py", ["--steps", "x"], "argument --steps: invalid int value: 'x'"),
])
def test_a_flag_the_main_job_refuses_ends_the_example_in_one_line_on_every_rank(mpiexec, name, argv, said):
    """Before: the main job's UsageError surfaced as a traceback from each rank, exit status 1; the examples' own
    flags (argparse) printed a usage block and the error once per rank."""
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, f"mpi_examples/{name}", *argv], env=mpi_env(),
                          capture_output=True, text=True, timeout=100, cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count(f"{name}: error: {said}") == 1, proc.stderr
    assert "usage:" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_pipeline_refuses_more_micro_batches_than_the_main_job_before_making_them():
    """Before: --micro-batches 1000000000 made a billion batches up front (a run that never ends)."""
    proc = run_example("pipeline.py", "--micro-batches", "1000000000")
    assert proc.returncode == 2 and "--micro-batches must be in 1..1,024" in proc.stderr, proc.stderr
