"""The array-module seam: every compute path in minizero calls ``backend.xp``.

``xp`` is NumPy by default; ``set_backend("cupy")`` swaps in CuPy (same API) without
touching any technique, and ``set_backend("strict")`` swaps in :mod:`minizero.strict`,
NumPy underneath but with arrays that refuse every implicit host transfer the way CuPy's
do (the CPU-only proof that the CuPy path leaks nothing). Host/device transfers go through
``to_host`` and ``to_device`` so that on NumPy they are no-ops and on CuPy/strict they are
real copies. :func:`set_device` maps the ``--device`` flag (cpu, cuda, strict) onto these.

The dtype policy lives here too: minizero trains in float32 by default, float64
is a first-class dtype for tests (tolerances like 1e-12 catch bookkeeping bugs),
and float16 is the compute dtype of mixed precision.

Mirrors: ``cupy.get_array_module`` / the "xp" convention of the Array API.
"""
from __future__ import annotations

import os

import numpy as np

from minizero import strict

xp = np  #: the active array module (numpy, cupy or minizero.strict)
name = "numpy"
device_description = "cpu (NumPy)"  #: the last :func:`set_device`'s one-line description (the job's header)

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}


def set_backend(backend: str) -> None:
    """Switch the array module for the whole process.

    Args:
        backend: ``"numpy"``, ``"cupy"`` or ``"strict"`` (:mod:`minizero.strict`).
    Raises:
        ValueError: unknown backend name.
        ImportError: ``"cupy"`` asked for but CuPy is not installed
            (``pip install -e ".[gpu]"`` in the checkout, or ``pip install cupy-cuda12x``).
    """
    global xp, name
    if backend == "numpy":
        xp, name = np, "numpy"
    elif backend == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency)

        xp, name = cupy, "cupy"
    elif backend == "strict":
        xp, name = strict, "strict"
    else:
        raise ValueError(f"unknown backend {backend!r}; allowed: 'numpy', 'cupy', 'strict'")


DEVICES = ("cpu", "cuda", "strict")  #: the values of ``--device``


class DeviceError(RuntimeError):
    """``--device cuda`` cannot run here (CuPy missing or no GPU); the message says what to install or check."""


def local_rank(default: int = 0) -> int:
    """This process's rank among the processes on its node, from the launcher's environment.

    Read from ``MPI_LOCALRANKID`` (MPICH's Hydra), ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI),
    ``SLURM_LOCALID`` (srun) or ``LOCAL_RANK`` (torchrun's name), the first one set; ``default``
    when none is (one process, or a launcher that sets none: give it the communicator's rank).
    """
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


