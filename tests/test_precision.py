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


def test_widen_is_astype_for_every_half_and_keeps_the_layout():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # NaNs and infs included
    got = backend.widen(every)
    assert got.dtype == np.float32 and got.tobytes() == every.astype(np.float32).tobytes()
    w = every[:4096].reshape(64, 64)
    for a in (w, w.T, w[:, ::2], w[5, 7]):  # C-order, F-order, strided, 0-d: the layout astype gives
        g = backend.widen(a)
        assert g.tobytes() == a.astype(np.float32).tobytes() and g.strides == a.astype(np.float32).strides
    f32 = np.ones(3, np.float32)
    assert backend.widen(f32) is f32  # not float16: no copy


def _layouts(x):
    """Views of the (8, 12, 24) ``x`` as attention makes them, and others: each must come back in astype's layout."""
    heads = x[..., :8].reshape(8, 12, 2, 4).transpose(0, 2, 1, 3)  # a head split of one third of a fused projection
    return [heads, heads.transpose(0, 1, 3, 2), x.transpose(1, 0, 2), x.T, x[:, :, 3:17], x[::2], x[:, ::-1],
            x[..., :1], np.broadcast_to(x[0, 0], (3, 24)), x[0].T, x.transpose(2, 0, 1)[1:]]


def test_widen_and_narrow_keep_astypes_layout_for_every_view():
    x = np.random.default_rng(1).normal(size=(8, 12, 24)).astype(np.float16)
    for a in _layouts(x):
        want = a.astype(np.float32)
        got = backend.widen(a)
        assert got.strides == want.strides and got.tobytes() == want.tobytes(), (a.shape, a.strides)
    for a in _layouts(x.astype(np.float32) * 1.001):  # float32 views, dense and not
        want = a.astype(np.float16)
        got = backend.narrow(a)
        assert got.strides == want.strides and got.tobytes() == want.tobytes(), (a.shape, a.strides)


