"""Gradients and values on paths tests/test_autograd.py leaves out, each found by a mutation audit of the autograd
and model core (a planted fault that every other test let through): float64, finite differences or exact values."""
import operator

import numpy as np

import minizero.autograd as A
from minizero.autograd import Tensor
from tests.test_autograd import check_op, r


def test_split_and_concat_along_a_leading_axis():
    """Split's and Concat's backward along axis 0 and 1 of 3-D arrays (every other test splits the last axis)."""
    check_op(lambda a: (lambda x, y: x * 2.0 + y * y)(*A.split(a, 2, axis=0)), r(4, 3, 2))
    check_op(lambda a: A.split(a, 3, axis=1)[2] * 3.0, r(2, 6, 2))
    w = Tensor(r(5, 3, 2))
    check_op(lambda a, b: A.concat([a, b], axis=0) * w, r(2, 3, 2), r(3, 3, 2))
    check_op(lambda a, b: A.concat([a, b], axis=1), r(2, 1, 4), r(2, 3, 4))
    check_op(lambda a: a.T, r(2, 3, 4))  # ``.T`` of 3 axes reverses them all (every other test's is 2-D)


def test_reflected_operators_keep_the_operand_order():
    """``1 - a``, ``2 / a``, ``3 + a`` and ``4 * a`` with the Tensor on the right: __rsub__ had no test."""
    check_op(lambda a: 1.0 - a, r(3, 4))
    check_op(lambda a: 2.0 / a, np.abs(r(3, 4)) + 1.0)
    check_op(lambda a: 3.0 + a * (4.0 * a), r(3, 4))
    x = np.arange(1.0, 5.0)
    np.testing.assert_array_equal((1.0 - Tensor(x)).data, 1.0 - x)
    np.testing.assert_array_equal((2.0 / Tensor(x)).data, 2.0 / x)


def test_an_array_on_the_left_gives_a_tensor_with_its_gradient():
    """``array - tensor`` (and +, *, /, @) went through NumPy's ufunc on an object array: an ndarray of Tensors,
    no error, no gradient. ``__array_ufunc__ = None`` hands it to the Tensor's reflected operator."""
    a, x = r(3, 4), r(3, 4)
    for f in (operator.sub, operator.add, operator.mul, operator.truediv):
        got = f(a, Tensor(x))
        assert isinstance(got, Tensor), f.__name__
        np.testing.assert_array_equal(got.data, f(a, x))
    check_op(lambda t: a - t, x)
    check_op(lambda t: a / t, np.abs(x) + 1.0)
    b = r(2, 3)
    check_op(lambda t: b @ t, x)
    assert isinstance(np.float64(2.0) - Tensor(x), Tensor)


GAMMA = 0x9E3779B97F4A7C15


def _mix64(z):
    """SplitMix64's finalizer, from tests/test_autograd.py's sequential reference (its first step adds GAMMA)."""
    from tests.test_autograd import _splitmix64
    return _splitmix64((z - GAMMA) % 2 ** 64, 1)[0]


def test_manual_seed_and_the_batch_rows_mask_follow_the_documented_keys():
    """manual_seed(s) starts at key mix64(s); inside batch_rows(lo, total) site s's mask is the stream at key
    fold_in(fold_in(key, offset), s), fold_in(k, d) = mix64(k ^ mix64(d)), read from row lo: written out here apart
    from rng.py (the layout tests compare rng.py with itself, so a changed key derivation passed them all)."""
    from tests.test_autograd import _splitmix64
    from minizero.autograd import rng
    from minizero.nn.module import Dropout
    A.manual_seed(2024)
    assert rng.get_rng_state() == {"key": _mix64(2024), "offset": 0}
    assert rng.uniform_bits(3).tolist() == _splitmix64(_mix64(2024), 3)
    rng.set_rng_state({"key": 1234, "offset": 5})
    with rng.batch_rows(1, 3):
        kept = Dropout(0.5, site=2)(Tensor(np.ones((2, 4, 5)))).data != 0
    key = _mix64(_mix64(1234 ^ _mix64(5)) ^ _mix64(2))
    u = np.array(_splitmix64(key, 3 * 4 * 5), dtype=np.uint64) >> np.uint64(40)
    want = (u.astype(np.float64) * 2.0 ** -24 >= np.float32(0.5)).reshape(3, 4, 5)[1:]
    assert 0.3 < want.mean() < 0.7
    np.testing.assert_array_equal(kept, want)
    A.manual_seed(0)


