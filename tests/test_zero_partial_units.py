"""ZeRO 2-3 with a unit only partly used in some micro-batches (issue 26, case 1): equal to stage 1."""
import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.comm import run_in_threads
from minizero.memory.zero import ZeroOptimizer
from minizero.nn import Linear, Module, ModuleList


class Block(Module):
    def __init__(self, rng):
        super().__init__()
        self.lin1 = Linear(6, 6, dtype="float64", rng=rng)
        self.lin2 = Linear(6, 6, dtype="float64", rng=rng)

    def forward(self, x, use2):
        h = self.lin1(x)
        return self.lin2(h) if use2 else h


class Blocks(Module):
    def __init__(self, n):
        super().__init__()
        rng = np.random.default_rng(0)
        self.h = ModuleList([Block(rng) for _ in range(n)])

    def forward(self, x, uses):
        for block, use2 in zip(self.h, uses):
            x = block(x, use2)
        return (x * x).sum()


def _grads(comm, stage, pattern, overlap):
    model = Blocks(len(pattern[0]))
    opt = ZeroOptimizer(model, comm, stage, overlap_reduce=overlap)
    rng = np.random.default_rng(10 + comm.rank)
    for uses in pattern:
        x = Tensor(rng.standard_normal((3, 6)))
        (model(x, uses) * (1.0 / len(pattern))).backward()
    opt.reduce_gradients()
    return np.concatenate([np.asarray(g).ravel() for g in opt.grad_shards()])


PATTERNS = {  # per micro-batch, per block: is lin2 used?
    "one_unit_unused_then_used": [(False,), (True,)],
    "one_unit_used_then_unused": [(True,), (False,)],
    "unused_then_used": [(True, False), (True, True)],
    "four_micro_batches": [(True, True), (False, True), (True, True), (True, False)],
    "unused_in_last": [(True, True), (True, False)],
    "unused_in_every": [(False, False), (False, False)],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_partly_used_unit_equals_stage_1(pattern, stage, overlap):
    ref = run_in_threads(2, _grads, 1, PATTERNS[pattern], False)
    got = run_in_threads(2, _grads, stage, PATTERNS[pattern], overlap)
    for r, g in zip(ref, got):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-14)
