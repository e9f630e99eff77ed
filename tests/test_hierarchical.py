"""Node awareness in-process: made-up node layouts on the ThreadCommunicator.

The hierarchical all-reduce equals the flat ring bitwise on integer-valued data and
within twice Higham's bound gamma_(N-1) * sum|x| otherwise; the bytes it sends across
nodes are 2(n-1)/n of the buffer per node; the mesh keeps tensor groups inside nodes.
"""
import re

import numpy as np
import pytest

from minizero.comm import all_reduce, run_in_threads
from minizero.comm.hierarchical import HierarchicalAllReduce, cross_node_bytes
from minizero.comm.nodes import NodeLayout, NodeTrafficCommunicator, discover_nodes
from minizero.loop import train
from minizero.numerals import unwrapped
from minizero.parallel.topology import Topology
from minizero.train import UsageError, parse_args

LAYOUTS = [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2), (0, 1, 2), (0, 0, 0), (0,)]


def _both(comm, layout, x_of_rank):
    comm = NodeTrafficCommunicator(comm, NodeLayout(layout))
    hier = HierarchicalAllReduce(comm)
    x = x_of_rank(comm.rank)
    ring = all_reduce(comm, x)
    before = comm.cross_node.bytes_sent
    got = hier(x)
    return ring, got, comm.cross_node.bytes_sent - before, hier.cross.traffic.bytes_sent


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_hierarchical_equals_the_ring_bitwise_on_integers(layout, n):
    def x_of_rank(r):
        return np.random.default_rng(r).integers(-2 ** 20, 2 ** 20, size=(n,)).astype(np.float64)

    res = run_in_threads(len(layout), _both, layout, x_of_rank)
    for ring, got, _, _ in res:
        assert got.tobytes() == ring.tobytes()
        assert got.tobytes() == res[0][1].tobytes()  # every rank bit-identical


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchical_is_within_float64_rounding_of_the_ring(layout):
    N, n = len(layout), 4096
    xs = [np.random.default_rng(10 + r).standard_normal(n) * 10.0 ** np.random.default_rng(r).integers(-8, 8, n)
          for r in range(N)]
    res = run_in_threads(N, _both, layout, lambda r: xs[r].copy())
    u = 2.0 ** -53
    gamma = (N - 1) * u / (1 - (N - 1) * u)
    bound = 2 * gamma * np.sum(np.abs(xs), axis=0)  # each order within gamma*sum|x| of the exact sum
    for ring, got, _, _ in res:
        assert np.all(np.abs(got - ring) <= bound)
        assert got.tobytes() == res[0][1].tobytes()


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
@pytest.mark.parametrize("layout", [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2), (0, 0, 0, 0, 1, 1, 1, 1)])
def test_bytes_across_nodes_are_2_n_minus_1_over_n_of_the_buffer_per_node(layout):
    n_elem = 840  # divisible by every L and n here, so the formula is exact
    S = n_elem * 8
    res = run_in_threads(len(layout), _both, layout, lambda r: np.ones(n_elem))
    nodes = NodeLayout(layout)
    n = nodes.n_nodes
    hier_cross = sum(r[2] for r in res)
    assert hier_cross / n == 2 * (n - 1) / n * S  # per node, whatever the ranks per node
    assert hier_cross == sum(r[3] for r in res) == cross_node_bytes(n_elem, 8, nodes, "hierarchical")
    # the flat ring (ranks node by node): each node's one outgoing boundary link carries 2(N-1)/N * S
    N = len(layout)
    assert cross_node_bytes(n_elem, 8, nodes, "ring") == n * 2 * (N - 1) / N * S > hier_cross


def test_one_rank_per_node_is_the_flat_ring_and_uneven_nodes_are_refused():
    assert cross_node_bytes(840, 8, NodeLayout((0, 1, 2)), "hierarchical") == \
        cross_node_bytes(840, 8, NodeLayout((0, 1, 2)), "ring")
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        run_in_threads(3, lambda c: HierarchicalAllReduce(c, NodeLayout((0, 0, 1))))
    with pytest.raises(ValueError, match="native"):
        run_in_threads(2, lambda c: HierarchicalAllReduce(c)(np.ones(3), native=True))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        run_in_threads(2, lambda c: HierarchicalAllReduce(c)(np.ones(6)[::2]))
    read_only = np.ones(3)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        run_in_threads(2, lambda c: HierarchicalAllReduce(c)(np.ones(3), out=read_only))


def test_threads_are_one_node_and_splits_keep_the_layout():
    assert run_in_threads(3, discover_nodes)[0] == NodeLayout((0, 0, 0))

    def f(c):
        c = NodeTrafficCommunicator(c, NodeLayout((0, 1, 0, 1)))
        sub = c.split(color=c.rank % 2, key=-c.rank)  # reversed order inside each group
        return sub.nodes, [c.nodes.local_rank(r) for r in range(4)], c.nodes.local_size(c.rank)

    out = run_in_threads(4, f)
    assert out[0][0] == NodeLayout((0, 0)) and out[1][0] == NodeLayout((1, 1))
    assert out[0][1] == [0, 0, 1, 1] and out[0][2] == 2
    assert NodeLayout((0, 0, 1)).describe() == "2 nodes with 2+1 ranks"