def test_float16_softmax_backward_renormalizes_and_bias_gradient_sums_in_float32():
    """float16 probabilities do not sum to 1: unrenormalized, a gradient common to a whole row leaks through
    (g - sum(g y)) as ~1e-3 instead of ~1e-7; a float16 bias gradient is summed in float32 and rounded once
    (4096 x 0.1 is 409.5, not float16 accumulation's 256)."""
    from minizero.autograd import functional as F
    x = Tensor((np.random.default_rng(0).standard_normal((2, 3, 16, 16)) * 3).astype(np.float16), requires_grad=True)
    y = F.causal_softmax(x)
    y.backward(np.full(y.shape, 5.0, np.float16))
    assert np.abs(x.grad.astype(np.float64)).max() < 1e-5
    b = Tensor(np.zeros(3, np.float16), requires_grad=True)
    F.linear(Tensor(np.ones((4096, 2), np.float16)), Tensor(np.ones((3, 2), np.float16)), b).backward(
        np.full((4096, 3), 0.1, np.float16))
    np.testing.assert_array_equal(b.grad, np.float16(409.5))


def test_a_leaf_gradient_keeps_the_leaf_dtype_and_nothing_is_saved_without_recording():
    """A float16 leaf in a float32 product gets a float16 ``.grad`` (Tensor's contract: data's dtype); an op that
    records nothing (no_grad, or no input needing a gradient) saves nothing through the pack hook."""
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float16), requires_grad=True)
    (x * Tensor(np.array([0.5, 0.25, 2.0], np.float32))).sum().backward()
    assert x.grad.dtype == np.float16 and x.grad.tolist() == [0.5, 0.25, 2.0]
    from minizero.autograd import functional as F
    packed = []
    with A.saved_tensors_hooks(lambda a: packed.append(a.shape) or a, lambda a: a):
        with A.no_grad():
            F.gelu(Tensor(r(2, 3), requires_grad=True))
        F.gelu(Tensor(r(2, 3)))
        assert packed == []
        F.gelu(Tensor(r(2, 3), requires_grad=True))
    assert packed == [(2, 3)]


def test_module_zero_grad_drops_every_gradient_and_layer_norm_takes_its_eps():
    """Module.zero_grad sets every ``.grad`` to None (the recompute test calls it between two equal backwards, which
    accumulating would pass too); nn.LayerNorm passes its own ``eps`` (every model uses the default)."""
    from minizero.autograd import functional as F
    from minizero.nn import GPT, get_config
    from minizero.nn.module import LayerNorm
    model = GPT(get_config("tiny", dtype="float64"), seed=1)
    x = np.arange(8).reshape(1, 8)
    model(x, x)[1].backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    ln, z = LayerNorm(5, eps=0.5, dtype="float64"), r(2, 5) * 0.1
    want = F.layer_norm(Tensor(z), Tensor(np.ones(5)), Tensor(np.zeros(5)), eps=0.5).data
    np.testing.assert_array_equal(ln(Tensor(z)).data, want)
    assert np.abs(want - F.layer_norm(Tensor(z), Tensor(np.ones(5)), Tensor(np.zeros(5))).data).max() > 0.1


class _NoGradForA(A.Function):
    """x * 2 whose backward gives None for its input: a contribution that carries no gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return None


def test_a_leaf_root_and_a_none_contribution():
    """backward() of a leaf is the gradient given, once; a leaf whose one contribution is None still fires its
    post-accumulate hook (as PyTorch's), with ``.grad`` None."""
    x = Tensor(r(3), requires_grad=True)
    g = r(3)
    x.backward(g)
    np.testing.assert_array_equal(x.grad, g)
    calls = []
    y = Tensor(r(3), requires_grad=True)
    y.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad))
    _NoGradForA.apply(y).sum().backward()
    assert calls == [None] and y.grad is None


def test_dropout_scale_above_one_half_and_the_config_refuses_p_rounding_to_one():
    """Inverted dropout scales kept elements by 1/(1 - p) for any p (the other tests use p <= 1/2); GPTConfig itself
    refuses a p whose float32 is 1 (the command line and the weights file check it apart)."""
    import pytest
    from minizero.autograd import functional as F
    from minizero.nn import GPTConfig
    A.manual_seed(4)
    x = Tensor(np.full((50, 40), 3.0), requires_grad=True)
    y = F.dropout(x, 0.75)
    keep = y.data != 0
    assert 0.2 < keep.mean() < 0.3
    np.testing.assert_array_equal(y.data[keep], 12.0)
    y.backward(np.ones((50, 40)))
    np.testing.assert_array_equal(x.grad, keep * 4.0)
    A.manual_seed(0)
    GPTConfig(dropout=0.99999994).validate()
    with pytest.raises(ValueError, match="at most 0.99999994"):
        GPTConfig(dropout=0.999999999).validate()
