"""The planner's alpha-beta cost: message steps per collective (as minizero's algorithms run them) and per step, times
``Hardware.latency``, beside bytes / bandwidth (memory/estimator/messages.py)."""
import types

import numpy as np
import pytest

from minizero import plan as P
from minizero.comm.all_to_all import all_to_all
from minizero.comm.collectives import all_gather, all_reduce, broadcast, reduce_scatter, shard_range
from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES
from minizero.comm.threads import run_in_threads
from minizero.memory.estimator import Strategy, comm_bytes_per_step
from minizero.memory.estimator.messages import buckets, collective_steps, comm_messages_per_step
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
