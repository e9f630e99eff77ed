"""Nothing lost, nothing stuck: outputs on full disks and devices, a locked OUT, stalled and orphaned ranks.

Full disks are small tmpfs mounts (root only; skipped with the reason elsewhere), always
unmounted. Every test that launches ranks has a timeout.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from minizero.args import UsageError, parse_args
from minizero.data import eval_batches, global_batch
from minizero.files import FolderLock, FolderLocked, WriteError, atomic_write
from minizero.memory.offload import ActivationOffload, OffloadError, ram_backed
from tests.conftest import REPO_ROOT, earlier_json, mpi_env

TINY = ["--model", "tiny", "--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "8",
        "--no-progress"]


def launch(mpiexec, n, args, timeout=120, env=None, module=("-m", "minizero.train")):
    t0 = time.monotonic()
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, *module, *args], env=env or mpi_env(),
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.fixture
def small_disk(tmp_path):
    """A factory: ``small_disk(size)`` mounts a tmpfs of ``size`` (e.g. "64k") and returns its path."""
    mounted = []

    def mount(size):
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        for _ in range(20):  # a rank killed a moment ago may still hold it
            if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)


def fill(disk):
    """Fill ``disk`` to the last byte."""
    try:
        with open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


# --------------------------------------------------------------------------- 1, 2: outputs
def test_atomic_write_on_a_full_disk_keeps_the_previous_file(small_disk):
    d = small_disk("64k")
    (d / "s.json").write_text('{"good": 1}')
    fill(d)
    with pytest.raises(WriteError, match=r"s\.json.*disk is full"):
        atomic_write(str(d / "s.json"), lambda f: f.write("x" * 20000), mode="w")
    assert (d / "s.json").read_text() == '{"good": 1}'
    assert sorted(os.listdir(d)) == ["filler", "s.json"]


def test_atomic_write_writes_into_devices_and_refuses_folders(tmp_path):
    before = os.stat("/dev/null")
    atomic_write("/dev/null", lambda f: f.write(b"x" * 100))
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    with pytest.raises(WriteError, match="is a directory"):
        atomic_write(str(tmp_path), lambda f: f.write(b"x"))
    p = tmp_path / "w.bin"
    atomic_write(str(p), lambda f: f.write(b"abc"))
    assert p.read_bytes() == b"abc" and oct(p.stat().st_mode & 0o777) != oct(0o600)


@pytest.mark.timeout(120)
def test_json_on_a_full_disk_exits_nonzero_and_keeps_the_previous_file(mpiexec, small_disk, tmp_path):
    d = small_disk("64k")
    earlier = earlier_json(train_loss=[1], world_size=1, config={})  # a summary (another JSON is the user's: refused)
    (d / "s.json").write_text(earlier)
    fill(d)
    # one rank: the lock is rank 0's alone, its refusal every rank's (shown under 2 ranks by the locked OUT tests)
    proc, _ = launch(mpiexec, 1, TINY + ["--out", str(tmp_path / "o"), "--json", str(d / "s.json")], timeout=90)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout  # refused before work: its lock cannot be written
    said = proc.stderr.replace("\n  ", " ")  # a refusal past 120 columns goes on over indented lines
    assert said == (f"python -m minizero.train: error: --json {str(d / 's.json')!r}: could not write "
                    f"{str(d / '.s.json.lock')!r}: no space left on device (the disk is full)\n"), proc.stderr
    assert (d / "s.json").read_text() == earlier
    assert sorted(os.listdir(d)) == ["filler", "s.json"]


@pytest.fixture(scope="module")
def zero3_run_to_dev_null(tmp_path_factory):
    """One job for two tests: ``--zero 3 --tp 2`` on 2 ranks (one data rank), its summary to /dev/null;
    (the job, /dev/null's stat before it)."""
    from minizero.files import mpiexec_path

    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install mpich, or a system MPI)")
    before = os.stat("/dev/null")
    proc, _ = launch(mpiexec, 2, TINY + ["--zero", "3", "--tp", "2", "--out", str(tmp_path_factory.mktemp("o")),
                                         "--json", "/dev/null"], timeout=90)
    return proc, before


