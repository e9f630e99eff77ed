"""Absmax quantization's exact rules, each checked apart from minizero/quantization.py's own arithmetic.

Written for mutants that survived tests/test_quantize.py (its round-trip bound holds for all of them): a scale
rounded down or kept to 24 bits, an overflow guard at FP32's max, floor for round, pack_int4 taking -9, dequantize
taking too many scales, and quantize_blockwise taking any code book.
"""
import math

import numpy as np
import pytest

from minizero.quantization import (GRANULARITIES, QMAX, absmax_scale, dequantize, dequantize_blockwise, dynamic_code,
                                   linear_code, pack_int4, quantize, quantize_blockwise, unpack_int4)

FP32_TINY, FP32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def _codes(q, bits, n):
    return q.reshape(-1).astype(np.int64) if bits == 8 else unpack_int4(q, n).astype(np.int64)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_scale_is_absmax_over_qmax_rounded_up_to_16_significant_bits(bits):
    """ldexp(ceil(m 2**16) / 2**16, e) of frexp(absmax / qmax) = (m, e), by Python's math, bit for bit: rounded up
    (a scale rounded down survived the round-trip tests) and 16 bits, so q * scale is exact in float32 (24 bits
    survived too). Exact quotients stay: 127 / 127 is 1."""
    rng = np.random.default_rng(7)
    absmax = np.concatenate([np.exp(rng.uniform(-69, 69, 2000)), [QMAX[bits], 3.0, 1e-30, 2.0 ** -100]])
    want = []
    for a in absmax.tolist():
        m, e = math.frexp(a / QMAX[bits])
        want.append(max(math.ldexp(math.ceil(m * 2 ** 16) / 2 ** 16, e), FP32_TINY))
    got = absmax_scale(absmax, bits)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.astype(np.float64), want)
    assert got[-4] == 1.0


def test_a_value_whose_scale_would_round_past_fp32s_max_is_refused_not_an_inf_scale():
    """absmax / 127 just under FP32's max rounds up to 2**128, inf in float32: codes 0 and inf * 0 = NaN on the
    way back. The guard refuses from half FP32's max (a guard at the max itself survived); at half it still works."""
    with pytest.raises(ValueError, match="too large for an FP32 scale"):
        quantize(np.array([127 * FP32_MAX * (1 - 2.0 ** -20), 1.0]), 8)
    x = np.array([127 * FP32_MAX / 2, 1.0])
    q, scale = quantize(x, 8)
    assert np.isfinite(scale) and q.tolist() == [127, 0]
    assert np.abs(dequantize(q, scale, dtype=np.float64) - x).max() <= float(scale) / 2


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_half_to_even_and_negating_x_negates_its_codes(bits):
    """With scale exactly 1, q = rint(x): halves go to the even code (NumPy's and torch.round's rule), so -x gets
    exactly -q; floor-then-correct (half down: 1.5 -> 1 but -1.5 -> -2) survived the round-trip bound."""
    top = QMAX[bits]
    x = np.array([top, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, top - 0.5, -(top - 0.5)])
    q, scale = quantize(x, bits)
    assert scale == 1.0
    np.testing.assert_array_equal(_codes(q, bits, x.size), np.rint(x))
    rng = np.random.default_rng(3)
    for granularity in GRANULARITIES:
        w = np.round(rng.standard_normal((6, 10)) * 8) / 2  # many exact halves of the scale
        qp, sp = quantize(w, bits, granularity, 16)
        qn, sn = quantize(-w, bits, granularity, 16)
        np.testing.assert_array_equal(sp, sn)
        np.testing.assert_array_equal(_codes(qn, bits, w.size), -_codes(qp, bits, w.size))


