"""bench/profile_step.py's attribution of own time to parts (what docs/benchmarks.md's profiles rest on)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import profile_step  # noqa: E402  (bench/ is no package; an import error fails, never skips)

WIDEN = ("/x/minizero/backend.py", 1, "widen")
TAKE = ("~", 0, "<method 'take' of 'numpy.ndarray' objects>")
KERNEL = ("/x/minizero/autograd/functional.py", 9, "forward")
HELPER = ("/x/numpy/_core/fromnumeric.py", 5, "clip")


def _stats():
    """cProfile's layout: key -> (calls, primitive calls, own s, cumulative s, {caller: (.., .., own s, ..)})."""
    return {
        KERNEL: (1, 1, 2.0, 6.0, {}),
        WIDEN: (2, 2, 1.0, 3.0, {KERNEL: (2, 2, 1.0, 3.0)}),
        TAKE: (3, 3, 1.5, 1.5, {WIDEN: (2, 2, 1.0, 1.0), KERNEL: (1, 1, 0.5, 0.5)}),
        HELPER: (2, 2, 1.0, 1.0, {TAKE: (1, 1, 0.4, 0.4), KERNEL: (1, 1, 0.6, 0.6)}),
    }


def test_share_below_follows_each_callers_own_time():
    share = profile_step.share_below(_stats(), {WIDEN})
    assert share[WIDEN] == 1.0 and share[KERNEL] == 0.0
    assert share[TAKE] == pytest.approx(1.0 / 1.5)  # 1.0 s of its 1.5 s came from widen
    assert share[HELPER] == pytest.approx(0.4 * (1.0 / 1.5) / 1.0)  # two levels down, through take's share


def test_split_parts_puts_the_time_below_casts_in_casts_and_keeps_the_total():
    parts = profile_step.split_parts(_stats(), profile_step.CAST_PARTS, scale=5.5)
    below = 1.0 + 1.0 + 0.4 * (1.0 / 1.5)
    assert parts["casts"] == pytest.approx(below)
    assert sum(parts.values()) == pytest.approx(5.5)  # own times add up to the step: nothing lost or counted twice
    assert parts["elementwise"] == pytest.approx(2.0 + 0.5)  # the kernel's own time and take's other half


def test_profiled_steps_time_only_the_steps_after_warmup():
    """The window opens at the first step after warm-up and closes at the loop's end (on_train_end), so the
    final validation and the report that follow are neither timed nor profiled."""
    import cProfile
    import time

    from minizero.callbacks import Callback, CallbackList

    seen = []

    class Record(Callback):
        def on_step_start(self, run, step):
            seen.append(("start", step))

        def on_train_end(self, run):
            seen.append(("end", None))

    hook = profile_step.ProfiledSteps(cProfile.Profile(), warmup=1)
    hook.callbacks = CallbackList([Record()])  # what setup() builds from the main job's defaults
    hook.on_step_start(None, 0)
    assert hook.started is None  # warm-up: not timed
    hook.on_step_start(None, 1)
    time.sleep(0.02)
    hook.on_train_end(None)
    after = hook.seconds
    time.sleep(0.05)  # what the loop does after its end (validation, report)
    assert after >= 0.02 and hook.seconds == after  # frozen at the end: the sleep below is not in it
    assert seen == [("start", 0), ("start", 1), ("end", None)]  # every point still reaches the callbacks


def test_the_gpu_parts_name_minizeros_cublas_calls_matmul():
    assert profile_step.part_of("/x/minizero/backend.py", "_cupy_matmul", False) == "matmul"
    assert profile_step.part_of("~", "<built-in method cupy_backends.cuda.libs.cublas.gemmStridedBatchedEx>",
                                False) == "matmul"
    assert profile_step.part_of("~", "<method 'astype' of 'cupy._core.core._ndarray_base' objects>",
                                False) == "elementwise"
    assert profile_step.part_of("~", "<built-in method cupy._core.core.ascontiguousarray>", False) == "elementwise"
    assert profile_step.part_of("/site-packages/cupy/_sorting/search.py", "where", False) == "elementwise"
    assert profile_step.part_of("/x/minizero/autograd/engine.py", "apply", False) == "python"


