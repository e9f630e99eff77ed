"""The communication layer's contracts that a small slip broke unnoticed: the mean's division point, argument
checks at their edges, a non-blocking ring's traced bytes and peers, cross-node bytes, MPI messages at the
one-message boundary. From a mutation audit of minizero/comm: each test fails on a planted bug that the other
tests let through (two on real faults, fixed: the traced bytes of a small ring all-reduce, native cross-node bytes)."""
import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.comm.collectives import divide_before_sum, mean_scale_


# --------------------------------------------------------------------------- the mean's division point
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_mean_divides_float16_before_the_sum_and_wider_floats_after_it(dtype):
    """float16 divides each addend (x / N before, nothing after); float32/64 scale the sum (x * (1/N) after,
    nothing before): bitwise, so a swapped rule or a wrong width threshold shows."""
    x = np.random.default_rng(0).standard_normal(101).astype(dtype) * 3
    before, after = mean_scale_(x.copy(), 3, before_sum=True), mean_scale_(x.copy(), 3, before_sum=False)
    if dtype == "float16":
        assert divide_before_sum(dtype)
        assert np.array_equal(before, x / np.float16(3)) and np.array_equal(after, x)
    else:
        assert not divide_before_sum(dtype)
        assert np.array_equal(before, x) and np.array_equal(after, x * x.dtype.type(1 / 3))
    assert np.array_equal(mean_scale_(x.copy(), 3, before_sum=dtype == "float16", predivided=True), x)
    assert np.array_equal(mean_scale_(x.copy(), 1, before_sum=dtype == "float16"), x)


def test_a_float16_mean_of_large_gradients_does_not_overflow():
    """Four ranks' 30000s: their sum (120000) is past float16's 65504, their mean (30000) is not."""
    def body(comm):
        from minizero.comm import all_reduce
        g = np.full(8, 30000, dtype=np.float16)
        mean_scale_(g, comm.world_size, before_sum=True)
        total = all_reduce(comm, g)
        return mean_scale_(total, comm.world_size, before_sum=False)

    for got in run_in_threads(4, body):
        assert np.array_equal(got, np.full(8, 30000, dtype=np.float16))


# --------------------------------------------------------------------------- argument checks, before any message
@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", ["ring", "native", "quantized"])
def test_a_shard_one_element_too_long_is_refused_by_name_before_any_message(call):
    """n = 10 over 2 ranks: shards of 5. A shard of 6 is refused by name as one of 4 is (tests/test_collectives.py
    tries only a short one; a one-sided size check would let a long one fail later, in a NumPy broadcast)."""
    from minizero.comm import all_gather
    from minizero.comm.quantized import quantized_all_gather

    def body(comm):
        shard = np.arange(6.0)
        try:
            if call == "quantized":
                quantized_all_gather(comm, shard, 10)
            else:
                all_gather(comm, shard, 10, native=call == "native")
        except ValueError as e:
            return str(e), comm.traffic.bytes_sent
        return None, comm.traffic.bytes_sent

    for r, (said, sent) in enumerate(run_in_threads(2, body, timeout=10)):
        assert said == f"rank {r}: shard has 6 elements, but shard_range(n=10, world_size=2, rank={r}) gives 5", said
        assert sent == 0


@pytest.mark.timeout(30)
def test_threads_native_all_gather_refuses_shards_of_two_dtypes_on_every_rank():
    """Shards of the right sizes but float32 on rank 0, float64 on rank 1: refused (MPI's native all-gather
    compares dtypes too), not concatenated into a promoted float64 array."""
    def body(comm):
        try:
            comm.native_allgather(np.ones(2, np.float32 if comm.rank == 0 else np.float64), 4)
        except ValueError as e:
            return str(e)
        return None

    for said in run_in_threads(2, body, timeout=10):
        assert said is not None and "do not make one array of n=4 elements" in said, said


@pytest.mark.timeout(30)
def test_native_allreduce_called_directly_refuses_an_out_of_another_dtype_or_shape():
    """``comm.native_allreduce(x, out)`` checks ``out`` itself (``all_reduce`` is not the only caller): a float32
    ``out`` for float64 ``x`` is refused before any message, not filled with rounded sums."""
    def body(comm):
        said = []
        for out in (np.empty(4, np.float32), np.empty(5)):
            try:
                comm.native_allreduce(np.ones(4), out=out)
            except ValueError as e:
                said.append(str(e))
        return said, comm.traffic.bytes_sent

    for said, sent in run_in_threads(2, body, timeout=10):
        assert said == ["out has shape (4,) float32, x has (4,) float64; they must match",
                        "out has shape (5,) float64, x has (4,) float64; they must match"] and sent == 0, said


