"""Every op's backward against central finite differences, in float64."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minizero import backend
import minizero.autograd as A
from minizero.autograd import Tensor, functional as F


def numeric_grad(f, arrays, i, eps=1e-6):
    """Central differences of scalar f(arrays) with respect to arrays[i]."""
    x = arrays[i]
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f(arrays)
        x[idx] = old - eps
        fm = f(arrays)
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


def check_op(op, *arrays, wrt=None, rtol=1e-6, atol=1e-8, seed=0):
    """Compare autograd and finite differences of sum(op(*tensors) * R) for a fixed random R."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    wrt = range(len(arrays)) if wrt is None else wrt
    rng = np.random.default_rng(seed)
    out_shape = op(*[Tensor(a) for a in arrays]).shape
    weights = rng.normal(size=out_shape)

    def scalar(arrs):
        with A.no_grad():
            return float((op(*[Tensor(a) for a in arrs]).data * weights).sum())

    tensors = [Tensor(a.copy(), requires_grad=(i in wrt)) for i, a in enumerate(arrays)]
    out = op(*tensors)
    out.backward(weights)
    for i in wrt:
        expected = numeric_grad(scalar, arrays, i)
        np.testing.assert_allclose(tensors[i].grad, expected, rtol=rtol, atol=atol, err_msg=f"input {i}")


rng = np.random.default_rng(42)


def r(*shape):
    return rng.normal(size=shape)


@pytest.mark.parametrize("sa,sb", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (2, 3))])
def test_broadcasting_elementwise(sa, sb):
    check_op(lambda a, b: a + b, r(*sa), r(*sb))
    check_op(lambda a, b: a - b, r(*sa), r(*sb))
    check_op(lambda a, b: a * b, r(*sa), r(*sb))
    check_op(lambda a, b: a / b, r(*sa), np.abs(r(*sb)) + 1.0)


def test_unary_and_scalar_ops():
    check_op(lambda a: -a, r(3, 4))
    check_op(lambda a: a ** 3, r(3, 4))
    check_op(lambda a: a.exp(), r(3, 4))
    check_op(lambda a: a.log(), np.abs(r(3, 4)) + 0.5)
    check_op(lambda a: a.tanh(), r(3, 4))
    check_op(lambda a: 2.0 * a + 1.0 - a / 3.0, r(3, 4))
    check_op(lambda a: 1.0 / a, np.abs(r(2, 2)) + 1.0)


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (-1, True), ((0, 2), False)])
def test_reductions(axis, keepdims):
    check_op(lambda a: a.sum(axis=axis, keepdims=keepdims), r(2, 3, 4))
    check_op(lambda a: a.mean(axis=axis, keepdims=keepdims), r(2, 3, 4))


def test_mean_over_several_axes_runs_on_a_device_array_module(strict_backend):
    """Tensor.mean(axis=(0, 2)) counts its elements in Python: it gave xp.prod a list, which CuPy (and the strict
    module) refuse."""
    x = Tensor(strict_backend.xp.asarray(np.arange(24.0).reshape(2, 3, 4)), requires_grad=True)
    got = x.mean(axis=(0, 2))
    assert np.array_equal(backend.to_host(got.data), np.arange(24.0).reshape(2, 3, 4).mean(axis=(0, 2)))


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5)),
                                   ((2, 2, 3, 4), (1, 2, 4, 3))])
def test_batched_matmul(sa, sb):
    check_op(lambda a, b: a @ b, r(*sa), r(*sb))


def test_matmul_rejects_vectors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        Tensor(r(3)) @ Tensor(r(3, 2))


def test_shape_ops():
    check_op(lambda a: a.reshape(4, 6), r(2, 3, 4))
    check_op(lambda a: a.transpose(2, 0, 1), r(2, 3, 4))
    check_op(lambda a: a.transpose(-1, 0, -2), r(2, 3, 4))  # negative axes, as numpy.transpose takes them
    check_op(lambda a: a.T, r(2, 3))
    check_op(lambda a: a[1:, ::2], r(3, 4))
    check_op(lambda a: a[np.array([0, 2, 0])], r(3, 4))  # repeated index: gradients add
    check_op(lambda a: A.split(a, 3, axis=-1)[1] * 2.0, r(2, 6))
    check_op(lambda a, b: A.concat([a, b], axis=1), r(2, 3), r(2, 2))


def test_to_dtype_copies_forward_and_returns_the_gradient_in_the_input_dtype():
    """Before: MoE kept this Function to itself (parallel/moe.py's ``_ToDtype``)."""
    from minizero.autograd.ops import ToDtype
    x = Tensor(np.array([1.0, 2.5, -3.0], np.float16), requires_grad=True)
    y = ToDtype.apply(x, np.float32)
    assert y.dtype == np.float32 and y.data.tolist() == [1.0, 2.5, -3.0]
    (y * Tensor(np.array([2.0, 3.0, 4.0], np.float32))).sum().backward()
    assert x.grad.dtype == np.float16 and x.grad.tolist() == [2.0, 3.0, 4.0]


