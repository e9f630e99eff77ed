"""The array-module seam: every compute path in minizero calls ``backend.xp``.

``xp`` is NumPy today; ``set_backend("cupy")`` swaps in CuPy (same API) without
touching any technique. Host/device transfers go through ``to_host`` and
``to_device`` so that on NumPy they are no-ops and on CuPy they are real copies.

The dtype policy lives here too: minizero trains in float32 by default, float64
is a first-class dtype for tests (tolerances like 1e-12 catch bookkeeping bugs),
and float16 is the compute dtype of mixed precision.

Mirrors: ``cupy.get_array_module`` / the "xp" convention of the Array API.
"""
from __future__ import annotations

import numpy as np

xp = np  #: the active array module (numpy or cupy)
name = "numpy"

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}


def set_backend(backend: str) -> None:
    """Switch the array module for the whole process.

    Args:
        backend: ``"numpy"`` or ``"cupy"``.
    Raises:
        ValueError: unknown backend name.
        ImportError: ``"cupy"`` asked for but CuPy is not installed
            (``pip install minizero[gpu]``).
    """
    global xp, name
    if backend == "numpy":
        xp, name = np, "numpy"
    elif backend == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency)

        xp, name = cupy, "cupy"
    else:
        raise ValueError(f"unknown backend {backend!r}; allowed: 'numpy', 'cupy'")


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
    """
    if name == "numpy" and a.dtype == np.float16 and b.dtype == np.float16:
        return (a.astype(np.float32, order="C") @ b.astype(np.float32, order="C")).astype(np.float16)
    return a @ b


def to_host(a) -> np.ndarray:
    """Return ``a`` as a NumPy array on the host (a copy only on CuPy)."""
    if name == "cupy" and not isinstance(a, np.ndarray):
        return a.get()
    return np.asarray(a)


def to_device(a):
    """Return ``a`` as an array of the active module (a copy only on CuPy)."""
    return xp.asarray(a)


def synchronize() -> None:
    """Wait for queued device work (no-op on NumPy); call before timing."""
    if name == "cupy":
        xp.cuda.Device().synchronize()
