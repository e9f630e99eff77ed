"""--precision bf16 (memory/bf16.py): round-to-nearest-even into float32's top 16 bits, bf16 Linear layers,
a run that tracks FP32, and the refused combinations."""
import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.bf16 import BF16Linear, from_bf16_bits, round_bf16, to_bf16_bits, use_bf16
from minizero.nn import GPT, Linear, get_config


def _f(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


# (float32 bits in, bf16 bits out): ties to even, carries, inf, overflow, subnormals, signed zero
HAND = [(0x3F800000, 0x3F80),  # 1.0
        (0x3F808000, 0x3F80),  # 1 + 2^-8: halfway between 1 and 1 + 2^-7, ties to the even 1.0
        (0x3F818000, 0x3F82),  # 1 + 3 x 2^-8: halfway, ties to the even 1 + 2^-6 (up)
        (0x3F808001, 0x3F81),  # just above halfway: up
        (0x3F807FFF, 0x3F80),  # just below halfway: down
        (0x3FFF8000, 0x4000),  # the carry runs into the exponent: 2.0
        (0x7F7F0000, 0x7F7F),  # the largest finite bf16 stays
        (0x7F7FFFFF, 0x7F80),  # float32's max rounds to +inf (as in ml_dtypes and PyTorch)
        (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),  # +-inf
        (0x00000001, 0x0000),  # the smallest float32 subnormal flushes to +0 by rounding
        (0x00008000, 0x0000),  # half the smallest bf16 subnormal: a tie, to the even 0
        (0x00018000, 0x0002),  # 1.5 bf16 subnormal units: a tie, to the even 2
        (0x00010000, 0x0001),  # the smallest bf16 subnormal is exact
        (0x80000000, 0x8000),  # -0.0 keeps its sign
        (0xBF808000, 0xBF80)]  # negative ties as positive ones


def test_rounding_hand_cases():
    src, want = zip(*HAND)
    got = to_bf16_bits(_f(src))
    assert got.dtype == np.uint16
    assert [hex(g) for g in got] == [hex(w) for w in want]


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF, 0xFF800001])
def test_nan_stays_a_quiet_nan_with_its_sign(bits):
    """0x7F800001 has only low payload bits: the rounding carry alone would leave 0x7F80, i.e. inf."""
    out = to_bf16_bits(_f([bits]))[0]
    assert np.isnan(from_bf16_bits(np.array([out], np.uint16))[0]) and out & 0x0040 and (out >> 15) == (bits >> 31)


