"""Small shared plumbing for the programs: atomic file writes and finding ``mpiexec``.

Not a technique — the two helpers every command-line program (train, compare,
plan, quantize) and benchmark needs, written once.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile


def atomic_write(path: str, write) -> None:
    """Call ``write(tmp_path)`` on a fresh temporary file beside ``path``, then rename it to ``path``.

    A crash or an exception inside ``write`` leaves any previous ``path`` untouched
    and removes the temporary file. The folder of ``path`` is created if missing.
    Raises whatever ``write`` or the file system raises (``OSError``).
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def mpiexec_path() -> str | None:
    """``mpiexec`` beside the running Python (the mpich wheel's), else on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")
