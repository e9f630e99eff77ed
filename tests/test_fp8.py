"""--precision fp8 (memory/fp8.py): exact rounding onto the E4M3 / E5M2 grids with saturation, current and
delayed per-tensor scaling, a run that tracks FP32, and the refused combinations."""
import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.fp8 import (AMAX_HISTORY, E4M3, E5M2, FP8Linear, ScaledCast, from_fp8_bits, round_to_fp8,
                                 to_fp8_bits, use_fp8)
from minizero.nn import GPT, Linear, get_config

# (value, E4M3, E5M2): normals, ties to even, subnormals, saturation
HAND = [(1.0, 1.0, 1.0),
        (1.0625, 1.0, 1.0),  # E4M3: halfway between 1 and 1.125, to the even 1; E5M2: below 1.125
        (1.1875, 1.25, 1.25),  # E4M3: halfway between 1.125 and 1.25, to the even 1.25
        (1.125, 1.125, 1.0),  # E5M2: halfway between 1 and 1.25, to the even 1
        (2.0 ** -9, 2.0 ** -9, 2.0 ** -9),  # E4M3's smallest subnormal
        (2.0 ** -10, 0.0, 2.0 ** -10),  # half of it: a tie, to the even 0 (E5M2: a normal)
        (3 * 2.0 ** -10, 2.0 ** -8, 3 * 2.0 ** -10),  # 1.5 subnormal units: a tie, to the even 2
        (2.0 ** -17, 0.0, 0.0),  # half E5M2's smallest subnormal 2^-16: to the even 0
        (448.0, 448.0, 448.0), (464.0, 448.0, 448.0),  # E4M3 saturates at 448 (464 would round to 480)
        (1e6, 448.0, 57344.0), (-1e6, -448.0, -57344.0), (np.inf, 448.0, 57344.0)]


@pytest.mark.parametrize("fmt,col", [(E4M3, 1), (E5M2, 2)])
def test_rounding_hand_cases(fmt, col):
    x = np.array([h[0] for h in HAND], np.float32)
    np.testing.assert_array_equal(round_to_fp8(x, fmt), np.array([h[col] for h in HAND], np.float32))
    assert np.isnan(round_to_fp8(np.array([np.nan], np.float32), fmt)).all()
    with pytest.raises(TypeError, match="float32"):
        round_to_fp8(x.astype(np.float64), fmt)


@pytest.mark.parametrize("fmt,name", [(E4M3, "float8_e4m3fn"), (E5M2, "float8_e5m2")])
def test_rounding_equals_ml_dtypes_inside_the_range(fmt, name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2 ** 32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x[np.isfinite(x) & (np.abs(x) <= fmt.max)],
                        (rng.standard_normal(500_000) * fmt.max / 8).astype(np.float32),
                        (rng.standard_normal(500_000) * 2.0 ** fmt.emin).astype(np.float32)])
    x = np.concatenate([x, np.float32([0.0, -0.0])])
    q = round_to_fp8(x, fmt)
    np.testing.assert_array_equal(q, x.astype(getattr(ml_dtypes, name)).astype(np.float32))
    bits = to_fp8_bits(q, fmt)
    np.testing.assert_array_equal(bits, x.astype(getattr(ml_dtypes, name)).view(np.uint8))  # the same 8 bits
    np.testing.assert_array_equal(from_fp8_bits(bits, fmt), q)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_code_decodes_and_encodes_back(fmt):
    codes = np.arange(256, dtype=np.uint8)
    vals = from_fp8_bits(codes, fmt)
    finite = np.abs(vals) <= fmt.max  # E4M3's 0x7F / 0xFF, E5M2's 0x7D-0x7F: NaN; E5M2's 0x7C: past max
    np.testing.assert_array_equal(to_fp8_bits(vals[finite], fmt), codes[finite])
    assert np.abs(vals[finite]).max() == fmt.max and sorted(set(np.abs(vals[finite]).tolist()))[1] == 2.0 ** (
        fmt.emin - fmt.mantissa)  # the smallest subnormal


