"""The planner's alpha-beta cost: message steps per collective (as minizero's algorithms run them) and per step, times
``Hardware.latency`` (``inter_node_latency`` for those crossing nodes), beside bytes / bandwidth
(memory/estimator/messages.py)."""
import types

import numpy as np
import pytest

from minizero import plan as P
from minizero.comm.all_to_all import all_to_all
from minizero.comm.collectives import all_gather, all_reduce, broadcast, reduce_scatter, shard_range
from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES, _real_rank
from minizero.comm.threads import run_in_threads
from minizero.memory.estimator import Strategy, comm_bytes_per_step
from minizero.memory.estimator.messages import (buckets, collective_steps, comm_messages_per_step, inter_node_steps,
                                                message_steps)
from minizero.models import get_model
from minizero.parallel.data_parallel import DataParallel

SMALL, LARGE = 4096, 4 * SMALL_ALLREDUCE_MAX_BYTES  # bytes: recursive doubling, the ring


def test_steps_per_collective_follow_minizeros_algorithms():
    """Before: no such count; step time was bytes / bandwidth only. Ring all-reduce 2(N-1), recursive doubling
    log2 N (+2 folding a non-power of two), reduce-scatter, all-gather and all-to-all N-1, broadcast ceil(log2 N)."""
    assert [collective_steps("all_reduce", LARGE, n) for n in (1, 2, 3, 4, 8)] == [0, 2, 4, 6, 14]
    assert [collective_steps("all_reduce", SMALL, n) for n in (1, 2, 3, 4, 6, 8)] == [0, 1, 3, 2, 4, 3]
    assert [collective_steps(op, SMALL, 8) for op in ("reduce_scatter", "all_gather", "all_to_all")] == [7, 7, 7]
    assert [collective_steps("broadcast", 0, n) for n in (2, 3, 4, 5, 8)] == [1, 2, 2, 3, 3]
    assert collective_steps("send", 1, 2) == 1
    with pytest.raises(ValueError, match="op='gather'; allowed: all_reduce"):
        collective_steps("gather", 1, 2)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op, nbytes", [("all_reduce", SMALL), ("all_reduce", LARGE), ("reduce_scatter", LARGE),
                                        ("all_gather", LARGE), ("broadcast", SMALL), ("all_to_all", 4 * 12)])
