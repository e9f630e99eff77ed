"""Quantized collectives: error bounds, identical results on every rank, and a quarter of the bytes."""
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from minizero.comm import bytes_sent as fp32_bytes_sent
from minizero.comm import reduce_scatter, run_in_threads, shard_range
from minizero.comm.quantized import bytes_sent, quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
from minizero.quantization import dequantize, element_scale, quantize
from tests.conftest import REPO_ROOT, mpi_env

CASES = [(2, 1000), (3, 1000), (4, 4099), (3, 2), (5, 3)]


def _data(rank, n):
    rng = np.random.default_rng([rank, n])
    return (rng.standard_normal(n) * np.exp(rng.uniform(-3, 1, n))).astype(np.float32)


def _gather(comm, n, block):
    x = _data(comm.rank, n)
    off, size = shard_range(n, comm.world_size, comm.rank)
    comm.traffic.reset()
    out = quantized_all_gather(comm, x[off:off + size].copy(), n, block_size=block)
    return x, out, comm.traffic.snapshot()


def _scatter(comm, n, block):
    x = _data(comm.rank, n)
    comm.traffic.reset()
    got = quantized_reduce_scatter(comm, x, block_size=block)
    sent = comm.traffic.snapshot()
    exact = reduce_scatter(comm, x.astype(np.float64))
    return x, got, exact, sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,n", CASES)
def test_all_gather_bound_identical_ranks_and_bytes(world_size, n):
    block = 64
    results = run_in_threads(world_size, _gather, n, block)
    for r in range(world_size):
        np.testing.assert_array_equal(results[r][1], results[0][1])  # every rank gathers the same values
        assert results[r][2]["bytes_sent"] == bytes_sent("all_gather", n, world_size, r, block)
        by_op = results[r][2]["by_op"]  # the inner ring all-gathers are counted under the outer label
        assert by_op["quantized_all_gather"] == results[r][2]["bytes_sent"] and by_op.get("all_gather", 0) == 0
    out = results[0][1]
    for r in range(world_size):
        off, size = shard_range(n, world_size, r)
        part = results[r][0][off:off + size]
        _, scale = quantize(part, 8, "block", block)
        assert (np.abs(out[off:off + size] - part) <= element_scale(scale, (size,), "block", block) / 2).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,n", CASES)
def test_reduce_scatter_bound_and_bytes(world_size, n):
    block = 64
    results = run_in_threads(world_size, _scatter, n, block)
    xs = [r[0] for r in results]
    for r in range(world_size):
        off, size = shard_range(n, world_size, r)
        _, got, exact, sent = results[r]
        bound = np.zeros(size)
        for j in range(world_size):
            if j != r:  # what j sent r: its chunk r, quantized with blocks starting at the chunk
                q, scale = quantize(xs[j][off:off + size], 8, "block", block)
                bound += element_scale(scale, (size,), "block", block) / 2
        assert (np.abs(got.astype(np.float64) - exact) <= bound * (1 + 1e-6) + 1e-6 * np.abs(exact)).all()
        assert sent["bytes_sent"] == bytes_sent("reduce_scatter", n, world_size, r, block)


def _scatter_strict(comm, n, block):
    from minizero import backend
    got = quantized_reduce_scatter(comm, backend.xp.asarray(_data(comm.rank, n)), block_size=block)
    return backend.to_host(got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,n", [(2, 1001), (3, 1003), (4, 4099), (5, 3)])
def test_every_float32_view_of_a_message_is_4_byte_aligned(strict_backend, world_size, n):
    """The strict module refuses a view whose address is not a multiple of its itemsize (a GPU faults on
    it); chunk lengths not a multiple of 4 once put the scales at an odd offset. Results equal NumPy's."""
    from minizero import strict
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        strict.zeros(9, np.uint8)[1:5].view(np.float32)
    assert strict.zeros(9, np.uint8)[4:8].view(np.float32).shape == (1,)
    got = run_in_threads(world_size, _scatter_strict, n, 64)
    strict_backend.set_backend("numpy")
    want = run_in_threads(world_size, lambda comm: quantized_reduce_scatter(comm, _data(comm.rank, n), block_size=64))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))  # bitwise


