"""Small shared plumbing for the programs: atomic file writes and finding ``mpiexec``.

Not a technique — the two helpers every command-line program (train, compare,
plan, quantize) and benchmark needs, written once.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
import time

#: temporary names: ``.NAME.minizero~HOST~PID~RANDOM.tmp`` (HOST and PID say whose write it is)
_TMP_TAG = "minizero"
_TMP_RE = re.compile(r"^\..*\." + _TMP_TAG + r"~(?P<host>.*)~(?P<pid>\d+)~[^~]*\.tmp$")
#: a temporary file this old is stale whoever wrote it (a write that takes an hour is not expected)
STALE_AFTER_S = 3600


def _umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status; elsewhere set and restore)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove what killed writes left in ``folder``: temporary files of :func:`atomic_write` older than
    :data:`STALE_AFTER_S`, or written on this host by a process that no longer exists. Returns their paths.

    Files of live writes (and of other hosts, until they are an hour old) are left alone; a file
    that vanishes or cannot be removed meanwhile is skipped.
    """
    removed, host, now = [], socket.gethostname(), time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _TMP_RE.match(name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        try:
            old = now - os.path.getmtime(path) > STALE_AFTER_S
            dead = m["host"] == host and int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"]))
            if old or dead:
                os.remove(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def atomic_write(path: str, write) -> None:
    """Call ``write(tmp_path)`` on a fresh temporary file beside ``path``, then rename it to ``path``.

    A crash or an exception inside ``write`` leaves any previous ``path`` untouched
    and removes the temporary file; temporary files left by killed writes into the same
    folder are removed first (:func:`remove_stale_temporaries`). The result has the mode
    a plain ``open`` would give (0o666 minus the umask: 644 under umask 022), not
    mkstemp's 600. The folder of ``path`` is created if missing.
    Raises whatever ``write`` or the file system raises (``OSError``).
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    remove_stale_temporaries(d)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.{_TMP_TAG}~{socket.gethostname()}~"
                                             f"{os.getpid()}~", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def mpiexec_path() -> str | None:
    """``mpiexec`` beside the running Python (the mpich wheel's), else on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")