@pytest.mark.timeout(300)
def test_a_device_profile_runs_its_profiled_steps_in_a_child_with_launch_blocking(monkeypatch):
    """--device strict takes the path --device cuda takes: the profiled run in a child process with
    CUDA_LAUNCH_BLOCKING=1 (and this process's threads and malloc setting), its profile read back from a file;
    the timed run in this process has no profiler on."""
    import subprocess

    children, enabled, real_run = [], [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: children.append((cmd, kw)) or real_run(cmd, **kw))
    real_enable = profile_step.cProfile.Profile.enable
    monkeypatch.setattr(profile_step.cProfile.Profile, "enable", lambda self: enabled.append(1) or real_enable(self))
    out = profile_step.profile_main_job("fp16", batch=1, steps=2, warmup=1, device="strict", model="tiny",
                                        threads=1)
    assert enabled == []  # no profiler in this process: the step time is unprofiled
    (cmd, kw), = children
    assert kw["env"]["CUDA_LAUNCH_BLOCKING"] == "1" and "--profile-worker" in cmd and kw["timeout"] > 0
    assert '"--device", "strict"' in cmd[-1] and cmd[-1].endswith(", 1, false]")  # threads 1, malloc kept
    assert out["minizero"] > 0 and out["casts"] > 0  # float16 storage is widened at every kernel (in the child)
    assert sum(out[p] for p in profile_step.CAST_PARTS) == pytest.approx(out["minizero"])  # shares of the step


def test_device_and_model_need_the_main_jobs_mode():
    import subprocess
    script = os.path.join(os.path.dirname(profile_step.__file__), "profile_step.py")
    cases = [(["--device", "cuda"], "give --precision too"),
             (["--threads", "100000"], "argument --threads: '100000' is above "),
             (["--steps", "100000000000"], "argument --steps: '100000000000' is above 10,000"),
             (["--warmup", "-1"], "argument --warmup: '-1' is below 0; allowed: an integer in 0..10,000"),
             (["--precision", "fp16,fp16"], "each once"), (["--batch", "8,8"], "each batch size once"),
             (["--precision", "fp16", "--model", "x"], "argument --model: 'x': allowed: a model preset, one of deep")]
    try:
        import cupy  # noqa: F401
    except ImportError:  # no CuPy: one line naming the install, not a DeviceError traceback
        cases.append((["--precision", "fp16", "--device", "cuda"], "--device cuda needs CuPy"))
    for argv, said in cases:
        done = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr and "usage:" not in done.stderr, done.stderr


def test_bench_header_names_this_process_s_blas_threads_or_the_ranks_rule():
    import _machine
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not blas:
        pytest.skip("no BLAS that threadpoolctl sees: the header says 'BLAS unknown'")
    own, ranks = _machine.header(), _machine.header(_machine.RANK_THREADS)
    assert f"{_machine.count(blas[0]['num_threads'], 'thread')})" in own and f"{_machine.RANK_THREADS})" in ranks
    assert "threads)" not in ranks and "OPENBLAS_CORETYPE=" in ranks
    assert f"| numpy {np.__version__} |" in own  # casts and ufunc loops change speed between NumPy releases


def test_the_header_says_1_thread_not_1_threads():
    """Before: 'kernel SkylakeX, 1 threads' (a new user's find)."""
    import _machine

    assert (_machine.count(1, "thread"), _machine.count(2, "thread"), _machine.count("?", "thread")) == (
        "1 thread", "2 threads", "? threads")


def test_without_pytorch_the_table_says_why_its_columns_are_empty(monkeypatch, capsys):
    monkeypatch.setattr(profile_step, "import_torch", lambda: None)
    monkeypatch.setattr(profile_step, "profile", lambda b, steps: dict.fromkeys([*profile_step.PARTS, "minizero"], 1.0))
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--batch", "1", "--threads", "1"])
    profile_step.main()
    out = capsys.readouterr().out.splitlines()
    assert out[-2].endswith("| - | - |") and out[-1].startswith("PyTorch is not installed here"), out
