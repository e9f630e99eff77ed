"""files.atomic_write: outputs get the user's umask, and killed writes' temporary files are cleaned up."""
import os
import socket
import subprocess
import sys
import time

import pytest

from minizero import temporaries
from minizero.files import atomic_write
from minizero.temporaries import STALE_AFTER_S, remove_stale_temporaries
from tests.conftest import earlier_json


def _write_under_umask(path, mask):
    old = os.umask(mask)
    try:
        atomic_write(str(path), lambda f: f.write("x"), mode="w")
    finally:
        os.umask(old)
    return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_mode_follows_umask(tmp_path, mask, mode):
    assert _write_under_umask(tmp_path / "f.txt", mask) == mode


def _tmp_name(target, host, pid):
    return f".{target}.minizero~{host}~{pid}~abcd1234.tmp"


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has this id (until reused, which the test tolerates below)


def test_stale_temporaries_are_removed_by_the_next_write(tmp_path):
    host = socket.gethostname()
    dead = tmp_path / _tmp_name("model.npz", host, _dead_pid())
    old = tmp_path / _tmp_name("model.npz", "elsewhere", 1)
    live_other_host = tmp_path / _tmp_name("model.npz", "elsewhere", 2)
    live_here = tmp_path / _tmp_name("model.npz", host, os.getppid())  # our parent: alive
    unrelated = tmp_path / ".model.npz.abc.tmp"  # not ours: never touched
    for p in (dead, old, live_other_host, live_here, unrelated):
        p.write_bytes(b"partial")
    hour_ago = time.time() - STALE_AFTER_S - 5
    os.utime(old, (hour_ago, hour_ago))
    atomic_write(str(tmp_path / "summary.json"), lambda f: f.write("{}"), mode="w")
    assert not old.exists()
    assert live_other_host.exists() and live_here.exists() and unrelated.exists()
    if not temporaries._pid_alive(int(dead.name.split("~")[2])):  # a reused pid would rightly keep it
        assert not dead.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(
        [p.name for p in (live_other_host, live_here, unrelated)] + ["summary.json"]
        + ([dead.name] if dead.exists() else []))


def test_a_killed_write_leaves_a_temporary_that_the_next_run_removes(tmp_path):
    """A write killed mid-way (SIGKILL) leaves its temporary file; the next atomic_write there removes it."""
    code = ("import os, signal, sys; from minizero.files import atomic_write\n"
            "def w(f):\n    f.write(b'half'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            f"atomic_write({str(tmp_path / 'model.npz')!r}, w)")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -9
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and not (tmp_path / "model.npz").exists()
    assert remove_stale_temporaries(str(tmp_path)) == [str(tmp_path / left[0])]
    assert os.listdir(tmp_path) == []


def test_a_save_dirs_latest_pointer_is_never_an_output(tmp_path):
    """--json (train, finetune, quantize) or --trace naming a save dir's ``latest`` replaced the pointer with JSON
    (exit 0): the save dir's own record of its newest checkpoint lost. A file of that name elsewhere is written."""
    from minizero.overwrite import check_output, refuse_read_back

    (tmp_path / "ck" / "step_00000002").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000002" / "manifest.json").write_text("{}")
    (tmp_path / "ck" / "latest").write_text("step_00000002\n")
    (tmp_path / "latest").write_text(earlier_json(baseline={}, rows=[]))  # a summary: --json may replace it
    for check in (refuse_read_back, lambda path, flag: check_output(path, flag)):
        with pytest.raises(ValueError, match="would overwrite latest, which minizero's programs read back"):
            check(str(tmp_path / "ck" / "latest"), "--json")
        check(str(tmp_path / "latest"), "--json")


def test_a_replaced_file_keeps_its_mode(tmp_path):
    """A file the user made private (0600) or executable stays so when written again, whatever the umask.
    (Mutation audit: the new file given the umask's mode passed every test.)"""
    for mode in (0o600, 0o755):
        path = tmp_path / f"f{mode:o}.json"
        path.write_text("{}")
        os.chmod(path, mode)
        assert _write_under_umask(path, 0o022) == mode
        assert path.read_text() == "x"
