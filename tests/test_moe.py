"""Mixture of experts with expert parallelism (parallel/moe.py).

* Routing: top-k by probability, capacity filled first choice first in token order, the rest dropped.
* ep = 2 and 4 (threads) equal ep = 1 in float64 (1e-12) with drops: each rank's output equals the
  one-process layer on that rank's tokens; expert gradients equal the one-process gradients summed
  over the ranks' batches; the router's gradients summed over ranks equal the same sum; the Switch
  loss and the counts are the one-process ones.
* Refused: experts not divisible by ep, top_k out of range.
"""
import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.comm import run_in_threads
from minizero.parallel.moe import MoELayer, route


def test_route_fills_first_choices_first_and_drops_past_capacity():
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1]])
    token, expert, kept = route(probs, 2, 2)
    assert token.tolist() == [0, 1, 2, 0, 1, 2]
    assert expert.tolist() == [0, 0, 1, 1, 1, 0]
    assert kept.tolist() == [True, True, True, True, False, False]


def _batches(ranks, t, c):
    rng = np.random.default_rng(1)
    return [rng.normal(size=(t, c)) for _ in range(ranks)], [rng.normal(size=(t, c)) for _ in range(ranks)]


@pytest.mark.parametrize("ep,k", [(2, 1), (2, 2), (4, 2)])
def test_expert_parallel_equals_one_process(ep, k):
    t, c, hid, e = 12, 6, 5, 4
    xs, ws = _batches(ep, t, c)
    kw = dict(n_embd=c, hidden=hid, num_experts=e, top_k=k, capacity_factor=1.0, seed=3)
    ref = MoELayer(**kw)
    want = []
    for x, w in zip(xs, ws):
        xt = Tensor(x, requires_grad=True)
        out = ref(xt)
        ((out * Tensor(w)).sum() + ref.aux_loss).backward()
        want.append((out.data, xt.grad, ref.aux_loss.item(), ref.expert_counts.copy(), ref.dropped))
    assert sum(d[4] for d in want) > 0  # the test exercises dropping

    def rank(comm):
        layer = MoELayer(comm=comm, **kw)
        xt = Tensor(xs[comm.rank], requires_grad=True)
        out = layer(xt)
        ((out * Tensor(ws[comm.rank])).sum() + layer.aux_loss).backward()
        return (out.data, xt.grad, layer.aux_loss.item(), layer.expert_counts, layer.dropped,
                layer.router.grad, layer.w1.grad, layer.w2.grad)

    res = run_in_threads(ep, rank)
    for got, exp in zip(res, want):
        for i in range(2):
            np.testing.assert_allclose(got[i], exp[i], rtol=0, atol=1e-12 * np.abs(exp[i]).max())
        assert abs(got[2] - exp[2]) <= 1e-12 and got[3].tolist() == exp[3].tolist() and got[4] == exp[4]
    router = sum(r[5] for r in res)
    np.testing.assert_allclose(router, ref.router.grad, rtol=0, atol=1e-12 * np.abs(ref.router.grad).max())
    local = e // ep
    for j, r in enumerate(res):
        for got, full in ((r[6], ref.w1.grad), (r[7], ref.w2.grad)):
            want_g = full[j * local:(j + 1) * local]
            np.testing.assert_allclose(got, want_g, rtol=0, atol=1e-12 * np.abs(full).max())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_experts=3"):
        run_in_threads(2, lambda comm: MoELayer(4, 4, 3, comm=comm))
    with pytest.raises(ValueError, match="top_k=5"):
        MoELayer(4, 4, 4, top_k=5)
