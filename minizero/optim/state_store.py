"""The optimizer-state store: where an optimizer keeps its FP32 state and runs its update.

The seam between an optimizer (AdamW, ZeRO's sharded AdamW) and optimizer offload:
the optimizer asks the store for state arrays (``empty``/``copy_of``) and hands it the
gradients (``to_store``); the store decides whether they live on the device, in host
memory (ZeRO-Offload) or in files (ZeRO-Infinity's NVMe tier). It lives in ``optim/``
because optimizers use it; ``memory/offload.py`` (activation offload) re-exports it.
"""
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
    """Fail early: ``path`` must be a writable directory with at least ``need_bytes`` free.

    Raises:
        OffloadError: missing, not a directory, not writable, or too little space (numbers given).
    """
    if not os.path.isdir(path):
        raise OffloadError(errno.ENOENT, f"--offload-dir {path!r} is not an existing directory")
    try:
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"minizero")
    except OSError as e:
        raise OffloadError(e.errno, f"--offload-dir {path!r} is not writable: {e.strerror}") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OffloadError(errno.ENOSPC, f"--offload-dir {path!r} has {free:,} bytes free, "
                                         f"the run needs about {need_bytes:,}")



# ---- optimizer state offload (ZeRO-Offload / ZeRO-Infinity) ------------------------------
class OptimizerStateStore:
    """Where an optimizer keeps its FP32 state (master weights, Adam m and v) and runs its update.

    ``none``: device memory (ledger ``optimizer_state``). ``cpu``: host memory
    (ledger ``offloaded``): the update runs on the host on host copies of the
    gradients and the result is copied back to the device's compute-precision
    parameters — ZeRO-Offload (Ren et al. 2021, section 4). ``nvme``: every
    state array is an ``np.memmap`` over an anonymous file in ``offload_dir``
    (not in the ledger's memory categories; its bytes are ``disk_bytes``) —
    ZeRO-Infinity's NVMe tier (Rajbhandari et al. 2021, section 5) without the
    overlapping prefetch. On the NumPy backend host memory *is* device memory,
    so ``cpu`` only relabels bytes while ``nvme`` really lowers the resident
    peak; on CuPy ``cpu`` moves them off the GPU as well.

    Args:
        kind: ``"none"``, ``"cpu"`` or ``"nvme"``.  offload_dir: for nvme (default: temp dir).
    Raises:
        ValueError: unknown kind.  OffloadError: unusable directory, or a write that fails.
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
            a = np.zeros(shape, dtype)
            get_ledger().track(a, "offloaded")
            return a
        nbytes = int(np.prod(shape)) * dtype.itemsize
        try:
            f = tempfile.TemporaryFile(dir=self.dir)
            f.truncate(max(1, nbytes))
            a = np.memmap(f, dtype=dtype, mode="r+", shape=shape)
        except OSError as e:
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