@pytest.mark.timeout(120)
def test_json_to_dev_null_keeps_the_device(zero3_run_to_dev_null):
    proc, before = zero3_run_to_dev_null
    assert proc.returncode == 0, proc.stderr
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_quantize_json_writes_into_dev_null():
    from minizero.quantize import write_json_atomic

    before = os.stat("/dev/null")
    write_json_atomic("/dev/null", {"a": 1})
    assert os.stat("/dev/null").st_ino == before.st_ino


# --------------------------------------------------------------------------- 3: offload on a full disk
@pytest.mark.timeout(120)
def test_nvme_optimizer_offload_on_a_full_disk_says_so_before_training(mpiexec, small_disk, tmp_path):
    d = small_disk("2m")
    proc, _ = launch(mpiexec, 2, ["--model", "small", "--steps", "2", "--eval-batches", "1", "--no-progress",
                                  "--no-save", "--offload-optimizer", "nvme", "--offload-dir", str(d)], timeout=90)
    assert proc.returncode not in (0, 7, -7), proc.stderr  # 7: SIGBUS
    assert "Bus error" not in proc.stderr
    assert "disk is full" in proc.stderr and str(d) in proc.stderr and "bytes are free" in proc.stderr, proc.stderr
    assert "validation loss" not in proc.stdout
    assert "RAM" in proc.stderr  # tmpfs: the warning that nothing is saved


def test_activation_offload_on_a_full_disk_says_so(small_disk):
    d = small_disk("64k")
    off = ActivationOffload("nvme", str(d))
    fill(d)
    with pytest.raises(OffloadError, match="disk is full"):
        off.pack(np.ones(100_000))


