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
becomes a real device-to-host copy on CuPy), while ``nvme`` lowers the process's
resident memory: the bytes sit in a file (the kernel's page cache, not the process's
RSS) until backward — unless the folder is RAM-backed (tmpfs, ramfs: often the system
temp dir), where the file is memory all the same. Each file's blocks are reserved
before writing, so a full disk is reported as such.

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
import shutil
import tempfile

import numpy as np

from minizero import backend
from minizero.autograd import saved_tensors_hooks
from minizero.ledger import get_ledger
from minizero.optim.state_store import (  # noqa: F401 (re-exported)
    KINDS,
    OffloadError,
    OptimizerStateStore,
    check_offload_dir,
    ram_backed,
    reserve,
)


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
        f = None
        try:
            f = tempfile.TemporaryFile(dir=self.dir)
            reserve(f, a.nbytes, self.dir, f"rank {self.rank}: an offloaded activation "
                                           f"({self.bytes_offloaded - a.nbytes:,} bytes offloaded before it)")
            np.ascontiguousarray(backend.to_host(a)).tofile(f)  # streamed, no extra copy
            f.flush()
        except OSError as e:
            if f is not None:
                f.close()
            if isinstance(e, OffloadError):
                raise
            why = e.strerror or ("the disk is full" if shutil.disk_usage(self.dir).free < a.nbytes else str(e))
            raise OffloadError(e.errno or errno.EIO, f"rank {self.rank}: offloading {a.nbytes:,} bytes to "
                                                     f"{self.dir!r} failed: {why}") from None
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