def cuda_device_count() -> int:
    """The CUDA devices CuPy sees (>= 1), without selecting one or switching the array module.

    For a program that launches others with ``--device cuda`` (``python -m minizero.compare``) and
    must refuse before any work where they would all fail.
    Raises:
        DeviceError: CuPy is not installed, cannot reach the driver, or sees no device.
    """
    try:
        import cupy  # noqa: PLC0415  (optional dependency)
    except ImportError as e:
        raise DeviceError(f"--device cuda needs CuPy, which is not installed ({e}); install it from the minizero "
                          "checkout with: pip install -e '.[gpu]' (CUDA 12; '.[gpu-cuda13]' for CUDA 13)") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise DeviceError(f"--device cuda: CuPy cannot reach the CUDA driver ({e}); is there a GPU and a driver?") from e
    if count < 1:
        raise DeviceError("--device cuda: CuPy sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    return count


def set_device(device: str, rank_on_node: int = 0) -> str:
    """Select the array module and device for ``--device``; returns a one-line description.

    ``cpu`` is NumPy; ``strict`` is :mod:`minizero.strict` (NumPy underneath, host leaks raise);
    ``cuda`` is CuPy on GPU ``rank_on_node % device_count`` (rank r of a node uses GPU
    ``local_rank % count``, the usual one-GPU-per-process layout, as ``torch.cuda.set_device``).

    Raises:
        ValueError: ``device`` not one of :data:`DEVICES`, or a negative ``rank_on_node``.
        DeviceError: ``cuda`` asked for but CuPy is not installed or no CUDA device is visible.
    """
    global device_description
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    if rank_on_node < 0:
        raise ValueError(f"local rank must be >= 0, got {rank_on_node}")
    if device == "cpu":
        set_backend("numpy")
        device_description = "cpu (NumPy)"
        return device_description
    if device == "strict":
        set_backend("strict")
        device_description = "strict (NumPy underneath; implicit host transfers raise)"
        return device_description
    count = cuda_device_count()
    import cupy  # noqa: PLC0415  (optional dependency; cuda_device_count imported it)

    gpu = rank_on_node % count
    cupy.cuda.Device(gpu).use()
    set_backend("cupy")
    device_description = f"cuda:{gpu} (CuPy, {count} device(s) visible)"
    return device_description


def array_module(a):
    """The array module of ``a``: NumPy for a host ``numpy.ndarray``, else the active module ``xp``.

    For code that serves host and device arrays alike (the collectives carry device gradients
    and host metadata such as lengths and flags). Mirrors ``cupy.get_array_module``.
    """
    return np if isinstance(a, np.ndarray) else xp


def get_dtype(dtype) -> np.dtype:
    """Resolve ``"float32"``/``np.float32``/... to a NumPy dtype.

    Raises:
        ValueError: a dtype that minizero does not train in (allowed: float64,
            float32, float16).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPES)}")
        return np.dtype(DTYPES[dtype])
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dt.name!r}; allowed: {sorted(DTYPES)}")
    return dt


def matmul(a, b):
    """``a @ b``; two float16 operands are multiplied the way tensor cores do it.

    Tensor cores take FP16 inputs, accumulate in FP32 and round the result to
    FP16 (Micikevicius et al. 2018, section 3.2). NumPy has no such kernel (and
    its float16 matmul is very slow), so on NumPy the inputs are widened to
    float32, multiplied, and the result rounded to float16. On CuPy the real
    half-precision GEMM runs (cuBLAS accumulates in FP32 by default).
    Shapes: as ``numpy.matmul``.

    On NumPy the operands are handed to BLAS in the shapes it is fast at (measured on
    this machine, float32, :func:`_blas_matmul`): a stack times a matrix, (B, T, K) @ (K, N),
    is one (B*T, K) @ (K, N) GEMM (4x faster than NumPy's loop over B), and a batched
    product gets C-contiguous operands (5x faster than a transposed view). Each output
    element is still one dot product of the same K terms, so results change at most by
    rounding (the GEMM kernel's blocking).
    """
    if name == "strict":  # the NumPy kernels on the wrapped arrays: bitwise what cpu computes
        return strict.StrictArray(_numpy_matmul(strict.device_array(a), strict.device_array(b)))
    if name != "numpy":
        return a @ b
    return _numpy_matmul(a, b)


def matmul_operand(a):
    """``a`` as :func:`matmul` multiplies it: float16 widened to float32 on NumPy (exact), else ``a``.

    A kernel whose operand feeds several products widens it once with this and rounds each
    float32 product to float16 itself: the same bits as :func:`matmul` of the float16 operands.
    """
    return a.astype(np.float32) if name == "numpy" and a.dtype == np.float16 else a


def _numpy_matmul(a, b):
    """:func:`matmul` on NumPy arrays."""
    if a.dtype == np.float16 and b.dtype == np.float16:
        return _blas_matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return _blas_matmul(a, b)


def _blas_matmul(a, b):
    """``a @ b`` on NumPy with BLAS-friendly operands (see :func:`matmul`)."""
    if a.ndim > 2 and b.ndim == 2:
        rows = a.size // a.shape[-1] if a.shape[-1] else int(np.prod(a.shape[:-1]))  # not -1: K may be 0
        out = np.reshape(a, (rows, a.shape[-1])) @ b
        return out.reshape(a.shape[:-1] + (b.shape[-1],))
    if a.ndim > 2 or b.ndim > 2:
        return np.ascontiguousarray(a) @ np.ascontiguousarray(b)
    return a @ b


def to_host(a) -> np.ndarray:
    """Return ``a`` as a NumPy array on the host (a copy only on CuPy and strict: ``a.get()``)."""
    if hasattr(a, "get") and not isinstance(a, (np.ndarray, np.generic, dict)):
        return a.get()
    return np.asarray(a)


def to_device(a):
    """Return ``a`` as an array of the active module (a copy only on CuPy and strict: ``xp.asarray``)."""
    return xp.asarray(a)


def synchronize() -> None:
    """Wait for queued device work (no-op on NumPy); call before timing."""
    if name == "cupy":
        xp.cuda.Device().synchronize()


def host_scalar(a):
    """The Python number held by a one-element array (host or device): an explicit, synchronizing
    device-to-host copy on CuPy (``bool(x.any())`` or ``float(x.max())`` would be implicit ones).

    Raises:
        ValueError: ``a`` holds more than one element.
    """
    h = to_host(a)
    if h.size != 1:
        raise ValueError(f"host_scalar needs a one-element array, got shape {h.shape}")
    return h.reshape(()).item()


def pinned_zeros(shape, dtype) -> np.ndarray:
    """A zero-filled host array for device-to-host copies: page-locked (pinned) memory on CuPy
    (``cupyx.zeros_pinned``: DMA-able, so copies run at full bus speed and can be asynchronous),
    plain ``numpy.zeros`` otherwise. Mirrors PyTorch's ``pin_memory=True``.
    """
    if name == "cupy":
        import cupyx  # noqa: PLC0415  (optional dependency)

        return cupyx.zeros_pinned(shape, dtype)
    return np.zeros(shape, dtype)


def to_pinned_host(a) -> np.ndarray:
    """A new host copy of ``a`` (any array, any device), in page-locked memory on CuPy (as :func:`pinned_zeros`)."""
    if name == "cupy" and not isinstance(a, np.ndarray):
        import cupyx  # noqa: PLC0415  (optional dependency)

        out = cupyx.empty_pinned(a.shape, a.dtype)
        xp.ascontiguousarray(a).get(out=out)
        return out
    return np.array(to_host(a), copy=True)


def data_ptr(a) -> int:
    """The address of ``a``'s first element (host or device array): an identity for its bytes, as
    ``numpy``'s ``__array_interface__`` data pointer or CuPy's ``a.data.ptr``."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    if name == "strict":
        return strict.device_array(a).__array_interface__["data"][0]
    return a.data.ptr
