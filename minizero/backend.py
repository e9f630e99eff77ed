"""The array-module seam: every compute path in minizero calls ``backend.xp``.

``xp`` is NumPy by default, CuPy after ``set_backend("cupy")``, or :mod:`minizero.strict` (NumPy arrays that
refuse implicit host transfers, as CuPy's do). Transfers go through ``to_host``/``to_device`` (no-ops on
NumPy). The dtype policy: float32 by default, float64 for tests, float16 the mixed-precision compute dtype.
Mirrors: ``cupy.get_array_module`` / the "xp" convention of the Array API.
"""
from __future__ import annotations

import math
import os

import numpy as np

from minizero import strict

xp = np  #: the active array module (numpy, cupy or minizero.strict)
name = "numpy"
device_description = "cpu (NumPy)"  #: the last :func:`set_device`'s one-line description (the job's header)

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}


def usable_cores() -> int:
    """The CPU cores this process may run on: ``os.sched_getaffinity`` (what ``taskset``, a container's cpuset or
    ``mpiexec``'s binding allow), else ``os.cpu_count()`` (macOS has no affinity call); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def blas_info() -> dict:
    """NumPy's BLAS as threadpoolctl sees it: ``internal_api`` (openblas, mkl, blis), ``version``, ``architecture``
    (the kernel, OpenBLAS only) and ``num_threads`` (this process's, after any limit); ``{}`` where it finds none."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415  (scans the loaded libraries: only when asked)
    return next((i for i in threadpool_info() if i.get("user_api") == "blas"), {})


MALLOC_MMAP_THRESHOLD = 32 * 2 ** 20  #: glibc's largest mmap threshold: smaller blocks come from the reused heap
MALLOC_TRIM_THRESHOLD = 2 ** 30  #: free heap glibc keeps before returning memory to the system
malloc_kept = False  #: True once :func:`keep_freed_memory` changed this process's malloc


def keep_freed_memory() -> bool:
    """Ask glibc's malloc (``mallopt(3)``) to keep freed memory for the next array instead of unmapping it.

    By default glibc maps large blocks fresh and unmaps them on free, so each temporary of a step faults its
    pages in again (docs/benchmarks.md, "Memory allocation"). Process-wide. Returns True if glibc took both
    settings; False without glibc's mallopt, or where it refused one (e.g. a 32-bit glibc's lower ceiling).
    """
    global malloc_kept
    import ctypes

    try:  # the process's own symbols (libc's among them): no ctypes.util.find_library, which runs ldconfig
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt in this process: not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h; each call returns 1 if accepted
    set_mmap = bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD))
    set_trim = bool(mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))
    malloc_kept = set_mmap and set_trim
    return malloc_kept


def set_backend(backend: str) -> None:
    """Switch the array module for the whole process: ``"numpy"``, ``"cupy"`` or ``"strict"``.

    Raises ValueError: unknown name; ImportError: CuPy not installed (``pip install -e ".[gpu]"``).
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
    """This process's rank on its node (``MPI_LOCALRANKID``, Open MPI's, Slurm's, ``LOCAL_RANK``), else ``default``."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isascii() and value.isdigit():  # not "²" (isdigit, which int() refuses) nor "٣"
            return int(value)
    return default


def cuda_device_count() -> int:
    """The CUDA devices CuPy sees (>= 1), selecting none. Raises DeviceError: no CuPy, no driver, or no device."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency)
    except ImportError as e:
        raise DeviceError(f"--device cuda needs CuPy, which is not installed ({e}); install it from the minizero "
                          "checkout with: pip install -e '.[gpu]' (CUDA 12; '.[gpu-cuda13]' for CUDA 13)") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise DeviceError(f"--device cuda: CuPy cannot reach the CUDA driver ({e}); "
                          "is there a GPU and a driver?") from e
    if count < 1:
        raise DeviceError("--device cuda: CuPy sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    return count


def set_device(device: str, rank_on_node: int = 0) -> str:
    """Select the array module and device for ``--device``; returns a one-line description.

    ``cpu``: NumPy; ``strict``: :mod:`minizero.strict`; ``cuda``: CuPy on GPU ``rank_on_node % device_count``.
    Raises ValueError: ``device`` not in :data:`DEVICES`, negative ``rank_on_node``; DeviceError: no CuPy or GPU.
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
    """The array module of ``a``: NumPy for a host ``numpy.ndarray``, else ``xp`` (``cupy.get_array_module``)."""
    return np if isinstance(a, np.ndarray) else xp