@pytest.mark.parametrize("fmt,code", [(E4M3, 0x7F), (E5M2, 0x7E)])
def test_a_nan_stays_nan_through_the_codes_and_a_cast(fmt, code):
    """Before: to_fp8_bits turned NaN into an arbitrary finite code (E4M3: -256 after a cast), hiding it."""
    x = np.array([1.0, np.nan, -np.nan, -2.0], np.float32)
    bits = to_fp8_bits(round_to_fp8(x, fmt), fmt)
    assert bits[1] == code and bits[2] == 0x80 | code  # ml_dtypes' NaN, its sign kept
    assert np.isnan(from_fp8_bits(bits, fmt)[1:3]).all() and np.isnan(ScaledCast(fmt, "current").cast(x)[1])
    assert ScaledCast(fmt, "current").cast(x)[3] == -2.0  # a NaN amax casts at scale 1: the finite values still cast


def test_fp8_linear_saves_one_byte_per_element():
    set_ledger(MemoryLedger())
    from minizero.ledger import get_ledger
    lin = FP8Linear(Linear(8, 4, rng=np.random.default_rng(0)), "current")
    before = get_ledger().current["activations"]
    y = lin(Tensor(np.ones((5, 8), np.float32), requires_grad=True))
    assert get_ledger().current["activations"] - before == 5 * 8 + 4 * 8 + 2 * 4  # x and W codes + two scales
    del y


def test_current_scaling_maps_the_amax_to_the_format_max():
    x = np.array([0.5, -2.0, 1e-3, 0.0], np.float32)
    cast = ScaledCast(E4M3, "current")
    q = cast.cast(x)
    assert q[1] == -2.0 and q[3] == 0.0  # the amax lands exactly on 448 and comes back
    np.testing.assert_allclose(q, x, rtol=2 ** -4)
    assert cast.stats() == {"elements": 4, "saturated": 0, "underflowed": 0}


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_tiny_amax_keeps_the_scale_finite(fmt):
    """An amax below max / 2^127 (448 / 1e-37 is past float32's range) scales by 2^127: finite, no warning."""
    x = np.array([1e-37, -3e-38, 0.0], np.float32)
    with np.errstate(all="raise"):
        codes, scale = ScaledCast(fmt, "current").quantize(x)
        q = ScaledCast(fmt, "current").cast(x)
    assert float(scale) == 2.0 ** 127 and np.isfinite(q).all()
    np.testing.assert_allclose(q, x, rtol=2 ** -2)  # E5M2 keeps 2 mantissa bits


def test_delayed_scaling_uses_the_largest_amax_of_the_history():
    cast = ScaledCast(E4M3, "delayed")
    cast.cast(np.array([4.0], np.float32))  # first cast: its own amax; history [4]
    small = cast.cast(np.array([1.0, 2.0 ** -12], np.float32))  # scale 448/4: 2^-12 * 112 = 0.027 -> on the grid
    assert small[0] == 1.0
    big = cast.cast(np.array([100.0], np.float32))  # scale from the history's 4: 100 * 112 saturates at 448
    assert big[0] == 4.0 and cast.stats()["saturated"] == 1
    for _ in range(AMAX_HISTORY):  # the 100 leaves the window after AMAX_HISTORY more casts of 1.0
        cast.cast(np.array([1.0], np.float32))
    assert float(cast.history.max()) == 1.0
    assert (E4M3.rounds_to_max, E5M2.rounds_to_max) == (464.0, 61440.0)
    current = ScaledCast(E4M3, "current")
    current.cast(np.random.default_rng(0).standard_normal(10_000).astype(np.float32))
    assert current.stats()["saturated"] == 0  # its own amax lands on max (to within float32 rounding)
    with pytest.raises(ValueError, match="'max'"):
        ScaledCast(E4M3, "max")


