"""Data parallel equals single process: N ranks x micro-batch b == one process with N*b (float64)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from tests import dp_reference
from tests.conftest import REPO_ROOT, mpi_env

MICRO = 2
GRAD_RTOL, PARAM_RTOL = 1e-12, 1e-12


def single_process(n):
    """One rank with micro-batch n * MICRO: the baseline every data-parallel run must equal."""
    return run_in_threads(1, dp_reference.run, n * MICRO)[0]


def assert_matches(ref, got, label):
    assert (ref["grad_norms"] > dp_reference.CLIP).all(), "clipping must be active in this test"
    for i, (a, b) in enumerate(zip(ref["grads0"], got["grads0"])):
        scale = np.abs(a).max()
        np.testing.assert_allclose(b, a, rtol=0, atol=GRAD_RTOL * scale, err_msg=f"{label}: grad of param {i}")
    for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
        np.testing.assert_allclose(b, a, rtol=PARAM_RTOL, atol=PARAM_RTOL * np.abs(a).max(),
                                   err_msg=f"{label}: param {i} after {dp_reference.STEPS} steps")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_threads_data_parallel_equals_single_process(n):
    ref = single_process(n)
    results = run_in_threads(n, dp_reference.run, MICRO)
    for r, got in enumerate(results):
        assert_matches(ref, got, f"rank {r}/{n}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_data_parallel_equals_single_process(n, mpiexec, tmp_path):
    ref = single_process(n)
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "dp_check.py")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, script, str(tmp_path), str(MICRO)],
                          env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(n):
        data = np.load(tmp_path / f"rank{r}.npz")
        k = len(ref["params"])
        got = {"grads0": [data[f"g{i}"] for i in range(k)], "params": [data[f"p{i}"] for i in range(k)]}
        assert_matches(ref, got, f"mpi rank {r}/{n}")
    meta = json.loads((tmp_path / "rank0.json").read_text())
    assert meta["world_size"] == n


def test_ledger_counts_real_array_sizes():
    """Parameters, gradients and optimizer state in the ledger equal the arrays' own nbytes."""
    from minizero.nn import GPT, get_config
    from minizero.optim import AdamW

    ledger = set_ledger(MemoryLedger())
    model = GPT(get_config("tiny", dtype="float64"))
    params = model.parameters()
    p_bytes = sum(p.data.nbytes for p in params)
    assert ledger.current["parameters"] == p_bytes
    opt = AdamW(params)
    assert ledger.current["optimizer_state"] == 2 * p_bytes
    x = np.random.default_rng(0).integers(0, 256, (2, 16))
    _, loss = model(x, x)
    assert ledger.current["activations"] > 0
    loss.backward()
    assert ledger.current["gradients"] == sum(p.grad.nbytes for p in params) == p_bytes
    del loss, _, x  # the token ids were saved by the embedding: alive while the caller holds them
    assert ledger.current["activations"] == 0  # every saved activation freed after backward
    opt.zero_grad()
    assert ledger.current["gradients"] == 0 and ledger.peak["gradients"] == p_bytes
    set_ledger(MemoryLedger())


def test_a_bucket_filled_exactly_to_bucket_bytes_takes_no_more():
    """Four 32-byte gradients, 64-byte buckets: two full buckets (a gradient that fits exactly joins its bucket)."""
    from minizero.nn.module import Parameter
    from minizero.parallel.data_parallel import DataParallel

    def layout(comm):
        params = [Parameter(np.full(4, float(i))) for i in range(4)]
        dp = DataParallel(params, comm, bucket_bytes=64)
        return [[params.index(p) for p, _ in lay] for _, lay in dp.buckets]

    assert run_in_threads(2, layout) == [[[3, 2], [1, 0]]] * 2


