"""Shared plumbing for the programs: durable atomic file writes, a folder lock, finding ``mpiexec``."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import sys

from minizero.streams import opened, stream_fd
from minizero.temporaries import check_writable_folder, make_temporary, nearest_existing, remove_stale_temporaries


def umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status; elsewhere set and restore)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, ValueError, IndexError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


class WriteError(OSError):
    """Writing an output file failed; ``str()`` names the path and the OS error (e.g. disk full)."""


def write_error(path: str, e: BaseException) -> WriteError:
    """``e`` as a WriteError naming ``path`` (a full disk said in words)."""
    code = getattr(e, "errno", None)
    why = getattr(e, "strerror", None) or str(e) or type(e).__name__
    if code == errno.ENOSPC:
        why = "no space left on device (the disk is full)"
    return WriteError(code or errno.EIO, f"could not write {path!r}: {why}")


def atomic_write(path: str, write, mode: str = "wb") -> None:
    """Write ``path`` through ``write(f)`` (``mode`` ``"wb"``/``"w"``): temporary, fsync, rename, fsync folder.

    ``path`` then holds the previous or the whole new file; a non-regular ``path`` (``/dev/null``) is written into;
    a link is written through, its target replaced (as editors do: the link stays a link). The temporary is
    :func:`~minizero.temporaries.make_temporary`'s, the name that ``check_writable_folder`` probes before the work.
    Raises WriteError (an OSError, naming ``path``; previous file kept): a step failed or ``path`` is a directory;
    ValueError: another ``mode``; whatever else ``write`` raises (the temporary removed).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r}; allowed: 'wb' or 'w'")
    enc = None if mode == "wb" else "utf-8"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise write_error(path, e) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise WriteError(errno.EISDIR, f"could not write {path!r}: it is a directory")
    fd = stream_fd(path)  # /dev/stdout: its descriptor, written where it stands (minizero.streams)
    if fd is not None or st is not None and not stat.S_ISREG(st.st_mode):  # a device or FIFO: never renamed over
        try:
            with open(path if fd is None else opened(fd), mode, encoding=enc) as f:
                write(f)
                if fd is not None and mode == "w":  # a stream: what is printed next starts a line of its own
                    f.write("\n")
        except OSError as e:
            raise write_error(path, e) from None
        return
    tmp, real = None, os.path.realpath(path)  # a link's target (a dangling link's too)
    try:
        d = os.path.dirname(real)
        os.makedirs(d, exist_ok=True)
        remove_stale_temporaries(d)
        fd, tmp = make_temporary(d, os.path.basename(real))
        os.fchmod(fd, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~umask())  # mkstemp's is 0600
        with os.fdopen(fd, mode, encoding=enc) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)
        tmp = None
        _fsync_dir(d)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)


def _fsync_dir(d: str) -> None:
    """Make a rename in ``d`` durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is done
    finally:
        os.close(fd)


class FolderLocked(OSError):
    """Another live process holds the folder's lock; the message names its pid and host."""


class FolderLock:
    """An exclusive ``fcntl.flock`` on ``FOLDER/.lock`` for a job's life (``flock(1)``; git's ``index.lock``).
    ``acquire()`` creates the folder, locks without waiting, writes ``pid P on host H``; the kernel drops the lock
    when the process dies. Raises (acquire) FolderLocked naming the holder; OSError: cannot create."""

    NAME = ".lock"

    def __init__(self, folder: str, name: str = NAME, subject: str | None = None):
        self.folder, self.path, self.fd, self.made = folder, os.path.join(folder, name), None, False
        self.subject = folder if subject is None else subject  # what the refusal names: the folder, or a file

    @classmethod
    def for_file(cls, path: str) -> FolderLock:
        """The lock of one output file ``path``: ``.NAME.lock`` beside it (two jobs writing one --json)."""
        folder, name = os.path.split(os.path.abspath(path))
        return cls(folder, f".{name}.lock", path)

    def acquire(self) -> None:
        """Take the lock now or raise :class:`FolderLocked`; see the class docstring."""
        self.made = not os.path.isdir(self.folder)  # release() removes a folder it made that stayed empty
        os.makedirs(self.folder, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = _holder(fd)
                finally:
                    os.close(fd)
                other = "folder" if self.subject == self.folder else "file"
                raise FolderLocked(errno.EBUSY, f"{self.subject!r} is in use by another minizero job ({holder}); "
                                                f"wait for it to end or choose another {other}") from None
            try:  # the previous holder may have removed the file between our open and our flock
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        except OSError:  # a full disk: no lock file left behind (nor the folder made for it)
            self.release()
            raise

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; raises nothing: a lock file that cannot be removed,
        the folder gone or read-only, stays behind unlocked, and the next :meth:`acquire` takes it). A folder that
        :meth:`acquire` made and that nothing was written into is removed too (a job that failed leaves nothing)."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)
            if self.made:
                os.rmdir(self.folder)  # OSError unless empty
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def lock_outputs(wanted) -> tuple[list, str | None]:
    """Take each ``(flag, lock)`` of ``wanted`` (:class:`FolderLock`) in order, for the job's life. Returns (the
    locks held, None), or ([], ``"FLAG 'path' is in use by another minizero job (pid P on host H); ..."``) when one
    cannot be taken (the ones taken before it released): the one line every program prints."""
    locks = []
    for flag, lock in wanted:
        try:
            lock.acquire()
        except OSError as e:  # FolderLocked names the path and the holder; a full disk: the path and why
            release_all(locks)
            return [], f"{flag} {e.strerror}" if isinstance(e, FolderLocked) else (
                f"{flag} {lock.subject!r}: {write_error(lock.path, e).strerror}")
        locks.append(lock)
    return locks, None