def test_split_all_outputs_used():
    check_op(lambda a: (lambda q, k, v: q * k + v)(*A.split(a, 3, axis=-1)), r(2, 9))


def test_linear():
    check_op(lambda x, w, b: F.linear(x, w, b), r(2, 3, 4), r(5, 4), r(5))
    check_op(lambda x, w: F.linear(x, w), r(3, 4), r(5, 4))
    own = np.random.default_rng(1)  # finite differences check backward against forward, not forward itself
    x, w, b = own.normal(size=(2, 3, 4)), own.normal(size=(5, 4)), own.normal(size=5)
    want = np.einsum("btk,ok->bto", x, w) + b
    np.testing.assert_allclose(F.linear(Tensor(x), Tensor(w), Tensor(b)).data, want, rtol=0,
                               atol=1e-14 * np.abs(want).max())


def test_embedding():
    idx = np.array([[0, 2, 2], [1, 0, 3]])
    check_op(lambda w: F.embedding(idx, w), r(4, 3))
    w = np.random.default_rng(1).normal(size=(4, 3))
    np.testing.assert_array_equal(F.embedding(idx, Tensor(w)).data, [[w[i] for i in row] for row in idx])


def test_layer_norm():
    check_op(lambda x, w, b: F.layer_norm(x, w, b), r(2, 3, 5), r(5), r(5), rtol=1e-5)
    # forward as PyTorch's LayerNorm: biased variance (divide by C), eps 1e-5 inside the square root
    own = np.random.default_rng(1)  # rows of scale 1e-3: eps is not negligible beside their variance
    x, w, b = own.normal(size=(2, 3, 5)) * 1e-3, own.normal(size=5), own.normal(size=5)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).sum(-1, keepdims=True) / 5
    want = (x - mu) / np.sqrt(var + 1e-5) * w + b
    np.testing.assert_allclose(F.layer_norm(Tensor(x), Tensor(w), Tensor(b)).data, want, rtol=0, atol=1e-14)


def test_gelu():
    check_op(F.gelu, r(3, 7))
    x = np.linspace(-3, 3, 7)
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(F.gelu(Tensor(x)).data, expected, rtol=1e-14)


def test_causal_softmax():
    check_op(F.causal_softmax, r(2, 4, 4))
    y = F.causal_softmax(Tensor(r(3, 3))).data
    assert (np.triu(y, 1) == 0).all() and np.abs(y.sum(-1) - 1).max() <= 1e-15


def test_dropout_gradient_and_reproducibility():
    A.manual_seed(3)
    state = F.get_rng_state()
    x = Tensor(r(200, 50), requires_grad=True)
    y = F.dropout(x, 0.25)
    keep = y.data != 0
    assert 0.70 < keep.mean() < 0.80
    np.testing.assert_allclose(y.data[keep], x.data[keep] / 0.75, rtol=1e-15)
    y.backward(np.ones_like(y.data))
    np.testing.assert_allclose(x.grad, keep / 0.75, rtol=1e-15)
    F.set_rng_state(state)
    y2 = F.dropout(Tensor(x.data), 0.25)
    np.testing.assert_array_equal(y2.data, y.data)
    assert F.dropout(x, 0.25, training=False) is x
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout(x, 1.0)


def _splitmix64(seed, n):
    """The reference sequential SplitMix64 (Steele, Lea & Flood 2014; Vigna's splitmix64.c), written
    out here apart from minizero/autograd/rng.py: state += GAMMA, then the finalizer, mod 2**64."""
    mask, out, x = 2 ** 64 - 1, [], seed
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & mask
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_dropout_generator_is_splitmix64_at_any_offset():
    """The vectorized counter-based generator equals sequential SplitMix64 seeded with the key, from any
    offset (what recompute and a resumed checkpoint replay), and the reference's published first outputs
    for seed 1234567."""
    from minizero.autograd import rng

    assert _splitmix64(1234567, 3) == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    want = _splitmix64(1234567, 40)
    rng.set_rng_state({"key": 1234567, "offset": 0})
    assert rng.uniform_bits(40).tolist() == want
    rng.set_rng_state({"key": 1234567, "offset": 13})
    assert rng.uniform_bits(27).tolist() == want[13:]
    assert rng.get_rng_state() == {"key": 1234567, "offset": 40}
    near_end = 2 ** 64 - 5  # the counter wraps mod 2**64, as the reference's state does
    rng.set_rng_state({"key": 7, "offset": near_end})
    assert rng.uniform_bits(8).tolist() == _splitmix64((7 + near_end * 0x9E3779B97F4A7C15) % 2 ** 64, 8)
    assert rng.get_rng_state() == {"key": 7, "offset": 3}
    with pytest.raises(ValueError, match="n >= 0"):
        rng.uniform_bits(-1)
    assert rng.get_rng_state() == {"key": 7, "offset": 3}  # a refused call draws nothing
    A.manual_seed(0)


