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
