"""Parameters without a gradient: skipped by the optimizer on every rank, whichever ranks used them.

Issue 19: a parameter that gets no gradient is skipped everywhere (PyTorch AdamW's ``grad is None``):
no weight decay, no moment update -- under one process, data parallelism and ZeRO 1-3 alike.
Issue 26, case 2: a parameter used on some ranks only (data-dependent control flow) is updated on
every rank with the average, a rank without a gradient counting as zeros (PyTorch DDP's
``find_unused_parameters=True``); the replicas stay bitwise equal. ZeRO-3 refuses it (ZeroOrderError).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero.comm import bytes_sent, run_in_threads
from minizero.zero import zero_optimizer
from minizero.nn import GPT, Parameter, get_config
from minizero.optim import AdamW
from minizero.optim.used_parameters import used_anywhere
from minizero.parallel.data_parallel import DataParallel
from tests.conftest import REPO_ROOT, mpi_env
from tests.mpi_scripts import rank_dependent_check as RD


def _model():
    """The tiny GPT (float64) with two parameters no forward uses: one inside block 0's unit, one on its own."""
    model = GPT(get_config("tiny", dtype="float64"), seed=0)
    model.transformer["h"][0].unused = Parameter(np.full((4, 4), 0.5))  # 2-D: would be decayed
    model.transformer["ln_f"].unused_bias = Parameter(np.full(3, 0.25))
    return model


def _train(comm, zero, steps=3):
    """``steps`` AdamW steps (weight decay 0.1) over the data split by rank; {name: final value}."""
    model = _model()
    n, r = comm.world_size, comm.rank
    if zero:
        opt = zero_optimizer(model, comm, zero, lr=1e-2, weight_decay=0.1)
        reduce = opt.reduce_gradients
    else:
        dp, opt = DataParallel(model.parameters(), comm), AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        reduce = dp.allreduce_gradients
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.integers(0, 256, (4, 16))  # the global batch; rank r takes rows r::n (mean of the means)
        model(x[r::n], x[r::n])[1].backward()
        reduce()
        opt.step()
        opt.zero_grad() if zero else model.zero_grad()
    if zero == 3:
        with opt.full_parameters():
            return {k: p.data.copy() for k, p in model.named_parameters()}
    return {k: p.data.copy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_unused_parameter_stays_bitwise_unchanged(zero, ranks):
    out = run_in_threads(ranks, _train, zero)
    single = run_in_threads(1, _train, 0)[0]
    for state in out:
        assert np.array_equal(state["transformer.h.0.unused"], np.full((4, 4), 0.5))
        assert np.array_equal(state["transformer.ln_f.unused_bias"], np.full(3, 0.25))
        moved = state["transformer.h.0.mlp.c_fc.weight"] - _model().transformer["h"][0].mlp.c_fc.weight.data
        assert np.abs(moved).max() > 1e-4  # the used ones trained
        for k, v in single.items():  # and equal the single process (float64)
            np.testing.assert_allclose(state[k], v, rtol=0, atol=1e-12, err_msg=k)


# ------------------------------------------------- issue 26: a parameter used on some ranks only
# tests/mpi_scripts/rank_dependent_check.py: ranks run different graphs (PyTorch DDP's find_unused_parameters)
def _check_rank_dependent(kind, stage, overlap, per_rank, ref):
    label = f"{kind}, stage {stage}{' overlapped' if overlap else ''}"
    for name, value in ref.items():
        for rank, params in enumerate(per_rank):  # the replicas stay bitwise equal, and equal the average's step
            assert np.array_equal(params[name], per_rank[0][name]), f"{label}: rank {rank} differs on {name}"
        np.testing.assert_allclose(per_rank[0][name], value, rtol=0, atol=1e-12, err_msg=f"{label}: {name}")
    if kind == "blocks":  # the pattern did what it says: block 1 (rank 0 only) trained, block 3's lin2 (no rank) did not
        init = dict(RD.build("blocks").named_parameters())
        for name in ("h.1.lin1.weight", "h.2.lin2.weight"):
            assert np.abs(per_rank[1][name] - init[name].data).max() > 1e-3, name
        assert np.array_equal(per_rank[1]["h.3.lin2.weight"], init["h.3.lin2.weight"].data)


@pytest.mark.usefixtures("ring_all_reduce")  # the overlapped rings at every bucket size, so their order matters
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,stage,overlap", RD.CASES)
def test_rank_dependent_control_flow_keeps_replicas_bitwise_equal(kind, stage, overlap):
    """Rank 1 skips a block: every rank updates it with the average (zeros for rank 1), as one process does."""
    _check_rank_dependent(kind, stage, overlap, run_in_threads(2, RD.train, kind, stage, overlap), RD.reference(kind))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1])
