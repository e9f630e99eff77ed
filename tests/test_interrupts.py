"""Ctrl-C and SIGTERM in the command-line tools other than the main job (that one: test_reliability.py): one
``interrupted`` line naming the tool and the signal, exit 128 + the signal, no traceback, no half-written file, no
mpiexec job left behind, and no interrupt lost in a weakref callback."""
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref

import pytest

from tests.conftest import REPO_ROOT, mpi_env
from minizero.interrupts import Interrupts, interruptible


def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment holds ``mark`` (this test's launches and everything they started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _ranks_running(mark: str, module: str) -> int:
    """How many of this test's processes run ``python -m module``: an mpiexec job's ranks (not mpiexec itself)."""
    n = 0
    for pid in _marked_processes(mark):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += f.read().split(b"\0")[1:3] == [b"-m", module.encode()]
        except OSError:
            pass
    return n


def _ranks_imported(mark: str, n: int) -> bool:
    """Whether ``n`` of this test's MPI ranks have loaded NumPy: minizero's ``__init__`` (which sets SIGINT's
    default action for ``python -m minizero.X``) runs before any of its modules imports NumPy."""
    found = 0
    for pid in _marked_processes(mark):
        try:
            with open(f"/proc/{pid}/environ", "rb") as env, open(f"/proc/{pid}/maps") as maps:
                found += any(v.startswith(b"PMI_RANK=") for v in env.read().split(b"\0")) and \
                    "_multiarray_umath" in maps.read()
        except OSError:
            pass
    return found >= n


def _first_line(stream, timeout: float) -> str:
    """The first line a process prints on ``stream`` ("" if none within ``timeout`` s or it ended first)."""
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def _interrupt(cmd, delay, sig=signal.SIGINT, mark=None, ready=None, after_first_line=None):
    """Start ``cmd`` (its own session, so SIGINT is not ignored), send ``sig`` ``delay`` s after ``ready()`` holds
    or after its first line on ``after_first_line`` ("stdout" or "stderr"; at most 150 s of waiting); (status,
    stderr, that first line not included).

    Before set-up ends the tools keep SIGINT's and SIGTERM's default action (minizero.interrupts.guard_set_up):
    a signal sent a fixed time after start landed there on a loaded machine (load 9 on 2 cores: status -15, not
    143). So a test of the one-line message waits for a line printed after set-up (finetune's header)."""
    mark = mark or uuid.uuid4().hex
    env = dict(mpi_env(), MINIZERO_TEST_MARK=mark)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while ready is not None and not ready() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        if after_first_line:
            assert _first_line(getattr(proc, after_first_line), 150), \
                f"no line on {after_first_line} within 150 s: {proc.poll()}"
        time.sleep(delay)
        assert proc.poll() is None, f"ended before the signal: {proc.communicate()}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _one_line(err, tool, name):
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.count("interrupted") == 1, err
    assert f"python -m {tool}: interrupted ({name})" in err, err


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The tiny model's weights as train writes them (model.npz beside model.json), made here (none of the tests
    needs them trained: a 2-step train in a subprocess cost a Python start-up), and a text to fine-tune on."""
    import numpy as np

    from minizero.args import model_config, parse_args
    from minizero.nn import GPT
    from minizero.saved_model import write_model_json

    out = tmp_path_factory.mktemp("base")
    cfg = model_config(parse_args(["--model", "tiny", "--no-save"], 1))
    np.savez(out / "model.npz", **GPT(cfg).state_dict())
    write_model_json(str(out), cfg)
    data = out / "finetune.txt"
    data.write_text(open(os.__file__).read() * 3)
    return out / "model.npz", data


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig,code,name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_finetune_interrupted_prints_one_line_and_writes_nothing(weights, tmp_path, sig, code, name):
    out = tmp_path / "ft"
    status, err = _interrupt([sys.executable, "-m", "minizero.finetune", "--weights", str(weights[0]), "--data",
                              str(weights[1]), "--steps", "100000", "--batch-size", "2", "--eval-batches", "1",
                              "--out", str(out), "--json", str(tmp_path / "ft.json")], 0.5, sig,
                             after_first_line="stdout")  # its header: printed once set-up has ended
    assert status == code, err
    _one_line(err, "minizero.finetune", name)
    assert not (tmp_path / "ft.json").exists() and not (out.exists() and os.listdir(out)), os.listdir(tmp_path)


@pytest.mark.timeout(200)
def test_debug_parity_interrupted_ends_its_mpiexec_job(mpiexec, tmp_path):
    mark = uuid.uuid4().hex
    status, err = _interrupt([sys.executable, "-m", "minizero.debug", "parity", "-n 2 --dp 2", "-n 1",
                              "--steps", "100000", "--model", "tiny"], 2, mark=mark,
                             ready=lambda: _ranks_running(mark, "minizero.train") == 2)  # its first job's ranks
    assert status == 130, err
    _one_line(err, "minizero.debug", "SIGINT")
    deadline = time.monotonic() + 60  # ends, however loaded the machine; a job left running fails below
    while _marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _marked_processes(mark), "the parity run's mpiexec or ranks outlived the interrupt"


def test_an_interrupt_dropped_in_a_weakref_callback_is_not_lost(monkeypatch, capsys):
    monkeypatch.setattr(Interrupts, "raised", [])
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    class Array:
        pass

    def main(argv):
        a = Array()
        ref = weakref.ref(a, lambda r: Interrupts.handler(KeyboardInterrupt)(signal.SIGINT, None))  # Ctrl-C there
        del a  # Python prints the callback's KeyboardInterrupt as "Exception ignored" and goes on
        assert ref() is None
        return 0

    try:
        assert interruptible("minizero.sample", "nothing was written", main) == 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert "Exception ignored" not in err and err.count("interrupted (SIGINT)") == 1, err


def test_a_stale_launcher_rank_still_says_it_was_interrupted():
    """PMI_SIZE=2 PMI_RANK=1 left in a shell, no launcher (compare, finetune, hardware run): Ctrl-C printed nothing."""
    code = ("import sys; from minizero.interrupts import interruptible\n"
            "def main(argv):\n    raise KeyboardInterrupt\n"
            "sys.exit(interruptible('minizero.compare', 'nothing', main))")
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=dict(env, PMI_SIZE="2", PMI_RANK="1"), timeout=60)
    assert proc.returncode == 130 and "python -m minizero.compare: interrupted (SIGINT)" in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tool,args", [("minizero.sample", ["--tokens", "100000"])])
def test_a_long_tool_interrupted_prints_one_line(weights, tool, args):
    # after its settings line on stderr, printed in main, inside interruptible (a fixed 3 s from its start lands in
    # the imports on a slow enough machine, where SIGINT keeps its default action: status -2)
    status, err = _interrupt([sys.executable, "-m", tool, "--weights", str(weights[0]), *args], 0.5,
                             after_first_line="stderr")
    assert status == 130, err
    _one_line(err, tool, "SIGINT")


@pytest.mark.parametrize("printing", ["print('x' * 100_000)", "print('x', flush=True); print('y')"])
def test_stdout_closed_by_its_reader_ends_quietly(printing):
    """``python -m minizero.plan ... | head -1``: the rest dropped, exit 0, no BrokenPipeError traceback (every tool
    runs in interruptible; before, only plan and sample caught it, and debug said "error: [Errno 32] Broken pipe")."""
    code = ("import sys; from minizero.interrupts import interruptible\n"
            f"def main(argv):\n    {printing}\n    return 0\n"
            "sys.exit(interruptible('tool', 'nothing', main))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == "", err


def test_every_tool_runs_in_interruptible():
    """Each ``python -m minizero.X`` but the main job (its own MPI-aware handling) ends its ``__main__`` block
    through ``interruptible``, so ``| head -1`` and Ctrl-C end every tool the same way (compare did not)."""
    import pathlib
    tools = [p for p in pathlib.Path(REPO_ROOT, "minizero").rglob("*.py")
             if 'if __name__ == "__main__":' in p.read_text()]
    assert len(tools) >= 8, tools
    bare = [p.name for p in tools if p.name != "train.py"
            and "interruptible(" not in p.read_text().split('if __name__ == "__main__":')[-1]]  # the last one
    assert bare == []


def test_every_bench_script_and_the_lesson_build_run_in_run_script():
    """bench/*.py and lessons/build.py end their ``__main__`` through ``run_script`` (the stdout watcher)."""
    import pathlib
    scripts = [*pathlib.Path(REPO_ROOT, "bench").glob("*.py"), pathlib.Path(REPO_ROOT, "lessons", "build.py")]
    scripts = [p for p in scripts if 'if __name__ == "__main__":' in p.read_text()]
    assert len(scripts) >= 20, scripts
    bare = [p.name for p in scripts if "run_script(main)" not in p.read_text().split('if __name__ == "__main__":')[-1]]
    assert bare == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,code,name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_bench_script_interrupted_prints_one_line(sig, code, name):
    """``python bench/X.py``, Ctrl-C: before, a KeyboardInterrupt traceback; SIGTERM: killed silently (status -15),
    leaving the mpiexec job it launched running (bench_memory.py). Now one line, 130 / 143."""
    cmd = [sys.executable, "bench/bench_heldout.py", "--model", "tiny", "--steps", "1000000", "--batches", "1"]
    status, err = _interrupt(cmd, 1, sig, after_first_line="stdout")  # its first line: the header, before training
    assert status == code and "Traceback" not in err and err == f"bench_heldout.py: interrupted ({name})\n", err


@pytest.mark.timeout(300)
def test_a_bench_script_s_launched_ranks_end_with_it_on_sigterm(mpiexec, tmp_path):
    """A bench script launching the main job got SIGTERM: subprocess.run killed the launcher alone. Under a
    launcher that runs mpiexec as its child (Intel MPI's mpirun script, a module's wrapper), mpiexec and every rank
    ran on after the script's "interrupted" line. Now its whole process group ends (minizero.interrupts.run_group)."""
    wrapper = tmp_path / "mpirun"
    wrapper.write_text(f'#!/bin/sh\n"{mpiexec}" "$@"\n')  # not exec: mpiexec is the wrapper's child
    wrapper.chmod(0o755)
    code = ("import runpy, sys; import minizero.files\n"
            f"minizero.files.mpiexec_path = lambda: {str(wrapper)!r}\n"
            "sys.argv = ['bench/bench_memory.py', '--model', 'tiny', '--ranks', '2', '--steps', '1000000', "
            "'--configs', 'baseline']\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    mark = uuid.uuid4().hex
    try:
        status, err = _interrupt([sys.executable, "-c", code], 1, signal.SIGTERM, mark=mark,
                                 ready=lambda: _ranks_running(mark, "minizero.train") == 2)
        assert status == 143 and err.endswith("bench_memory.py: interrupted (SIGTERM)\n"), err
        deadline = time.time() + 10
        while _marked_processes(mark) and time.time() < deadline:
            time.sleep(0.2)
        assert not _marked_processes(mark), "the bench script's mpiexec or ranks outlived its SIGTERM"
    finally:
        for pid in _marked_processes(mark):  # what outlived it before (mpiexec, its proxy, both ranks)
            os.kill(pid, signal.SIGKILL)


def _reader_gone(argv):
    """``argv`` with its stdout's reader gone before the first write: (exit status, stderr)."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=mpi_env())
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


@pytest.mark.timeout(180)
def test_a_bench_script_and_the_lesson_build_end_quietly_when_stdout_s_reader_goes(tmp_path):
    """``python bench/X.py | head -1``, ``python lessons/build.py | head -1``: before, a BrokenPipeError traceback
    and exit 1 (neither ran in interruptible, as the tools do); now the rest is dropped, exit 0, nothing on stderr."""
    import pathlib
    import shutil
    bench = ["bench/bench_recompute.py", "--model", "tiny", "--batch", "2", "--repeats", "1"]
    assert _reader_gone(bench) == (0, "")
    for out, code, said in ((">&-", 2, "standard output is closed (>&-); send it to a file or to /dev/null"),
                            ("> /dev/full", 1, "cannot write standard output (No space left on device)")):
        proc = subprocess.run(f"{sys.executable} {' '.join(bench)} {out}", shell=True, capture_output=True, text=True,
                              cwd=REPO_ROOT, env=mpi_env(), timeout=120)
        assert proc.returncode == code and proc.stderr.startswith(f"bench_recompute.py: error: {said}"), proc.stderr
    lessons = tmp_path / "lessons"  # a copy of build.py over one template of its own: the real lessons stay as they are
    (lessons / "templates").mkdir(parents=True)
    (lessons / "values").mkdir()
    shutil.copy(pathlib.Path(REPO_ROOT, "lessons", "build.py"), lessons)
    (lessons / "templates" / "99_x.md").write_text("x {{ a }}\n")
    (lessons / "values" / "99_x.json").write_text('{"a": 1}')
    assert _reader_gone([str(lessons / "build.py"), "--no-execute", "99_x"]) == (0, "")
    assert (lessons / "99_x.md").read_text().endswith("x 1\n")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("cmd,line", [
    (["minizero.plan", "--model", "tiny", "--gpus", "1"], "python -m minizero.plan: error: cannot write standard "
                                                          "output (No space left on device); files already written"),
    (["minizero.train", "--model", "tiny", "--steps", "1", "--no-save", "--eval-batches", "1", "--progress", "none"],
     "[rank 0] minizero.train failed: cannot write standard output (No space left on device)"),
])
def test_stdout_on_a_full_disk_is_one_line(cmd, line):
    """``> /dev/full`` (a full disk): before, print's OSError traceback (plan, sample, quantize, compare, train)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", *cmd], stdout=full, stderr=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env=mpi_env(), timeout=100)
    said = " ".join(proc.stderr.split())  # a long line goes on over indented lines of <= 120 columns
    assert proc.returncode == 1 and line in said and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(200)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_finetune_json_on_a_full_disk_is_one_line(weights):
    """Before: the runs, then a WriteError traceback (quantize said it in one line); then the runs and that line.
    Now /dev/full (written no bytes: check_writable_file) is refused before any step."""
    proc = subprocess.run([sys.executable, "-m", "minizero.finetune", "--weights", str(weights[0]), "--data",
                           str(weights[1]), "--method", "full", "--steps", "1", "--eval-batches", "1", "--json",
                           "/dev/full"], capture_output=True, text=True, cwd=REPO_ROOT, env=mpi_env(), timeout=180)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == ("python -m minizero.finetune: error: --json '/dev/full' cannot be written (No space left "
                           "on device);\n  give a file on a writable file system\n"), proc.stderr


@pytest.mark.timeout(120)
def test_finetune_rank_stalled_in_start_up_ends_the_job_after_comm_timeout(mpiexec, weights, tmp_path):
    """As the main job (test_reliability): a rank stopped before Python runs left its peer in MPI_Init for ever;
    fine-tuning had no set-up bound. Now faulthandler's timer (minizero.interrupts.guard_set_up) ends it."""
    cmd = [sys.executable, "-m", "minizero.finetune", "--weights", str(weights[0]), "--data", str(weights[1]),
           "--steps", "2", "--batch-size", "2", "--eval-batches", "1", "--comm-timeout", "2"]
    stopped = "kill -STOP $$; exec " + " ".join(cmd)
    t0 = time.monotonic()
    proc = subprocess.Popen([mpiexec, "-n", "1", *cmd, ":", "-n", "1", "sh", "-c", stopped], env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:  # a hang must not leave the launcher's proxy (it spun a core for ever) and the stopped rank behind
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "Timeout (0:00:02)!" in err, err
    assert time.monotonic() - t0 < 60


def _ctrl_c_after(mpiexec, argv, delay):
    """``mpiexec -n 2 python -m *argv``, SIGINT (Ctrl-C) ``delay`` s after both ranks ran minizero's start-up code
    (:func:`_ranks_imported`; a fixed delay from the launch landed before it on a loaded machine, where Python's
    own handler still prints a KeyboardInterrupt traceback): the finished process and its stderr."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", *argv], env=dict(mpi_env(),
                            MINIZERO_TEST_MARK=mark), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 150
        while not _ranks_imported(mark, 2) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, f"ended before its ranks had started: {proc.communicate()}"
        assert _ranks_imported(mark, 2), "the ranks did not load NumPy within 150 s"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, err


@pytest.mark.timeout(400)
@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_ctrl_c_while_finetune_ranks_start_prints_no_traceback(mpiexec, weights, tmp_path, delay):
    """Ctrl-C while the ranks imported printed a KeyboardInterrupt traceback per rank (fine-tuning's handlers came
    with its imports); inside MPI_Init a Python handler never runs. Now the signal's default action until set-up
    ends, as the main job: mpiexec's status, no traceback, no hang; after set-up, one line."""
    proc, err = _ctrl_c_after(mpiexec, ["minizero.finetune", "--weights", str(weights[0]), "--data", str(weights[1]),
                                        "--steps", "100000", "--batch-size", "2", "--eval-batches", "1", "--out",
                                        str(tmp_path / "ft")], delay)
    assert proc.returncode != 0
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.count("minizero.finetune: interrupted") <= 1, err
    assert not (tmp_path / "ft").exists() or os.listdir(tmp_path / "ft") == [".lock"]


@pytest.mark.parametrize("argv,seconds", [
    (["--comm-timeout", "3"], 3.0), (["--comm-timeout=5"], 5.0), (["--comm-timeout", "2", "--comm-timeout", "7"], 7.0),
    (["--comm-timeout", "\u0663"], 600.0), (["--comm-timeout", "0"], 600.0), (["--comm-timeout", "nan"], 600.0),
    (["--comm-timeout", "1_0"], 600.0), (["--comm-timeout"], 600.0), ([], 600.0),
    (["--comm-timeout", "1"], 1.0), (["--comm-timeout", "0.99"], 600.0)])  # the minimum (1 s here) is allowed
def test_set_up_waits_at_most_the_comm_timeout_given(argv, seconds):
    """What train and finetune bound their set-up with, read before MPI starts (their parsers refuse bad values)."""
    from minizero.interrupts import set_up_timeout

    assert set_up_timeout(argv, 600.0, 1.0) == seconds


FORKED_IN_THE_BLOCK = """
import os, sys, time
from minizero.interrupts import mpi_start_guarded
with mpi_start_guarded("forks.py", sys.argv[1:]):
    if os.fork() == 0:  # a child that keeps the watchdog's pipe open past the block
        time.sleep(4)
        os._exit(0)
time.sleep(3)
print("done", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_mpi_start_watchdog_ends_with_the_block_though_a_forked_child_holds_its_pipe():
    """Before: the watchdog stopped only at its pipe's end of file; a child forked without exec kept the write end,
    and 2 s later it ended the process that started fine ("MPI_Init waited 2 s ... and was ended", exit 143)."""
    clean = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI", "OMPI_", "PMIX", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", FORKED_IN_THE_BLOCK, "--comm-timeout", "2"], capture_output=True,
                          text=True, timeout=30, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, env=clean)
    assert proc.returncode == 0 and proc.stdout == "done\n" and proc.stderr == "", (proc.returncode, proc.stderr)


@pytest.mark.parametrize("launch,default_action", [
    (["-m", "minizero.sample"], True), (["-mminizero.quantize"], True), (["-m", "pytest"], False), ([], False)])
def test_ctrl_c_while_a_tool_imports_ends_it_without_a_traceback(launch, default_action):
    """``python -m minizero.sample`` (quantize, plan, ...) interrupted while importing NumPy and minizero printed a
    KeyboardInterrupt traceback per rank: the tools' handlers come with main(). Now importing the package for
    ``python -m minizero.X`` gives SIGINT its default action until the program installs its own; any other program
    importing minizero keeps Python's handler."""
    code = ("import signal, sys\n"
            f"if {bool(launch)}:\n"
            f"    sys.argv[:1] = ['-m']; sys.orig_argv[:] = [sys.executable, *{launch!r}]  # as runpy while it imports\n"
            "import minizero\n"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_DFL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=mpi_env(),
                          timeout=60)
    assert proc.stdout.strip() == str(default_action), proc.stderr


@pytest.mark.parametrize("size,status", [("2", -signal.SIGTERM), ("1", -signal.SIGINT), ("", -signal.SIGINT)])
def test_ctrl_c_while_one_of_several_mpich_ranks_imports_ends_it_as_sigterm(size, status):
    """SIGINT's default action on one MPICH rank (2), ORed by the launcher with the SIGKILL it sends the others (9),
    read "Segmentation fault (signal 11)". Now one of several ranks (PMI_SIZE > 1) ends by SIGTERM (15 | 9 = 15)."""
    code = ("import os, signal, sys, time\n"
            "sys.argv[:1] = ['-m']; sys.orig_argv[:] = [sys.executable, '-m', 'minizero.train']\n"
            "import minizero\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=dict(mpi_env(), PMI_SIZE=size), timeout=60)
    assert proc.returncode == status and not proc.stderr, proc.stderr


@pytest.mark.timeout(400)
def test_ctrl_c_while_tool_ranks_start_prints_no_traceback(mpiexec, weights):
    """One tool for all: what a tool does while its ranks start is minizero/__init__.py's (no branch on the tool),
    then interruptible's (every tool's: test_every_tool_runs_in_interruptible). sample, which loads weights and then
    runs on, is still starting or working when the signal lands (plan, dropped here, may have ended)."""
    argv = ["minizero.sample", "--tokens", "100000", "--weights", str(weights[0])]
    for delay in (0.2, 0.5):
        proc, err = _ctrl_c_after(mpiexec, argv, delay)
        assert "Traceback" not in err and "Exception ignored" not in err, err


def test_each_printed_line_is_one_write_under_pythonunbuffered(monkeypatch):
    """Under PYTHONUNBUFFERED (set in many containers) stdout and stderr write through: print sent a line's text
    and its newline in two writes, and MPICH's launcher put another rank's line between them ("[0] a[1] b" then
    two newlines). A program's start (watch_stdout) makes each line one write."""
    import io

    from minizero.interrupts import watch_stdout

    class Raw(io.RawIOBase):  # the file descriptor: records each write
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    streams = {}
    for name in ("stdout", "stderr"):
        streams[name] = io.TextIOWrapper(Raw(), encoding="utf-8", write_through=True)  # what -u gives
        monkeypatch.setattr(sys, name, streams[name])
        monkeypatch.setattr(sys, f"__{name}__", streams[name])
    watch_stdout()
    print("[rank 1] [stage 1] act mb0 (2, 16, 16) <── stage 0")
    print("error: one line", file=sys.stderr)
    assert streams["stdout"].buffer.writes == [b"[rank 1] [stage 1] act mb0 (2, 16, 16) <\xe2\x94\x80\xe2\x94\x80 "
                                               b"stage 0\n"]
    assert streams["stderr"].buffer.writes == [b"error: one line\n"]


def test_closed_stdout_is_one_line_and_exit_2_before_any_work(monkeypatch, capsys):
    """``python -m minizero.X >&-`` (every tool, through interruptible): before, watch_stdout wrapped None and each
    print raised AttributeError (tracebacks, exit 120)."""
    from minizero.interrupts import watch_stdout

    monkeypatch.setattr(sys, "stdout", None)
    ran = []
    with pytest.raises(SystemExit) as stop:
        interruptible("minizero.plan", "nothing", lambda argv: ran.append(1) or 0)
    assert stop.value.code == 2 and ran == []
    assert capsys.readouterr().err == ("python -m minizero.plan: error: standard output is closed (>&-); send it to "
                                       "a file or to /dev/null (> /dev/null)\n")
    with pytest.raises(SystemExit):
        watch_stdout("minizero.train")  # the main job's __main__ (below)


@pytest.mark.timeout(120)
def test_main_job_with_closed_stdout_or_its_reader_gone_says_one_line():
    """``>&-``: exit 2, one line. ``| head -2``: before, "minizero.train failed: BrokenPipeError" and a traceback
    through progress.py, exit 1; now one line and 141 (128 + SIGPIPE)."""
    cmd = [sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "2", "--no-save"]
    closed = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=mpi_env(), timeout=100,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2 and closed.stderr.startswith("python -m minizero.train: error: standard output "
                                                               "is closed"), closed.stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env=mpi_env())
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=100) == 141 and "Traceback" not in err, err
    assert " ".join(err.split()) == ("[rank 0] minizero.train stopped: standard output's reader went away (broken "
                                     "pipe); files already written are left as they were")


@pytest.mark.parametrize("encoding,shown", [("ascii", b"sample: a\\ufffdb\n"), ("latin-1", b"sample: a\\ufffdb\n"),
                                            ("utf-8", "sample: a\ufffdb\n".encode())])
def test_any_stdout_encoding_prints_the_sample(monkeypatch, encoding, shown):
    """``PYTHONIOENCODING=ascii python -m minizero.train``: before, it trained, wrote its files, then raised
    UnicodeEncodeError printing the sample (U+FFFD); a UTF-8 terminal shows what it showed."""
    import io

    from minizero.interrupts import watch_stdout

    stream = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "__stdout__", stream)
    watch_stdout()
    print("sample: a\ufffdb")
    sys.stdout.flush()
    assert stream.buffer.getvalue() == shown


def test_run_script_s_interrupt_line_comes_from_rank_0_only(monkeypatch, capsys):
    """Under a launcher (PMI_FD a socket) every rank gets mpiexec's SIGINT: before, every rank of a bench script
    printed 'interrupted'; the tools' rule (rank 0 speaks) now holds for the scripts too (a reviewer's find)."""
    import socket

    from minizero.interrupts import run_script

    ours, _theirs = socket.socketpair()
    monkeypatch.setenv("PMI_FD", str(ours.fileno()))
    monkeypatch.setenv("PMI_SIZE", "2")

    def interrupted():
        raise KeyboardInterrupt

    try:
        for rank, said in (("1", ""), ("0", "interrupted (SIGINT)")):
            monkeypatch.setenv("PMI_RANK", rank)
            assert run_script(interrupted) == 130
            err = capsys.readouterr().err
            assert (said in err) if said else err == "", (rank, err)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ours.close()
        _theirs.close()


def test_the_mpi_start_guard_gives_back_the_signal_handlers_it_found(monkeypatch):
    """Inside mpi_start_guarded SIGINT and SIGTERM take their default action (no Python handler runs in MPI_Init);
    after the block, normal or raising, the handlers it found are back, and an ignored SIGINT stays ignored."""
    import signal

    from minizero.interrupts import mpi_start_guarded

    for k in [k for k in os.environ if k.startswith(("PMI", "PMIX", "OMPI_"))]:
        monkeypatch.delenv(k)
    mine = lambda signum, frame: None  # noqa: E731
    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with mpi_start_guarded("t", timeout_s=60):
            assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == [signal.SIG_DFL] * 2
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(ValueError), mpi_start_guarded("t", timeout_s=60):
            raise ValueError("the block failed")
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with mpi_start_guarded("t", timeout_s=60):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_run_script_says_which_run_failed_and_why(capsys):
    """A bench script's launched run that fails (run_group(check=True), its output captured): before, a
    CalledProcessError traceback without the run's own error; now that error's last lines, one line naming the
    command, exit 1."""
    from minizero.interrupts import run_script

    def failed():
        raise subprocess.CalledProcessError(2, ["mpiexec", "-n", "8", "python", "-m", "minizero.train"],
                                            stderr="python -m minizero.train: error: --out 'x' is not a directory\n")

    try:
        assert run_script(failed) == 1
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--out 'x' is not a directory" in err, err
    assert "error: a run exited 2: mpiexec -n 8 python -m minizero.train" in err, err


def test_of_two_dropped_interrupts_the_first_is_raised_again(monkeypatch):
    """Interrupts.check raises the first signal's exception (Ctrl-C, then SIGTERM: KeyboardInterrupt, exit 130)."""
    from minizero.interrupts import Terminated

    monkeypatch.setattr(Interrupts, "raised", [KeyboardInterrupt, Terminated])
    with pytest.raises(KeyboardInterrupt):
        Interrupts.check()


def test_end_of_set_up_forgets_interrupts_of_an_earlier_run(monkeypatch):
    """A program run twice in one process (tests, notebooks): the first run's dropped interrupt is not raised again."""
    from minizero.interrupts import end_set_up

    monkeypatch.setattr(Interrupts, "raised", [KeyboardInterrupt])
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        end_set_up()
        Interrupts.check()
    except KeyboardInterrupt:  # not pytest's own: it would end the session
        pytest.fail("end_set_up kept an earlier run's dropped interrupt")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
