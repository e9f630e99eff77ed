"""bench/gpu_check.py without a GPU: a plain message, every row "not run", JSON written, exit 0; with a GPU
listed but CuPy missing: one line, exit 3; every row's failure, whatever its message, still gives the table."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, earlier_json

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import gpu_check  # noqa: E402


def _without_cupy(tmp_path, smi_listing: str | None):
    """Runs gpu_check with CuPy hidden and a fake ``nvidia-smi`` first on PATH: it prints ``smi_listing``
    (exit 0), or fails as it does without a driver (None)."""
    (tmp_path / "cupy.py").write_text("raise ImportError('CuPy is hidden for this test')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + (f"echo '{smi_listing}'\n" if smi_listing is not None else
                                    "echo 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n"))
    smi.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_ROOT]),
               PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]))
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "gpu_check.py"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=100, cwd=str(tmp_path))
    return done, out


@pytest.mark.timeout(120)
def test_without_cupy_every_check_is_not_run_and_the_exit_code_is_zero(tmp_path):
    done, out = _without_cupy(tmp_path, None)  # nvidia-smi without a driver: no GPU
    assert done.returncode == 0, done.stderr
    assert "no GPU: nvidia-smi lists none and CuPy not installed" in done.stdout
    result = json.loads(out.read_text())
    assert [c["check"] for c in result["checks"]] == gpu_check.CHECKS
    assert all(c["status"] == "not run" for c in result["checks"])
    assert result["hardware"] is None and "CuPy not installed" in result["reason_not_run"]
    assert done.stdout.count("| not run |") == len(gpu_check.CHECKS)
    assert done.stdout.count("CuPy not installed") == 1, done.stdout  # said once, not in every row


@pytest.mark.timeout(120)
def test_a_listed_gpu_without_cupy_is_one_line_and_a_non_zero_exit(tmp_path):
    """A broken install on a GPU machine must not look like "no GPU, nothing to check" (exit 0)."""
    done, out = _without_cupy(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)")
    assert done.returncode == 3
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "nvidia-smi lists 1 GPU(s) but CuPy or NCCL will not load" in lines[0] and "docs/gpu.md" in lines[0]
    assert not out.exists()


class _Boom(Exception):
    def __str__(self):
        return ""


@pytest.mark.timeout(60)
def test_exceptions_with_empty_messages_still_give_the_table_and_the_json(tmp_path, monkeypatch, capsys):
    """Every row raises: with an empty message, a multi-line one, a bare RuntimeError(); each row says FAIL
    with the exception's name, the table has every row, the JSON is written, the exit status is 1."""
    monkeypatch.setattr(gpu_check, "probe", lambda: ({"name": "NVIDIA H200", "count": 1, "cupy": "14.2.0",
                                                      "cuda_runtime": 12080, "nccl": 22703}, ""))

    def raise_(e):
        def f(*args, **kwargs):
            raise e
        return f
    monkeypatch.setattr(gpu_check, "half_gemms", raise_(ValueError("a\nb")))
    monkeypatch.setattr(gpu_check, "equal_runs", raise_(_Boom()))
    monkeypatch.setattr(gpu_check, "nccl_collectives", raise_(RuntimeError("\n\n")))
    monkeypatch.setattr(gpu_check, "throughput", raise_(RuntimeError()))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--json", str(out)]) == 1
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(gpu_check.CHECKS)
    assert table[1] == "| float16 matmul == float32 matmul | FAIL | ValueError: a |"
    assert table[2] == "| cupy == numpy, tiny | FAIL | _Boom: _Boom() |"
    assert "| NCCL collectives, 1 rank | FAIL | RuntimeError: (no message) |" in table
    assert "| gpt2 8x1024 fp16 | FAIL | RuntimeError: RuntimeError() |" in table
    result = json.loads(out.read_text())
    assert [c["status"] for c in result["checks"]] == ["FAIL"] * 6 + ["not run"] + ["FAIL"] * 2