def test_pack_int4_refuses_every_code_outside_minus_8_to_7():
    """Before the check's bound was tested on 8 only, 'lo < -9' survived: -9 & 0xF packs as 7."""
    for bad in (-9, 8, -128, 127):
        with pytest.raises(ValueError, match=r"must lie in \[-8, 7\]"):
            pack_int4(np.array([0, bad], np.int16))
    assert unpack_int4(pack_int4(np.array([-8, 7], np.int8)), 2).tolist() == [-8, 7]


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_dequantize_refuses_a_scale_array_of_the_wrong_size(granularity):
    """One scale too many was used silently (its first entries) when the check was 'fewer than needed'."""
    x = np.arange(24.0).reshape(4, 6) - 11
    q, scale = quantize(x, 8, granularity, 8)
    for wrong in (np.append(scale, 1.0), scale.reshape(-1)[:-1]):
        with pytest.raises(ValueError, match=f"scale has {wrong.size} entries"):
            dequantize(q, wrong, x.shape, 8, granularity, 8)


def test_quantize_blockwise_refuses_a_code_book_it_cannot_search():
    """The open item "quantize_blockwise's code book unchecked": the nearest value is found by binary search over
    midpoints, so a code must be ascending, finite and at most 256 values (uint8 codes). Before, all passed silently:
    bitsandbytes' code reversed dequantized with errors of 2 absmax, a shuffled one 0.57 absmax, NaN broke the
    search, a 257th value wraps its code to 0."""
    x = np.random.default_rng(0).standard_normal(200)
    code = dynamic_code(True)
    nan = code.copy()
    nan[3] = np.nan
    for bad, said in ((code[::-1].copy(), "ascending order"), (np.random.default_rng(1).permutation(code),
                                                                  "ascending order"),
                      (nan, "finite values"), (np.sort(np.append(code, 0.5)), r"code has shape \(257,\)"),
                      (code.reshape(16, 16), r"shape \(16, 16\)"), (code[:1], r"shape \(1,\)"),
                      (np.arange(256), "dtype int64")):
        with pytest.raises(ValueError, match=said):
            quantize_blockwise(x, bad, 64)
    for signed in (True, False):  # the library's own code books are accepted: each element gets its nearest value
        for book in (dynamic_code(signed), linear_code(signed)):
            y = x if signed else np.abs(x)
            c, absmax = quantize_blockwise(y, book, 64)
            normed = y / np.repeat(absmax.astype(np.float64), 64)[:y.size]
            dist = np.abs(book.astype(np.float64)[None, :] - normed[:, None])
            np.testing.assert_allclose(dist[np.arange(y.size), c], dist.min(axis=1), rtol=0, atol=1e-12)


def test_nf4_levels_are_the_published_table_bit_for_bit():
    """QLoRA (arXiv:2305.14314) appendix E / bitsandbytes' NF4 table, typed here from the paper: equal as float32, so
    codes mean what bitsandbytes' mean. (The quantile construction is checked to 2e-7, more than a float32 step at
    0.56 (6e-8): a level moved by one step survived.)"""
    from minizero.nf4 import NF4_LEVELS
    published = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
    assert NF4_LEVELS.dtype == np.float32
    np.testing.assert_array_equal(NF4_LEVELS, np.array(published, np.float32))


def test_nf4_names_its_own_non_finite_count():
    """Two infs in one block of 64 are 2 non-finite elements; with NF4's check removed the double quantization
    refused instead, counting 1 block constant ('x has 1 non-finite value(s)'), which tests/test_qlora.py accepted."""
    from minizero.nf4 import NF4Tensor
    x = np.ones(100, np.float32)
    x[[3, 5]] = np.inf
    with pytest.raises(ValueError, match="NF4Tensor of a tensor with 2 non-finite elements"):
        NF4Tensor(x)