def test_the_mesh_keeps_tensor_groups_inside_nodes_and_warns_when_they_cannot():
    def topo(layout, dp, tp, pp):
        def f(c):
            t = Topology(NodeTrafficCommunicator(c, NodeLayout(layout)), dp, tp, pp)
            return t.placement_warnings(), {k: t.nodes_spanned(k) for k in ("tp", "dp", "pp")}, t.all_groups("dp")
        return run_in_threads(len(layout), f)[0]

    warnings, spans, dp_groups = topo((0, 0, 1, 1), 2, 2, 1)
    assert warnings == [] and spans == {"tp": 1, "dp": 2, "pp": 1} and dp_groups == [[0, 2], [1, 3]]
    warnings, spans, _ = topo((0, 1, 0, 1), 2, 2, 1)  # ranks dealt round-robin: every tensor group spans 2 nodes
    assert len(warnings) == 2 and "tensor group [0, 1] spans nodes [0, 1]" in warnings[0] and spans["tp"] == 2
    _, spans, _ = topo((0,) * 4 + (1,) * 4, 2, 2, 2)  # tp inside, dp inside the node, stages across
    assert spans == {"tp": 1, "dp": 1, "pp": 2}


def _train(layout, flags):
    def f(c):
        c = NodeTrafficCommunicator(c, NodeLayout(layout))
        args = parse_args(["--model", "tiny", "--dtype", "float64", "--steps", "2", "--eval-batches", "1",
                           "--eval-every", "0", "--progress", "none", "--seed", "5", *flags], c.world_size, quiet=True)
        lines = []
        r = train(args, c, log=lines.append)
        return r["model"] and r["model"].state_dict(), r["topo"], r["strategy"].sync.bytes_sent, lines
    return run_in_threads(len(layout), f)


def test_in_process_dp2_tp2_on_two_fake_nodes_sends_only_gradients_across():
    res = _train((0, 0, 1, 1), ["--dp", "2", "--tp", "2"])
    for _, topo, dp_bytes, _ in res:
        assert topo.tp_comm.cross_node.bytes_sent == 0
        assert topo.dp_comm.cross_node.snapshot()["by_op"]["all_reduce"] == dp_bytes > 0
        world = topo.world.cross_node.snapshot()["by_op"]
        # besides the gradients: set-up, metrics, the few bytes of the agreement on the parameters used and the
        # replica check's digests after the last step
        assert set(world) <= {"all_reduce", "broadcast_params", "metrics", "used_parameters", "replica_check",
                              "validation"}
        assert world["all_reduce"] == dp_bytes
    line = next(line for line in unwrapped("\n".join(res[0][3]))  # cut at 120 columns
                if "dp gradient all-reduce (ring) across nodes per step" in line)
    measured, computed = re.search(r"per step: (\S+ \S+); computed: flat ring (\S+ \S+),", line).groups()
    assert measured == computed, line  # the gradients alone: the ring formula


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
def test_hierarchical_training_equals_ring_training():
    ring = _train((0, 0, 1, 1), ["--dp", "4"])
    hier = _train((0, 0, 1, 1), ["--dp", "4", "--allreduce", "hierarchical"])
    for name, a in ring[0][0].items():
        np.testing.assert_allclose(hier[0][0][name], a, rtol=0, atol=1e-12 * max(1.0, np.abs(a).max()), err_msg=name)
    assert sum(r[2] for r in hier) == sum(r[2] for r in ring)  # same bytes in all, fewer of them across nodes
    cross = [sum(r[1].dp_comm.cross_node.bytes_sent for r in run) for run in (ring, hier)]
    assert cross[1] < cross[0]


def test_hierarchical_is_refused_where_it_would_not_run():
    for bad in (["--zero", "1"], ["--native-comm"]):
        with pytest.raises(UsageError, match="--allreduce hierarchical"):
            parse_args(["--allreduce", "hierarchical", *bad], 2)


@pytest.mark.timeout(60)
def test_hierarchical_is_checked_by_debug_collectives_refuses_strings_and_counts_its_scratch():
    """Its traffic block named no array, so --debug-collectives never compared shapes; strings were summed;
    its receive chunk was not in the memory ledger."""
    from minizero.comm.flight import CollectiveMismatchError, check_collectives
    from minizero.ledger import MemoryLedger, set_ledger

    def body(comm, n_of_rank):
        check_collectives(comm)
        comm = NodeTrafficCommunicator(comm, NodeLayout((0, 0, 1, 1)))
        hier = HierarchicalAllReduce(comm)
        with pytest.raises(ValueError, match=r"x has dtype <U1; a sum over ranks needs numbers"):
            hier(np.array(["a", "b"]))
        ledger = set_ledger(MemoryLedger())
        hier(np.ones(n_of_rank[comm.rank]))
        return ledger.peak["comm_scratch"]

    assert run_in_threads(4, body, [8, 8, 8, 8], timeout=10) == [4 * 8] * 4  # one chunk of 8/L elements
    with pytest.raises(CollectiveMismatchError) as e:
        run_in_threads(4, body, [8, 8, 9, 8], timeout=10)
    assert "all_reduce #" in str(e.value) and "shape (9,)" in str(e.value), str(e.value)


@pytest.mark.parametrize("layout", [(0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2), (0, 0, 0, 0, 1, 1, 1, 1)])
@pytest.mark.parametrize("n_elem", [5, 841, 100_003])  # not divisible by L: chunks of unequal size
def test_cross_node_bytes_formula_equals_the_bytes_sent_on_uneven_buffers(layout, n_elem):
    res = run_in_threads(len(layout), _both, layout, lambda r: np.ones(n_elem))
    nodes = NodeLayout(layout)
    assert sum(r[2] for r in res) == cross_node_bytes(n_elem, 8, nodes, "hierarchical")
