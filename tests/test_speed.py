"""The fast paths of issue 17 give the bits of the plain formulas they replace (float64),
and float16 ops compute in float32 and round once at the store."""
import math

import numpy as np
import pytest

from minizero import backend
from minizero.autograd import Tensor
from minizero.autograd import functional as F
from minizero.autograd import kernels
from minizero.autograd.kernels import scatter_add_rows

C = math.sqrt(2.0 / math.pi)


@pytest.fixture(params=[kernels.BLOCK_ELEMENTS, 50, 1], ids=["blocks", "uneven-blocks", "one-element-blocks"])
def blocks(request, monkeypatch):
    """The kernels' block size: as shipped (one block for these small arrays), 50 elements (blocks of a row or two,
    the last one short) and 1 (one row per block); the last two blocked from any size (before: BLOCKED_FROM stayed
    at 4 x 65536 elements, so these small arrays ran as one block whatever the block size, the blocked loops
    untested)."""
    if request.param != kernels.BLOCK_ELEMENTS:
        monkeypatch.setattr(kernels, "BLOCKED_FROM", 0)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", request.param)


def _run(fn, x, g, *extra):
    t = Tensor(x, requires_grad=True)
    y = fn.apply(t, *extra)
    y.backward(g)
    return y.data, t.grad


def test_gelu_float64_is_bitwise_the_plain_formula(blocks):
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 5, 64)) * 3, rng.standard_normal((3, 5, 64))
    y, dx = _run(F.GELU, x, g)
    t = np.tanh(C * (x + 0.044715 * (x * x * x)))
    np.testing.assert_array_equal(y, 0.5 * x * (1.0 + t))
    dt = (1.0 - t * t) * C * (1.0 + 3 * 0.044715 * x * x)
    np.testing.assert_array_equal(dx, g * (0.5 * (1.0 + t) + 0.5 * x * dt))


def test_softmax_float64_is_bitwise_the_plain_formula(blocks):
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((2, 3, 7, 7)) * 4, rng.standard_normal((2, 3, 7, 7))
    y, dx = _run(F.CausalSoftmax, x, g)
    xs = np.where(np.triu(np.ones((7, 7), bool), k=1), -np.inf, x)
    e = np.exp(xs - xs.max(axis=-1, keepdims=True))
    ref = e / e.sum(axis=-1, keepdims=True)
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_array_equal(dx, ref * (g - (g * ref).sum(axis=-1, keepdims=True)))


def test_layer_norm_float64_is_bitwise_the_plain_formula(blocks):
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((4, 6, 32)) + 1.5, rng.standard_normal((4, 6, 32))
    w, b = rng.standard_normal(32), rng.standard_normal(32)
    tx, tw, tb = (Tensor(a, requires_grad=True) for a in (x, w, b))
    y = F.layer_norm(tx, tw, tb)
    y.backward(g)
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    xhat = (x - mean) * rstd
    np.testing.assert_array_equal(y.data, xhat * w + b)
    gx = g * w
    dx = rstd * (gx - gx.mean(axis=-1, keepdims=True) - xhat * (gx * xhat).sum(axis=-1, keepdims=True) / 32)
    np.testing.assert_array_equal(tx.grad, dx)
    np.testing.assert_array_equal(tw.grad, (g * xhat).reshape(-1, 32).sum(axis=0))
    np.testing.assert_array_equal(tb.grad, g.reshape(-1, 32).sum(axis=0))


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_scatter_add_rows_is_bitwise_add_at(dtype):
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 11, 500)
    rows = rng.standard_normal((500, 8)).astype(dtype)
    ref = np.zeros((13, 8), np.float64)  # float64: add.at's bits; float16: that sum rounded once
    np.add.at(ref, idx, rows.astype(np.float64))
    ref = ref.astype(dtype)
    got = scatter_add_rows((13, 8), idx, rows)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, ref)
    assert not got[11:].any()  # rows never indexed stay zero


def test_stacked_matmul_equals_numpy():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 5, 7)), rng.standard_normal((2, 7))
    np.testing.assert_allclose(backend.matmul(a, b.T), a @ b.T, rtol=1e-14)
    q, k = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 6, 4))
    np.testing.assert_allclose(backend.matmul(q, np.swapaxes(k, -1, -2)), q @ np.swapaxes(k, -1, -2), rtol=1e-14)
    assert backend.matmul(np.zeros((2, 3, 0)), np.zeros((0, 4))).shape == (2, 3, 4)