def get_dtype(dtype) -> np.dtype:
    """Resolve ``"float32"``/``np.float32``/... to a NumPy dtype. Raises ValueError: not float64, float32 or float16."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {sorted(DTYPES)}")
        return np.dtype(DTYPES[dtype])
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dt.name!r}; allowed: {sorted(DTYPES)}")
    return dt


def matmul(a, b, bias=None):
    """``a @ b (+ bias)`` (shapes as ``numpy.matmul``; ``bias`` (N,)); float16 operands as tensor cores take them.

    FP16 inputs, FP32 accumulation, FP16 result (Micikevicius et al. 2018, 3.3): widened to float32 on NumPy,
    the bias added before the one rounding (cuBLASLt's epilogue); CuPy: cuBLAS's half GEMM, then the bias.
    On NumPy a (B, T, K) @ (K, N) stack is one 2-D GEMM, batched operands made C-contiguous.
    """
    if name == "strict":  # the NumPy kernels on the wrapped arrays: bitwise what cpu computes
        return strict.StrictArray(_numpy_matmul(strict.device_array(a), strict.device_array(b),
                                                None if bias is None else strict.device_array(bias)))
    if name != "numpy":
        y = _cupy_matmul(a, b)
        if bias is None:
            return y
        if y.dtype == np.float16:
            return (y.astype(np.float32) + bias).astype(np.float16)
        y += bias
        return y
    return _numpy_matmul(a, b, bias)


def _cupy_matmul(a, b):
    """:func:`matmul` on CuPy arrays: the float16 products the model makes run as cuBLAS half GEMMs.

    CuPy's ``@`` runs a 2-D float16 product as one cuBLAS half GEMM (float32 accumulation), but multiplies any operand
    of 3 or more axes as float32 batches of float32 copies (``cupy/_core/_routines_linalg.pyx``, ``matmul``). So:

    - (..., K) @ (K, N): the rows folded into one 2-D product (as on NumPy), any dtype;
    - float16 (..., M, K) @ (..., K, N) with the same leading axes (attention's batches): one
      ``cublasGemmStridedBatchedEx`` on contiguous half operands, CUBLAS_COMPUTE_32F (cuBLAS's docs);
    - anything else (broadcast or 1-D operands, mixed dtypes, mismatched or empty dimensions): CuPy's ``@``,
      which also raises its own error for shapes that do not multiply.
    """
    if a.ndim > 2 and b.ndim == 2 and a.shape[-1] == b.shape[0]:
        rows = math.prod(a.shape[:-1])
        return _cupy_matmul(a.reshape(rows, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[-1],))
    if (a.dtype != np.float16 or b.dtype != np.float16 or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]
            or a.shape[-1] != b.shape[-2] or a.size == 0 or b.size == 0):
        return a @ b
    from cupy.cuda import device, runtime  # noqa: PLC0415  (optional dependency)
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415

    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    (m, k), n = a.shape[-2:], b.shape[-1]
    c = xp.empty(a.shape[:-1] + (n,), dtype=np.float16)
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)  # host scalars (cuBLAS's default pointer mode)
    # row-major C = A B is column-major C^T = B^T A^T: cuBLAS's A is our b (n x k), its B our a (k x m)
    cublas.gemmStridedBatchedEx(
        device.get_cublas_handle(), cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k, one.ctypes.data,
        b.data.ptr, runtime.CUDA_R_16F, n, k * n, a.data.ptr, runtime.CUDA_R_16F, k, m * k, zero.ctypes.data,
        c.data.ptr, runtime.CUDA_R_16F, n, m * n, math.prod(a.shape[:-2]), cublas.CUBLAS_COMPUTE_32F,
        cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)
    return c


def matmul_operand(a):
    """``a`` as :func:`matmul` multiplies it: float16 widened to float32 on NumPy (exact), else ``a``."""
    return widen(a) if name == "numpy" else a


CAST_CHUNK = 1 << 16  #: elements :func:`narrow` and :func:`binary` convert per pass (256 KiB of float32: cache-sized)
_HALF_TO_FLOAT = None  # the float32 value of each of the 65,536 float16 bit patterns, built on first use


def widen(a):
    """native float16 ``a`` as a new float32 array, bitwise ``a.astype(np.float32)`` (its layout too, but for the
    strides of size-1 axes, which address nothing); else ``a``.
    NumPy: a 256 KiB table lookup, not its emulated per-element half cast (numpy/numpy#28753; bench/profile_step.py)."""
    if a.dtype != np.float16:
        return a
    if name != "numpy" or not isinstance(a, np.ndarray) or a.ndim == 0:
        return a.astype(np.float32)
    global _HALF_TO_FLOAT
    if _HALF_TO_FLOAT is None:
        _HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    if not a.flags.c_contiguous:  # the layout astype gives (a GEMM's rounding depends on its operands' order)
        perm = _dense_order(a)
        if perm is not None:  # e.g. a transpose: widen it in memory order, the same axes put back
            return widen(a.transpose(perm)).transpose(np.argsort(perm))
        if all(s > 0 for s in a.strides):  # e.g. a head of the fused projection: a dense float16 copy in memory
            perm = tuple(sorted(range(a.ndim), key=lambda i: -a.strides[i]))  # order (2 bytes an element), widened
            return widen(np.ascontiguousarray(a.transpose(perm))).transpose(np.argsort(perm))  # as empty_like lays out
        out = np.empty_like(a, dtype=np.float32)  # a strided view: astype's layout, as empty_like orders it
        return np.take(_HALF_TO_FLOAT, a.view(np.uint16), out=out, mode="clip")
    return np.take(_HALF_TO_FLOAT, a.view(np.uint16), mode="clip")  # every uint16 is in range: no bounds checks


def _dense_order(a):
    """The axis order that makes ``a`` C-contiguous (a transpose of a dense block, as a permuted copy is), or None."""
    perm = tuple(sorted(range(a.ndim), key=lambda i: -a.strides[i]))
    return perm if a.transpose(perm).flags.c_contiguous else None


def narrow(a):
    """float32 ``a`` as float16, bitwise ``a.astype(np.float16)`` (nearest even; a NaN stays a NaN, not its payload).

    NumPy: passes over chunks of CAST_CHUNK elements where one float add does the rounding ("magic number" rounding,
    as in F. Giesen's float-to-half conversions) and integers do the rest (no subnormal float arithmetic, so
    flush-to-zero modes do not change it); faster than NumPy's per-element cast; checked on all 2^32 inputs.
    Native byte order only.
    """
    if name != "numpy" or a.dtype != np.float32 or not isinstance(a, np.ndarray) or a.ndim == 0:
        return a.astype(np.float16)
    if not a.flags.c_contiguous:  # the layout astype keeps
        perm = _dense_order(a)
        return a.astype(np.float16) if perm is None else narrow(a.transpose(perm)).transpose(np.argsort(perm))
    out = np.empty(a.shape, dtype=np.float16)
    flat, into = a.reshape(-1), out.reshape(-1)
    for i in range(0, a.size, CAST_CHUNK):  # a chunk at a time: its dozen passes stay in the core's cache
        _narrow_into(flat[i:i + CAST_CHUNK], into[i:i + CAST_CHUNK])
    return out


def _narrow_into(a, out) -> None:
    """:func:`narrow` of the C-contiguous float32 ``a`` into the float16 ``out`` of its shape."""
    r = np.abs(a)
    np.clip(r, 0.0, 65520.0, out=r)  # an inf becomes 65520, which rounds to inf below; a NaN stays
    bits = r.view(np.uint32)
    m = bits & 0x7F800000  # |a|'s exponent field, at least that of 2^-14 (below it float16's step is 2^-24) ...
    np.clip(m, 113 << 23, 142 << 23, out=m)
    m += 13 << 23  # ... times 2^13: M = 2^(e + 13), whose ulp is float16's step at |a|
    r += m.view(np.float32)  # M + |a| rounded to nearest even by the FPU (a normal float: no subnormal here)
    bits -= m  # |a| in float16 steps: 1024 + the 10 mantissa bits (2048 when it rounded up to 2^(e+1))
    m -= (126 << 23) - (1 << 13)  # float16's exponent field minus 1 (0 below 2^-14, where the steps are the
    m >>= 13  # subnormal's bits), moved to bits 10-14, plus 1 (clip's fast path needs a lower bound above 0)
    m += bits  # 1 + the half's bits: a carry into bit 10 moves the exponent, 65520 and up become 0x7C00 (inf)
    np.clip(m, 1, 0x7E01, out=m)  # a NaN's bits are far above any half's: it becomes float16's NaN
    sign = a.view(np.uint32) >> 16
    sign &= 0x8000
    m += sign  # bit 15 is clear in m: the add sets the sign
    m -= 1
    np.copyto(out.view(np.uint16), m, casting="unsafe")


def to_dtype(a, dtype):
    """``a`` as ``dtype`` (no copy when it already is), bitwise ``a.astype(dtype)`` but for NaN payloads; float32 to
    float16 by :func:`narrow`, float16 to wider floats through :func:`widen` (not NumPy's per-element casts)."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if a.dtype == np.float16 and dtype.kind == "f" and dtype.itemsize >= 4:
        return widen(a).astype(dtype, copy=False)
    return narrow(a) if dtype == np.float16 and a.dtype == np.float32 else a.astype(dtype)


def binary(op: str, a, b):
    """``xp.<op>(a, b)`` (op "add", "subtract", "multiply"); float16 in float32, rounded once: NumPy's bits,
    with array casts in place of NumPy's per-element ones (timed by bench/profile_step.py), by blocks of CAST_CHUNK."""
    f = getattr(xp, op)
    if name != "numpy" or not (hasattr(a, "dtype") and hasattr(b, "dtype")) or np.result_type(a, b) != np.float16:
        return f(a, b)
    same = a.shape == b.shape and b.flags.c_contiguous
    if a.size <= CAST_CHUNK or not a.flags.c_contiguous or not (same or b.ndim == 0):
        return narrow(f(widen(a), widen(b)))
    out, flat_a, flat_b = np.empty(a.shape, np.float16), a.reshape(-1), b.reshape(-1) if same else b
    into = out.reshape(-1)
    for i in range(0, a.size, CAST_CHUNK):  # a block at a time: widened, combined and rounded while in cache
        blk = slice(i, i + CAST_CHUNK)
        _narrow_into(f(widen(flat_a[blk]), widen(flat_b[blk] if same else b)), into[blk])
    return out


def _numpy_matmul(a, b, bias=None):
    """:func:`matmul` on NumPy arrays."""
    half = a.dtype == np.float16 and b.dtype == np.float16
    y = _blas_matmul(widen(a), widen(b)) if half else _blas_matmul(a, b)  # a new array: the bias goes in in place
    if bias is not None:
        y += widen(bias)
    return narrow(y) if half else y


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
    """The Python number in a one-element array: an explicit device-to-host copy. Raises ValueError: more elements."""
    h = to_host(a)
    if h.size != 1:
        raise ValueError(f"host_scalar needs a one-element array, got shape {h.shape}")
    return h.reshape(()).item()


def pinned_zeros(shape, dtype) -> np.ndarray:
    """A zero-filled host array, pinned (``cupyx.zeros_pinned``) on CuPy, else ``numpy.zeros``
    (PyTorch's ``pin_memory``)."""
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
