"""The strict array module refuses every implicit host transfer and computes bitwise as NumPy."""
import copy
import pickle

import numpy as np
import pytest

from minizero import backend, strict


@pytest.fixture
def x():
    return strict.asarray(np.arange(12, dtype=np.float64).reshape(3, 4) / 7)


REFUSALS = {
    "np.asarray": lambda x: np.asarray(x),
    "np.array": lambda x: np.array(x),
    "np.float64 cast": lambda x: np.asarray(x, dtype=np.float64),
    "float of a matrix": lambda x: float(x),
    "int of a matrix": lambda x: int(x),
    "bool of a matrix": lambda x: bool(x),
    "ndarray + strict": lambda x: np.ones((3, 4)) + x,
    "strict + ndarray": lambda x: x + np.ones((3, 4)),
    "strict * 0-d ndarray": lambda x: x * np.array(2.0),
    "in-place with ndarray": lambda x: x.__iadd__(np.ones((3, 4))),
    "np ufunc with ndarray": lambda x: np.maximum(x, np.zeros(4)),
    "xp function with ndarray": lambda x: strict.concatenate([x, np.ones((1, 4))]),
    "xp.where with ndarray": lambda x: strict.where(x > 0, x, np.zeros((3, 4))),
    "np function": lambda x: np.concatenate([x, x]),
    "np.sum": lambda x: np.sum(x),
    "np ufunc": lambda x: np.exp(x),
    "np ufunc out=": lambda x: np.tanh(x, out=x),
    "iteration": lambda x: list(x),
    "for loop": lambda x: [v for v in x],
    "ndarray index": lambda x: x[np.array([0, 1])],
    "assign ndarray": lambda x: x.__setitem__(0, np.ones(4)),
    "tolist": lambda x: x.tolist(),
    "tobytes": lambda x: x.tobytes(),
    "pickle": lambda x: pickle.dumps(x),
    "view as ndarray": lambda x: x.view(np.ndarray),
    "list mixing device and host": lambda x: strict.asarray([x[0], 1.0]),
    # what CuPy's signatures refuse (cupy/_core/_kernel.pyx: "Unsupported type"; no initial=/where=)
    "list operand": lambda x: x + [1.0, 2.0, 3.0, 4.0],
    "tuple operand in place": lambda x: x.__imul__((1.0, 2.0, 3.0, 4.0)),
    "list to a ufunc": lambda x: strict.maximum([0.0], x),
    "list to xp.sum": lambda x: strict.sum([1.0, 2.0]),
    "list to xp.where": lambda x: strict.where(x > 0, x, [0.0] * 4),
    "sum initial=": lambda x: x.sum(initial=0.0),
    "xp.max initial=": lambda x: strict.max(x, initial=0.0),
    "xp.sum where=": lambda x: strict.sum(x, where=x > 0),
    "ufunc where=": lambda x: strict.add(x, x, where=x > 0),
    "ufunc order=": lambda x: strict.exp(x, order="C"),
    "add.reduce initial=": lambda x: strict.add.reduce(x, initial=1.0),
    "add.reduce of a list": lambda x: strict.add.reduce([1.0, 2.0]),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_every_implicit_host_transfer_raises(x, name):
    with pytest.raises((TypeError, ValueError, AttributeError)):
        REFUSALS[name](x)


def test_allowed_as_on_cupy(x):
    assert float(x.sum()) == float(np.arange(12).sum() / 7)  # 0-d: an explicit sync, as on CuPy
    assert int(strict.asarray([3])) == 3 and bool(strict.asarray(True))
    assert isinstance(np.float32(2) * x, strict.StrictArray) and isinstance(2.0 * x, strict.StrictArray)
    assert isinstance(x.sum(), strict.StrictArray) and x.sum().shape == ()  # reductions give 0-d arrays
    assert len(x) == 3 and x.shape == (3, 4) and x.dtype == np.float64 and x.nbytes == 96


def test_no_index_as_on_cupy():
    """CuPy refuses a device array as a Python index (``__index__``: a hidden device sync); ``int(x)`` is the way."""
    with pytest.raises(TypeError):
        range(strict.asarray(3))
    with pytest.raises(TypeError):
        [0, 1, 2][strict.asarray(1)]
    assert list(range(int(strict.asarray(3)))) == [0, 1, 2]


@pytest.mark.parametrize("call", ["maximum.reduce", "minimum.accumulate", "multiply.reduceat", "tanh.at",
                                  "multiply.at", "logical_and.reduce"])
def test_ufunc_methods_beyond_cupys_raise_not_implemented(x, call):
    """CuPy has reduce/accumulate on add and multiply only, reduceat on add, at on its scatter ops."""
    ufunc, method = call.split(".")
    with pytest.raises(NotImplementedError, match=call):
        getattr(getattr(strict, ufunc), method)(x, *(([0],) if method in ("at", "reduceat") else ()))


def test_ufunc_methods_cupy_has_equal_numpy(x):
    a = x.get()
    for got, want in [(strict.add.reduce(x, axis=1), np.add.reduce(a, axis=1)),
                      (strict.multiply.accumulate(x, axis=0), np.multiply.accumulate(a, axis=0)),
                      (strict.add.reduceat(x, strict.asarray([0, 2]), axis=1), np.add.reduceat(a, [0, 2], axis=1)),
                      (strict.maximum.outer(x[0], x[1]), np.maximum.outer(a[0], a[1])),
                      (strict.take(x, [0, 2], axis=1), np.take(a, [0, 2], axis=1))]:  # indices may be a list on CuPy
        assert got.get().tobytes() == want.tobytes()


def test_flags_are_cupys_three():
    """CuPy's ``flags`` (cupy/_core/flags.pyx through 14.2) has c_contiguous, f_contiguous and owndata only."""
    a = strict.asarray(np.zeros(3))
    assert not hasattr(a.flags, "writeable")
    assert a.flags.c_contiguous and a.flags.f_contiguous and a.flags.owndata
    v = strict.asarray(np.zeros((3, 4)))[:, ::2]
    assert not v.flags.c_contiguous and not v.flags.f_contiguous and not v.flags.owndata


def test_explicit_transfers_copy_and_count(x):
    host = np.ones(4)
    strict.reset_transfers()
    d = strict.asarray(host)
    host[0] = 5  # the device copy does not alias host memory
    back = d.get()
    back[1] = 7
    assert np.array_equal(d.get(), np.ones(4))
    d.set(np.full(4, 2.0))
    assert np.array_equal(backend.to_host(d), np.full(4, 2.0))
    assert strict.transfers == {"to_device": 2, "to_host": 3}
    assert strict.asarray(d) is d  # already on the device: no copy, not counted
    assert strict.transfers["to_device"] == 2


def test_views_report_their_owner(x):
    row = x[1]
    assert row.base is x and x.base is None and x.T.base is x
    assert copy.deepcopy(x).base is None and copy.copy(x) is not x
    assert x.astype(np.float64, copy=False) is x


def test_a_view_holds_its_owner_and_an_owner_is_not_wrapped_twice():
    """As NumPy and CuPy arrays: a view keeps its owner (``.base``) alive after the owner's last other
    reference is gone, so the memory ledger counts the owner's bytes, not the view's; and a call that
    returns its own owning input (``ascontiguousarray`` of a contiguous array) returns the same object."""
    import gc

    from minizero.ledger import MemoryLedger

    for xp in (np, strict):
        a = xp.zeros((4, 4))
        v = a[1:]
        del a
        gc.collect()
        assert v.base is not None and v.base.shape == (4, 4)
        led = MemoryLedger()
        led.track(v, "activations")
        assert led.current["activations"] == 4 * 4 * 8  # the whole buffer the view keeps alive
        b = xp.zeros(3)
        assert xp.ascontiguousarray(b) is b and xp.ascontiguousarray(b[::2]).base is None


def _pairs():
    """(name, f) computed on NumPy arrays and on strict arrays."""
    return {
        "arith": lambda m, a, b: (a * 3 - b) / (a + 1) ** 2 + (-a) % 2 + abs(b) // 1,
        "compare": lambda m, a, b: m.where(a < b, a, b) + (a >= b),
        "ufuncs": lambda m, a, b: m.exp(a) + m.log(m.abs(b) + 1) + m.tanh(a) + m.sqrt(m.maximum(a, 0)),
        "reductions": lambda m, a, b: m.concatenate([a.sum(axis=0), b.mean(axis=1), a.max(keepdims=True).ravel()]),
        "shape ops": lambda m, a, b: m.swapaxes(a.reshape(2, 2, 3), 0, 2).transpose(1, 0, 2).T.astype(np.float32),
        "matmul": lambda m, a, b: a @ b.T,
        "indexing": lambda m, a, b: a[:, ::2][b[:, 0] > 0][..., None] + a[m.arange(2)].sum(),
        "cumsum split": lambda m, a, b: m.split(m.cumsum(a, axis=1), 2, axis=1)[1],
        "add.at": lambda m, a, b: _add_at(m, a, b),
        "setitem": lambda m, a, b: _setitem(m, a, b),
        "in-place": lambda m, a, b: _inplace(a.copy(), b),
    }


def _add_at(m, a, b):
    out = m.zeros((5, 4))
    m.add.at(out, m.asarray([0, 2, 0]) if m is strict else np.array([0, 2, 0]), a)
    return out


def _setitem(m, a, b):
    out = m.empty_like(a)
    out[...] = 0
    out[1] = b[2]
    out[:, 3] = 7.5
    return out


def _inplace(a, b):
    a += b
    a *= 0.5
    a -= 1
    return a


@pytest.mark.parametrize("name", sorted(_pairs()))
def test_arithmetic_equals_numpy_bitwise(name):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    f = _pairs()[name]
    want = f(np, a, b)
    got = f(strict, strict.asarray(a), strict.asarray(b))
    assert isinstance(got, strict.StrictArray)
    host = got.get()
    assert host.dtype == want.dtype and host.shape == want.shape
    assert host.tobytes() == want.tobytes()


def test_backend_matmul_and_transfers_under_strict(strict_backend):
    rng = np.random.default_rng(1)
    for dtype in (np.float64, np.float32, np.float16):
        a, b = rng.normal(size=(2, 3, 5)).astype(dtype), rng.normal(size=(5, 4)).astype(dtype)
        backend.set_backend("numpy")
        want = backend.matmul(a, b)
        backend.set_backend("strict")
        got = backend.matmul(backend.to_device(a), backend.to_device(b))
        assert isinstance(got, strict.StrictArray)
        assert backend.to_host(got).tobytes() == want.tobytes()
    assert backend.xp is strict and isinstance(backend.xp.zeros(3), backend.xp.ndarray)


def test_set_device_and_its_errors(strict_backend):
    assert "strict" in backend.set_device("strict") and backend.name == "strict"
    assert "cpu" in backend.set_device("cpu", 3) and backend.xp is np
    with pytest.raises(ValueError, match="allowed: cpu, cuda, strict"):
        backend.set_device("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(backend.DeviceError, match="pip install"):
            backend.set_device("cuda")
        assert backend.xp is np  # a failed switch leaves the module as it was


def test_local_rank_reads_the_launchers_variable(monkeypatch):
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert backend.local_rank(default=5) == 5
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert backend.local_rank() == 2
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert backend.local_rank() == 1