def test_fp8_linear_quantizes_forward_in_e4m3_and_the_gradient_in_e5m2():
    rng = np.random.default_rng(3)
    lin = Linear(8, 4, rng=rng)
    x, g = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    fl = FP8Linear(lin, "current")
    xt = Tensor(x, requires_grad=True)
    y = fl(xt)
    (y * Tensor(g)).sum().backward()
    xq, wq, gq = (ScaledCast(f, "current").cast(a) for f, a in ((E4M3, x), (E4M3, lin.weight.data), (E5M2, g)))
    np.testing.assert_allclose(y.data, xq @ wq.T + lin.bias.data, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(xt.grad, gq @ wq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lin.weight.grad, gq.T @ xq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lin.bias.grad, g.sum(axis=0), rtol=1e-6)  # from the unquantised gradient
    assert np.abs(y.data - (x @ lin.weight.data.T + lin.bias.data)).max() > 1e-3  # the quantization is visible
    assert len(use_fp8(GPT(get_config("tiny")))) == 9
    with pytest.raises(ValueError, match="scaling"):
        use_fp8(GPT(get_config("tiny")), "max")


def _losses(comm, extra, steps=40):
    from minizero.train import parse_args, train

    set_ledger(MemoryLedger())
    argv = ["--model", "tiny", "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--no-progress",
            "--lr", "3e-3"] + extra
    return train(parse_args(argv, comm.world_size), comm, log=lambda s: None).train_losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_run_tracks_fp32_within_a_bound(scaling):
    fp32 = np.array(run_in_threads(1, _losses, [])[0])
    fp8 = np.array(run_in_threads(1, _losses, ["--precision", "fp8", "--fp8-scaling", scaling])[0])
    gap = np.abs(fp8 - fp32).max()
    assert np.isfinite(fp8).all() and 0 < gap < 0.05, gap  # 0.009 delayed, 0.005 current here
    assert fp32[0] - fp32[-1] > 0.5 and fp8[0] - fp8[-1] > 0.5  # it trains


@pytest.mark.parametrize("argv,match", [
    (["--dtype", "float64"], "--dtype must be float32"),
    (["--tp", "2"], "--precision fp8 with --tp 2 is not supported"),
    (["--recompute", "full"], "--fp8-scaling delayed with --recompute full"),
    (["--fp8-scaling", "max"], "invalid choice: 'max'")])
def test_bad_fp8_combinations_are_refused(argv, match):
    from minizero.flags import UsageError
    from minizero.train import parse_args
    with pytest.raises((UsageError, ValueError), match=match):
        parse_args(["--model", "tiny", "--precision", "fp8"] + argv, 2)
    parse_args(["--model", "tiny", "--precision", "fp8", "--fp8-scaling", "current", "--recompute", "full"], 1)


def test_evaluation_does_not_move_the_delayed_scales():
    """A cast under no_grad (evaluation) reads the amax history but does not record into it."""
    from minizero.autograd import no_grad
    from minizero.memory.fp8 import E4M3, ScaledCast
    cast = ScaledCast(E4M3, "delayed")
    cast.quantize(np.full(8, 2.0, np.float32))
    before = cast.history.copy()
    with no_grad():
        cast.quantize(np.full(8, 100.0, np.float32))
    np.testing.assert_array_equal(cast.history, before)
    cast.quantize(np.full(8, 3.0, np.float32))
    assert cast.history[0] == 3.0 and cast.history[1] == 2.0


def _cast_slices(comm, scaling, sizes):
    x = np.arange(1, 4 * sizes[comm.rank] + 1, dtype=np.float32).reshape(sizes[comm.rank], 4)
    codes, scale = ScaledCast(E4M3, scaling, comm).quantize(x)
    return float(scale), codes.shape


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_an_empty_slice_casts_with_amax_zero_and_still_joins_the_all_gather(scaling):
    """A rank whose slice of the tensor is empty (0 rows) took the max of nothing: ValueError there, while the other
    rank waited in the amax all-gather. Now its amax is 0: every rank gets the whole tensor's scale; none, 1."""
    got = run_in_threads(2, _cast_slices, scaling, [0, 2], timeout=5)
    assert got == [(E4M3.max / 8.0, (0, 4)), (E4M3.max / 8.0, (2, 4))]
    assert run_in_threads(2, _cast_slices, scaling, [0, 0], timeout=5) == [(1.0, (0, 4))] * 2