@pytest.mark.timeout(30)
def test_tags_end_at_32767_the_least_mpi_tag_ub_allows():
    """32767 is the largest tag every MPI accepts: taken as an int or a NumPy int; 32768 is refused, either way."""
    def body(comm):
        comm.sendrecv(np.ones(1), 0, np.empty(1), 0, tag=32767)
        comm.sendrecv(np.ones(1), 0, np.empty(1), 0, tag=np.int64(32767))
        said = []
        for tag in (32768, np.int64(32768)):
            try:
                comm.send(np.ones(1), 0, tag=tag)
            except ValueError as e:
                said.append(str(e))
        return said

    (said,) = run_in_threads(1, body)
    assert said[0] == "tag=32768; allowed: an int in [0, 32767]" and len(said) == 2, said
    assert "32768" in said[1] and said[1].endswith("; allowed: an int in [0, 32767]"), said  # NumPy 2: np.int64(...)


@pytest.mark.timeout(30)
def test_a_bool_tag_is_refused_as_a_bool_rank_is():
    """tag=True was taken as tag 1 (bool is an int): refused before anything is posted, as source=True is."""
    def body(comm):
        said = []
        for call in (lambda: comm.irecv(np.empty(1), 0, tag=True), lambda: comm.isend(np.ones(1), 0, tag=False),
                     lambda: comm.send(np.ones(1), 0, tag=True)):
            try:
                call()
            except ValueError as e:
                said.append(str(e))
        return said

    (said,) = run_in_threads(1, body)
    assert said == ["tag=True; allowed: an int in [0, 32767]", "tag=False; allowed: an int in [0, 32767]",
                    "tag=True; allowed: an int in [0, 32767]"], said


# --------------------------------------------------------------------------- non-blocking rings
@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_a_traced_nonblocking_ring_reports_the_bytes_it_sent_and_its_two_neighbours(op):
    """n = 10 float64 over 3 ranks (chunks 4, 3, 3): the timeline event's ``bytes`` is what the ring sent, to the
    byte (before: a small all-reduce's event said 80, the bytes of recursive doubling, which it does not run);
    ``peers`` are rank-1 and rank+1."""
    from minizero import trace
    from minizero.comm.nonblocking import RingCollective

    # elements each rank sends: n minus its own chunk; n minus rank+1's; the two together
    elements = {"reduce_scatter": [6, 7, 7], "all_gather": [7, 7, 6], "all_reduce": [13, 14, 13]}[op]

    def body(comm):
        comm.traffic.tracer = trace.Tracer(comm.rank)
        RingCollective(comm, np.arange(10.0) + comm.rank, op, tag=70).start().wait()
        return comm.traffic.tracer.events, comm.traffic.bytes_sent

    for r, (events, sent) in enumerate(run_in_threads(3, body, timeout=10)):
        (event,) = [e for e in events if e["name"] == op]
        assert event["args"]["bytes"] == sent == 8 * elements[r]
        assert event["args"]["peers"] == [(r - 1) % 3, (r + 1) % 3]


@pytest.mark.timeout(30)
def test_a_nonblocking_ring_waiting_for_its_left_neighbour_names_it_on_three_ranks():
    """Rank 0 of 3 receives from rank 2 (its left) and sends to rank 1, whose copy is taken at once: it waits for
    rank 2, and the timeout says so (on 2 ranks left and right are one rank)."""
    import threading

    from minizero.comm import CommTimeoutError
    from minizero.comm.nonblocking import RingCollective

    ended = threading.Event()

    def body(comm):
        if comm.rank == 0:
            try:
                RingCollective(comm, np.ones(6), "all_reduce", tag=77, name="all_reduce test").start().wait()
            finally:
                ended.set()
        else:  # still there, sending nothing, until rank 0's wait ends (a returned rank fails the wait at once)
            ended.wait(120)

    with pytest.raises(CommTimeoutError, match=r"^\[rank 0/3\] rank 0: all_reduce test \(tag 77\) waited 0\.5 s for "
                                               r"rank 2 of a communicator of 3"):
        run_in_threads(3, body, timeout=0.5)


@pytest.mark.timeout(30)
def test_a_nonblocking_ring_started_twice_is_refused():
    from minizero.comm.nonblocking import RingCollective

    def body(comm):
        coll = RingCollective(comm, np.ones(4), "all_gather", tag=71, name="gather twice").start()
        coll.wait()
        with pytest.raises(RuntimeError, match="^gather twice was already started$"):
            coll.start()
        return coll.buf

    assert [b.tolist() for b in run_in_threads(2, body, timeout=10)] == [[1.0] * 4] * 2


# --------------------------------------------------------------------------- groups and nodes
def test_threads_a_split_group_keeps_its_parents_timeout():
    """A group's waits time out as the world's do (``run_in_threads(timeout=...)``), not after the 60 s default."""
    assert run_in_threads(2, lambda comm: comm.split(comm.rank).split(0).timeout, timeout=7.5) == [7.5, 7.5]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 1, 0, 1, 0)])
