"""FP8 delayed scaling across data parallelism and checkpoints (issue 29).

* The amax reduction: each step, every replica's histories take the max over the data group of the ranks'
  own amaxes (which differ: each rank casts its own rows), so the replicas hold the same histories, bitwise,
  in threads and under ``mpiexec`` (read from the checkpoint's per-rank state).
* Checkpoints carry the histories: 6 steps straight == 3 steps, save, resume, 3 steps, bitwise; without the
  histories the resumed run differs (the check can fail).
"""
import subprocess
import sys

import numpy as np
import pytest

import minizero.checkpoint.load as checkpoint_load
from minizero.checkpoint import read_manifest
from minizero.comm import run_in_threads
from minizero.memory.fp8 import AMAX_HISTORY, AmaxReduction, fp8_state
from minizero.train import parse_args, train
from tests.conftest import REPO_ROOT, mpi_env

BASE = ["--model", "tiny", "--eval-batches", "1", "--eval-every", "0", "--progress", "none", "--lr", "3e-3",
        "--seed", "3", "--warmup", "2", "--steps", "6", "--precision", "fp8", "--fp8-scaling", "delayed"]


def _train(comm, argv):
    res = train(parse_args(BASE + argv, comm.world_size), comm, log=lambda s: None)
    s = res["strategy"]
    params = {n: p.data.copy() for n, p in s.stage.named_parameters()}
    return {"losses": res["train_losses"], "start": res["start_step"], "fp8": fp8_state(s.stage), "params": params}


def test_replicas_hold_the_group_max_of_their_own_amaxes(monkeypatch):
    local = {}  # rank -> every step's own amaxes, before the reduction
    reduce = AmaxReduction.reduce

    def spy(self):
        local.setdefault(self.comm.rank, []).append(np.array([float(a) for c in self.casts for a in c.pending]))
        reduce(self)
    monkeypatch.setattr(AmaxReduction, "reduce", spy)
    out = run_in_threads(2, _train, ["--steps", "3", "--no-save"], timeout=120)
    assert out[0]["fp8"] == out[1]["fp8"] and out[0]["fp8"]  # the same histories, bitwise
    own = [np.stack(local[r]) for r in (0, 1)]  # (steps, casts)
    assert (own[0] != own[1]).any()  # the ranks' own amaxes differ (x and g: each its own rows)
    first = next(iter(out[0]["fp8"].values()))["x"]
    assert len(first) == AMAX_HISTORY and first[3:] == [0.0] * (AMAX_HISTORY - 3)  # 3 steps, newest first
    newest = np.maximum(own[0][-1], own[1][-1])  # the last step's group max is every history's entry 0
    got = [h[k][0] for h in out[0]["fp8"].values() for k in ("x", "w", "g")]
    np.testing.assert_array_equal(np.array(got, np.float32), newest.astype(np.float32))


def _run(n, argv):
    return run_in_threads(n, _train, argv, timeout=120)[0]


@pytest.mark.timeout(300)
def test_six_steps_equal_three_save_resume_three_with_the_amax_histories(tmp_path, monkeypatch):
    straight = _run(2, ["--no-save"])
    _run(2, ["--no-save", "--save-every", "3", "--save-dir", str(tmp_path)])
    folder = str(tmp_path / "step_00000003")
    assert all(f["fp8"] for f in read_manifest(folder)["files"])
    resumed = _run(2, ["--no-save", "--resume", folder])
    assert resumed["start"] == 3
    assert resumed["losses"] == straight["losses"][3:] and resumed["fp8"] == straight["fp8"]
    for k, a in straight["params"].items():
        np.testing.assert_array_equal(resumed["params"][k], a, err_msg=k)
    # negative control: without the saved histories the first resumed casts use their own amaxes
    monkeypatch.setattr(checkpoint_load, "load_fp8_state", lambda model, state: [])
    fresh = _run(2, ["--no-save", "--resume", folder])
    assert fresh["losses"] != straight["losses"][3:]


@pytest.mark.timeout(300)
def test_replicas_agree_under_mpiexec(mpiexec, tmp_path):
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", *BASE, "--steps", "3", "--sample-tokens", "1",
           "--out", str(tmp_path / "out"), "--save-every", "3"]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = read_manifest(str(tmp_path / "out" / "checkpoints" / "step_00000003"))["files"]
    assert len(files) == 2 and files[0]["fp8"] == files[1]["fp8"] and files[0]["fp8"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,scaling", [(["--cp", "2"], "current"), (["--ulysses", "2"], "delayed")])
def test_context_parallel_casts_take_the_whole_sequences_amax(layout, scaling):
    """Under --cp / --ulysses a Linear sees T/cp rows per rank: its x and g casts take the context group's max amax,
    so 2 ranks equal one process to float32 rounding (with each chunk's own amax the first loss moved by 2e-4)."""
    argv = ["--no-save", "--steps", "2", "--fp8-scaling", scaling]
    one, two = _run(1, argv), _run(2, argv + layout)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-7)