@pytest.mark.timeout(60)
def test_a_timed_out_row_kills_its_whole_process_group(tmp_path):
    """mpiexec's ranks are grandchildren: killing mpiexec alone would leave them running on the GPU."""
    pid_file = tmp_path / "pid"
    runner = gpu_check.Runner(budget_s=60, workdir=str(tmp_path))
    with pytest.raises(RuntimeError, match="timed out after 5 s .process group killed."):
        runner.run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], limit_s=5)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # SIGKILL takes effect when the process next runs: later on a loaded machine
    while (state := _state(grandchild)) not in ("gone", "Z", "X") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state in ("gone", "Z", "X"), state  # gone, or a zombie waiting for init to reap it (killed, not running)


def _state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


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


class _Runner:  # a warm-up run, then gpt2 runs of 3 and 8 steps that took 10 s and 20 s (start-up in both)
    def __init__(self, elapsed=None):
        self.seen, self.elapsed = [], elapsed or {"1": 30.0, "3": 10.0, "8": 20.0}

    def train(self, args, ranks=1, limit_s=0, weights=True):
        self.seen.append(args)
        return {"elapsed_s": self.elapsed[args[args.index("--steps") + 1]]}

    def left(self):
        return 0.0  # no time left for PyTorch's side


def test_throughput_is_timed_from_the_difference_of_two_runs_after_a_warm_up():
    runner = _Runner()
    status, text, row = gpu_check.throughput(runner, "fp16", 989.5e12, (3, 8))
    from minizero.memory.estimator import model_flops_per_step
    from minizero.nn import get_config
    assert row["minizero_tokens_per_s"] == 8 * 1024 / 2.0  # 5 more steps took 10 s more
    assert row["minizero_mfu"] == pytest.approx(model_flops_per_step(get_config("gpt2"), 8) / 2.0 / 989.5e12)
    assert all("--device" in a and "cuda" in a and "fp16" in a for a in runner.seen)
    assert [a[a.index("--steps") + 1] for a in runner.seen] == ["1", "3", "8"]  # the untimed warm-up first
    assert status == "measured" and "tokens/s" in text and "PyTorch side not run" in text


@pytest.mark.parametrize("longer_s", [10.0, 9.0])
def test_a_step_time_of_zero_or_less_is_an_error(longer_s):
    with pytest.raises(RuntimeError, match="step time .* <= 0"):
        gpu_check.throughput(_Runner({"1": 30.0, "3": 10.0, "8": longer_s}), "fp32", 66.9e12, (3, 8))


def test_the_float16_matmul_row_passes_numpys_product_and_fails_a_wrong_one(monkeypatch):
    """The row's comparison on NumPy (on the GPU it runs on CuPy): minizero's float16 products pass, a product
    rounded to float16 twice over (a float16 accumulation's error) or left in float32 fails."""
    from minizero import backend

    try:
        assert gpu_check.half_gemms("numpy")[0] == "pass"
        right = backend.matmul
        monkeypatch.setattr(backend, "matmul", lambda a, b: right(a, b).astype(np.float32))
        assert gpu_check.half_gemms("numpy")[0] == "FAIL"
        monkeypatch.setattr(backend, "matmul", lambda a, b: (right(a, b) * np.float16(1.001)).astype(np.float16))
        status, detail = gpu_check.half_gemms("numpy")
        assert status == "FAIL" and "max relative" in detail
    finally:
        backend.set_backend("numpy")


