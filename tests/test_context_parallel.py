"""Ring attention (context parallelism): equal to whole causal attention in float64, load-balanced chunks."""
import math

import numpy as np
import pytest

from minizero.autograd import Tensor, causal_softmax
from minizero.comm import run_in_threads
from minizero.parallel.context_parallel import (chunk_ids, ring_attention, ring_bytes, split_for_context_parallel,
                                                unsplit_from_context_parallel)


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = np.arange(16)
    shards = [split_for_context_parallel(x, r, 2, 0) for r in range(2)]
    assert shards[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and shards[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    np.testing.assert_array_equal(unsplit_from_context_parallel(shards, 0), x)
    with pytest.raises(ValueError, match="divisible by 2 x cp = 6"):
        split_for_context_parallel(x, 0, 3, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_equals_whole_causal_attention(cp):
    """Outputs and the gradients of q, k, v (1e-12), every rank's chunks; bytes sent as ring_bytes says."""
    b, h, s, d = 2, 3, 16, 4
    rng = np.random.default_rng(0)
    q, k, v, w = (rng.normal(size=(b, h, s, d)) for _ in range(4))
    qt, kt, vt = (Tensor(a, requires_grad=True) for a in (q, k, v))
    att = causal_softmax((qt @ kt.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d)))
    ref = att @ vt
    (ref * Tensor(w)).sum().backward()

    def rank(comm):
        r = comm.rank
        ql, kl, vl = (Tensor(split_for_context_parallel(a, r, cp, 2), requires_grad=True) for a in (q, k, v))
        out = ring_attention(ql, kl, vl, comm)
        sent = comm.traffic.bytes_sent
        (out * Tensor(split_for_context_parallel(w, r, cp, 2))).sum().backward()
        return out.data, ql.grad, kl.grad, vl.grad, sent, comm.traffic.bytes_sent - sent

    res = run_in_threads(cp, rank)
    for i, want in enumerate([ref.data, qt.grad, kt.grad, vt.grad]):
        got = unsplit_from_context_parallel([r_[i] for r_ in res], 2)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max(), err_msg=str(i))
    expect = ring_bytes(b, h, s, d, 8, cp)
    for r_ in res:
        assert (r_[4], r_[5]) == (expect["forward"], expect["backward"] if cp > 1 else 0)