def test_narrow_is_astype_at_every_rounding_boundary():
    """backend.narrow against NumPy's cast: every half, every tie between neighbours and the float32 values either
    side of it, the overflow edge, specials, and random bit patterns (all 2^32 were checked once, off the suite)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    finite = np.sort(halves[np.isfinite(halves)])
    ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32 (12 significant bits)
    near = [np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))]
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.996, 65520, -65520, 1e30, 2.0 ** -25,
                        2.0 ** -24 * 1.5, 1e-45, -1e-45, 2.0 ** -14], np.float32)
    rand = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([finite.astype(np.float32), ties, *near, special, rand])
    with np.errstate(all="ignore"):
        got, want = backend.narrow(x), x.astype(np.float16)
    nan = np.isnan(want)
    assert got.dtype == np.float16 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # a NaN keeps its sign (not its payload)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    m = x[:4096].reshape(64, 64)
    for a in (m.T, m[:, ::2]):  # F-order and strided: astype's layout
        assert backend.narrow(a).strides == a.astype(np.float16).strides


@pytest.mark.parametrize("chunk", [backend.CAST_CHUNK, 100])  # 100: blocks of 100 elements, the last one short
def test_binary_is_numpys_float16_arithmetic(chunk, monkeypatch):
    monkeypatch.setattr(backend, "CAST_CHUNK", chunk)
    rng = np.random.default_rng(5)
    a, b = (rng.normal(size=(64, 33)) * 300).astype(np.float16), rng.normal(size=(64, 33)).astype(np.float16)
    for op in ("add", "subtract", "multiply"):
        for x, y in ((a, b), (a, np.float16(0.177)), (a, 1.5), (a, b.astype(np.float32))):  # Python float: NumPy's rule
            want = getattr(np, op)(x, y)
            got = backend.binary(op, x, y)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (op, type(y))


def test_fp16_linear_adds_its_bias_before_the_one_rounding():
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(2, 5, 64)).astype(np.float16), rng.normal(size=(32, 64)).astype(np.float16)
    b = (rng.normal(size=32) * 100).astype(np.float16)
    got = F.linear(Tensor(x), Tensor(w), Tensor(b)).data
    want = ((x.astype(np.float32).reshape(10, 64) @ w.astype(np.float32).T) + b.astype(np.float32)).astype(np.float16)
    assert got.dtype == np.float16 and got.reshape(10, 32).tobytes() == want.tobytes()
    twice = ((x.astype(np.float32).reshape(10, 64) @ w.astype(np.float32).T).astype(np.float16).astype(np.float32)
             + b.astype(np.float32)).astype(np.float16)
    assert (twice != want).any()  # rounding the product first would change some outputs: the test can fail


def test_fp16_statistics_in_fp32():
    x = Tensor((np.random.default_rng(1).normal(size=(4, 64)) * 300).astype(np.float16))
    y = F.layer_norm(x, Tensor(np.ones(64, np.float16)), Tensor(np.zeros(64, np.float16)))
    assert y.dtype == np.float16 and np.isfinite(y.data).all()  # x^2 would overflow FP16 (max 65504)
    loss = F.cross_entropy(Tensor(np.zeros((4, 256), np.float16)), np.arange(4))
    assert loss.dtype == np.float32 and np.isclose(loss.item(), np.log(256))


def test_fp16_softmax_backward_keeps_the_row_shift_invariance():
    """A gradient common to a whole row of probabilities must not leak into the scores' gradient.

    Nearly uniform attention and a large common component c in g (value vectors sharing a mean): the
    exact dx = y * (g - y.g) is small and sums to 0 over the row. Computed from the float16 y (whose
    entries do not sum to 1) with float16 arithmetic, c leaked in as y * c * (1 - sum y): the error
    was ~100% of dx and the q and k gradients of deep layers were noise (issue 11 item 10).
    """
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 64, 64)) * 0.1).astype(np.float16)
    g = (1.0 + 1e-3 * rng.normal(size=x.shape)).astype(np.float16)
    xt = Tensor(x, requires_grad=True)
    F.causal_softmax(xt).backward(g)
    ref = Tensor(x.astype(np.float64), requires_grad=True)
    F.causal_softmax(ref).backward(g.astype(np.float64))
    err = np.linalg.norm(xt.grad.astype(np.float64) - ref.grad) / np.linalg.norm(ref.grad)
    assert xt.grad.dtype == np.float16 and err < 1e-2, err
    row_sums = np.abs(xt.grad.astype(np.float64).sum(axis=-1)).max()
    assert row_sums < 1e-2 * np.abs(ref.grad).sum(axis=-1).max(), row_sums


def test_fp16_bias_gradient_accumulates_in_fp32():
    """Linear's bias gradient sums g over N rows in float32 and rounds once (a float16 running sum
    rounds at every row: past 2048 it can no longer add a 1)."""
    rng = np.random.default_rng(0)
    g = rng.uniform(0.5, 1.5, size=(4096, 8)).astype(np.float16)
    x = Tensor(np.ones((4096, 4), np.float16))
    w, b = Tensor(np.zeros((8, 4), np.float16), requires_grad=True), Tensor(np.zeros(8, np.float16), requires_grad=True)
    F.linear(x, w, b).backward(g)
    exact = g.astype(np.float64).sum(axis=0)
    assert b.grad.dtype == np.float16
    assert np.abs(b.grad.astype(np.float64) - exact).max() <= exact.max() * 2 ** -11


def test_fp16_embedding_gradient_accumulates_in_fp32():
    """A token seen 4096 times: its row of the embedding gradient sums 4096 contributions in float32."""
    w = Tensor(np.zeros((4, 2), np.float16), requires_grad=True)
    F.embedding(np.zeros(4096, np.int64), w).backward(np.ones((4096, 2), np.float16))
    assert w.grad.dtype == np.float16 and (w.grad[0] == 4096).all() and (w.grad[1:] == 0).all()


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


def test_scaler_overflow_restarts_the_growth_count():
    s = DynamicLossScaler(init_scale=1024, growth_interval=3)  # PyTorch's growth tracker: 0 after an overflow
    s.update(False), s.update(False)
    assert s.update(True) and s.scale == 512
    for _ in range(2):
        assert s.update(False) is False and s.scale == 512  # 2 clean steps since the overflow: no growth yet
    s.update(False)
    assert s.scale == 1024


def test_scaler_hysteresis_like_deepspeed():
    s = DynamicLossScaler(init_scale=1024, hysteresis=2, growth_interval=1000)
    assert s.update(True) and s.scale == 1024  # first overflow tolerated (step still skipped)
    assert s.update(True) and s.scale == 512   # second lowers the scale
    assert s.update(True) and s.scale == 256   # tolerance used up until the scale grows (DeepSpeed)


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


# ---- mixed precision in the training loop ------------------------------------------------
from minizero.comm import run_in_threads  # noqa: E402
from minizero.train import UsageError, parse_args, train  # noqa: E402

FP16_TINY = ["--model", "tiny", "--precision", "fp16", "--eval-every", "0", "--eval-batches", "1",
             "--no-progress", "--micro-batch-size", "2"]


def _run_fp16(comm, argv, after_grads=None):
    from minizero.ledger import MemoryLedger, set_ledger

    set_ledger(MemoryLedger())
    args = parse_args(FP16_TINY + argv, comm.world_size)
    res = train(args, comm, log=lambda s: None, after_grads=after_grads)
    from minizero.ledger import get_ledger

    return res, get_ledger().snapshot()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,n", [(0, 1), (0, 2), (1, 2), (2, 2), (3, 2), (1, 3), (3, 3)])
def test_fp16_model_state_bytes_per_parameter(stage, n):
    """2 + 2 + 12 bytes per parameter at stage 0; the 12 (and more) sharded by ZeRO."""
    from minizero.zero import ZeroOptimizer

    results = run_in_threads(n, _run_fp16, ["--steps", "1", "--zero", str(stage)])
    for res, _ in results:
        sb = res["state_bytes"]
        opt = res["opt"]
        if isinstance(opt, ZeroOptimizer):
            padded = opt.shard_map.padded
            psi = padded  # flat buffers include the padding
        else:
            psi = res["model"].num_parameters()
        shard = psi // n
        expect = {0: (2 * psi, 2 * psi, 12 * psi), 1: (2 * psi, 2 * psi, 12 * shard),
                  2: (2 * psi, 2 * shard, 12 * shard), 3: (2 * shard, 2 * shard, 12 * shard)}[stage]
        assert (sb["parameters"], sb["gradients"], sb["optimizer_state"]) == expect


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_injected_inf_on_one_rank_skips_the_step_everywhere(stage, monkeypatch):
    monkeypatch.setenv("MINIZERO_FAULT", "1:2:inf")
    snaps = {}

    def after_grads(step, params, opt):
        if step in (2, 3):  # state before step 2's update and before step 3's: equal if step 2 was skipped
            if hasattr(opt, "units"):
                arrays = [a.copy() for st in opt.units for a in (st.master, st.m, st.v)]
            else:
                arrays = [a.copy() for a in opt.masters + opt.m + opt.v]
            snaps.setdefault(threading.get_ident(), {})[step] = arrays

    import threading

    results = run_in_threads(2, _run_fp16, ["--steps", "5", "--zero", str(stage), "--initial-loss-scale", "1024"],
                             after_grads=after_grads)
    for res, _ in results:
        assert res["skipped_steps"] == 1
        assert res["loss_scales"] == [1024.0, 1024.0, 1024.0, 512.0, 512.0]
        assert np.isnan(res["grad_norms"][2]) and np.isfinite(res["grad_norms"][3])
        assert res["opt"].step_count == 4
        # nor the schedule (as DeepSpeed): step 3 gets the rate step 2 had, then the warmup goes on
        assert res["lrs"][3] == res["lrs"][2] and len(set(res["lrs"])) == 4, res["lrs"]
    assert len(snaps) == 2
    for per_rank in snaps.values():
        for a, b in zip(per_rank[2], per_rank[3]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(60)
def test_scale_grows_after_the_window():
    (res, _), = run_in_threads(1, _run_fp16, ["--steps", "7", "--loss-scale-window", "3",
                                              "--initial-loss-scale", "256"])
    assert res["loss_scales"] == [256.0] * 3 + [512.0] * 3 + [1024.0]
    assert res["skipped_steps"] == 0


@pytest.mark.timeout(60)
def test_fp16_update_unscales_the_gradients(monkeypatch):
    import minizero.optim.adamw as adamw  # Adam is nearly scale-invariant: check the factor the update gets
    from minizero.optim import clip_coefficient

    got = []
    real = adamw.adamw_update
    monkeypatch.setattr(adamw, "adamw_update", lambda *a, **k: got.append(a[-1]) or real(*a, **k))
    (res, _), = run_in_threads(1, _run_fp16, ["--steps", "1", "--initial-loss-scale", "256"])
    assert got and set(got) == {clip_coefficient(res["grad_norms"][0], 1.0) / 256}


def test_fp16_bad_flags():
    with pytest.raises(UsageError, match="--dtype must stay float32, got float64"):
        parse_args(["--precision", "fp16", "--dtype", "float64"])
    with pytest.raises(UsageError, match="hysteresis=0"):
        parse_args(["--precision", "fp16", "--hysteresis", "0"])


@pytest.mark.timeout(300)
def test_fp16_loss_tracks_fp32_over_200_steps():
    """On the embedded corpus, 200 steps of the tiny model: FP16 within 0.05 nats of FP32.

    bench/bench_precision.py makes the same comparison for other presets.
    """
    common = ["--model", "tiny", "--steps", "200", "--eval-every", "0", "--eval-batches", "2", "--no-progress",
              "--micro-batch-size", "8"]

    def run(comm, extra):
        return train(parse_args(common + extra, 1), comm, log=lambda s: None)

    fp32 = run_in_threads(1, run, ["--precision", "fp32"])[0]
    fp16 = run_in_threads(1, run, ["--precision", "fp16"])[0]
    tail32 = np.mean(fp32["train_losses"][-20:])
    tail16 = np.mean(fp16["train_losses"][-20:])
    assert abs(tail16 - tail32) < 0.05, (tail16, tail32)
    assert abs(fp16["val_history"][-1][1] - fp32["val_history"][-1][1]) < 0.05


def test_to_dtype_is_astype_for_every_half_and_float():
    """backend.to_dtype: every float16 bit pattern to float32 and float64 (through widen), float32 to float16 (narrow),
    float64 to float16 (NumPy's cast: one rounding, not two), all bitwise astype but for a signaling NaN's payload
    (float32 to float64 quiets it); the same dtype is no copy."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    nan = np.isnan(halves)
    for dtype in (np.float32, np.float64):
        with np.errstate(invalid="ignore"):
            got, want = backend.to_dtype(halves, dtype), halves.astype(dtype)
        assert got.dtype == dtype and got[~nan].tobytes() == want[~nan].tobytes()
        assert np.isnan(got[nan]).all() and np.array_equal(np.signbit(got), np.signbit(want))
    x = np.random.default_rng(2).standard_normal(5000) * 10.0 ** np.random.default_rng(3).integers(-9, 5, 5000)
    for a in (x, x.astype(np.float32)):
        with np.errstate(over="ignore"):
            got, want = backend.to_dtype(a, np.float16), a.astype(np.float16)
        assert got.dtype == np.float16 and got.tobytes() == want.tobytes()
    assert backend.to_dtype(x, np.float64) is x


@pytest.mark.timeout(120)
def test_overflow_at_the_minimum_scale_is_said_once_per_job_in_the_log():
    """Before: every rank printed Python's two-line RuntimeWarning (its path and source line), N copies under
    mpirun -n N; now rank 0's log says it once, as a line of the run's output."""
    import warnings

    logs = []
    argv = ["--model", "tiny", "--steps", "2", "--eval-batches", "1", "--eval-every", "0", "--progress", "none",
            "--no-save", "--sample-tokens", "0", "--precision", "fp16", "--initial-loss-scale", "16777216",
            "--min-loss-scale", "16777216"]  # loss x 2**24 overflows FP16 at every step
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = run_in_threads(2, lambda comm: train(parse_args(argv, 2), comm, log=logs.append).skipped_at, timeout=60)
    assert out == [[0, 1]] * 2
    said = [line for line in logs if "minimum loss scale" in line]
    assert said == ["warning: FP16 gradients overflow at the minimum loss scale 1.67772e+07; steps are being "
                    "skipped"], logs