def test_rounding_equals_ml_dtypes_on_random_and_edge_bit_patterns():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    near = (rng.integers(0, 2 ** 16, size=200_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000  # exact ties
    x = np.concatenate([bits, near, np.array([b for b, _ in HAND], np.uint32)]).view(np.float32)
    x = x[~np.isnan(x)]  # NaN payloads differ (ml_dtypes makes its own); NaN-ness is tested above
    np.testing.assert_array_equal(to_bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_round_trip_is_exact_and_idempotent():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e3
    r = round_bf16(x)
    np.testing.assert_array_equal(round_bf16(r), r)
    assert np.abs(r - x).max() <= np.abs(x).max() * 2.0 ** -8  # half an ulp of 8 significant bits
    with pytest.raises(TypeError, match="float32"):
        to_bf16_bits(x.astype(np.float64))


def test_strict_module_gives_the_same_bits(strict_backend):
    x = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
    want = to_bf16_bits(x)  # a host array: NumPy
    got = to_bf16_bits(strict_backend.xp.asarray(x))
    np.testing.assert_array_equal(got.get(), want)


def test_bf16_linear_rounds_inputs_outputs_and_gradients():
    rng = np.random.default_rng(3)
    lin = Linear(6, 5, rng=rng)
    lin.bias.data[...] = rng.standard_normal(5).astype(np.float32)
    x, g = rng.standard_normal((2, 3, 6)).astype(np.float32), rng.standard_normal((2, 3, 5)).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    y = BF16Linear(lin)(xt)
    (y * Tensor(g)).sum().backward()
    xr, wr, gr = round_bf16(x), round_bf16(lin.weight.data), round_bf16(g)
    np.testing.assert_array_equal(y.data, round_bf16(xr @ wr.T + lin.bias.data))
    np.testing.assert_allclose(xt.grad, round_bf16(gr @ wr), rtol=2 ** -7)
    np.testing.assert_allclose(lin.weight.grad, round_bf16(gr.reshape(6, 5).T @ xr.reshape(6, 6)), rtol=2 ** -7)
    assert np.array_equal(round_bf16(xt.grad), xt.grad) and np.array_equal(round_bf16(lin.weight.grad),
                                                                          lin.weight.grad)
    assert not np.array_equal(y.data, x @ lin.weight.data.T + lin.bias.data)  # the rounding is visible


def test_bf16_linear_saves_two_bytes_per_element():
    from minizero.ledger import get_ledger
    set_ledger(MemoryLedger())
    lin = BF16Linear(Linear(8, 4, rng=np.random.default_rng(0)))
    before = get_ledger().current["activations"]
    y = lin(Tensor(np.ones((5, 8), np.float32), requires_grad=True))
    assert get_ledger().current["activations"] - before == 2 * (5 * 8 + 4 * 8)  # x and W as uint16
    del y


def test_use_bf16_converts_every_linear_and_keeps_names():
    model = GPT(get_config("tiny"))
    names = list(dict(model.named_parameters()))
    done = use_bf16(model)
    assert len(done) == 4 * 2 + 1 and "lm_head" in done  # c_attn, c_proj, c_fc, mlp.c_proj per block; the head
    assert list(dict(model.named_parameters())) == names
    assert model.lm_head.weight is model.transformer["wte"].weight
    with pytest.raises(TypeError, match="float32 parameters"):
        use_bf16(GPT(get_config("tiny", dtype="float64")))


def _losses(comm, extra, steps=40):
    from minizero.train import parse_args, train

    set_ledger(MemoryLedger())
    argv = ["--model", "tiny", "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--no-progress",
            "--lr", "3e-3"] + extra
    return train(parse_args(argv, comm.world_size), comm, log=lambda s: None).train_losses


@pytest.mark.timeout(300)
def test_bf16_run_tracks_fp32_within_a_bound():
    fp32 = run_in_threads(1, _losses, [])[0]
    bf16 = run_in_threads(1, _losses, ["--precision", "bf16"])[0]
    gaps = np.abs(np.array(bf16) - np.array(fp32))
    assert 0 < gaps.max() < 0.01, gaps  # the rounding changes the run (5.5e-4 here), far less than the loss falls
    assert fp32[0] - fp32[-1] > 0.5 and np.isfinite(bf16).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_model_a_one_process_run_returns_computes_as_it_trained(precision):
    """Before: the stage's head was converted, the GPT's (what the closing sample and evaluation use) not."""
    from minizero.memory.bf16 import BF16Linear
    from minizero.memory.fp8 import FP8Linear
    from minizero.train import parse_args, train

    argv = ["--model", "tiny", "--dtype", "float32", "--steps", "1", "--eval-every", "0", "--eval-batches", "1",
            "--no-progress", "--precision", precision]
    res = run_in_threads(1, lambda comm: train(parse_args(argv, 1), comm, log=lambda s: None))[0]
    assert type(res.model.lm_head) is {"bf16": BF16Linear, "fp8": FP8Linear}[precision]
    assert res.model.lm_head.weight is res.model.transformer["wte"].weight  # still tied


@pytest.mark.timeout(300)
def test_bf16_under_a_pipeline_equals_one_process():
    one = run_in_threads(1, _losses, ["--precision", "bf16", "--grad-accum", "2"], 3)[0]
    two = run_in_threads(2, _losses, ["--precision", "bf16", "--pp", "2"], 3)[0]
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-6)


@pytest.mark.parametrize("argv,match", [
    (["--dtype", "float64"], "--dtype must be float32, got float64"),
    (["--tp", "2"], "--precision bf16 with --tp 2 is not supported"),
    (["--initial-loss-scale", "1024"], "only apply"),
    (["--precision", "bf8"], None)])
def test_bad_bf16_combinations_are_refused(argv, match):
    from minizero.flags import UsageError
    from minizero.train import parse_args
    argv = (["--precision", "bf16"] if "--precision" not in argv else []) + argv
    with pytest.raises((UsageError, ValueError), match=match or "invalid choice: 'bf8'"):
        parse_args(["--model", "tiny"] + argv, 2)



@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,extra", [(2, ["--dp", "2", "--zero", "3"]), (1, ["--recompute", "full"]),
                                     (1, ["--attention", "flash"])])
def test_bf16_composes_with_zero_recompute_and_flash(n, extra):
    base = ["--precision", "bf16"] + (["--dp", "2"] if n == 2 else [])
    plain = run_in_threads(n, _losses, base, 3)[0]
    np.testing.assert_allclose(run_in_threads(n, _losses, base + extra, 3)[0], plain, rtol=0, atol=1e-6)