def test_a_quarter_of_the_fp32_bytes():
    """At B = 256 the wire carries (1 + 4/256) / 4 = 0.254 of the FP32 ring's bytes."""
    n, world = 8 * 2 ** 16, 8
    for op in ("all_gather", "reduce_scatter"):
        ratio = bytes_sent(op, n, world, 0, 256) / fp32_bytes_sent(op, n, 4, world, 0)
        assert abs(ratio - (1 + 4 / 256) / 4) < 1e-3, (op, ratio)


def test_one_rank_sends_nothing_and_is_exact():
    x = _data(0, 100)
    gathered, scattered, sent = run_in_threads(1, lambda c: (quantized_all_gather(c, x), quantized_reduce_scatter(c, x),
                                                             c.traffic.bytes_sent))[0]
    np.testing.assert_array_equal(gathered, x)
    np.testing.assert_array_equal(scattered, x)
    assert sent == 0 == bytes_sent("all_gather", 100, 1, 0)


@pytest.mark.timeout(60)
def test_errors_are_named():
    with pytest.raises(ValueError, match="shard has 3 elements"):
        run_in_threads(2, lambda c: quantized_all_gather(c, np.ones(3, np.float32), 10))
    with pytest.raises(ValueError, match=r"rank [01]'s shard has 1 non-finite"):
        run_in_threads(2, lambda c: quantized_all_gather(c, np.array([1.0, np.nan], np.float32)))
    with pytest.raises(ValueError, match="op='broadcast'"):  # (all_reduce became a valid op in issue 19)
        bytes_sent("broadcast", 10, 2, 0)
    read_only = np.zeros(4, np.float32)  # before: NumPy's "assignment destination is read-only", after the messages
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"out is read-only \(shape \(4,\)\)"):
        run_in_threads(2, lambda c: quantized_all_reduce(c, np.ones(4, np.float32), out=read_only))


@pytest.mark.timeout(60)
def test_overflowed_gradients_arrive_as_nan_not_as_an_error():
    """FP16 loss scaling skips a step whose gradients overflowed; the INT8 reduce-scatter must let it see that."""
    def scatter(comm):
        x = np.ones(8, np.float16)
        if comm.rank == 1:
            x[1] = np.inf  # rank 1's chunk 0 (elements 0-3) goes to rank 0
        return quantized_reduce_scatter(comm, x, block_size=2)

    out = run_in_threads(2, scatter)
    assert np.isnan(out[0][:2]).all() and (out[0][2:] == 2).all()  # only the block with the inf
    assert (out[1] == 2).all()


def test_float64_stays_float64():
    outs = run_in_threads(2, lambda c: quantized_reduce_scatter(c, np.linspace(-1, 1, 10)))
    assert outs[0].dtype == np.float64
    # rank 0's chunk: its own part exact + rank 1's dequantized; both hold the same data here
    q, s = quantize(np.linspace(-1, 1, 10)[:5], 8, "block", 256)
    np.testing.assert_array_equal(outs[0], np.linspace(-1, 1, 10)[:5] + dequantize(q, s, dtype=np.float64))


@pytest.mark.timeout(120)
def test_mpi_demo_runs(mpiexec):
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, f"{REPO_ROOT}/mpi_examples/quantized_collectives.py"],
                          env=mpi_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "within the bound" in proc.stdout and "of the FP32 bytes" in proc.stdout