def test_outlier_columns_do_not_set_the_row_scales():
    """LLM.int8()'s FP32 columns are zeroed before the rest is quantized: each row's scale is that of its other
    columns. (Mutant: not zeroing survived; the columns are restored exactly either way, the rest lost precision.)"""
    from minizero.nn import Linear
    from minizero.quantize import QuantizedLinear
    lin = Linear(12, 6, rng=np.random.default_rng(3))
    lin.weight.data[:, 7] = 50.0  # an outlier column 100x the rest
    ql = QuantizedLinear.from_linear(lin, 8, "row", outlier_columns=[7])
    rest = np.delete(lin.weight.data, 7, axis=1)
    np.testing.assert_array_equal(ql.weight_q.scale, absmax_scale(np.abs(rest).max(axis=1), 8))


def test_an_all_zero_block_gets_the_code_of_zero():
    """0 / 0 was NaN, which the binary search puts past the last value (code 1.0; times absmax 0 it is still 0, so
    dequantized values could not tell): the nearest value to 0 is 0, for the block-wise codes and NF4 alike."""
    from minizero.nf4 import NF4_LEVELS, NF4Tensor
    x = np.concatenate([np.zeros(64), np.linspace(-1, 1, 64)]).astype(np.float32)
    for book in (dynamic_code(True), dynamic_code(False), linear_code(True)):
        c, absmax = quantize_blockwise(x if book.min() < 0 else np.abs(x), book, 64)
        assert absmax[0] == 0 and (book[c[:64]] == 0).all()
    assert (NF4_LEVELS[NF4Tensor(x).indices()[:64]] == 0).all()


def test_quantize_blockwise_refuses_what_it_cannot_store_before_any_work():
    """An offset that is not an int >= 0, x beyond float32 (its block maximum became inf: every element NaN), text
    or objects, a given absmax that is NaN or negative: each named, with what is allowed."""
    code, x = dynamic_code(), np.linspace(-1.0, 1.0, 10)
    for offset in (-1, True, 1.5, None, "3"):
        with pytest.raises(ValueError, match=r"^offset=.*; allowed: an int >= 0"):
            quantize_blockwise(x, code, 4, offset)
    with pytest.raises(ValueError, match=r"^x holds 1e\+308, beyond float32's .*block maxima are stored as float32"):
        quantize_blockwise(np.array([1e308, -1e308, 1.0]), code)
    for bad in (np.array(["a", "b"]), np.array([1.0, None])):
        with pytest.raises(ValueError, match=f"^x has dtype {bad.dtype}; allowed: bool, int or float numbers"):
            quantize_blockwise(bad, code)
    for value in (np.nan, -1.0, np.inf):
        absmax = np.array([1.0, 1.0, value], np.float32)
        with pytest.raises(ValueError, match=r"^absmax\[2\] = .*; allowed: block maxima, finite numbers >= 0"):
            quantize_blockwise(x, code, 4, 0, absmax)
    codes, absmax = quantize_blockwise(x, code, 4, np.int64(2), np.zeros(3))  # NumPy ints and zero maxima: allowed
    assert codes.shape == (10,) and absmax.tolist() == [0.0, 0.0, 0.0]


def test_nf4_names_what_it_cannot_hold():
    """Before: float64 past float32's range was called 'non-finite', None too; a list or a float was an
    AttributeError, text NumPy's 'could not convert', and complex lost its imaginary part in silence."""
    from minizero.nf4 import NF4Tensor
    for x, said in ((np.array([1e39, 1.0]), "ValueError: NF4Tensor of a tensor holding 1e+39, beyond float32's"),
                    (np.array([np.inf, 1.0]), "ValueError: NF4Tensor of a tensor with 1 non-finite elements"),
                    (None, "TypeError: NF4Tensor of a NoneType; allowed: an array (numpy/cupy) of real numbers"),
                    ([1.0, 2.0], "TypeError: NF4Tensor of a list; allowed"),
                    (np.ones(4, complex), "TypeError: NF4Tensor of a ndarray of dtype complex128; allowed"),
                    (np.array(["a"]), "TypeError: NF4Tensor of a ndarray of dtype <U1; allowed")):
        with pytest.raises((TypeError, ValueError)) as e:
            NF4Tensor(x)
        assert f"{e.type.__name__}: {e.value}".startswith(said), e.value
