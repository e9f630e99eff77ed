"""The temporary files of :func:`minizero.files.atomic_write`: their one name, their clean-up, and the probe
that checks before any work that a write will succeed (the same name, in the same folder, at the same length)."""
from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
import time

#: temporary names: ``.NAME.minizero~HOST~PID~RANDOM.tmp`` (HOST and PID say whose write it is)
TAG = "minizero"
_TMP_RE = re.compile(r"^\..*\." + TAG + r"~(?P<host>.*)~(?P<pid>\d+)~[^~]*\.tmp$")
#: a temporary file this old is stale whoever wrote it (a write that takes an hour is not expected)
STALE_AFTER_S = 3600


def _prefix(name: str) -> str:
    return f".{name}.{TAG}~{socket.gethostname()}~{os.getpid()}~"


def make_temporary(folder: str, name: str) -> tuple[int, str]:
    """Create (mode 0600) and open the temporary of a write of file ``name`` in ``folder``: (fd, its path)."""
    return tempfile.mkstemp(dir=folder, prefix=_prefix(name), suffix=".tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True  # PermissionError too: someone else's live process


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove temporaries of killed :func:`atomic_write` calls in ``folder`` (stale or dead writer); returns them."""
    removed, host, now = [], socket.gethostname(), time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:
        if (m := _TMP_RE.match(name)) is None:
            continue
        path = os.path.join(folder, name)
        try:  # stale, or its writer on this host is dead
            if now - os.path.getmtime(path) > STALE_AFTER_S or (
                    m["host"] == host and int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"]))):
                os.remove(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def nearest_existing(path: str) -> str:
    """``path`` if it exists, else its nearest existing ancestor. Raises OSError naming a link loop, a link to
    nothing, a name or path too long."""
    while True:
        try:
            os.stat(path)
            return path
        except (FileNotFoundError, NotADirectoryError):  # the latter: a file above it, named by the caller
            if os.path.islink(path):  # dangling: makedirs would answer "File exists"
                raise NotADirectoryError(errno.ENOTDIR, f"{path!r} links to the missing {os.readlink(path)!r}"
                                         ) from None
            path = os.path.dirname(path)
        except OSError as e:
            why = {errno.ELOOP: "is a loop of symbolic links (each leads to the next)",
                   errno.ENAMETOOLONG: "is too long for the file system (a name in it, or the whole path)",
                   }.get(e.errno, f"cannot be reached ({e.strerror})")
            raise OSError(e.errno, f"{path!r} {why}") from None


def check_writable_folder(folder: str, name: str = "manifest.json") -> None:
    """Check, making nothing, that ``atomic_write`` can write ``name`` (a file name, or ``SUB/NAME``) into ``folder``,
    made first if missing: its temporary (:func:`make_temporary`) is created and removed in the nearest existing
    folder, and every name and the whole path the write uses (links resolved) fit the file system's limits. The
    default ``name`` is the longest that minizero's programs write into a folder they are given.
    Raises OSError (``strerror`` names the path): a link loop or a dangling link, not a directory, too long, or
    takes no file."""
    target = os.path.join(os.path.abspath(folder), name)
    for d in (os.path.dirname(target), os.path.dirname(os.path.realpath(target))):  # makedirs', then the write's
        where = nearest_existing(d)
        if not os.path.isdir(where):
            raise NotADirectoryError(errno.ENOTDIR, f"{where!r} is not a directory")
    d, base = os.path.split(os.path.realpath(target))
    name_max, path_max = os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    for part in [] if where == d else os.path.relpath(d, where).split(os.sep):
        if 0 < name_max < len(os.fsencode(part)):  # a folder makedirs would make (-1: no limit)
            raise OSError(errno.ENAMETOOLONG, f"the folder name {part!r} is longer than the file system's "
                                              f"{name_max} bytes")
    size = len(os.fsencode(os.path.join(d, _prefix(base)))) + len("XXXXXXXX.tmp")  # mkstemp: 8 random characters
    if 0 < path_max <= size:
        raise OSError(errno.ENAMETOOLONG, f"{d!r} is too long: writing {base!r} there takes a temporary path "
                                          f"{size} bytes long, and paths must stay under {path_max}")
    try:
        fd, tmp = make_temporary(where, base)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        why = (f"the temporary's name would be longer than the file system's {name_max} bytes"
               if e.errno == errno.ENAMETOOLONG else e.strerror or str(e))
        raise OSError(e.errno, f"{where!r} takes no file named {base!r} ({why})") from None


def unwritable(flag: str, path: str, e: OSError, what: str = "file") -> str:
    """The line every program prints when a probe here (or ``files.check_writable_file``) refuses output ``path``
    (``flag``; ``what``: "file" or "folder"): why (``e``), then what to give instead."""
    give = {errno.ENAMETOOLONG: "a shorter path", errno.ELOOP: "another path", errno.ENOTDIR: "another path",
            errno.ENXIO: "a regular file", errno.EACCES: "a path you can write to",
            errno.EPERM: "a path you can write to"}.get(e.errno, f"a {what} on a writable file system")
    return f"{flag} {path!r} cannot be written ({e.strerror or e}); give {give}"