def test_steps_equal_the_blocking_messages_of_the_busiest_rank(n, op, nbytes):
    """The count is what the code does: the most send / recv / sendrecv calls any rank makes in one collective."""
    def body(comm):
        calls = [0]
        for name in ("send", "recv", "sendrecv"):
            method = getattr(comm, name)
            setattr(comm, name, lambda *a, _m=method, **k: (calls.__setitem__(0, calls[0] + 1), _m(*a, **k))[1])
        x = np.ones(nbytes // 4, dtype=np.float32)
        if op == "all_gather":
            all_gather(comm, np.ones(shard_range(x.size, n, comm.rank)[1], np.float32), x.size)
        else:
            {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "broadcast": broadcast,
             "all_to_all": all_to_all}[op](comm, x if op != "all_to_all" else x[:n * (x.size // n)])
        return calls[0]
    assert max(run_in_threads(n, body, timeout=30)) == collective_steps(op, nbytes, n)


def test_data_parallel_buckets_are_the_trainers():
    """ZeRO 0 counts one all-reduce per DataParallel bucket, filled in reverse parameter order as the trainer fills
    them: the default model's 1 MiB buckets, 4 of them, the last over 256 KiB (the ring's 2(N-1) steps each)."""
    from minizero.nn import GPT, get_config

    model = GPT(get_config("default"))
    dp = DataParallel(model.parameters(), types.SimpleNamespace(world_size=2), broadcast_params=False)
    shape = get_model("minizero-default")
    assert buckets(shape.tensor_sizes(), 4, 2 ** 20) == [flat.nbytes for flat, _ in dp.buckets]
    st = Strategy(dp=4, precision="fp32")
    assert comm_messages_per_step(shape, st)["dp"] == len(dp.buckets) * 6 == 24


def test_messages_per_step_by_group():
    """ZeRO 1-3 per unit (u): ZeRO-1 one reduce-scatter a step, ZeRO-2 one a micro-batch, ZeRO-3 a reduce-scatter and
    two all-gathers a micro-batch; ZeRO 1-2 one all-gather a unit after the step. tp: 4 all-reduces per layer and
    micro-batch plus the two ends; pp: one send per micro-batch and boundary."""
    m = get_model("minizero-default")
    u = 2 + m.n_layer + 1  # the tied embedding, ln_f and the layers, wpe (zero_overlap.zero_units)
    for zero, dp, after in ((1, u, u), (2, 3 * u, u), (3, 3 * 3 * u, 0)):
        got = comm_messages_per_step(m, Strategy(dp=2, zero=zero, micro_batches=3, precision="fp32"))
        assert (got["dp"], got["dp_after"]) == (dp, after), zero
    llama = get_model("llama3-8b")
    st = Strategy(dp=1, tp=8, pp=2, micro_batches=4)
    got = [comm_messages_per_step(llama, st, 8192, stage=i) for i in (0, 1)]
    layers = llama.n_layer // 2
    assert [g["tp"] for g in got] == [4 * (layers * 4 + 1) * 14] * 2  # 32 MiB activations: the ring's 2(t-1)
    assert [g["pp"] for g in got] == [4, 4]


def test_latency_is_a_term_of_the_step_time_and_a_flag(capsys):
    """The step time adds steps x ``Hardware.latency`` per group; ``--latency-us`` sets it (0: bytes alone)."""
    m = get_model("minizero-default")
    st = Strategy(dp=8, zero=3, micro_batches=16, precision="fp32")
    zero, five = (P.step_time(m, st, P.Hardware(latency=a), 128) for a in (0.0, 5e-6))
    steps = comm_messages_per_step(m, st, 128)
    assert five["dp"] - zero["dp"] == pytest.approx(5e-6 * steps["dp"]) and steps["dp"] == 16 * 3 * 7 * 7
    assert comm_bytes_per_step(m, st, 128)["dp"] / 300e9 < 5e-6 * steps["dp"]  # a small model: latency-bound
    code = P.main(["--model", "default", "--gpus", "8", "--strategy", "dp8 zero3", "--latency-us", "0", "--json"])
    bytes_only = capsys.readouterr().out
    assert code == 0 and P.main(["--model", "default", "--gpus", "8", "--strategy", "dp8 zero3", "--json"]) == 0
    assert '"latency": 5e-06' in capsys.readouterr().out and '"latency": 0.0' in bytes_only
    with pytest.raises(SystemExit):
        P.main(["--model", "default", "--gpus", "8", "--latency-us", "-1"])
    assert "--latency-us: '-1' is out of range; allowed: microseconds in [0, 1e+06]" in capsys.readouterr().err


def test_inter_node_steps_of_a_group_spanning_nodes():
    """Before: every step took one latency. 16 ranks on 2 nodes of 8: NCCL's ring counts 2(nodes-1) = 2 of the
    all-reduce's 30 steps and nodes-1 = 1 of a reduce-scatter's or all-gather's 15; recursive doubling 1 of 4 (the
    exchange at distance 8), the binomial broadcast 1 of 4; every pairwise all-to-all step and a send cross."""
    ops = [("all_reduce", LARGE), ("reduce_scatter", 0), ("all_gather", 0), ("all_reduce", SMALL), ("broadcast", 0),
           ("all_to_all", 0), ("send", 0)]
    assert [collective_steps(op, b, 16) for op, b in ops] == [30, 15, 15, 4, 4, 15, 1]
    assert [inter_node_steps(op, b, 16, 1, 8) for op, b in ops] == [2, 1, 1, 1, 1, 15, 1]
    assert [inter_node_steps(op, b, 16, 1, 16) for op, b in ops] == [0] * 7  # one node
    assert [inter_node_steps(op, b, 16) for op, b in ops] == [0] * 7  # gpus_per_node None: one node
    assert inter_node_steps("all_reduce", SMALL, 32, 1, 8) == 2 and inter_node_steps("all_reduce", LARGE, 32, 1, 8) == 6
    assert inter_node_steps("all_reduce", SMALL, 8, 2, 8) == 1  # stride 2 (tp 2): 4 members a node, 2 nodes
    assert inter_node_steps("all_reduce", SMALL, 4, 8, 8) == 2  # stride 8: a node each, every exchange crosses


@pytest.mark.parametrize("n, stride, per", [(12, 1, 4), (6, 1, 3), (16, 1, 8), (10, 2, 8), (24, 1, 6), (7, 3, 4)])
def test_recursive_doubling_counts_the_exchanges_whose_partner_is_on_another_node(n, stride, per):
    """The closed form equals a walk over minizero's pairs: the fold's (2i, 2i+1), then v with v XOR 2^j of the
    virtual ranks, a step crossing if any pair's members sit on different nodes (member i on GPU i x stride)."""
    node = lambda i: i * stride // per  # noqa: E731
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    fold = [(2 * i, 2 * i + 1) for i in range(rem)]
    steps = [fold] * (2 if rem else 0) + [[(_real_rank(v, rem), _real_rank(v ^ (1 << j), rem)) for v in range(p)]
                                         for j in range(p.bit_length() - 1)]
    want = sum(any(node(a) != node(b) for a, b in pairs) for pairs in steps)
    assert inter_node_steps("all_reduce", SMALL, n, stride, per) == want and len(steps) == collective_steps(
        "all_reduce", SMALL, n)


def test_a_dp_group_spanning_nodes_splits_its_steps_and_prices_them_apart():
    """dp 16 ZeRO-1 on 2 nodes of 8: each unit's reduce-scatter and all-gather after the step take 15 steps, 1 across
    (NCCL's nodes-1); on one node of 16 none; the step time's dp part is 14 x 5 us + 1 x 9.6 us a call more than bytes
    alone (the reduce-scatter hidden behind a long compute, the all-gather after the step exposed)."""
    m = get_model("minizero-default")
    st = Strategy(dp=16, zero=1, precision="fp32")
    u = 2 + m.n_layer + 1
    steps, inter = message_steps(m, st, gpus_per_node=8)
    assert (steps["dp"], inter["dp"], steps["dp_after"], inter["dp_after"]) == (15 * u, u, 15 * u, u)
    assert message_steps(m, st, gpus_per_node=16)[1] == dict.fromkeys(steps, 0)
    slow = dict(flops=1e6, gpus_per_node=8)  # compute hides every reduce-scatter
    alpha, bytes_only = (P.step_time(m, st, P.Hardware(latency=a, inter_node_latency=b, **slow), 128)
                         for a, b in ((5e-6, 9.6e-6), (0.0, 0.0)))
    assert alpha["dp"] - bytes_only["dp"] == pytest.approx(u * (14 * 5e-6 + 9.6e-6), rel=1e-9)
    pp = Strategy(dp=1, tp=8, pp=2, micro_batches=4)  # stage 0 sends 4 activations to node 2: all across
    llama = get_model("llama3-8b")
    assert message_steps(llama, pp, 8192, 0, 8)[1]["pp"] == 4 == message_steps(llama, pp, 8192, 0, 8)[0]["pp"]
    t, t0 = (P.step_time(llama, pp, P.Hardware(latency=5e-6, inter_node_latency=b), 8192) for b in (9.6e-6, 0.0))
    assert t["pp"] - t0["pp"] == pytest.approx(4 * 9.6e-6, rel=1e-9)


def test_inter_node_latency_is_a_flag(capsys):
    """``--inter-node-latency-us`` sets ``Hardware.inter_node_latency`` (default 14, NCCL's network ring step); the
    assumptions line names both latencies; out of range is refused naming the value."""
    args = ["--model", "default", "--gpus", "16", "--strategy", "dp16 zero3"]
    assert P.main(args + ["--json"]) == 0 and '"inter_node_latency": 1.4e-05' in capsys.readouterr().out
    assert P.main(args + ["--inter-node-latency-us", "20", "--json"]) == 0
    assert '"inter_node_latency": 2e-05' in capsys.readouterr().out
    assert P.main(args + ["--inter-node-latency-us", "20"]) == 0
    said = capsys.readouterr().out
    assert "but --inter-node-latency-us as given" in said and "5 us per message step within a node, 20 across" in said
    with pytest.raises(SystemExit):
        P.main(args + ["--inter-node-latency-us", "2e6"])
    err = capsys.readouterr().err
    assert "--inter-node-latency-us: '2e6' is out of range;" in err and "allowed: microseconds in [0, 1e+06]" in err


@pytest.mark.parametrize("n, stride, per", [(12, 1, 4), (10, 3, 8), (7, 5, 8), (40, 3, 16), (5, 8, 8), (9, 16, 8)])
def test_ring_and_broadcast_counts_equal_a_walk_over_the_members_nodes(n, stride, per):
    """Counted without listing each node's first member (the planner calls it per bucket and unit): a ring crosses
    between each pair of nodes its members span, the binomial broadcast at every distance reaching past the first."""
    node = [i * stride // per for i in range(n)]
    cuts = len(set(node)) - 1
    crossing = sum(any(node[i] != node[i + (1 << j)] for i in range(min(1 << j, n - (1 << j))))
                   for j in range(collective_steps("broadcast", 0, n)))
    got = [inter_node_steps(op, LARGE, n, stride, per) for op in ("all_reduce", "reduce_scatter", "broadcast")]
    assert got == [2 * cuts, cuts, crossing]
