"""Every benchmark the docs quote runs end to end at its smallest size and prints its header and table.

Timings are not checked (benchmarks measure; tests do not time). What is checked: the script exits 0, prints the
machine header (``bench/_machine.py``) and at least one table row. bench_quantization (tests/test_quantized_comm.py),
profile_step and profile_collective (their own tests) and the scripts that need PyTorch, mpiexec or minutes at
any size (bench_vs_torch, bench_speedup, bench_3d_main_job, bench_allreduce, bench_multihost, bench_defaults,
bench_qlora, bench_setup_peak, bench_header) are left to their own runs (bench_defaults: its main on the tiny model
in-process, below).
"""
import glob
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, mpi_env

SMOKE = {
    "bench_recompute": ["--model", "tiny", "--batch", "2", "--repeats", "1"],
    "bench_precision": ["--model", "tiny", "--steps", "4", "--window", "2"],
    "bench_low_precision": ["--model", "tiny", "--steps", "4", "--window", "2"],
    "bench_overlap": ["--ranks", "2", "--steps", "2", "--model", "tiny", "--strategies", "dp"],
    "bench_flight": ["--ranks", "2", "--steps", "3", "--rounds", "1", "--model", "tiny"],
    "bench_train": ["--ranks", "1", "--steps", "2", "--model", "tiny", "--rounds", "1"],
    "bench_seq_memory": ["--model", "tiny", "--batch", "1", "--repeats", "1", "--png", "{tmp}/seq_memory.png"],
    "bench_memory": ["--model", "tiny", "--ranks", "1", "--steps", "2", "--configs", "baseline"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_runs_and_prints_its_table(name, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in SMOKE[name]]
    proc = subprocess.run([sys.executable, os.path.join("bench", f"{name}.py"), *argv], cwd=REPO_ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(" UTC | " in line and "OPENBLAS_CORETYPE=" in line for line in lines), proc.stdout[:2000]
    assert any(line.startswith("|") and line.count("|") >= 3 and "---" not in line for line in lines[1:]), \
        proc.stdout[-2000:]


def test_scripts_that_launch_the_main_job_s_ranks_print_the_ranks_thread_rule():
    """A table of ranks needs the ranks' BLAS threads in its header. Before: bench_flight and bench_memory printed
    their own ('2 threads') above runs of 8 ranks on 2 cores, which ran with one thread each."""
    launchers = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "bench", "*.py"))):
        with open(path) as f:
            src = f.read()
        if '"minizero.train"' in src and "mpiexec" in src and "_machine.header(" in src:
            launchers.append((os.path.basename(path), "_machine.header(_machine.RANK_THREADS)" in src))
    assert len(launchers) >= 6 and all(ok for _, ok in launchers), launchers


@pytest.mark.timeout(240)
def test_bench_defaults_prints_a_row_per_setting(monkeypatch, capsys):
    """Before: every setting's run ended in a TypeError (the script assigned into train's TrainResult) after minutes
    of training, no row printed. Here the tiny model, 25 steps (fp16's pair: 21), in this process."""
    from tests.test_bench_args import load

    bd = load("bench_defaults")
    argv = bd.train_argv
    monkeypatch.setattr(bd, "train_argv", lambda *a: [*argv(*a), "--model", "tiny", "--steps", "25"])
    monkeypatch.setattr(bd, "FP16_STEPS", 21)
    monkeypatch.setattr(sys, "argv", ["bench_defaults.py", "--settings", "1e-3,5,1.0", "--fp16-all"])
    bd.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.001 | 5 | 1 |")]
    assert len(rows) == 1 and rows[0].count("|") == 9 and "not run" not in rows[0], rows


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,argv", [("bench_recompute", ["--threads", "1"]), ("bench_seq_memory", [])])
def test_header_gives_the_blas_threads_the_runs_use(name, argv, tmp_path):
    """Before: the process's own BLAS threads (2 here), printed before the runs were limited to one."""
    extra = [a.replace("{tmp}", str(tmp_path)) for a in SMOKE[name]] + argv
    proc = subprocess.run([sys.executable, os.path.join("bench", f"{name}.py"), *extra], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0 and ", 1 thread) | " in proc.stdout.splitlines()[0], proc.stdout[:300] + proc.stderr


@pytest.mark.timeout(120)
def test_bench_setup_peak_says_its_process_figures_are_tracemalloc_s(mpiexec):
    proc = subprocess.run([mpiexec, "-n", "1", sys.executable, os.path.join("bench", "bench_setup_peak.py"), "--model",
                           "tiny"], cwd=REPO_ROOT, env=mpi_env(), capture_output=True, text=True, timeout=100)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and " UTC | " in lines[0], proc.stdout + proc.stderr
    assert lines[1].startswith("whole model: ") and "tracemalloc (on through set-up)" in lines[1], lines[1]
