"""An output named by one of this process's open descriptors (``--json /dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
``/proc/self/fd/N``) is written into that descriptor where it stands, after what was printed: a temporary renamed
over ``--json /dev/stdout > log`` replaced the log, and what followed went to the unlinked file. Nothing is replaced,
so nothing there is checked as an earlier output; a pipe has its reader (it is no FIFO waiting for one)."""
from __future__ import annotations

import fcntl
import os
import re
import sys

NAMED = {"/dev/stdout": 1, "/dev/stderr": 2}
NUMBERED = re.compile(r"/(?:dev|proc/self)/fd/([0-9]+)")


def stream_fd(path: str) -> int | None:
    """The descriptor ``path`` names (:data:`NAMED`, :data:`NUMBERED`), or None: a path of its own."""
    p = os.path.normpath(os.path.abspath(path)) if path else ""
    if found := NUMBERED.fullmatch(p):
        return int(found.group(1))
    return NAMED.get(p)


def check_stream(path: str, flag: str) -> None:
    """Raise ValueError unless ``path``'s descriptor is open for writing (a closed stdout, ``>&-``, is not)."""
    fd = stream_fd(path)
    try:
        writable = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) != os.O_RDONLY
    except OSError:
        raise ValueError(f"{flag} {path!r}: file descriptor {fd} is not open; give a file path") from None
    if not writable:
        raise ValueError(f"{flag} {path!r}: file descriptor {fd} is open for reading only; give a file path")


def opened(fd: int) -> int:
    """A duplicate of ``fd`` to write into, what Python buffered for stdout and stderr written first."""
    sys.stdout.flush()
    sys.stderr.flush()
    return os.dup(fd)


def lockable(path: str) -> bool:
    """Whether ``path`` is an output file a job locks: a regular file or none yet, not a stream nor a device."""
    return stream_fd(path) is None and (os.path.isfile(path) or not os.path.exists(path))
