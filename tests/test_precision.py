"""FP16 mixed precision pieces: tensor-core matmul emulation, FP32 statistics, the dynamic loss scaler."""
import numpy as np
import pytest

from minizero import backend
from minizero.autograd import Tensor, functional as F
from minizero.memory.precision import DynamicLossScaler, LossScaleError, local_overflow


def test_half_matmul_accumulates_in_fp32():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 512)).astype(np.float16)
    b = rng.normal(size=(512, 4)).astype(np.float16)
    exact = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float16)
    got = backend.matmul(a, b)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16))
    assert np.abs(got.astype(np.float64) - exact.astype(np.float64)).max() <= 2 * np.abs(exact).max() * 2 ** -10


def test_fp16_statistics_in_fp32():
    x = Tensor((np.random.default_rng(1).normal(size=(4, 64)) * 300).astype(np.float16))
    y = F.layer_norm(x, Tensor(np.ones(64, np.float16)), Tensor(np.zeros(64, np.float16)))
    assert y.dtype == np.float16 and np.isfinite(y.data).all()  # x^2 would overflow FP16 (max 65504)
    loss = F.cross_entropy(Tensor(np.zeros((4, 256), np.float16)), np.arange(4))
    assert loss.dtype == np.float32 and np.isclose(loss.item(), np.log(256))


def test_scaler_pytorch_defaults_backoff_and_growth():
    s = DynamicLossScaler(growth_interval=3)
    assert s.scale == 2.0 ** 16
    assert s.update(True) is True and s.scale == 2.0 ** 15  # overflow: skip, halve
    for _ in range(2):
        assert s.update(False) is False
    assert s.scale == 2.0 ** 15
    s.update(False)  # 3rd clean step in a row: double
    assert s.scale == 2.0 ** 16
    assert s.skipped == 1


def test_scaler_hysteresis_like_deepspeed():
    s = DynamicLossScaler(init_scale=1024, hysteresis=2, growth_interval=1000)
    assert s.update(True) and s.scale == 1024  # first overflow tolerated (step still skipped)
    assert s.update(True) and s.scale == 512   # second lowers the scale
    assert s.update(True) and s.scale == 512


def test_scaler_stops_at_min_scale_after_bounded_skips():
    s = DynamicLossScaler(init_scale=2.0, min_scale=1.0, max_skips_at_min=3)
    s.update(True)
    assert s.scale == 1.0
    with pytest.warns(RuntimeWarning, match="minimum loss scale"):
        s.update(True)
    s.update(True)
    with pytest.raises(LossScaleError, match="3 consecutive steps at the minimum loss scale 1.0"):
        s.update(True)


def test_scaler_rejects_bad_settings():
    with pytest.raises(ValueError, match="backoff_factor=1.5"):
        DynamicLossScaler(backoff_factor=1.5)


def test_local_overflow():
    assert not local_overflow([np.ones(3), None])
    assert local_overflow([np.ones(3), np.array([1.0, np.inf])])
    assert local_overflow([np.array([np.nan], np.float16)])