def test_the_measured_tables_in_docs_gpu_md_are_the_committed_outputs():
    """No hand-typed number: docs/gpu.md's device-check table is the committed JSON rendered by the script's
    own table_lines, and its profile table is the committed output of bench/profile_step.py."""
    docs = os.path.join(REPO_ROOT, "docs")
    page = open(os.path.join(docs, "gpu.md")).read()
    with open(os.path.join(docs, "measured", "gpu_check_h200.json")) as f:
        result = json.load(f)
    assert result["hardware"]["name"] == "NVIDIA H200" and result["date"][:10] in page
    table = "\n".join(gpu_check.table_lines(result["checks"], gpu=True))
    assert table in page
    with open(os.path.join(docs, "measured", "gpu_check_h100.json")) as f:  # the H100's, 2026-12-05
        h100 = json.load(f)
    assert h100["hardware"]["name"].startswith("NVIDIA H100") and h100["date"][:10] in page
    assert "\n".join(gpu_check.table_lines(h100["checks"], gpu=True)) in page
    for earlier in ("gpu_check_h200_first.json", "gpu_check_h200_second.json"):  # their speed rows
        with open(os.path.join(docs, "measured", earlier)) as f:
            rows = [c for c in json.load(f)["checks"] if c["check"].startswith("gpt2")]
        assert len(rows) == 2 and "\n".join(gpu_check.table_lines(rows, gpu=True)) in page
    with open(os.path.join(docs, "measured", "profile_step_h200.md")) as f:
        printed = f.read().splitlines()
    rows = [line for line in printed if line.startswith("|")]
    assert len(rows) == 4 and "\n".join(rows) in page and printed[0] in page


def test_the_results_never_replace_what_the_user_wrote(tmp_path):
    """Attacker: --json pointed at a checkpoint's manifest.json (or its 'latest') replaced it after the whole
    check; '' failed only at the end; a missing folder was created. Only a new file or an earlier result goes.
    Before (minizero.jsons): an earlier result was known by its keys; a user's JSON with them was replaced, and so
    was a run's summary.json beside its weights; /dev/stdout was refused (and, until 2026-12-07, /dev/null)."""
    (tmp_path / "manifest.json").write_text('{"format": "minizero-checkpoint"}')
    (tmp_path / "latest").write_text("step_00000002")
    (tmp_path / "old.json").write_text(earlier_json(checks=[], hardware=None))
    (tmp_path / "mine.json").write_text('{"checks": [], "hardware": null}')  # a gpu_check result's keys, no mark
    (tmp_path / "model.npz").write_bytes(b"")
    (tmp_path / "summary.json").write_text(earlier_json(train_loss=[]))
    problem = gpu_check.json_target_problem
    for name in ("latest", "mine.json"):
        assert "does not hold a summary minizero wrote" in problem(str(tmp_path / name)), name
    for name in ("manifest.json", "summary.json"):
        assert f"would overwrite {name}, which minizero's" in problem(str(tmp_path / name))
    assert problem("/dev/stdout") is None and "descriptor 987 is not open" in problem("/dev/fd/987")
    assert problem("") == "--json '': give a file path"
    assert "does not exist" in problem(str(tmp_path / "no" / "x.json"))
    assert problem("/dev/null") is None  # written into, as train.py's --json (before: refused)
    assert "is a directory" in problem(str(tmp_path))
    for name in ("new.json/.", "old.json/.", "old.json/.."):  # before: new.json written, old.json failed late
        path = f"{tmp_path}/{name}"  # as typed: pathlib drops a last '.'
        assert problem(path) == f"--json {path!r} ends in {name[8:]!r}: give a file path"
    assert problem(str(tmp_path / "old.json")) is None and problem(str(tmp_path / "new.json")) is None


def test_a_big_json_at_the_results_path_is_not_parsed_whole(tmp_path, monkeypatch):
    """Before: any existing --json was json.load-ed whole (a 1 GB JSON of the user's: over a minute and GBs)."""
    import json
    from minizero import jsons
    (tmp_path / "big.json").write_text(json.dumps({"a": "x" * jsons.BIG}))
    monkeypatch.setattr(json, "load", lambda f: pytest.fail("parsed whole"))
    assert "does not hold a summary minizero wrote" in gpu_check.json_target_problem(str(tmp_path / "big.json"))


def test_the_equality_rows_train_with_dropout():
    """Rows 1-3 (CuPy against NumPy, two ranks against one, NCCL against MPI) run with dropout, so a GPU session
    checks the dropout generator's uint64 arithmetic on CuPy and the masks addressed by site and row; the
    flags parse as the main job's."""
    from minizero.args import parse_args
    args = parse_args(["--model", "tiny", *gpu_check.EQUAL], 1)
    assert args.dropout == 0.1 and args.dtype == "float64" and args.steps == 5