def test_float16_gelu_computes_in_float32_and_rounds_once(blocks):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4096) * 3).astype(np.float16)
    g = rng.standard_normal(4096).astype(np.float16)
    y, dx = _run(F.GELU, x, g)
    assert y.dtype == dx.dtype == np.float16
    x32, g32 = x.astype(np.float32), g.astype(np.float32)
    y32, dx32 = _run(F.GELU, x32, g32)
    np.testing.assert_array_equal(y, y32.astype(np.float16))
    np.testing.assert_array_equal(dx, dx32.astype(np.float16))


def test_dropout_masks_are_float32_draws():
    F.manual_seed(7)
    keep = F.dropout_keep_mask((1000,), 0.25)
    from minizero.autograd import rng  # the counter-based generator: 24-bit uniforms, exact in float32

    key = rng.mix64_int(7)
    ref = np.array([(rng.mix64_int(key + (i + 1) * rng.GAMMA) >> 40) * 2.0 ** -24 >= 0.25 for i in range(1000)])
    np.testing.assert_array_equal(keep, ref)


def test_tracemalloc_is_off_unless_asked_and_rss_is_reported():
    from minizero.args import build_parser
    from minizero.ledger import memory_summary
    from minizero.train import peak_rss_bytes, use_tracemalloc
    p = build_parser()
    assert not use_tracemalloc(p.parse_args([]))
    assert use_tracemalloc(p.parse_args(["--tracemalloc"]))
    assert not use_tracemalloc(p.parse_args(["--tracemalloc", "--no-tracemalloc"]))
    assert peak_rss_bytes() > 10 * 2**20  # this interpreter with NumPy loaded
    text = memory_summary(None, [peak_rss_bytes()], process_peak_source="rss")
    assert "getrusage" in text and "tracemalloc traces" in text


def test_keep_freed_memory_serves_a_large_array_from_the_heap():
    """After ``keep_freed_memory`` a 4 MiB array is not an mmap of its own (glibc's mallinfo2: bytes in mmapped
    blocks unchanged), so freeing it keeps its pages for the next array; before it, glibc maps it. In a child
    process: the setting is process-wide and this test must not change the suite's own allocator."""
    import subprocess
    import sys

    child = """
import ctypes, numpy as np
from minizero import backend
try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
except AttributeError:
    raise SystemExit(3)  # no glibc >= 2.33
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2.restype = Info
def mapped_by_a_new_array():
    before = mallinfo2().hblkhd
    a = np.ones(2 ** 20, np.float32)  # 4 MiB
    return mallinfo2().hblkhd - before
print(mapped_by_a_new_array(), backend.keep_freed_memory(), mapped_by_a_new_array())
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    if run.returncode == 3:
        pytest.skip("no glibc >= 2.33 (mallinfo2) here")
    assert run.returncode == 0, run.stderr
    default, kept, after = run.stdout.split()
    assert int(default) >= 4 * 2 ** 20 and kept == "True" and int(after) == 0


def test_usable_cores_counts_the_cores_this_process_may_run_on(monkeypatch):
    """taskset / a cpuset / mpiexec's binding, not the machine's count: a 16-core machine that lets a process
    use 2 gives it 2 BLAS threads and no spinning for a third rank (the device run's profile ran 16 threads on 2)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert backend.usable_cores() == 2
    from minizero.comm import base
    assert base.spin_seconds(2) == base.SPIN_S and base.spin_seconds(3) == 0.0
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS: no affinity call
    assert backend.usable_cores() == 16


def test_blocked_layer_norm_keeps_a_strided_inputs_bits(monkeypatch):
    """A transposed (strided) input is normalized in its own layout whatever the block size: blocks would copy it
    C-contiguous first, which changes the order of each row's sum."""
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((3, 7, 40, 33)).transpose(0, 1, 3, 2), rng.standard_normal((3, 7, 33, 40))
    w, b = rng.standard_normal(40), rng.standard_normal(40)
    results = []
    for block, blocked_from in ((kernels.BLOCK_ELEMENTS, kernels.BLOCKED_FROM), (50, 0)):  # one block; many
        monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", block)
        monkeypatch.setattr(kernels, "BLOCKED_FROM", blocked_from)
        tx = Tensor(x, requires_grad=True)
        y = F.layer_norm(tx, Tensor(w), Tensor(b))
        y.backward(g)
        results.append((y.data, tx.grad))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
