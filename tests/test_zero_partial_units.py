"""ZeRO 1-3 with a unit only partly used in some micro-batches (issue 26, case 1): every stage equals one process.

Stage 2 used to drop a micro-batch's gradient and stage 3 to produce NaN: a partly used unit was
reduced (stage 3: freed) when its missing gradient arrived in the *next* micro-batch. Each
backward pass now ends its micro-batch (minizero/zero/stage2.py). The cases (patterns of use x the order
of forwards and backwards x stage x overlap) are tests/mpi_scripts/partial_units_check.py's.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.autograd.engine import queue_callback
from minizero.comm import run_in_threads
from tests.conftest import REPO_ROOT, mpi_env
from tests.mpi_scripts import partial_units_check as P

ATOL = 1e-14  # float64; the gradients are O(1)


def assert_equal_to_reference(shards, params, ref, rank, label):
    ref_shards, ref_params = ref
    assert np.isfinite(shards).all(), f"{label}: rank {rank}: a non-finite gradient"
    np.testing.assert_allclose(shards, ref_shards[rank], rtol=0, atol=ATOL, err_msg=f"{label}: rank {rank} gradients")
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=0, atol=ATOL, err_msg=f"{label}: rank {rank} {name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(P.ORDERS))
@pytest.mark.parametrize("pattern", list(P.PATTERNS))
def test_partly_used_unit_every_stage_equals_one_process(pattern, order):
    """Threads, 2 ranks, float64: stages 1, 2, 3, with and without the overlapped reduce-scatter."""
    ref = P.reference(2, pattern, order)
    stage1 = run_in_threads(2, P.run, 1, pattern, order, False)
    for stage, overlap in [(1, False), (2, False), (2, True), (3, False), (3, True)]:
        got = stage1 if stage == 1 else run_in_threads(2, P.run, stage, pattern, order, overlap)
        for rank, (shards, params) in enumerate(got):
            label = f"{pattern}, {order}, stage {stage}{' overlapped' if overlap else ''}"
            assert_equal_to_reference(shards, params, ref, rank, label)
            np.testing.assert_allclose(shards, stage1[rank][0], rtol=0, atol=ATOL, err_msg=f"{label} vs stage 1")


@pytest.mark.timeout(300)
def test_mpi_partly_used_unit_every_stage_equals_one_process(mpiexec, tmp_path):
    """The same cases under mpiexec, 2 ranks (MPI's non-blocking rings for the overlapped stages)."""
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "partial_units_check.py")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, script, str(tmp_path)], env=mpi_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    refs = {}
    for pattern, order, stage, overlap in P.CASES:
        ref = refs.setdefault((pattern, order), P.reference(2, pattern, order))
        case = f"{pattern}:{order}:{stage}:{int(overlap)}"
        for rank, d in enumerate(data):
            params = {name: d[f"p:{case}:{name}"] for name in ref[1]}
            assert_equal_to_reference(d["g:" + case], params, ref, rank, f"mpi {case}")


def test_queue_callback_runs_once_after_the_outermost_backward():
    """The engine's end-of-backward seam: after every gradient landed, once, after a nested backward too."""
    calls = []
    w = Tensor(np.ones(3), requires_grad=True)

    def inner_hook(_):
        if not calls:
            queue_callback(lambda: calls.append(("end", w.grad.copy())))
            inner = Tensor(np.ones(2), requires_grad=True)
            (inner * 2.0).sum().backward()  # nested, as recompute's: the callback waits for the outer one
            calls.append(("nested done", None))
    w.register_post_accumulate_grad_hook(inner_hook)
    ((w * 3.0).sum()).backward()
    assert [c[0] for c in calls] == ["nested done", "end"]
    np.testing.assert_array_equal(calls[1][1], np.full(3, 3.0))
    with pytest.raises(RuntimeError, match="outside backward"):
        queue_callback(lambda: None)



class _DirectUse(P.Blocks):
    """Block 1 runs lin1 only; lin2's weight is used directly, in a part of the loss of its own."""

    def forward(self, x, uses=None):
        return self.h[1](self.h[0](x, 2), 1), (x @ self.h[1].lin2.weight.T).tanh()


def _direct_use_backwards(model, x, scale):
    """The direct use's backward first: lin2's gradient lands with no bucket open (stage 2 must keep it)."""
    chain, direct = model(Tensor(x))
    ((direct * direct).sum() * scale).backward()
    ((chain * chain).sum() * scale).backward()


@pytest.mark.parametrize("stage", [1, 2])  # stage 3 refuses the direct use: the next test
def test_gradient_landed_before_its_unit_bucket_opened_is_kept(stage):
    """Threads, 2 ranks, float64: owned gradient shards equal one process's mean of the two ranks' gradients."""
    def grads(comm):
        model = _DirectUse(2)
        opt = P.zero_optimizer(model, comm, stage, lr=P.LR)
        _direct_use_backwards(model, P._inputs(comm.rank, 1)[0], 1.0)
        opt.reduce_gradients()
        return np.concatenate([np.asarray(g).ravel() for g in opt.grad_shards()])

    ref = _DirectUse(2)
    for r in range(2):
        _direct_use_backwards(ref, P._inputs(r, 1)[0], 0.5)
    sm = P.ShardMap.from_model(ref, 2)
    flat = {k: (p.grad if p.grad is not None else np.zeros(p.shape)) for k, p in ref.named_parameters()}
    for rank, got in enumerate(run_in_threads(2, grads)):
        shards = [sm.shard(i, rank) for i in range(len(sm.units))]
        want = np.concatenate([sm.flatten(i, flat)[off:off + size] for i, (off, size) in enumerate(shards)])
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"stage {stage}, rank {rank}")


def test_stage3_parameter_used_outside_its_module_raises_naming_it():
    """Stage 3 gathers a unit only while its module runs: a direct use raises (it gave NaN gradients silently)."""
    def direct_use(comm):
        model = _DirectUse(2)
        P.zero_optimizer(model, comm, 3, lr=P.LR)
        with pytest.raises(RuntimeError, match=r"h\.1\.lin2\.weight used outside its module's forward.*stage 1 or 2"):
            _direct_use_backwards(model, P._inputs(comm.rank, 1)[0], 1.0)
    run_in_threads(2, direct_use)
