"""The optimizer-state store: where an optimizer keeps its FP32 state and runs its update (the offload seam)."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

import numpy as np

from minizero import backend
from minizero.ledger import get_ledger

KINDS = ("none", "cpu", "nvme")


class OffloadError(OSError):
    """Offloading failed (full disk, unwritable directory); the message names the directory and the cause."""


def check_offload_dir(path: str, need_bytes: int = 0) -> None:
    """Fail early unless ``path`` is a writable directory with ``need_bytes`` free.
    Raises OffloadError (numbers given)."""
    if not os.path.isdir(path):
        raise OffloadError(errno.ENOENT, f"offload folder {path!r} is not an existing directory")
    try:
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"minizero")
    except OSError as e:
        why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
        raise OffloadError(e.errno, f"offload folder {path!r} is not writable: {why}") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OffloadError(errno.ENOSPC, f"offload folder {path!r} has {free:,} bytes free, "
                                         f"the run needs about {need_bytes:,}")


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def ram_backed(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The file-system type of ``path`` when it keeps files in RAM (tmpfs, ramfs) per ``mounts``, else None;
    never raises."""
    try:
        with open(mounts) as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for row in rows:
        if len(row) < 3:
            continue
        point = row[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, row[2]
    return fstype if fstype in RAM_FILESYSTEMS else None


def reserve(f, nbytes: int, folder: str, what: str) -> None:
    """Allocate ``nbytes`` of disk blocks for ``f`` now (``posix_fallocate``; ``truncate`` on macOS).

    Raises OffloadError: ENOSPC or another OS error, naming ``folder``, bytes needed and bytes free.
    """
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(f.fileno(), 0, max(1, nbytes))
        else:  # pragma: no cover (macOS)
            f.truncate(max(1, nbytes))
    except OSError as e:
        free = shutil.disk_usage(folder).free
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise OffloadError(e.errno or errno.EIO, f"{what} in offload folder {folder!r} needs {nbytes:,} bytes, "
                                                 f"{free:,} bytes are free: {why}") from None


# ---- optimizer state offload (ZeRO-Offload / ZeRO-Infinity) ------------------------------
class OptimizerStateStore:
    """Where an optimizer keeps its FP32 state (master weights, Adam m and v) and runs its update.

    ``kind``: ``"none"`` (device, ``optimizer_state``); ``"cpu"`` (host, ``offloaded``; update in NumPy,
    ZeRO-Offload section 4); ``"nvme"`` (``np.memmap`` in ``offload_dir``, ZeRO-Infinity section 5).
    Raises ValueError: unknown kind; OffloadError: unusable directory, or a write that fails.
    """

    def __init__(self, kind: str = "none", offload_dir: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"optimizer offload {kind!r} is not one of {KINDS}")
        self.kind, self.disk_bytes = kind, 0
        self.dir = None
        if kind == "nvme":
            self.dir = offload_dir or tempfile.gettempdir()
            check_offload_dir(self.dir)

    @property
    def on_host(self) -> bool:
        """True when the state (and so the update) lives off the device."""
        return self.kind != "none"

    def zeros(self, shape, dtype):
        """A zero array of ``shape``/``dtype`` in this store (device, host or memory-mapped file)."""
        dtype = np.dtype(dtype)
        if self.kind == "none":
            a = backend.xp.zeros(shape, dtype)
            get_ledger().track(a, "optimizer_state")
            return a
        if self.kind == "cpu":
            a = backend.pinned_zeros(shape, dtype)
            get_ledger().track(a, "offloaded")
            return a
        nbytes = int(np.prod(shape)) * dtype.itemsize
        try:
            f = tempfile.TemporaryFile(dir=self.dir)
        except OSError as e:
            raise OffloadError(e.errno, f"optimizer state of {nbytes:,} bytes could not be placed in {self.dir!r}: "
                                        f"{e.strerror}") from None
        try:
            reserve(f, nbytes, self.dir, f"optimizer state ({self.disk_bytes:,} bytes placed so far)")
            a = np.memmap(f, dtype=dtype, mode="r+", shape=shape)
        except OSError as e:
            f.close()
            if isinstance(e, OffloadError):
                raise
            raise OffloadError(e.errno, f"optimizer state of {nbytes:,} bytes could not be placed in {self.dir!r}: "
                                        f"{e.strerror}") from None
        f.close()  # the mapping keeps the anonymous file alive until the array is freed
        self.disk_bytes += nbytes
        return a

    def copy_of(self, array, dtype):
        """A copy of ``array`` (any device) converted to ``dtype``, in this store."""
        a = self.zeros(array.shape, dtype)
        a[...] = backend.to_host(array) if self.on_host else array
        return a

    def to_store(self, array):
        """``array`` where the update runs: a host copy when offloaded (the same array on NumPy)."""
        return backend.to_host(array) if self.on_host else array