def test_ram_backed_is_the_longest_mount_prefix(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\n/dev/sdb1 /scratch/disk xfs rw 0 0\n")
    assert ram_backed("/scratch/x", str(mounts)) == "tmpfs"
    assert ram_backed("/scratch/disk/x", str(mounts)) is None
    assert ram_backed("/scratchy", str(mounts)) is None
    assert ram_backed("/x", str(tmp_path / "missing")) is None


# --------------------------------------------------------------------------- 4: one job per OUT
@pytest.mark.timeout(120)
def test_second_job_in_a_locked_out_is_refused_by_every_rank(mpiexec, tmp_path):
    out = tmp_path / "o"
    lock = FolderLock(str(out))
    lock.acquire()
    try:
        with pytest.raises(FolderLocked, match=f"pid {os.getpid()}"):
            FolderLock(str(out)).acquire()
        proc, elapsed = launch(mpiexec, 2, TINY + ["--out", str(out)], timeout=60)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr
    said = proc.stderr.replace("\n  ", " ")  # a refusal past 120 columns goes on over indented lines
    assert said.count(f"pid {os.getpid()}") == 1 and "in use by another minizero job" in said
    assert not (out / "model.npz").exists() and elapsed < 30
    assert not out.exists()  # released: the lock file is gone, and the folder the lock made with it


@pytest.mark.timeout(120)
def test_second_job_on_a_locked_save_dir_is_refused_by_every_rank(mpiexec, tmp_path):
    """Issue 26: two jobs on one --save-dir deleted each other's checkpoints; it is locked as OUT is."""
    save = tmp_path / "ck"
    lock = FolderLock(str(save))
    lock.acquire()
    try:
        proc, elapsed = launch(mpiexec, 2, TINY + ["--out", str(tmp_path / "o"), "--save-dir", str(save),
                                                   "--save-every", "1"], timeout=60)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(f"pid {os.getpid()}") == 1 and "--save-dir" in proc.stderr, proc.stderr
    assert not (tmp_path / "o" / "model.npz").exists() and elapsed < 30
    assert not save.exists() and not os.path.exists(tmp_path / "o")  # both released, the folders they made gone


# --------------------------------------------------------------------------- 5, 6, 8: checked before work
@pytest.mark.parametrize("argv,needle", [
    (["--eval-batches", "1000000000"], "--eval-batches must be <= 10,000"),
    (["--grad-accum", "100000000"], "--grad-accum must be <= 1,024, got 100,000,000"),
    (["--micro-batches", "100000000"], "--micro-batches must be <= 1,024"),
    (["--batch-size", "1000000000"], "--batch-size must be <= 65,536"),
    (["--precision", "fp16", "--initial-loss-scale", "1e300"], "--initial-loss-scale must be <= 2**24"),
    (["--resume", ""], "--resume '': expected a checkpoint folder"),
    (["--json", ""], "--json '': expected a file path"),
    (["--steps", "100000000000000000000"], "--steps must be <= 1,000,000,000"),
    (["--steps", "5", "--warmup", "9"], "--warmup 9 is longer than --steps 5"),
    (["--comm-timeout", "0"], "--comm-timeout must be a finite number of seconds > 0"),
    (["--out", "/proc/x"], "--out '/proc/x' cannot be written"),
    (["--out", "/sys/x"], "--out '/sys/x' cannot be written"),
    (["--data", "/dev/zero"], "'/dev/zero' is a character device"),
    (["--precision", "fp16", "--loss-scale-window", "0"], "--loss-scale-window must be >= 1; got --loss-scale-window=0"),
    (["--precision", "fp16", "--min-loss-scale", "0"], "--min-loss-scale must be in"),
])
def test_bad_values_are_refused_by_name(argv, needle):
    with pytest.raises(UsageError) as e:
        parse_args(argv, world_size=2)
    assert needle in str(e.value)


def test_out_whose_model_npz_is_a_folder_is_refused(tmp_path):
    (tmp_path / "model.npz").mkdir()
    with pytest.raises(UsageError, match="model.npz' is a directory"):
        parse_args(["--out", str(tmp_path)], world_size=2)


def test_pipe_given_to_data_is_named(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match=r"is a named pipe \(FIFO\), not a regular file"):
        parse_args(["--data", str(fifo)], world_size=2)


def test_quantize_weights_given_a_folder_is_named(tmp_path):
    from minizero.quantize import read_weights

    with pytest.raises(ValueError, match="is a directory, not a regular file"):
        read_weights(str(tmp_path))


@pytest.mark.parametrize("spec,needle", [
    ("2:1:raise", "names rank 2"), ("1:4:kill", r"names step 4 \(0-based: the progress log's step 5\); --steps 4 allows 0..3")])
def test_fault_spec_outside_the_job_is_refused(monkeypatch, spec, needle):
    from minizero.args import check_fault_spec

    monkeypatch.setenv("MINIZERO_FAULT", spec)
    with pytest.raises(UsageError, match=needle):
        check_fault_spec(2, 4)


@pytest.mark.parametrize("spec,save_every,needle", [
    ("0:1:kill_in_save", 0, "no checkpoint is saved after step 1; give --save-every N"),
    ("0:0:kill_in_save", 2,
     "no checkpoint is saved after step 0; allowed: a step s with s + 1 a multiple of --save-every 2, or the last, 4")])
def test_a_kill_in_save_that_no_save_follows_is_refused(monkeypatch, spec, save_every, needle):
    """Before: it was accepted and never fired, so a test of a killed save passed without any kill."""
    from minizero.args import check_fault_spec

    monkeypatch.setenv("MINIZERO_FAULT", spec)
    with pytest.raises(UsageError, match=re.escape(f"MINIZERO_FAULT={spec!r} never fires: {needle}")):
        check_fault_spec(2, 5, save_every)
    for ok in ("0:1:kill_in_save", "1:4:kill_in_save"):  # after step 2 (the 2nd) and the last
        monkeypatch.setenv("MINIZERO_FAULT", ok)
        check_fault_spec(2, 5, 2)


@pytest.mark.timeout(60)
def test_fault_spec_naming_a_missing_rank_exits_2_under_mpi(mpiexec):
    proc, _ = launch(mpiexec, 2, TINY + ["--no-save"], env=dict(mpi_env(), MINIZERO_FAULT="2:1:raise"), timeout=50)
    assert proc.returncode == 2 and proc.stderr.count("names rank 2") == 1, proc.stderr


def test_validation_batches_are_lazy_and_repeatable():
    tokens = np.arange(5000, dtype=np.uint8)
    val = eval_batches(tokens, 16, 1_000_000, 4, seed=3)  # would be ~1 GB as a list
    assert len(val) == 1_000_000
    first = [b for _, b in zip(range(3), val)]
    again = [b for _, b in zip(range(3), val)]
    for (x, y), (x2, y2), i in zip(first, again, range(3)):
        ref = global_batch(tokens, i, 4, 16, 3)
        np.testing.assert_array_equal(x, ref[0]); np.testing.assert_array_equal(y, ref[1])
        np.testing.assert_array_equal(x, x2)


# --------------------------------------------------------------------------- 7: stalled and orphaned ranks
@pytest.mark.timeout(120)
def test_rank_stalled_in_start_up_ends_the_job_after_comm_timeout(mpiexec, tmp_path):
    """Before: a rank stopped while starting (here: before Python runs) hung the job for ever, rank 0 waiting
    in MPI_Init where --comm-timeout did not reach. Now set-up is bounded by --comm-timeout too."""
    cmd = [sys.executable, "-m", "minizero.train", *TINY, "--steps", "2", "--no-save", "--comm-timeout", "2"]
    stopped = "kill -STOP $$; exec " + " ".join(cmd)
    t0 = time.monotonic()
    proc = subprocess.run([mpiexec, "-n", "1", *cmd, ":", "-n", "1", "sh", "-c", stopped], env=mpi_env(),
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and "Timeout (0:00:02)!" in proc.stderr, proc.stderr
    assert elapsed < 60


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@pytest.mark.timeout(200)
def test_ranks_end_when_their_launcher_is_gone(mpiexec):
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("needs Linux's /proc/PID/task/PID/children")
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", *TINY, "--steps", "100000",
                             "--no-save"], env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        ranks, deadline = [], time.monotonic() + 60
        while len(ranks) < 2 and time.monotonic() < deadline:
            proxies = _children(proc.pid)
            ranks = [r for p in proxies for r in _children(p)]
            time.sleep(0.1)
        assert len(ranks) == 2, "ranks did not start within 60 s"
        _wait_for_handlers(ranks)  # set-up has ended: training (a fixed 2 s could land in the imports when loaded)
        for p in proxies:
            os.kill(p, signal.SIGKILL)  # the launcher's proxy, by its pid
        deadline = time.monotonic() + 30  # exit_with_parent polls every 0.5 s: 30 s is for a loaded machine
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{r}") and _alive(r) for r in ranks):
            time.sleep(0.2)
        alive = [r for r in ranks if _alive(r)]
        for r in alive:
            os.kill(r, signal.SIGKILL)
        assert not alive, "ranks kept running as orphans"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _catches_sigterm(pid):
    """Whether ``pid`` has a handler for SIGTERM (/proc/PID/status, SigCgt): minizero installs its SIGINT and SIGTERM
    handlers when set-up ends (minizero.interrupts.end_set_up); before, SIGTERM has its default action."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _marked_ranks(mark):
    """The pids of the MPI ranks started with ``MINIZERO_TEST_MARK=mark`` in their environment."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                names = f.read().split(b"\0")
        except OSError:
            continue
        if f"MINIZERO_TEST_MARK={mark}".encode() in names and any(n.startswith(b"PMI_RANK=") for n in names):
            found.append(int(pid))
    return found


def _wait_for_handlers(pids, timeout=90):
    """Wait until every one of ``pids`` has ended its set-up (its signal handlers installed); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not all(map(_catches_sigterm, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_catches_sigterm, pids)), f"set-up did not end within {timeout} s on every rank"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- 8: what a user sees
@pytest.mark.timeout(200)
def test_ctrl_c_prints_one_interrupted_line(mpiexec):
    import uuid

    mark = uuid.uuid4().hex
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", *TINY, "--steps", "100000",
                             "--no-save", "--no-progress"], env=dict(mpi_env(), MINIZERO_TEST_MARK=mark),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # wait for training: the header on stdout is printed inside the try block that turns SIGINT into
        # one line (a signal during start-up, while the ranks still import, is another matter: see below)
        header = threading.Event()

        def read_stdout():
            for line in proc.stdout:
                if line.startswith("minizero:"):
                    header.set()
        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        assert header.wait(90), "no header within 90 s"
        ranks = _marked_ranks(mark)
        assert len(ranks) == 2, ranks
        _wait_for_handlers(ranks)  # rank 1's too: rank 0's header says nothing of it (a fixed 1 s did not either)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert err.count("interrupted") == 1, err


#: the main job whose training is interrupted at once on every rank (as mpiexec forwards Ctrl-C); each rank's
#: MPI_Abort says on stderr how long after its "interrupted" line it came
_ABORT_AFTER_LINE = """
import os, sys, time
import minizero.train as train
from minizero.comm.mpi import MPICommunicator
written, write, abort = [], train._write_stderr, MPICommunicator.abort
def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
def noted(text):
    write(text)
    written.append(time.monotonic())
def timed(self, code):
    gap = time.monotonic() - written[-1]
    os.write(2, b"abort %.3f s after the line\\n" % gap)
    time.sleep(0.2)  # the probe's own line needs the time to be forwarded that the test is about (< rank 1's 1 s)
    abort(self, code)
train.train, train._write_stderr, MPICommunicator.abort = interrupted, noted, timed
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
def test_rank_0_leaves_mpiexec_time_to_forward_its_interrupted_line(mpiexec):
    """Before: rank 0 wrote its line and called MPI_Abort at once; mpiexec killed the job and, about 1 run in 50,
    exited before forwarding the line (test_ctrl_c_prints_one_interrupted_line: stderr '', status 130)."""
    proc, _ = launch(mpiexec, 2, [*TINY, "--no-save", "--no-progress"], module=("-c", _ABORT_AFTER_LINE))
    assert proc.returncode == 130 and proc.stderr.count("interrupted") == 1, proc.stderr
    probe = re.search(r"abort ([\d.]+) s after the line", proc.stderr)
    assert probe, proc.stderr
    gap = float(probe.group(1))
    assert gap >= 0.1, proc.stderr


@pytest.mark.timeout(120)
def test_one_process_that_fails_or_is_interrupted_says_nothing_of_mpi_abort():
    """One process has no peer to stop: MPI_Abort added MPICH's "Abort(130) on node 0 (rank 0 in comm 0):
    application called MPI_Abort(MPI_COMM_WORLD, 130) - process 0" under the run's own line."""
    cmd = [sys.executable, "-m", "minizero.train", *TINY, "--no-save"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100,
                          env=dict(mpi_env(), MINIZERO_FAULT="0:1:raise"))
    assert proc.returncode == 1 and "injected fault" in proc.stderr and "Abort" not in proc.stderr, proc.stderr
    proc = subprocess.Popen([*cmd, "--steps", "100000"], env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while not proc.stdout.readline().startswith("minizero:"):  # the header: training has started
            assert proc.poll() is None, proc.stderr.read()
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "minizero.train: interrupted (SIGINT)" in err and "Abort" not in err, err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("delay", [0.3, 0.5, 0.8, 1.2])
def test_ctrl_c_while_the_ranks_start_prints_no_traceback(mpiexec, delay):
    """Ctrl-C ``delay`` s after both ranks ran minizero's start-up code: they are importing minizero, starting MPI,
    or training. Timed from the launch, 0.3 s landed now and then in Python's own start-up on a loaded machine, before
    minizero runs ("Fatal Python error: init_import_site", or runpy's KeyboardInterrupt traceback)."""
    from tests.test_interrupts import _ctrl_c_after

    proc, err = _ctrl_c_after(mpiexec, ["minizero.train", *TINY, "--steps", "100000", "--no-save"], delay)
    assert proc.returncode != 0
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.count("minizero.train: interrupted") <= 1, err


@pytest.mark.timeout(120)
def test_sigint_to_one_rank_while_it_starts_ends_the_job_as_sigterm_does(mpiexec, tmp_path):
    """SIGINT to rank 1 alone while it imported: MPICH's launcher said "Segmentation fault (signal 11)" and exited 11.
    It ORs its ranks' wait statuses, and SIGINT's 2 | the SIGKILL (9) it sends rank 0 is 11. Now a rank of several
    ends as SIGTERM's default action until set-up ends (15 | 9 = 15), as SIGTERM in that window did."""
    import uuid

    mark = uuid.uuid4().hex
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", *TINY, "--steps", "100000",
                             "--no-save", "--no-progress"], env=dict(mpi_env(), MINIZERO_TEST_MARK=mark),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path)
    try:
        rank1, deadline = None, time.monotonic() + 60
        while rank1 is None and time.monotonic() < deadline:  # rank 1 once NumPy is loaded: minizero's init has run
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as env, open(f"/proc/{pid}/maps") as maps:
                        names = env.read().split(b"\0")
                        if f"MINIZERO_TEST_MARK={mark}".encode() in names and b"PMI_RANK=1" in names and \
                                "_multiarray_umath" in maps.read():
                            rank1 = int(pid)
                except OSError:
                    pass
            time.sleep(0.02)
        assert rank1 is not None and proc.poll() is None, "rank 1 did not start within 60 s"
        os.kill(rank1, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "minizero:" not in out, out  # set-up had not ended: the header comes after it
    assert proc.returncode == 15 and "Terminated (signal 15)" in out + err and "Traceback" not in err, (out, err)


def test_a_signal_dropped_after_the_last_steps_check_is_raised_at_the_run_end():
    """Interrupts runs first at a step's end: a drop in that step's save or later callbacks is raised at the end."""
    from minizero.instrumentation import Interrupts

    Interrupts.raised.append(KeyboardInterrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            Interrupts().on_train_end(None)
        with pytest.raises(KeyboardInterrupt):
            Interrupts.check()
    finally:
        Interrupts.raised.clear()
    Interrupts().on_train_end(None)  # nothing dropped: nothing raised


def test_a_ctrl_c_dropped_in_a_weakref_callback_is_raised_at_the_step_end(capsys):
    import weakref

    from minizero.instrumentation import Interrupts

    class Owner:
        pass

    old = sys.unraisablehook
    sys.unraisablehook = Interrupts.quiet_hook
    handler = Interrupts.handler(KeyboardInterrupt)
    try:
        owner = Owner()
        ref = weakref.ref(owner, lambda _ref: handler(signal.SIGINT, None))  # as a signal landing there
        del owner  # the callback raises KeyboardInterrupt, which Python drops
        assert ref() is None and Interrupts.raised == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            Interrupts().on_step_end(None, 0, None)
        other = Owner()
        other_ref = weakref.ref(other, lambda _ref: int("other"))  # any other dropped exception still shows
        del other
        assert other_ref() is None
    finally:
        sys.unraisablehook = old
        Interrupts.raised.clear()
    err = capsys.readouterr().err
    assert "KeyboardInterrupt" not in err and "ValueError: invalid literal" in err, err


@pytest.mark.timeout(120)
def test_zero_over_one_data_rank_says_it_saves_nothing(zero3_run_to_dev_null):
    proc, _ = zero3_run_to_dev_null
    assert proc.returncode == 0, proc.stderr
    assert "--zero 3 over 1 data rank shards nothing" in proc.stdout


@pytest.mark.timeout(120)
def test_both_ranks_failing_print_both_tracebacks_whole(mpiexec):
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "both_fail.py")
    proc, _ = launch(mpiexec, 2, TINY + ["--no-save"], module=(script,), timeout=90)
    assert proc.returncode != 0
    for r in range(2):
        start = proc.stderr.index(f"[rank {r}] minizero.train failed: RuntimeError: boom on rank {r}")
        block = proc.stderr[start:]
        end = block.index(f"RuntimeError: boom on rank {r} " + "x" * 200, 60)
        block = block[:end]
        assert "Traceback (most recent call last)" in block and "in _failing_train" in block, block
        assert "in _deep" in block and "Previous line repeated" in block, block
        assert f"boom on rank {1 - r}" not in block  # not interleaved with the other rank's


# --------------------------------------------------------------------------- soak (short; the long one by hand)
@pytest.fixture(scope="module")
def soak_runs():
    """The short soak, once for the tests below: a good run, then raise, kill, stop (--comm-timeout 3) and SIGINT
    runs on 2 ranks, faults at steps in 1..12 (what the tests check shows at any step)."""
    from minizero.files import mpiexec_path
    from tests.soak import soak

    if mpiexec_path() is None:
        pytest.skip("mpiexec not found (pip install mpich, or a system MPI)")
    return soak(4, seed=7, last_step=12)


@pytest.mark.timeout(240)
def test_soak_short(soak_runs):
    assert all(not r["problems"] for r in soak_runs), soak_runs  # each ended within 30 s, nothing left, OUT loadable


@pytest.mark.timeout(240)
def test_stalled_rank_times_out_naming_it(soak_runs):
    """The soak's stop run (a rank SIGSTOPped at a step; within 30 s and exit status != 0: test_soak_short): its
    peer names it and the flag."""
    stalled = [(r["rank"], " ".join(r["stderr"].split())) for r in soak_runs if r["kind"] == "stop"]  # unwrapped
    assert stalled and all(f"waited 3 s for rank {rank}" in err and "--comm-timeout" in err
                           for rank, err in stalled), stalled


@pytest.mark.timeout(240)
def test_the_launchers_pid_for_a_sigkilled_rank_is_one_of_the_headers_pids(soak_runs):
    """The header's PIDs are the ranks' real process ids: MPICH's report of a SIGKILLed rank (the soak's kill run)
    names one of them. Not necessarily the killed rank's: the launcher SIGKILLs the others and reports whichever bad
    exit it handled first (this test asserted rank 1's PID, and the header said "a launcher names a killed rank by
    its PID": at 4 ranks, rank 3 killed, 7 of 10 reports named another rank)."""
    killed_runs = [r for r in soak_runs if r["kind"] == "kill"]
    assert killed_runs
    for r in killed_runs:
        assert r["rc"] != 0
        listed = re.search(r"PIDs\s+in\s+rank\s+order\s+(\d+)(-|,)\s*(\d+)", r["stdout"])  # the header may wrap
        assert listed, r["stdout"]
        first, how, last = listed.groups()
        pids = {first, str(int(first) + 1) if how == "-" else last}  # "4100-4101": a range; "4100,4230": two
        killed = re.search(r"PID (\d+) RUNNING AT", r["stdout"] + r["stderr"])
        if killed is None:
            pytest.skip("this launcher's report does not name the PID (Open MPI's names the rank itself)")
        assert killed.group(1) in pids, (listed.groups(), killed.group(0))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MINIZERO_SLOW"), reason="slow (~5 min): MINIZERO_SLOW=1 to run")
@pytest.mark.timeout(1200)
def test_soak_twenty_runs(mpiexec):
    from tests.soak import soak

    results = soak(20, seed=0)
    assert all(not r["problems"] for r in results), [r for r in results if r["problems"]]


@pytest.mark.timeout(180)
def test_compare_json_on_a_full_disk_and_on_dev_null(small_disk, tmp_path, mpiexec):
    d = small_disk("64k")
    earlier = earlier_json(runs=[1], strategies=[], tolerance=0.1)  # an earlier summary
    (d / "c.json").write_text(earlier)
    fill(d)
    base = [sys.executable, "-m", "minizero.compare", "--model", "tiny", "--ranks", "1", "--steps", "1",
            "--strategies", "baseline", "--out", str(tmp_path / "cmp")]
    (tmp_path / "hide").mkdir()  # matplotlib hidden: no compare.png drawn (tests/test_compare.py's), the JSON as ever
    (tmp_path / "hide" / "matplotlib.py").write_text("raise ImportError('hidden for this test')\n")
    env = dict(mpi_env(), PYTHONPATH=os.pathsep.join([str(tmp_path / "hide"), mpi_env()["PYTHONPATH"]]))
    # its run cut at once (--timeout: killed, a failed run): the results are written as after any run, the JSON last
    proc = subprocess.run(base + ["--timeout", "0.001", "--json", str(d / "c.json")], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 1 and "c.json" in proc.stderr and "disk is full" in proc.stderr, proc.stderr
    assert (d / "c.json").read_text() == earlier and sorted(os.listdir(d)) == ["c.json", "filler"]
    before = os.stat("/dev/null")
    proc = subprocess.run(base + ["--json", "/dev/null"], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert os.stat("/dev/null").st_ino == before.st_ino


def test_fault_spec_naming_a_rank_of_a_one_process_job_says_one_rank(monkeypatch):
    """Before: 'this job has ranks 0..0'."""
    from minizero.args import check_fault_spec

    monkeypatch.setenv("MINIZERO_FAULT", "1:0:raise")
    with pytest.raises(UsageError, match=r"names rank 1; this job has one rank, 0$"):
        check_fault_spec(1, 4)
    monkeypatch.setenv("MINIZERO_FAULT", "3:0:raise")
    with pytest.raises(UsageError, match=r"names rank 3; this job has ranks 0\.\.2$"):
        check_fault_spec(3, 4)


def test_a_kill_in_save_spec_is_checked_with_save_every_alone():
    """Before: spec_problem given --save-every without --steps ('each checked when given') raised TypeError."""
    from minizero.faults import spec_problem

    assert spec_problem("0:0:kill_in_save", save_every=2) == (
        "MINIZERO_FAULT='0:0:kill_in_save' never fires: no checkpoint is saved after step 0; allowed: a step s "
        "with s + 1 a multiple of --save-every 2")
    assert spec_problem("0:1:kill_in_save", save_every=2) is None