@pytest.mark.parametrize("n", [12, 40003])  # recursive doubling and the ring for the all-reduce
def test_native_collectives_count_the_bytes_across_nodes_that_minizeros_own_send(layout, n):
    """A native collective's cross-node bytes are those of minizero's algorithm, per rank (as its ledger bytes
    are): before, a broadcast root with children on both nodes counted all its bytes as crossing, and a small
    all-reduce counted its recursive-doubling bytes by the ring's right neighbour."""
    from minizero.comm import all_gather, all_reduce, broadcast, reduce_scatter, shard_range
    from minizero.comm.nodes import NodeLayout, NodeTrafficCommunicator

    def body(comm):
        comm = NodeTrafficCommunicator(comm, NodeLayout(layout))
        size = shard_range(n, comm.world_size, comm.rank)[1]
        crossed = {}
        for native in (False, True):
            for op, call in [("all_reduce", lambda: all_reduce(comm, np.ones(n), native=native)),
                             ("reduce_scatter", lambda: reduce_scatter(comm, np.ones(n), native=native)),
                             ("all_gather", lambda: all_gather(comm, np.ones(size), n, native=native)),
                             ("broadcast", lambda: broadcast(comm, np.ones(n), root=2, native=native))]:
                before = comm.cross_node.snapshot()["by_op"].get(op, 0)
                call()
                crossed[op, native] = comm.cross_node.snapshot()["by_op"].get(op, 0) - before
        return crossed

    got = run_in_threads(len(layout), body, timeout=30)
    for crossed in got:
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
            assert crossed[op, True] == crossed[op, False], (op, crossed)
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):  # not two zeros agreeing
        assert sum(crossed[op, False] for crossed in got) > 0, (op, got)


# --------------------------------------------------------------------------- MPI messages at their edges
#: under mpiexec -n 2: rank 0 sends, rank 1 receives; rank 1 prints what it got as JSON
MPI_EDGES = """import json
import numpy as np
from minizero.comm import world
from minizero.comm.mpi import PACK_MAX_BYTES
from minizero.comm.nonblocking import wait_all
comm = world()
comm.timeout = 20.0
exact = np.arange(PACK_MAX_BYTES // 4, dtype=np.float32)  # header + payload in one message, the largest such
got = {"split_timeout": comm.split(0).timeout}  # a group waits as long as its parent
def attempt(key, fn):
    try:
        got[key] = fn()
    except ValueError as e:
        got[key] = str(e)
if comm.rank == 0:
    comm.send(exact, 1, tag=5)
    comm.isend(exact + 1, 1, tag=6).wait()
    comm.sendrecv(exact + 2, 1, np.empty_like(exact), 1, tag=7)
    comm.send(np.zeros((1, 2, 3, 4, 5), np.float32), 1, tag=8)  # five dimensions: the most a header holds
    comm.send(np.zeros((2, 3), np.float32), 1, tag=9)
    comm.isend(exact[:3] * 3, 1, tag=10).wait()
    comm.isend(np.append(exact, np.float32(1)) * 4, 1, tag=11).wait()  # header and payload apart
else:
    buf = np.empty_like(exact)
    attempt("send", lambda: bool(np.array_equal(comm.recv(buf, 0, tag=5), exact)))
    req = comm.irecv(buf, 0, tag=6)
    attempt("isend", lambda: (wait_all(comm, [req], "irecv"), bool(np.array_equal(buf, exact + 1)))[1])
    attempt("sendrecv", lambda: bool(np.array_equal(comm.sendrecv(exact, 0, buf, 0, tag=7), exact + 2)))
    attempt("five_dims", lambda: comm.recv(np.empty((5, 4, 3, 2, 1), np.float32), 0, tag=8).shape)
    attempt("two_dims", lambda: comm.recv(np.empty((3, 2), np.float32), 0, tag=9).shape)
    small, large = np.empty(3, np.float32), np.empty(exact.size + 1, np.float32)  # irecv's own wait(), both kinds
    attempt("irecv_wait", lambda: (comm.irecv(small, 0, tag=10).wait(), comm.irecv(large, 0, tag=11).wait(),
                                   bool(np.array_equal(small, exact[:3] * 3)),
                                   bool(np.array_equal(large, np.append(exact, np.float32(1)) * 4)))[2:])
    print(json.dumps(got))
"""


@pytest.mark.timeout(120)
def test_mpi_a_message_of_exactly_pack_max_bytes_and_a_transposed_five_dim_shape(mpiexec):
    """The one-message / two-message boundary is PACK_MAX_BYTES on both sides (``<=``: one message): a message of
    exactly that size arrives whole by send, isend/irecv and sendrecv. The header holds up to five dimensions: an
    equal-sized buffer of another shape is refused there as with two (ThreadCommunicator's rule). A split group
    keeps its parent's timeout."""
    import json
    import subprocess
    import sys

    from tests.conftest import mpi_env

    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", MPI_EDGES], env=mpi_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got["send"] is True and got["isend"] is True and got["sendrecv"] is True, got
    assert got["irecv_wait"] == [True, True], got
    assert got["split_timeout"] == 20.0, got
    for key, sent, room in [("five_dims", "(1, 2, 3, 4, 5)", "(5, 4, 3, 2, 1)"), ("two_dims", "(2, 3)", "(3, 2)")]:
        assert f"is {sent} float32, the receive buffer is {room} float32" in got[key], got
