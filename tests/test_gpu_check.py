"""bench/gpu_check.py without a GPU: a plain message, every row "not run", JSON written, exit 0."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import gpu_check  # noqa: E402


@pytest.mark.timeout(120)
def test_without_cupy_every_check_is_not_run_and_the_exit_code_is_zero(tmp_path):
    (tmp_path / "cupy.py").write_text("raise ImportError('CuPy is hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_ROOT]))
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "gpu_check.py"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=100, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "no GPU: CuPy not installed" in done.stdout
    result = json.loads(out.read_text())
    assert [c["check"] for c in result["checks"]] == gpu_check.CHECKS
    assert all(c["status"] == "not run" for c in result["checks"])
    assert result["hardware"] is None and "CuPy not installed" in result["reason_not_run"]
    assert done.stdout.count("| not run |") == len(gpu_check.CHECKS)
    assert done.stdout.count("CuPy not installed") == 1, done.stdout  # said once, not in every row


def test_peaks_by_name_and_override():
    assert gpu_check.parse_peak(None, "NVIDIA H200") == (989.5e12, 66.9e12)
    assert gpu_check.parse_peak(None, "Some GPU") == (None, None)
    assert gpu_check.parse_peak("100,10", "NVIDIA H200") == (100e12, 10e12)
    with pytest.raises(SystemExit, match="peak-tflops"):
        gpu_check.parse_peak("-1", "x")


def test_max_difference_sees_losses_and_weights():
    import numpy as np
    a = {"train_loss": [1.0, 2.0], "weights": {"w": np.zeros(3)}}
    b = {"train_loss": [1.0, 2.0], "weights": {"w": np.array([0.0, 0.0, 1e-6])}}
    assert gpu_check.max_difference(a, a) == 0.0
    assert gpu_check.max_difference(a, b) == 1e-6
    assert gpu_check.max_difference(a, dict(b, weights=a["weights"], train_loss=[1.0, 2.5])) == 0.5


@pytest.mark.timeout(120)
def test_the_nccl_worker_passes_on_the_fake_nccl(tmp_path):
    """The collective check's own logic, at one rank, with tests/fake_nccl.py standing in for NCCL."""
    out = tmp_path / "nccl.json"
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_check; from tests import fake_nccl; "
            f"gpu_check.nccl_worker({str(out)!r}, nccl=fake_nccl, cuda=fake_nccl.cuda)")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["max_error"] <= 1e-12


def test_throughput_is_timed_from_the_difference_of_two_runs():
    class Runner:  # two gpt2 runs of 3 and 8 steps that took 10 s and 20 s (start-up included in both)
        seen = []

        def train(self, args, ranks=1, limit_s=0, weights=True):
            self.seen.append(args)
            return {"elapsed_s": 10.0 if args[args.index("--steps") + 1] == "3" else 20.0}

        def left(self):
            return 0.0  # no time left for PyTorch's side

    status, text, row = gpu_check.throughput(Runner(), "fp16", 989.5e12, (3, 8))
    from minizero.memory.estimator import model_flops_per_step
    from minizero.nn import get_config
    assert row["minizero_tokens_per_s"] == 8 * 1024 / 2.0  # 5 more steps took 10 s more
    assert row["minizero_mfu"] == pytest.approx(model_flops_per_step(get_config("gpt2"), 8) / 2.0 / 989.5e12)
    assert all("--device" in a and "cuda" in a and "fp16" in a for a in Runner.seen)
    assert status == "measured" and "tokens/s" in text