def test_every_seed_and_step_draws_its_own_global_batch():
    """The batch is seeded by the pair (seed, step): --seed 1 must not replay --seed 0's batches one step later.
    (Round-2 mutant: ``default_rng(seed + step)`` in data.global_batch survived.)"""
    from minizero.data import global_batch, load_tokens
    tokens = load_tokens(None)
    batches = {(seed, step): global_batch(tokens, step, 4, 16, seed)[0].tobytes() for seed in range(4)
               for step in range(4)}
    assert len(set(batches.values())) == len(batches)


def test_construction_gives_every_rank_rank_0s_parameters():
    """broadcast_params: the replicas start from rank 0's values, whatever each rank initialised."""
    from minizero.nn.module import Parameter
    from minizero.parallel.data_parallel import DataParallel

    def start(comm):
        p = Parameter(np.full(3, float(comm.rank + 1)))
        DataParallel([p], comm)
        return p.data.tolist()

    assert run_in_threads(3, start) == [[1.0] * 3] * 3


def test_validation_is_the_last_tenth_and_shares_no_token_with_training():
    from minizero.data import train_val_split

    train, val = train_val_split(np.arange(105))
    assert train.tolist() == list(range(95)) and val.tolist() == list(range(95, 105))


def test_a_negative_validation_index_counts_from_the_end():
    from minizero.data import eval_batches, load_tokens

    val = eval_batches(load_tokens(None)[:4000], 16, 3, 2, seed=5)
    for i in (-1, -2, -3):
        assert all(np.array_equal(a, b) for a, b in zip(val[i], val[3 + i]))
    assert not np.array_equal(val[-1][0], val[1][0])


def test_a_parameter_of_another_dtype_starts_a_bucket_of_its_own():
    """A float64 gradient beside a float32 one is averaged in a float64 bucket: not rounded to float32."""
    from minizero.nn.module import Parameter
    from minizero.parallel.data_parallel import DataParallel

    def average(comm):
        params = [Parameter(np.zeros(2)), Parameter(np.zeros(2, np.float32))]
        dp = DataParallel(params, comm)
        params[0].grad, params[1].grad = np.full(2, 1 + 2.0 ** -40), np.full(2, 3.0, np.float32)
        dp.allreduce_gradients()
        return [str(flat.dtype) for flat, _ in dp.buckets], params[0].grad.tolist(), params[1].grad.dtype

    assert run_in_threads(2, average) == [(["float32", "float64"], [1 + 2.0 ** -40] * 2, np.float32)] * 2


def test_float16_gradients_are_divided_before_the_sum_and_do_not_overflow():
    """Two ranks' float16 gradients of 40000: their mean is 40000, though their sum (80000) is past float16's 65504."""
    from minizero.nn.module import Parameter
    from minizero.parallel.data_parallel import DataParallel

    def average(comm):
        p = Parameter(np.zeros(3, np.float16))
        dp = DataParallel([p], comm)
        p.grad = np.full(3, 40000, np.float16)
        dp.allreduce_gradients()
        return p.grad.tolist()

    assert run_in_threads(2, average) == [[40000.0] * 3] * 2


@pytest.mark.parametrize("steps", [-1, 2.5, float("nan"), None, "3", True, np.int64(-2)])
def test_a_step_count_not_an_integer_at_least_0_is_refused_by_name_by_every_synchroniser(steps):
    """2.5 or nan steps divided silently and None failed on '<'; under ZeRO (its count reads no ``steps``) the
    strategy's figure took any. NumPy's integers pass as plain ints."""
    from types import SimpleNamespace

    from minizero.parallel.data_parallel import mean_per_step
    from minizero.parallel.strategy import Strategy

    zero_like = Strategy.__new__(Strategy)  # only its synchroniser is read
    zero_like.sync = SimpleNamespace(bytes_per_step=lambda steps=None: 7.0)
    for call in (lambda: mean_per_step(100.0, steps), lambda: zero_like.model_state_bytes_per_step(steps)):
        with pytest.raises(ValueError, match=f"^steps={re.escape(repr(steps))}; allowed: an integer >= 0$"):
            call()
    assert mean_per_step(100.0, np.int64(4)) == 25.0 and zero_like.model_state_bytes_per_step(np.int64(0)) == 7.0
