"""Issue 19: a parameter that gets no gradient is skipped everywhere (PyTorch AdamW's ``grad is None``):
no weight decay, no moment update -- under one process, data parallelism and ZeRO 1-3 alike."""
import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.memory.zero import ZeroOptimizer
from minizero.nn import GPT, Parameter, get_config
from minizero.optim import AdamW
from minizero.parallel.data_parallel import DataParallel


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
        opt = ZeroOptimizer(model, comm, zero, lr=1e-2, weight_decay=0.1)
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