# --------------------------------------------------------------------------- inside ZeRO: --quantized-comm
def _zero_run(comm, stage, quantized, steps, micro_batch=4, eval_batches=8):
    from minizero.train import parse_args, train

    argv = ["--model", "tiny", "--steps", str(steps), "--micro-batch-size", str(micro_batch), "--eval-every", "0",
            "--eval-batches", str(eval_batches), "--no-progress", "--zero", str(stage)]
    result = train(parse_args(argv + (["--quantized-comm"] if quantized else []), comm.world_size), comm,
                   log=lambda s: None)
    return result["opt"].step_bytes, result["val_history"][-1][1], comm.traffic.snapshot()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_sends_a_quarter_by_the_ledger(stage):
    from minizero.zero import ShardMap
    from minizero.nn import GPT, get_config

    n = 2
    sm = ShardMap.from_model(GPT(get_config("tiny")), n)
    exact = run_in_threads(n, _zero_run, stage, False, 1, 4, 1)  # the step's bytes: one validation batch will do
    quant = run_in_threads(n, _zero_run, stage, True, 1, 4, 1)
    for r in range(n):
        e, q = exact[r][0][0], quant[r][0][0]
        rs = sum(bytes_sent("reduce_scatter", u.padded, n, r) for u in sm.units)
        assert q["reduce_scatter_grads"] == rs
        assert e["reduce_scatter_grads"] == sum(fp32_bytes_sent("reduce_scatter", u.padded, 4, n, r) for u in sm.units)
        if stage == 3:  # forward and backward gathers are INT8; stages 1-2 all-gather exact parameters
            ag = sum(bytes_sent("all_gather", u.padded, n, r) for u in sm.units)
            assert q["gather_forward"] == q["gather_backward"] == ag
        else:
            assert q["all_gather_params"] == e["all_gather_params"]
        ratio = q["reduce_scatter_grads"] / e["reduce_scatter_grads"]
        assert 0.25 < ratio < 0.27, ratio  # (1 + 4/256) / 4 = 0.254, a little more for the 32-element units
        assert quant[r][2]["by_op"]["quantized_reduce_scatter"] > 0


def _zero3_final_loss(quantized):
    """200 steps of ZeRO-3 on 2 thread ranks with one BLAS thread: the last validation loss (in a worker process)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return run_in_threads(2, _zero_run, 3, quantized, 200, 8)[0][1]


@pytest.mark.timeout(300)
def test_zero3_training_with_int8_comm_stays_within_005_nats():
    """The issue's check: 200 steps of ZeRO-3 over 2 ranks, INT8 gathers and reduce-scatters vs FP32 ones,
    with the main job's global batch (16) and learning rate. (The tiny model's 200-step loss moves by a few
    hundredths under any perturbation — float64 instead of float32 moves it 0.04 — so this is a loose check;
    bench/bench_quantization.py measures the 'small' model: docs/benchmarks.md, "Quantization and sparsity".)"""
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:  # two cores: both at once
        exact, quant = pool.map(_zero3_final_loss, (False, True))
    assert exact < 3.0  # it learned (ln 256 = 5.55)
    assert abs(quant - exact) < 0.05, (exact, quant)


def test_quantized_comm_flags():
    """Issue 19: --quantized-comm works at --zero 0 too (this test used to assert the refusal);
    it still excludes the FP32-only all-reduces (MPI's own, the hierarchical one)."""
    from minizero.train import UsageError, parse_args

    assert parse_args(["--quantized-comm"]).quantized_comm
    with pytest.raises(UsageError, match="exclude each other"):
        parse_args(["--quantized-comm", "--zero", "2", "--native-comm"])
    with pytest.raises(UsageError, match="exclude each other"):
        parse_args(["--quantized-comm", "--allreduce", "hierarchical"], 2)


def _all_reduce(comm, n):
    from minizero.comm.quantized import quantized_all_reduce

    x = _data(comm.rank, n) * (1 + comm.rank)
    out = quantized_all_reduce(comm, x)
    return x, out, comm.traffic.snapshot()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 300, 1027])