def test_the_agreement_is_one_small_all_gather_per_step(stage):
    """Per step and rank: one all-gather of a bitmask of ceil(P/8) bytes, under ``used_parameters``;
    DataParallel's gradient bytes (``bytes_sent``) and ZeRO's per-step phases leave it out."""
    def fn(comm):
        before = comm.traffic.snapshot()["by_op"].get("used_parameters", 0)
        RD.train(comm, "blocks", stage, False)
        return comm.traffic.snapshot()["by_op"]["used_parameters"] - before
    num = len(RD.build("blocks").parameters())
    for rank, sent in enumerate(run_in_threads(2, fn)):
        assert sent == RD.STEPS * bytes_sent("all_gather", 2 * -(-num // 8), 1, 2, rank) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_zero3_refuses_rank_dependent_control_flow_on_every_rank(overlap):
    """Stage 3 gathers a unit as its forward begins: a block skipped on one rank is a ZeroOrderError on all
    (with prefetch too, where the ranks agree on the unit but one gathers it blocking, the other prefetched)."""
    for msg in run_in_threads(2, RD.train, "blocks", 3, overlap):
        assert isinstance(msg, str) and "ranks disagree on the next collective" in msg, msg


@pytest.mark.usefixtures("ring_all_reduce")
@pytest.mark.timeout(300)
def test_mpi_rank_dependent_control_flow_keeps_replicas_bitwise_equal(mpiexec, tmp_path):
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "rank_dependent_check.py")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, script, str(tmp_path)], env=mpi_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    refs = {kind: RD.reference(kind) for kind in ("blocks", "gpt")}
    for kind, stage, overlap in RD.CASES:
        case = f"{kind}:{stage}:{int(overlap)}"
        per_rank = [{name: d[f"{case}:{name}"] for name in refs[kind]} for d in data]
        _check_rank_dependent(kind, stage, overlap, per_rank, refs[kind])
    for d in data:
        for overlap in (0, 1):
            assert "ranks disagree on the next collective" in str(d[f"error:blocks:3:{overlap}"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num", [1, 8, 11, 17])
def test_the_bitmask_is_the_or_over_ranks_of_each_parameter_flag(num):
    """used_anywhere: 3 ranks with different flags; every rank gets the OR, per parameter, from ceil(P/8) bytes."""
    flags = [[(i * (r + 2)) % 5 == r for i in range(num)] for r in range(3)]

    def fn(comm):
        before = comm.traffic.bytes_sent
        got = used_anywhere(comm, flags[comm.rank])
        return got, comm.traffic.bytes_sent - before, comm.traffic.snapshot()["by_op"]
    expect = [any(f[i] for f in flags) for i in range(num)]
    assert 0 < sum(expect) < num or num == 1
    for rank, (got, sent, by_op) in enumerate(run_in_threads(3, fn)):
        assert got == expect
        assert sent == by_op["used_parameters"] == bytes_sent("all_gather", 3 * -(-num // 8), 1, 3, rank)
    assert run_in_threads(1, lambda c: used_anywhere(c, [True, False])) == [[True, False]]  # one rank: no message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_find_unused_parameters_false_sends_nothing_more_and_changes_no_bit(stage):
    """The fast path (every rank runs the same graph): no agreement message, the same weights bit for bit."""
    def fn(comm, find):
        model = RD.build("gpt")
        if stage == 0:
            dp = DataParallel(model.parameters(), comm, find_unused_parameters=find)
            opt, reduce = AdamW(model.parameters(), lr=1e-2), dp.allreduce_gradients
        else:
            opt = zero_optimizer(model, comm, stage, lr=1e-2, find_unused_parameters=find)
            reduce = opt.reduce_gradients
        for step in range(2):
            rows = np.random.default_rng(step).integers(0, 256, (4, 17))[comm.rank::2]
            model(rows[:, :-1], rows[:, 1:])[1].backward()
            reduce()
            opt.step()
            opt.zero_grad() if stage else model.zero_grad()
        return {k: p.data.copy() for k, p in model.named_parameters()}, comm.traffic.snapshot()["by_op"]
    on, off = run_in_threads(2, fn, True), run_in_threads(2, fn, False)
    for (w_on, t_on), (w_off, t_off) in zip(on, off):
        assert "used_parameters" not in t_off and t_on["used_parameters"] > 0
        assert all(np.array_equal(w_on[k], w_off[k]) for k in w_on)