def test_cross_entropy():
    targets = np.array([0, 3, 2, 3])
    check_op(lambda z: F.cross_entropy(z, targets), r(4, 5))
    z = r(4, 5)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -logp[np.arange(4), targets].mean()
    assert abs(F.cross_entropy(Tensor(z), targets).item() - want) <= 1e-14 * want
    with pytest.raises(ValueError, match="targets must lie"):
        F.cross_entropy(Tensor(z), np.array([0, 1, 2, 5]))


def test_attention_composite():
    """A whole attention core: softmax(q k^T / sqrt(d), causal) @ v."""
    def attn(q, k, v):
        return F.causal_softmax((q @ k.transpose(0, 2, 1)) * 0.5) @ v
    check_op(attn, r(2, 4, 3), r(2, 4, 3), r(2, 4, 3))


def test_shared_input_accumulates_and_hook_fires_once():
    x = Tensor(r(3), requires_grad=True)
    calls = []
    x.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad.copy()))
    y = (x * x + x * 3.0).sum()
    y.backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 3.0, rtol=1e-15)
    assert len(calls) == 1 and np.array_equal(calls[0], x.grad)
    y2 = (x * 2.0).sum()
    y2.backward()  # accumulation across backward calls (gradient accumulation)
    np.testing.assert_allclose(x.grad, 2 * x.data + 5.0, rtol=1e-15)


def test_no_grad_records_nothing():
    x = Tensor(r(3), requires_grad=True)
    with A.no_grad():
        y = x * 2.0
    assert y.grad_fn is None and not y.requires_grad


def test_backward_twice_needs_retain_graph():
    x = Tensor(r(3), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, 4 * x.data, rtol=1e-15)
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()


def test_saved_tensors_hooks_see_every_saved_array():
    packed, unpacked = [], []

    def pack(a):
        packed.append(a.shape)
        return ("box", a.copy())

    def unpack(box):
        unpacked.append(box[1].shape)
        return box[1]

    x = Tensor(r(2, 3), requires_grad=True)
    w = Tensor(r(4, 3), requires_grad=True)
    with A.saved_tensors_hooks(pack, unpack):
        y = F.gelu(F.linear(x, w))
    y.sum().backward()
    assert packed == [(2, 3), (4, 3), (2, 4)]
    assert sorted(unpacked) == sorted(packed)
    ref_x, ref_w = Tensor(x.data, requires_grad=True), Tensor(w.data, requires_grad=True)
    F.gelu(F.linear(ref_x, ref_w)).sum().backward()
    np.testing.assert_array_equal(x.grad, ref_x.grad)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3),
       st.integers(0, 2))
def test_broadcast_reduction_property(shape, ones, drop):
    """For any broadcastable pair, d(sum(a*b))/da == sum of b over the broadcast axes."""
    sb = tuple(shape)
    sa = tuple(1 if o else n for n, o in zip(sb, ones))[drop:] or (1,)
    a, b = r(*sa), r(*sb)
    ta = Tensor(a, requires_grad=True)
    (ta * Tensor(b)).sum().backward()
    expected = np.broadcast_to(b, np.broadcast_shapes(sa, sb))
    lead = expected.ndim - len(sa)
    expected = expected.sum(axis=tuple(range(lead)))
    expected = expected.sum(axis=tuple(i for i, n in enumerate(sa) if n == 1), keepdims=True)
    np.testing.assert_allclose(ta.grad, expected.reshape(sa) * np.ones(sa), rtol=0, atol=1e-13)  # sums of <= 27 N(0,1)


def test_backward_refuses_a_grad_of_another_shape():
    a = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    for bad in (np.arange(6.).reshape(3, 2), np.ones((7, 2, 3))):
        with pytest.raises(ValueError, match=r"grad has shape \(.*\); the root has shape \(2, 3\)"):
            (a * 1).backward(bad)
    assert a.grad is None
    (a * 1).backward([[1, 2, 3], [4, 5, 6]])  # an array-like converts, as Tensor(data) does
    np.testing.assert_array_equal(a.grad, [[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("p", [Tensor(np.full((2, 3), 2.0), requires_grad=True), np.full((2, 3), 2.0), "2", None])
def test_pow_refuses_an_exponent_that_is_not_a_real_scalar(p):
    """A Tensor exponent got no gradient (silently) and an array one could broadcast past the base's shape (found
    only in backward): both are refused by name before any work; NumPy's scalars pass."""
    x = Tensor(np.full((2, 3), 3.0), requires_grad=True)
    with pytest.raises(ValueError, match=r"Tensor \*\* p: p must be a real scalar \(int or float, NumPy's too\), got "
                                         + ("Tensor of shape" if isinstance(p, Tensor) else
                                            "ndarray of shape" if isinstance(p, np.ndarray) else "")):
        x ** p
    (x ** np.int64(2) + x ** np.float16(0.5)).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * 3.0 + 0.5 / np.sqrt(3.0), rtol=1e-12)
