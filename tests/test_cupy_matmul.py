"""backend._cupy_matmul without a GPU: CuPy's array module, device and cuBLAS replaced by NumPy stand-ins.

The stand-in ``gemmStridedBatchedEx`` reads and writes memory at the addresses it is given, with cuBLAS's
column-major layout (leading dimensions, batch strides), so these tests check the arguments minizero passes
(order, leading dimensions, strides, batch count, dtypes) and which shapes take the half GEMM at all.
"""
import ctypes
import sys
import types

import numpy as np
import pytest

from minizero import backend

CUDA_R_16F, COMPUTE_32F, OP_N, TENSOR_OP = 2, 68, 0, 99  # cuBLAS's / CUDA's enum values


class DeviceArray(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr``: the address cuBLAS is given."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _device(a):
    return np.ascontiguousarray(a).view(DeviceArray)


def _matrices(ptr, rows, cols, ld, stride, batch):
    """``batch`` column-major (rows, cols) float16 matrices at ``ptr`` (leading dimension ``ld``), as views."""
    extent = (batch - 1) * stride + ld * (cols - 1) + rows
    flat = np.ctypeslib.as_array((ctypes.c_uint16 * extent).from_address(ptr)).view(np.float16)
    return [np.lib.stride_tricks.as_strided(flat[i * stride:], (rows, cols), (2, 2 * ld)) for i in range(batch)]


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs the stand-ins; yields the list of gemm calls (m, n, k, batch)."""
    calls = []

    def gemm(handle, transa, transb, m, n, k, alpha, A, a_type, lda, stride_a, B, b_type, ldb, stride_b, beta,
             C, c_type, ldc, stride_c, batch, compute, algo):
        assert (handle, transa, transb, a_type, b_type, c_type, compute, algo) == (
            7, OP_N, OP_N, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, COMPUTE_32F, TENSOR_OP)
        assert lda >= max(1, m) and ldb >= max(1, k) and ldc >= max(1, m)  # cuBLAS's rules
        al, be = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
        for a, b, c in zip(_matrices(A, m, k, lda, stride_a, batch), _matrices(B, k, n, ldb, stride_b, batch),
                           _matrices(C, m, n, ldc, stride_c, batch)):
            c_new = al * (a.astype(np.float32) @ b.astype(np.float32))
            c[...] = (c_new + be * c.astype(np.float32) if be else c_new).astype(np.float16)
        calls.append((m, n, k, batch))

    xp = types.SimpleNamespace(ascontiguousarray=_device, empty=lambda shape, dtype: _device(np.empty(shape, dtype)))
    cuda = types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=lambda: 7),
                                 runtime=types.SimpleNamespace(CUDA_R_16F=CUDA_R_16F))
    cublas = types.SimpleNamespace(gemmStridedBatchedEx=gemm, CUBLAS_OP_N=OP_N, CUBLAS_COMPUTE_32F=COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT_TENSOR_OP=TENSOR_OP)
    libs = types.SimpleNamespace(cublas=cublas)
    for name, module in {"cupy": types.SimpleNamespace(cuda=cuda), "cupy.cuda": cuda, "cupy_backends":
                         types.SimpleNamespace(), "cupy_backends.cuda": types.SimpleNamespace(libs=libs),
                         "cupy_backends.cuda.libs": libs, "cupy_backends.cuda.libs.cublas": cublas}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backend, "xp", xp)
    monkeypatch.setattr(backend, "name", "cupy")
    yield calls


def _half(rng, *shape):
    return _device(rng.standard_normal(shape).astype(np.float16))


def _close(got, a, b):
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert got.dtype == np.float16 and got.shape == want.shape
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 ** -10 * np.abs(want) + 1e-3)


def test_an_attention_batch_is_one_strided_batched_half_gemm(fake_cupy):
    rng = np.random.default_rng(0)
    q, k = _half(rng, 2, 3, 5, 4), _half(rng, 2, 3, 6, 4)
    kt = np.swapaxes(k, -1, -2)  # (2, 3, 4, 6), not contiguous: copied first
    got = backend.matmul(q, kt)
    _close(got, q, kt)
    assert fake_cupy == [(6, 5, 4, 6)]  # C^T = B^T A^T: m = N, n = M, k = K, batch 2 x 3


def test_a_stack_times_a_matrix_is_folded_into_one_2d_product(fake_cupy, monkeypatch):
    rng = np.random.default_rng(1)
    x, w = _half(rng, 2, 7, 4), _half(rng, 3, 4)
    seen = []
    real = DeviceArray.__matmul__
    monkeypatch.setattr(DeviceArray, "__matmul__", lambda a, b: seen.append((a.shape, b.shape)) or real(a, b))
    got = backend.matmul(x, w.T)
    assert seen == [((14, 4), (4, 3))] and fake_cupy == []  # one 2-D product, which CuPy runs as a half GEMM
    _close(got, x, w.T)


@pytest.mark.parametrize("shapes", [((2, 3, 4, 5), (2, 3, 6, 7)), ((2, 3, 4), (5, 6))])
def test_shapes_that_do_not_multiply_raise_as_cupy_does(fake_cupy, shapes):
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError):
        backend.matmul(_half(rng, *shapes[0]), _half(rng, *shapes[1]))
    assert fake_cupy == []


@pytest.mark.parametrize("shapes", [((2, 3, 4, 5), (2, 3, 5, 0)), ((2, 0, 4, 5), (2, 0, 5, 3)),
                                    ((2, 3, 4, 5), (1, 3, 5, 6)), ((2, 3, 4, 5), (5,))])
def test_empty_broadcast_and_1d_operands_fall_back_to_cupys_product(fake_cupy, shapes):
    rng = np.random.default_rng(3)
    a, b = _half(rng, *shapes[0]), _half(rng, *shapes[1])
    assert np.array_equal(backend.matmul(a, b), np.asarray(a) @ np.asarray(b))
    assert fake_cupy == []


def test_float32_batches_are_left_to_cupy(fake_cupy):
    rng = np.random.default_rng(4)
    a, b = _device(rng.standard_normal((2, 3, 4))), _device(rng.standard_normal((2, 4, 5)))
    assert np.array_equal(backend.matmul(a, b), np.asarray(a) @ np.asarray(b)) and fake_cupy == []
