"""Recursive-doubling all-reduce (small buffers): exact tree order, identical on every rank, exact bytes."""
import numpy as np
import pytest

from minizero.comm.collectives import all_reduce, bytes_sent
from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES, all_reduce_algorithm
from minizero.comm.threads import run_in_threads


def tree_sum(xs):
    """The documented order: fold pairs (x_2i + x_2i+1) for the first 2r ranks, then a balanced tree."""
    n = len(xs)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    leaves = [xs[2 * i] + xs[2 * i + 1] for i in range(rem)] + list(xs[2 * rem:])
    while len(leaves) > 1:
        leaves = [leaves[i] + leaves[i + 1] for i in range(0, len(leaves), 2)]
    return leaves[0]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_recursive_doubling_order_bytes_and_identical_ranks(world):
    rng = np.random.default_rng(world)
    xs = [rng.standard_normal(37) * 10.0 ** rng.integers(-8, 8, 37) for _ in range(world)]

    def body(comm):
        before = comm.traffic.bytes_sent
        out = all_reduce(comm, xs[comm.rank].copy())
        return out, comm.traffic.bytes_sent - before

    res = run_in_threads(world, body)
    want = tree_sum(xs)
    for rank, (out, sent) in enumerate(res):
        np.testing.assert_array_equal(out, want)  # bit for bit, the documented order, every rank
        assert sent == bytes_sent("all_reduce", 37, 8, world, rank)
    p = 1 << (world.bit_length() - 1)
    log2p = p.bit_length() - 1
    sent = sorted(s for _, s in res)
    rem = world - p
    assert sent == sorted([37 * 8] * rem + [37 * 8 * (log2p + 1)] * rem + [37 * 8 * log2p] * (p - rem))


def test_the_ring_takes_large_buffers():
    assert all_reduce_algorithm(SMALL_ALLREDUCE_MAX_BYTES, 8) == "recursive_doubling"
    assert all_reduce_algorithm(SMALL_ALLREDUCE_MAX_BYTES + 1, 8) == "ring"
    assert all_reduce_algorithm(8, 1) == "ring"  # one rank: nothing to send either way
    n = SMALL_ALLREDUCE_MAX_BYTES // 4 + 4  # float32, just over the threshold: the ring's 2(N-1)/N
    assert bytes_sent("all_reduce", n, 4, 4, 0) == 2 * n * 4 * 3 // 4


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_bytes_sent_takes_numpy_integers_for_a_small_all_reduce_and_peers_refuse_a_rank_outside_the_world(world):
    """bytes_sent's checks pass NumPy's integers (as its ring's and broadcast's figures took them); recursive
    doubling's fold read int.bit_length (AttributeError). A rank outside 0..world_size - 1 was given peers
    (rank 5 of 3: [6]; rank -1: [-3, -2]) and is refused by name."""
    from minizero.comm.recursive_doubling import recursive_doubling_peers

    got = [bytes_sent("all_reduce", np.int64(37), np.int64(8), np.int64(world), np.int64(r)) for r in range(world)]
    assert got == [bytes_sent("all_reduce", 37, 8, world, r) for r in range(world)]
    assert all(type(b) is int for b in got)
    for rank in (world, -1):
        with pytest.raises(ValueError, match=f"^rank={rank} of world_size={world}; allowed: 0 <= rank < world_size$"):
            recursive_doubling_peers(world, rank)