def test_quantized_all_reduce_is_identical_everywhere_within_the_bound(world, n, ring_all_reduce):
    res = run_in_threads(world, _all_reduce, n)
    xs = [r[0] for r in res]
    exact = sum(xs)
    for r, (_, out, snap) in enumerate(res):
        assert np.array_equal(out, res[0][1])  # every rank dequantizes the same codes
        # reduce-scatter: the other ranks' scale/2 each; all-gather: the sum's scale/2 (scale = absmax / 127)
        bound = sum(np.abs(x).max() for x in xs) / 254 + np.abs(exact).max() / 254
        assert np.abs(out - exact).max() <= bound * (1 + 1e-6)
        if world == 1:
            assert np.array_equal(out, exact)
        sent = snap["by_op"].get("quantized_all_reduce", 0) if world > 1 else 0
        assert sent == bytes_sent("all_reduce", n, world, r)
    if world > 1 and n > 1000:
        ratio = bytes_sent("all_reduce", n, world, 0) / fp32_bytes_sent("all_reduce", n, 4, world, 0)
        assert 0.25 < ratio < 0.3, ratio


def _non_finite(comm):
    from minizero.comm.quantized import quantized_all_reduce

    x = np.ones(600, np.float32)
    if comm.rank == 1:
        x[5] = np.inf  # an FP16-style overflow on one rank must reach every rank's loss scaler
    return quantized_all_reduce(comm, x)


def test_quantized_all_reduce_carries_an_overflow_to_every_rank():
    for out in run_in_threads(2, _non_finite):
        assert not np.isfinite(out[:256]).any() and np.isfinite(out[256:]).all()


def _dp_run(comm, quantized, steps):
    from minizero.train import parse_args, train

    argv = ["--model", "tiny", "--steps", str(steps), "--micro-batch-size", "4", "--eval-every", "0",
            "--eval-batches", "8", "--no-progress"] + (["--quantized-comm"] if quantized else [])
    result = train(parse_args(argv, comm.world_size), comm, log=lambda s: None)
    return result["val_history"][-1][1], comm.traffic.snapshot()["by_op"]


@pytest.mark.timeout(300)
def test_data_parallel_with_int8_all_reduce_trains_like_fp32():
    """--zero 0 --quantized-comm over 2 ranks: a quarter of the gradient bytes, the same loss within 0.05 nats."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        exact, e_ops = run_in_threads(2, _dp_run, False, 40)[0]
        quant, q_ops = run_in_threads(2, _dp_run, True, 40)[0]
    assert "quantized_all_reduce" not in e_ops and q_ops.get("all_reduce", 0) < e_ops["all_reduce"]
    ratio = q_ops["quantized_all_reduce"] / (e_ops["all_reduce"] - q_ops.get("all_reduce", 0))
    assert 0.25 < ratio < 0.3, ratio
    assert abs(quant - exact) < 0.05, (exact, quant)


@pytest.mark.timeout(300)
def test_bench_quantization_comm_and_sparse_tables_run():
    """bench/bench_quantization.py's tables 4 and 5b end to end at the smallest size (table 4 once crashed on the
    loop's TrainResult): every row printed, and INT8 gathers and reduce-scatters send fewer bytes per step."""
    proc = subprocess.run([sys.executable, "bench/bench_quantization.py", "--model", "tiny", "--steps", "2",
                           "--eval-batches", "1", "--ranks", "2", "--only", "4,5b"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ", 1 thread)" in proc.stdout.splitlines()[0], proc.stdout[:300]  # before: the process's own, not the runs'
    rows = {line[:26].strip(): line[26:].split() for line in proc.stdout.splitlines() if line.startswith("ZeRO-")}
    assert sorted(rows) == ["ZeRO-2", "ZeRO-2 + INT8 comm", "ZeRO-3", "ZeRO-3 + INT8 comm"], proc.stdout
    for stage in (2, 3):
        assert float(rows[f"ZeRO-{stage}"][1]) == 1.0
        assert float(rows[f"ZeRO-{stage} + INT8 comm"][1]) < 1.0
    assert "5b. sparse training" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].split()[0] == "0.75"
