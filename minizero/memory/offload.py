"""Activation offload: saved activations leave device memory between forward and backward.

``offload_activations(kind)`` is a ``saved_tensors_hooks`` pair, so it applies to
every array any Function saves, with no change to any Function:

::

    forward:  ctx.save_for_backward(a) ──pack──>  cpu:  a host copy        (ledger: "offloaded")
                                                  nvme: an unnamed file     (ledger: nothing in memory)
    backward: ctx.saved_tensors       <─unpack──  the array again, on the device

Parameters are never offloaded (the ledger says which arrays are parameters:
they stay where they are), nor are arrays under ``min_bytes``.

Honesty about the NumPy backend: host memory *is* device memory there, so
``cpu`` only moves bytes from the ``activations`` category to ``offloaded`` (it
becomes a real device-to-host copy on CuPy), while ``nvme`` really lowers the
process's resident memory: the bytes sit in a file until backward.

Files: every saved array goes to its own *anonymous* file in ``offload_dir``
(``tempfile.TemporaryFile``: on Linux an O_TMPFILE inode that never has a name,
elsewhere a file unlinked right after creation). Such a file is private to the
process that opened it and its blocks are released when it is closed, when the
process exits, and even when the rank is killed with SIGKILL — nothing is ever
left behind, not even a directory. (A named per-rank folder, as the issue first
sketched, would be exactly the thing a killed rank leaves behind; so there is
none.)

Mirrors DeepSpeed's activation checkpoint CPU offload and ZeRO-Infinity's NVMe
offload (Rajbhandari et al. 2021, section 5), and PyTorch's
``torch.autograd.graph.save_on_cpu`` (a saved_tensors_hooks pair).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

import numpy as np

from minizero import backend
from minizero.autograd import saved_tensors_hooks
from minizero.memory.ledger import get_ledger

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


class _OnDisk:
    """A saved array living in an unnamed file: shape, dtype and the open file object."""

    __slots__ = ("file", "shape", "dtype")

    def __init__(self, file, shape, dtype):
        self.file, self.shape, self.dtype = file, shape, dtype


class ActivationOffload:
    """The pack/unpack pair for one rank; use ``with offloader:`` around the forward pass.

    Args:
        kind: ``"cpu"`` or ``"nvme"`` (``"none"`` makes the context a no-op).
        offload_dir: directory of the anonymous files (nvme; default: the system temp dir).
        rank: this rank (reported in error messages).
        min_bytes: arrays smaller than this stay in memory (default 1 KiB).
    Attributes:
        bytes_offloaded: total bytes packed so far (int).
    Raises:
        ValueError: unknown kind.  OffloadError: see :func:`check_offload_dir`.
    """

    def __init__(self, kind: str = "cpu", offload_dir: str | None = None, rank: int = 0, min_bytes: int = 1024):
        if kind not in KINDS:
            raise ValueError(f"activation offload {kind!r} is not one of {KINDS}")
        self.kind, self.min_bytes, self.bytes_offloaded = kind, min_bytes, 0
        self.rank = rank
        self.dir = None
        if kind == "nvme":
            self.dir = offload_dir or tempfile.gettempdir()
            check_offload_dir(self.dir)

    def _keep(self, a) -> bool:
        return a.nbytes < self.min_bytes or get_ledger().category_of(a) == "parameters"

    def pack(self, a):
        """Move ``a`` (any array) out of device memory; returns what backward will need."""
        if self._keep(a):
            return a
        self.bytes_offloaded += a.nbytes
        if self.kind == "cpu":
            host = np.array(backend.to_host(a), copy=True)
            get_ledger().track(host, "offloaded")
            return host
        try:
            f = tempfile.TemporaryFile(dir=self.dir)
            np.ascontiguousarray(backend.to_host(a)).tofile(f)  # streamed, no extra copy
            f.flush()
        except OSError as e:
            raise OffloadError(e.errno, f"rank {self.rank}: offloading {a.nbytes:,} bytes to {self.dir!r} failed: "
                                        f"{e.strerror}") from None
        return _OnDisk(f, a.shape, a.dtype)

    def unpack(self, packed):
        """Bring a packed array back to the device, as it was."""
        if isinstance(packed, _OnDisk):
            f = packed.file
            f.seek(0)
            count = int(np.prod(packed.shape))
            data = np.fromfile(f, dtype=packed.dtype, count=count)
            f.close()  # the unnamed file's blocks are released here
            if data.size != count:
                raise OffloadError(errno.EIO, f"offloaded activation in {self.dir!r} came back with "
                                              f"{data.size} of {count} elements")
            return backend.to_device(data.reshape(packed.shape))
        if isinstance(packed, np.ndarray) and backend.name != "numpy":
            return backend.to_device(packed)
        return packed

    @contextlib.contextmanager
    def __call__(self):
        """Context manager: offload every array saved inside the block."""
        if self.kind == "none":
            yield self
            return
        with saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def close(self) -> None:
        """Nothing to remove (every file is anonymous); kept so callers can release resources uniformly."""


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
