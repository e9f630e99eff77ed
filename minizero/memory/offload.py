"""Activation offload: saved activations leave device memory between forward and backward.

A ``saved_tensors_hooks`` pair: pack moves every saved array (not parameters, not under ``min_bytes``) to the
host (``cpu``: ledger ``offloaded``, pinned on CuPy) or to an anonymous file (``nvme``); unpack brings it back.
Mirrors: ``torch.autograd.graph.save_on_cpu``; ZeRO-Infinity's NVMe offload (Rajbhandari et al. 2021, section 5).
"""
from __future__ import annotations

import contextlib
import errno
import shutil
import tempfile
import weakref

import numpy as np

from minizero import backend
from minizero.autograd import saved_tensors_hooks
from minizero.ledger import get_ledger, owning_buffer
from minizero.optim.state_store import (  # noqa: F401 (re-exported)
    KINDS,
    OffloadError,
    OptimizerStateStore,
    check_offload_dir,
    ram_backed,
    reserve,
)

OFFLOADS = KINDS  #: "none", or where offloaded arrays go: "cpu" host memory, "nvme" files
MIN_BYTES = 1024  #: saved arrays smaller than this stay on the device (the estimator's OFFLOAD_MIN_BYTES)


class _OnDisk:
    """A saved array living in an unnamed file: shape, dtype and the open file object. The file is closed (its
    blocks released) when the last save holding this object lets it go: after that node's backward, or with the
    graph (``retain_graph=True`` keeps it readable, as without offload)."""

    __slots__ = ("file", "shape", "dtype", "__weakref__")

    def __init__(self, file, shape, dtype):
        self.file, self.shape, self.dtype = file, shape, dtype
        weakref.finalize(self, file.close)


def _buffer_key(a) -> tuple:
    """Identity of the bytes ``a`` shows: (owning buffer's id, first byte's address, shape, strides, dtype)."""
    return (id(owning_buffer(a)), backend.data_ptr(a), a.shape, a.strides, a.dtype.str)


class ActivationOffload:
    """The pack/unpack pair for one rank; use ``with offloader():`` around the forward pass.

    ``kind``: ``"cpu"``, ``"nvme"`` or ``"none"``; ``min_bytes``: smaller arrays stay. Attributes:
    bytes_offloaded; saves_shared. Raises ValueError: unknown kind; OffloadError (:func:`check_offload_dir`).
    """

    def __init__(self, kind: str = "cpu", offload_dir: str | None = None, rank: int = 0, min_bytes: int = MIN_BYTES):
        if kind not in KINDS:
            raise ValueError(f"activation offload {kind!r} is not one of {KINDS}")
        self.kind, self.min_bytes, self.bytes_offloaded = kind, min_bytes, 0
        self.saves_shared = 0
        # _buffer_key -> packed (host array or _OnDisk) while a save holds it and the device buffer lives: saves of
        # one buffer in one graph share a copy; a later forward packs the buffer anew (it may have been refilled)
        self._packed = weakref.WeakValueDictionary()
        self._watched = {}  # _buffer_key -> the finalizer dropping it when the device buffer dies (one per buffer)
        self.rank = rank
        self.dir = None
        if kind == "nvme":
            self.dir = offload_dir or tempfile.gettempdir()
            check_offload_dir(self.dir)

    def _keep(self, a) -> bool:
        return a.nbytes < self.min_bytes or get_ledger().category_of(a) == "parameters"

    def pack(self, a):
        """Move ``a`` (any array) out of device memory, once per buffer; returns what backward will need."""
        if self._keep(a):
            return a
        key = _buffer_key(a)
        packed = self._packed.get(key)
        if packed is not None:  # saved before by another Function: share the copy
            self.saves_shared += 1
            return packed
        packed = self._pack_new(a)
        self._packed[key] = packed
        if key not in self._watched:  # a buffer packed again each forward gets one finalizer, not one a step
            self._watched[key] = weakref.finalize(owning_buffer(a), self._unwatch, key)
        return packed

    def _unwatch(self, key) -> None:
        """The device buffer of ``key`` is freed: a new buffer at its address is another one."""
        self._packed.pop(key, None)
        self._watched.pop(key, None)

    def _pack_new(self, a):
        """One host copy (cpu) or one anonymous file (nvme) of ``a``."""
        self.bytes_offloaded += a.nbytes
        if self.kind == "cpu":
            host = backend.to_pinned_host(a)
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