def release_all(locks) -> None:
    """:meth:`FolderLock.release` each of ``locks`` (raises nothing)."""
    for lock in locks:
        lock.release()


def live_holder(folder: str) -> str | None:
    """``"pid P on host H"`` when a live process holds ``folder``'s :class:`FolderLock`, else None. Takes nothing
    and writes nothing: a shared ``flock`` tried and dropped at once on the existing lock file."""
    try:
        fd = os.open(os.path.join(folder, FolderLock.NAME), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # dropped by the close
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:  # what FolderLock.acquire wrote into the lock file: "pid P on host H"
    return os.read(fd, 200).decode("utf-8", "replace").strip() or "a process that is starting"


def live_job_holding(path: str) -> tuple[str, str] | None:
    """``(folder, holder)`` when ``path`` or the folder above it (a checkpoint's save dir, or OUT) is locked by a live
    job (:func:`live_holder`), else None: a checkpoint there may be pruned while it is read."""
    path = os.path.realpath(path)
    return next(((folder, h) for folder in (path, os.path.dirname(path)) if (h := live_holder(folder))), None)


#: what a reader of a running job's checkpoints is told (after "FOLDER is in use by a running minizero job (HOLDER)")
PRUNED_MID_READ = "whose saves prune its checkpoints; wait for it to end or copy the checkpoint elsewhere"


def check_writable_file(path: str) -> None:
    """:func:`check_writable_folder` for the file ``path``, written through a link to its target as
    :func:`atomic_write` does. Raises OSError: see there."""
    if stream_fd(path) is not None:  # written into its descriptor (minizero.streams.check_stream)
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:  # new, or a link to a file not there yet, whose target the write makes
        st = None
    except OSError:
        nearest_existing(os.path.abspath(path))  # a loop is named as such, not probed as a new file
        st = None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a device, written into:
        try:  # opened as atomic_write opens it, then
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:  # a FIFO that no process reads: ENXIO, "No such device or address"
            if e.errno == errno.ENXIO and stat.S_ISFIFO(st.st_mode):
                raise OSError(e.errno, f"{path!r} is a named pipe (FIFO) with no reader, not a regular file") from None
            raise
        try:
            os.write(fd, b"")  # written no bytes: /dev/full refuses even these (no space left), /dev/null takes them
        finally:
            os.close(fd)
        return
    real = os.path.realpath(path)
    check_writable_folder(os.path.dirname(real), os.path.basename(real))


def read_json(path: str):
    """The JSON value in the regular file ``path``. Raises OSError: unreadable; ValueError: not a regular file
    (a FIFO or a device would block or never end), not JSON (or not UTF-8), or nested too deeply."""
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a regular file (a FIFO or a device); give the JSON file itself")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path!r} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path!r} is JSON nested too deeply for a file minizero writes") from None


def content_digest(path: str, chunk: int = 1 << 20) -> str:
    """``'1,024 bytes, SHA-256 0123456789ab'``: what ranks compare of an input each reads from its own disk."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            n += len(block)
    return f"{n:,} bytes, SHA-256 {h.hexdigest()[:12]}"


def mpiexec_path() -> str | None:
    """``mpiexec`` beside the running Python (the mpich wheel's), else on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")
