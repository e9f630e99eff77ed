"""Collectives and communicators: equal to NumPy references, with the bytes the papers say.

Most tests run ranks as threads (``run_in_threads``); ``test_mpi_*`` launches real
ranks with ``mpiexec -n N`` on tests/mpi_scripts/collectives_check.py and compares
the result files each rank writes.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import REPO_ROOT, mpi_env
from minizero import backend
from minizero.comm import (
    GroupFailedError,
    TrafficLedger,
    all_gather,
    all_reduce,
    broadcast,
    bytes_sent,
    reduce_scatter,
    register_thread_start_hook,
    run_in_threads,
    shard_range,
)
from minizero.comm.threads import _THREAD_START_HOOKS

WORLD_SIZES = [1, 2, 3, 4, 5]


def lengths(world_size):
    return sorted({1, world_size - 1, world_size + 1, 1000, 2**16 + 3})


CASES = [(N, n) for N in WORLD_SIZES for n in lengths(N)]


# --------------------------------------------------------------------------- shard_range
@given(st.integers(0, 200), st.integers(1, 17))
def test_shard_range_matches_array_split(n, world_size):
    pieces = np.array_split(np.arange(n), world_size)
    for rank, piece in enumerate(pieces):
        offset, size = shard_range(n, world_size, rank)
        assert size == len(piece)
        assert np.array_equal(np.arange(offset, offset + size), piece)


@pytest.mark.parametrize("args", [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_shard_range_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        shard_range(*args)


@pytest.mark.parametrize("call, said", [
    (lambda: bytes_sent("broadcast", 10, 4, 2, 0, root=5), "root=5 is not a rank; allowed: an int in 0..1"),
    (lambda: bytes_sent("all_reduce", 10, 4, 2, 7), "rank=7 is not a rank; allowed: an int in 0..1"),
    (lambda: bytes_sent("all_gather", -3, 4, 2, 0), "n=-3; allowed: an int >= 0"),
    (lambda: bytes_sent("reduce_scatter", 10, 4, 0, 0), "world_size=0; allowed: an int >= 1"),
    (lambda: shard_range(10.5, 2, 0), "n=10.5; allowed: an int >= 0")])
def test_bytes_sent_and_shard_range_name_a_bad_argument(call, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        call()
    assert bytes_sent("broadcast", 10, 4, 2, 0, root=np.int64(1)) == 0 and shard_range(np.int64(5), 2, 1) == (3, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("native", [False, True])
def test_all_gather_names_a_float_n_before_any_message(native):
    def body(comm):
        all_gather(comm, np.ones(2), n=4.0, native=native)

    with pytest.raises(ValueError, match=re.escape("n=4.0; allowed: an int >= 0")):
        run_in_threads(2, body, timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call, said", [
    (lambda c: broadcast(c, np.zeros(3), root=True), "root=True"),
    (lambda c: broadcast(c, np.zeros(3), root=False, native=True), "root=False"),
    (lambda c: c.native_bcast(np.zeros(3), root=True), "root=True"),
    (lambda c: c.send(np.zeros(2), True), "dest=True"), (lambda c: c.recv(np.zeros(2), False), "source=False"),
    (lambda c: c.sendrecv(np.zeros(2), 1 - c.rank, np.zeros(2), True), "source=True"),
    (lambda c: c.isend(np.zeros(2), True), "dest=True")])
def test_a_bool_root_or_peer_is_refused_before_any_message(call, said):
    """Before: True was rank 1 and False rank 0 (bool is an int): broadcast(x, root=True) broadcast rank 1's x."""
    _raises_in_rank(2, call, ValueError, re.escape(f"{said} is a bool, not a rank; allowed: an int in 0..1"))
    with pytest.raises(ValueError, match="root=True is a bool, not a rank"):
        bytes_sent("broadcast", 10, 4, 2, 0, root=True)


# --------------------------------------------------------------------------- collectives on threads
def _all_collectives(comm, n):
    """Every collective, hand-written and native, on distinct float64 data per rank."""
    N, r = comm.world_size, comm.rank
    x = np.random.default_rng([r, n]).standard_normal(n)
    xd = backend.to_device(x)  # arrays of the active module (strict for the NCCL tests); results on the host
    off, size = shard_range(n, N, r)
    results, sent = {}, {}
    for impl, native in [("ring", False), ("native", True)]:
        calls = {
            "all_reduce": lambda: all_reduce(comm, xd, native=native),
            "reduce_scatter": lambda: reduce_scatter(comm, xd, native=native),
            "all_gather": lambda: all_gather(comm, xd[off:off + size].copy(), n, native=native),
            "broadcast": lambda: broadcast(comm, xd.copy(), root=N - 1, native=native),
        }
        for op, call in calls.items():
            comm.traffic.reset()
            results[op, impl] = backend.to_host(call())
            sent[op, impl] = comm.traffic.snapshot()
    return x, results, sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,n", CASES)
def test_collectives_match_numpy(world_size, n):
    out = run_in_threads(world_size, _all_collectives, n)
    xs = np.stack([x for x, _, _ in out])
    total = xs.sum(axis=0)
    gathered = np.concatenate([xs[q][slice(*_span(n, world_size, q))] for q in range(world_size)])
    for r, (_, results, _) in enumerate(out):
        off, size = shard_range(n, world_size, r)
        for impl in ["ring", "native"]:
            np.testing.assert_allclose(results["all_reduce", impl], total, rtol=0, atol=1e-12)
            np.testing.assert_allclose(results["reduce_scatter", impl], total[off:off + size], rtol=0, atol=1e-12)
            assert np.array_equal(results["all_gather", impl], gathered)
            assert np.array_equal(results["broadcast", impl], xs[world_size - 1])
        # every rank ends with bit-identical all-reduce results (each chunk summed once)
        assert np.array_equal(results["all_reduce", "ring"], out[0][1]["all_reduce", "ring"])
        assert results["reduce_scatter", "ring"].shape == (size,)


def _span(n, world_size, rank):
    off, size = shard_range(n, world_size, rank)
    return off, off + size


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,n", CASES)
def test_bytes_sent_per_rank(world_size, n):
    """Ring: all-reduce sends 2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N."""
    out = run_in_threads(world_size, _all_collectives, n)
    nbytes, chunk_bytes = n * 8, shard_range(n, world_size, 0)[1] * 8
    ratio = {"all_reduce": 2 * (world_size - 1) / world_size,
             "reduce_scatter": (world_size - 1) / world_size,
             "all_gather": (world_size - 1) / world_size}
    for r, (_, _, sent) in enumerate(out):
        for op, share in ratio.items():
            got = sent[op, "ring"]["bytes_sent"]
            if n % world_size == 0:
                assert got == share * nbytes
            else:
                assert abs(got - share * nbytes) <= chunk_bytes
            assert got == bytes_sent(op, n, 8, world_size, r)
            assert sent[op, "ring"]["by_op"] == {op: got}
            assert sent[op, "ring"]["calls"] == {op: 1}
            assert sent[op, "native"] == sent[op, "ring"]  # native records the same estimate
        # binomial tree: n bytes per child
        assert sent["broadcast", "ring"]["bytes_sent"] == bytes_sent("broadcast", n, 8, world_size, r,
                                                                     root=world_size - 1)
    total_bcast = sum(s["broadcast", "ring"]["bytes_sent"] for _, _, s in out)
    assert total_bcast == (world_size - 1) * nbytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_zero_length(world_size):
    def body(comm):
        x = np.zeros(0)
        return (all_reduce(comm, x).shape, reduce_scatter(comm, x).shape,
                all_gather(comm, x, 0).shape, broadcast(comm, x).shape, comm.traffic.bytes_sent)

    assert run_in_threads(world_size, body) == [((0,), (0,), (0,), (0,), 0)] * world_size


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype,atol", [("float16", 3e-2), ("float32", 1e-5), ("float64", 1e-13)])
def test_dtypes_reduce_in_input_dtype(dtype, atol):
    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal(1001).astype(dtype)
        return x, all_reduce(comm, x), all_reduce(comm, x, native=True), reduce_scatter(comm, x)

    out = run_in_threads(4, body)
    total = np.stack([x.astype(np.float64) for x, *_ in out]).sum(axis=0)
    for r, (x, ring, native, shard) in enumerate(out):
        assert ring.dtype == native.dtype == shard.dtype == np.dtype(dtype)
        np.testing.assert_allclose(ring, total, rtol=0, atol=atol)
        np.testing.assert_allclose(native, total, rtol=0, atol=atol)
        assert np.array_equal(shard, ring[slice(*_span(1001, 4, r))])


@pytest.mark.timeout(30)
def test_all_reduce_shapes_out_and_in_place():
    def body(comm):
        x = np.full((3, 4, 5), float(comm.rank + 1))
        out = np.empty_like(x)
        a = all_reduce(comm, x, out=out)
        y = x.copy()
        b = all_reduce(comm, y, out=y)  # in place
        gathered = all_gather(comm, reduce_scatter(comm, x))  # n=None: 60 / 3 equal shards
        return a is out, b is y, a, y, gathered, x

    for is_out, is_y, a, y, gathered, x in run_in_threads(3, body):
        assert is_out and is_y
        assert np.array_equal(a, np.full((3, 4, 5), 6.0)) and np.array_equal(y, a)
        assert np.array_equal(gathered, np.full(60, 6.0))
        assert x.shape == (3, 4, 5)  # the input is untouched


@pytest.mark.timeout(30)
@pytest.mark.parametrize("native", [False, True])
def test_all_gather_into_out_equals_a_new_array_and_may_hold_the_shard(native):
    """``out=`` (PyTorch's all_gather_into_tensor): the same bits as a new array, also when ``out`` already
    holds this rank's shard (ZeRO-1/2's flat buffer); a wrong ``out`` is refused on every rank before any message."""
    n = 1001

    def body(comm):
        lo, hi = _span(n, comm.world_size, comm.rank)
        flat = np.full(n, np.nan)
        flat[lo:hi] = np.random.default_rng(comm.rank).standard_normal(hi - lo)
        shard = flat[lo:hi]
        new = all_gather(comm, shard.copy(), n, native=native)
        into = all_gather(comm, shard.copy(), n, native=native, out=np.full(n, np.nan))
        same = all_gather(comm, shard, n, native=native, out=flat)  # the shard is a view of out
        errors = []
        for bad in (np.empty(n + 1), np.empty(n, np.float32), np.empty((n, 2))[:, 0]):
            try:
                all_gather(comm, shard, n, native=native, out=bad)
            except ValueError as e:
                errors.append(str(e))
        ro = np.empty(n)
        ro.flags.writeable = False
        try:
            all_gather(comm, shard, n, out=ro)
        except ValueError as e:
            errors.append(str(e))
        return new, into, same is flat, flat, errors, comm.traffic.calls.get("all_gather", 0)

    results = run_in_threads(3, body, timeout=20)
    for new, into, is_flat, flat, errors, calls in results:
        assert np.array_equal(new, results[0][0]) and np.array_equal(into, new) and np.array_equal(flat, new)
        assert is_flat and not np.isnan(new).any()
        assert len(errors) == 4 and all("out" in e for e in errors), errors
        assert "(1002,) float64" in errors[0] and "float32" in errors[1] and "C-contiguous" in errors[2]
        assert "read-only" in errors[3]
        assert calls == 3  # the three gathers; the refusals posted nothing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_into_out_reads_x_bitwise_as_in_place(world_size, algorithm):
    """Both algorithms write every element of ``out`` and read ``x`` itself (no copy first): the in-place
    bits, x intact (3 ranks: recursive doubling's fold)."""
    from minizero.comm.recursive_doubling import SMALL_ALLREDUCE_MAX_BYTES, all_reduce_algorithm

    n = 1001 if algorithm == "recursive_doubling" else SMALL_ALLREDUCE_MAX_BYTES // 8 + 1001  # float64
    assert all_reduce_algorithm(n * 8, world_size) == algorithm

    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal(n)
        kept = x.copy()
        out = all_reduce(comm, x, out=np.full(n, np.nan))
        in_place = all_reduce(comm, x.copy(), out=None)
        y = x.copy()
        all_reduce(comm, y, out=y)
        z = x.copy()
        all_reduce(comm, z, out=z[...])  # another object over the same memory
        shifted = np.concatenate([x, [0.0]])  # out overlaps x one element over: read x before out is written
        all_reduce(comm, shifted[1:], out=shifted[:-1])
        return np.array_equal(x, kept), out, in_place, y, z, shifted[:-1]

    results = run_in_threads(world_size, body, timeout=30)
    total = sum(np.random.default_rng(k).standard_normal(n) for k in range(world_size))
    for untouched, out, in_place, y, z, shifted in results:
        assert untouched
        assert np.array_equal(out, y) and np.array_equal(in_place, y) and np.array_equal(z, y)
        assert np.array_equal(out, results[0][1])  # the same bits on every rank
        np.testing.assert_allclose(shifted, np.concatenate([total[1:], [0.0]]), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- argument errors
def _raises_in_rank(world_size, fn, exc_type, match):
    """Run ``fn(comm)``: the caller sees ``exc_type`` with ``match`` and the rank in its message."""
    with pytest.raises(exc_type, match=match) as info:
        run_in_threads(world_size, fn, timeout=10)
    assert "[rank" in str(info.value)


@pytest.mark.timeout(60)
def test_clear_errors():
    strided = np.zeros(10)[::2]
    _raises_in_rank(2, lambda c: all_reduce(c, strided), ValueError, "C-contiguous")
    _raises_in_rank(2, lambda c: reduce_scatter(c, strided), ValueError, "C-contiguous")
    _raises_in_rank(2, lambda c: all_gather(c, np.zeros(3), n=10), ValueError, "shard has 3 elements")
    _raises_in_rank(2, lambda c: broadcast(c, np.zeros(3), root=2), ValueError, "root=2")
    _raises_in_rank(2, lambda c: all_reduce(c, np.zeros(3), out=np.zeros(4)), ValueError, "must match")
    _raises_in_rank(2, lambda c: c.send(strided, 1), ValueError, "C-contiguous")
    _raises_in_rank(2, lambda c: c.send(np.zeros(2), 5), ValueError, "dest=5")
    _raises_in_rank(2, lambda c: c.send(np.zeros(2), 0, tag=-1), ValueError, "tag=-1")
    _raises_in_rank(2, lambda c: c.send([1.0], 0), TypeError, "must be an array")
    _raises_in_rank(2, lambda c: c.recv(np.zeros(2), np.int64(5)), ValueError, "source=.*5.* is not a rank")  # NumPy ints are checked too

    def read_only(c):
        buf = np.zeros(2)
        buf.flags.writeable = False
        c.recv(buf, 1 - c.rank)
    _raises_in_rank(2, read_only, ValueError, "recv buffer is read-only")

    _raises_in_rank(2, lambda c: all_reduce(c, np.array(["a", "b"])), ValueError, "dtype <U1; a sum over ranks")
    _raises_in_rank(2, lambda c: reduce_scatter(c, np.array([None, 1])), ValueError, "dtype object; a sum")
    _raises_in_rank(2, lambda c: c.send(np.array([None, 1]), 1 - c.rank), TypeError, "holds references")

    def read_only_out(c):
        out = np.zeros(2)
        out.flags.writeable = False
        all_reduce(c, np.ones(2), out=out)
    _raises_in_rank(2, read_only_out, ValueError, "out is read-only")

    def read_only_root(c):  # the root of a broadcast only reads its array
        x = np.arange(3.0) if c.rank == 0 else np.zeros(3)
        x.flags.writeable = c.rank != 0
        return c.native_bcast(x, root=0).copy()
    assert all(np.array_equal(got, np.arange(3.0)) for got in run_in_threads(2, read_only_root, timeout=10))
    _raises_in_rank(2, lambda c: c.native_allreduce(np.zeros(2 + c.rank)), ValueError, "different arrays")


# --------------------------------------------------------------------------- point to point, split
@pytest.mark.timeout(30)
def test_send_recv_sendrecv():
    def body(comm):
        N, r = comm.world_size, comm.rank
        got = np.empty(3)
        if r == 0:
            comm.send(np.arange(3.0), 1, tag=7)
        elif r == 1:
            comm.recv(got, 0, tag=7)
        ring = comm.sendrecv(np.full(2, float(r)), (r + 1) % N, np.empty(2), (r - 1) % N)
        return got if r == 1 else None, ring, comm.traffic.snapshot()

    out = run_in_threads(3, body)
    assert np.array_equal(out[1][0], np.arange(3.0))
    for r, (_, ring, traffic) in enumerate(out):
        assert np.array_equal(ring, np.full(2, float((r - 1) % 3)))
        assert traffic["by_op"] == {"p2p": 16 + (24 if r == 0 else 0)}
        assert traffic["calls"] == {"p2p": 1 + (r == 0)}


@pytest.mark.timeout(30)
def test_recv_shape_mismatch_raises():
    def body(comm):
        if comm.rank == 0:
            comm.send(np.zeros(3), 1)
        else:
            comm.recv(np.empty(4), 0)

    _raises_in_rank(2, body, ValueError, r"\(3,\) float64")


@pytest.mark.timeout(30)
def test_split_into_two_groups():
    def body(comm):
        sub = comm.split(color=comm.rank % 2, key=-comm.rank)  # reverse rank order inside
        x = np.full(6, float(comm.rank))
        total = all_reduce(sub, x)
        shard = reduce_scatter(sub, x)
        sub.barrier()
        return sub.rank, sub.world_size, total, shard, sub.traffic.bytes_sent, comm.traffic.bytes_sent

    out = run_in_threads(5, body)
    evens, odds = [0, 2, 4], [1, 3]
    for r, (sub_rank, sub_size, total, shard, sub_bytes, world_bytes) in enumerate(out):
        members = evens if r % 2 == 0 else odds
        assert sub_size == len(members)
        assert sub_rank == sorted(members, reverse=True).index(r)
        assert np.array_equal(total, np.full(6, float(sum(members))))
        assert np.array_equal(shard, np.full(shard_range(6, sub_size, sub_rank)[1], float(sum(members))))
        assert sub_bytes == world_bytes > 0  # the parent ledger sees the sub-communicator's bytes


# --------------------------------------------------------------------------- failure, timeout, hooks
@pytest.mark.timeout(90)
def test_failing_rank_releases_blocked_ranks_promptly():
    def body(comm):
        if comm.rank == 2:
            time.sleep(0.1)
            raise ValueError("boom")
        if comm.rank == 1:
            comm.barrier()  # waits on rank 2 forever
        comm.recv(np.empty(1), 2)  # waits on rank 2 forever

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"\[rank 2/3\] boom"):
        run_in_threads(3, body, timeout=60)
    assert time.monotonic() - start < 30  # not the 60 s timeout (however loaded the machine)


@pytest.mark.timeout(30)
def test_blocked_rank_gets_group_failed_error():
    seen = []

    def body(comm):
        if comm.rank == 0:
            raise KeyError("first")
        try:
            comm.recv(np.empty(1), 0)
        except GroupFailedError as exc:
            seen.append(str(exc))
            raise

    with pytest.raises(KeyError, match="first"):
        run_in_threads(2, body)
    assert seen and "thread rank 0 raised KeyError" in seen[0]


def _rank_0_waits(wait):
    """A body whose rank 0 runs ``wait(comm)`` while rank 1 stays until that ends, sending nothing (a returned rank
    would fail the wait at once; a fixed sleep of 1 s against a 0.3 s timeout could end first on a loaded machine)."""
    ended = threading.Event()

    def body(comm):
        if comm.rank == 0:
            try:
                wait(comm)
            finally:
                ended.set()
        else:
            ended.wait(120)
    return body


@pytest.mark.timeout(90)
def test_recv_timeout_names_ranks_and_tag():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0: recv \(tag 5\) waited 0\.3 s for rank 1 "):
        run_in_threads(2, _rank_0_waits(lambda comm: comm.recv(np.empty(1), 1, tag=5)), timeout=0.3)
    assert time.monotonic() - start < 30  # the 0.3 s timeout fired (rank 1 stays for 120 s)


@pytest.mark.timeout(30)
def test_abort_stops_the_group():
    def body(comm):
        if comm.rank == 1:
            comm.abort(3)
        comm.barrier()

    _raises_in_rank(2, body, RuntimeError, r"abort\(errorcode=3\)")


@pytest.mark.timeout(30)
def test_thread_start_hooks_run_in_each_rank_thread():
    local = threading.local()
    hook = register_thread_start_hook(lambda: setattr(local, "name", threading.current_thread().name))
    try:
        names = run_in_threads(3, lambda comm: local.name)
    finally:
        _THREAD_START_HOOKS.remove(hook)
    assert names == [f"minizero-rank-{r}" for r in range(3)]


def test_traffic_ledger_labels_and_parent():
    parent = TrafficLedger()
    child = TrafficLedger(parent=parent)
    parent.record(5)
    with parent.op("outer"):
        with parent.op("inner"):
            parent.record(7)
        parent.record(1)
        child.record(2)  # no label of its own: the parent's label applies
    with child.op("all_reduce"):
        child.record(10)
    # the outermost open label wins: "inner" is counted as a call but its bytes belong to "outer"
    assert parent.snapshot() == {"bytes_sent": 25, "by_op": {"p2p": 5, "outer": 10, "inner": 0, "all_reduce": 10},
                                 "calls": {"p2p": 1, "outer": 1, "inner": 1, "all_reduce": 1}}
    assert child.snapshot() == {"bytes_sent": 12, "by_op": {"outer": 2, "all_reduce": 10},
                                "calls": {"outer": 0, "all_reduce": 1}}
    json.dumps(parent.snapshot())
    child.reset()
    assert child.bytes_sent == 0 and parent.bytes_sent == 25
    with pytest.raises(ValueError):
        parent.record(-1)


# --------------------------------------------------------------------------- real MPI
def _tolerance(dtype, world_size, ref):
    return 8 * world_size * np.finfo(dtype).eps * max(1.0, float(np.abs(ref).max(initial=0)))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [3, 4])  # odd and not a power of two; even; (2: every 2-rank job's ring)
def test_mpi_ring_matches_native_and_numpy(world_size, mpiexec, tmp_path):
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "collectives_check.py")
    proc = subprocess.run([mpiexec, "-n", str(world_size), sys.executable, script, str(tmp_path)],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = []
    for r in range(world_size):
        with np.load(tmp_path / f"rank{r}.npz") as data:
            arrays = dict(data)
        info = json.loads((tmp_path / f"rank{r}.json").read_text())
        ranks.append((arrays, info))

    for r, (arrays, info) in enumerate(ranks):
        cases = {k.split(":", 2)[2] for k in arrays if k.count(":") == 3}
        assert cases == {f"{dtype}:{n}" for dtype in ["float64", "float32", "float16"]
                         for n in {0, 1, world_size - 1, world_size + 1, 1000, 12345}}
        for case in cases:
            dtype = case.split(":")[0]
            for op in ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]:
                ref = arrays[f"{op}:ref:{case}"]
                atol = _tolerance(dtype, world_size, ref) if op in ("all_reduce", "reduce_scatter") else 0
                for impl in ["ring", "native"]:
                    got = arrays[f"{op}:{impl}:{case}"]
                    assert got.dtype == np.dtype(dtype), (op, impl, case)
                    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=0, atol=atol,
                                               err_msg=f"{op} {impl} {case} rank {r}")
                sent = info["traffic"][f"{op}:ring:{case}"]
                assert sent == info["traffic"][f"{op}:expected:{case}"], (op, case, r)
                assert info["traffic"][f"{op}:native:{case}"] == sent
            # all ranks hold bit-identical all-reduce results
            assert np.array_equal(arrays[f"all_reduce:ring:{case}"], ranks[0][0][f"all_reduce:ring:{case}"])
        meta = info["meta"]
        assert meta["sub_rank"] == meta["sub_expected_rank"]
        assert meta["sub_world_size"] == len(range(r % 2, world_size, 2))
        assert meta["sub_bytes"] == meta["world_bytes_after_split"]
        np.testing.assert_allclose(arrays["split:ring"], arrays["split:ref"], rtol=0, atol=1e-12)


#: world_rank of a split group (colors r % 2, ranks reversed), its groups kept to see them freed, printed per rank
WORLD_RANKS = """import json
from mpi4py import MPI
from minizero.comm.mpi import MPICommunicator
made = []
class Kept:  # an mpi4py communicator whose Get_group results are kept
    def __init__(self, comm): self.comm = comm
    def __getattr__(self, name): return getattr(self.comm, name)
    def Get_group(self): made.append(self.comm.Get_group()); return made[-1]
r = MPI.COMM_WORLD.Get_rank()
sub = MPICommunicator(Kept(MPI.COMM_WORLD.Split(r % 2, -r)), spin_s=0)
ranks = [sub.world_rank(k) for k in range(sub.world_size)] + [sub.world_rank(0)]
every = MPI.COMM_WORLD.gather([r, ranks, len(made), all(g == MPI.GROUP_NULL for g in made)])
if r == 0: print(json.dumps(every))"""


@pytest.mark.timeout(120)
def test_mpi_world_rank_translates_once_and_frees_its_groups(mpiexec):
    """Before: each call made two MPI groups (the communicator's, COMM_WORLD's) and freed neither: a flight
    recorder naming its groups, or a timeout message, leaked two MPI_Group handles a rank each time."""
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, "-c", WORLD_RANKS], env=mpi_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout) == [[0, [2, 0, 2], 1, True], [1, [3, 1, 3], 1, True], [2, [2, 0, 2], 1, True],
                   [3, [3, 1, 3], 1, True]]


# --------------------------------------------------------------------------- mismatched messages, stalled peers
#: tests/mpi_scripts/comm_faults.py's modes, in one job (one launch for the four tests below), a barrier between
#: them: dtypes first (it counts the world ledger's bytes), stall last (it sets a 1 s timeout that its rank 1 sleeps
#: through)
_MODES = ("dtypes", "native", "kinds", "stall")
_ALL_MODES = """
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "mpi_scripts"))
import comm_faults
from minizero.comm import world
for i, mode in enumerate(sys.argv[3:]):
    if i:
        world().barrier()
    os.makedirs(os.path.join(sys.argv[2], mode), exist_ok=True)
    comm_faults.main(os.path.join(sys.argv[2], mode), mode)
"""


@pytest.fixture(scope="module")
def comm_faults_job(tmp_path_factory):
    from tests.conftest import require_mpiexec

    mpiexec = require_mpiexec()
    out = tmp_path_factory.mktemp("comm_faults")
    # the ring at every size (small buffers would take recursive doubling): what the dtypes mode checks
    env = dict(mpi_env(), MINIZERO_SMALL_ALLREDUCE_MAX_BYTES="-1")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", _ALL_MODES, REPO_ROOT, str(out), *_MODES],
                          env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _comm_faults(out, mode):
    return [json.loads((out / mode / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(90)
def test_mpi_dtypes_of_one_byte_size_are_refused_by_name(comm_faults_job):
    ranks = _comm_faults(comm_faults_job, "dtypes")
    for r, (mine, theirs) in enumerate([("float32", "int32"), ("int32", "float32")]):
        got = ranks[r]["same_size"]
        assert got["error"] == "ValueError", got
        assert f"(2,) {theirs}" in got["message"] and f"(2,) {mine}" in got["message"]
        got = ranks[r]["same_bytes"]
        assert got["error"] == "ValueError" and "float64" in got["message"] and "float32" in got["message"], got
        assert ranks[r]["payload_bytes"] == 24  # headers are not counted: 8 + 16 payload bytes sent


@pytest.mark.timeout(90)
def test_mpi_native_collectives_of_unequal_lengths_raise_on_every_rank(comm_faults_job):
    """Issue 26: MPI's Iallreduce of 10 against 9 elements used to succeed, leaving one element unreduced."""
    for got in _comm_faults(comm_faults_job, "native"):
        for op in ("allreduce", "reduce_scatter", "bcast"):
            assert got[op]["error"] == "ValueError", (op, got[op])
            assert "(10,) float32" in got[op]["message"] and "(9,) float32" in got[op]["message"], got[op]
        assert got["allgather"]["error"] == "ValueError" and "n by rank [10, 9]" in got["allgather"]["message"]
        assert got["after"] == {"result": [2.0, 2.0, 2.0]}


def test_thread_native_collectives_of_unequal_lengths_raise_on_every_rank():
    x = lambda c: np.arange(10 - c.rank, dtype=np.float32)  # noqa: E731
    _raises_in_rank(2, lambda c: c.native_reduce_scatter(x(c)), ValueError, "different arrays")
    _raises_in_rank(2, lambda c: c.native_allgather(x(c)[:5 - c.rank], 10 - c.rank), ValueError, "do not make one array")
    _raises_in_rank(2, lambda c: c.native_bcast(x(c)), ValueError, "different arrays")


@pytest.mark.timeout(90)
def test_mpi_messages_of_another_size_are_refused_across_both_kinds(comm_faults_job):
    """One-message (up to PACK_MAX_BYTES) and two-message payloads: any size mismatch, either way, is a
    ValueError naming both on the receiver; the sender completes; a matching message then arrives whole."""
    from minizero.comm.mpi import PACK_MAX_BYTES

    sender, receiver = _comm_faults(comm_faults_job, "kinds")
    big = PACK_MAX_BYTES // 4 + 10
    for sent, room in [(16, big), (big, 16), (big, big + 5), (big + 5, big), (16, 8)]:
        got = receiver[f"{sent}->{room}"]
        assert got.get("error") == "ValueError", (sent, room, got)
        assert f"({sent},) float32" in got["message"] and f"({room},) float32" in got["message"], got
        assert "error" not in sender[f"{sent}->{room}"]
    assert receiver[f"{big}->{big}"] == {"result": big - 1} and receiver["16->16"] == {"result": 15}


@pytest.mark.timeout(30)
def test_threads_dtypes_of_one_byte_size_are_refused_by_name():
    def body(comm):
        return all_reduce(comm, np.array([1, 2, 3, 4], dtype=np.float32 if comm.rank == 0 else np.int32))

    with pytest.raises(ValueError, match="int32|float32"):
        run_in_threads(2, body, timeout=10)


#: rank 0's recv (tag 7) from rank 1 past a 1 s timeout, in comm.base.timeout_message's words
_STALL_WORDS = ("rank 0: recv (tag 7) waited 1 s for rank 1 of a communicator of 2 (the communicator's timeout); "
                "a rank is stalled or gone")


@pytest.mark.timeout(90)
def test_mpi_stalled_peer_times_out_naming_it_and_sleeps_meanwhile(comm_faults_job):
    got = _comm_faults(comm_faults_job, "stall")[0]
    assert got["recv"]["error"] == "CommTimeoutError", got
    assert got["recv"]["message"] == _STALL_WORDS, got  # the thread communicator's too (test_threads_timeout_...)
    assert 0.9 < got["wall_s"] < 10  # the 1 s timeout, with room for a loaded machine (rank 1 sends nothing)
    assert got["cpu_s"] < 0.5 * got["wall_s"], f"the waiting rank spun: {got}"


@pytest.mark.timeout(90)
def test_threads_wait_for_a_returned_rank_fails_at_once_and_an_infinite_timeout_is_refused():
    from minizero.comm import all_reduce
    from minizero.comm.threads import GroupFailedError

    def early(comm):
        if comm.rank == 0:
            all_reduce(comm, np.ones(4))

    start = time.monotonic()
    with pytest.raises(GroupFailedError, match="all_reduce waits for rank 1, which has already returned"):
        run_in_threads(2, early)
    assert time.monotonic() - start < 30  # at once: not run_in_threads's 60 s timeout
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            run_in_threads(2, early, timeout=bad)


@pytest.mark.timeout(30)
def test_threads_timeout_names_the_operation():
    from minizero.comm import CommTimeoutError

    with pytest.raises(CommTimeoutError) as e:
        run_in_threads(2, _rank_0_waits(lambda comm: comm.recv(np.empty(2), source=1, tag=7)), timeout=1.0)
    assert str(e.value).endswith(_STALL_WORDS), str(e.value)  # as MPI's (stall test) and NCCL's: one text
    with pytest.raises(CommTimeoutError, match=r"^\[rank 0/2\] rank 0: barrier waited 0\.5 s for the other ranks"):
        run_in_threads(2, _rank_0_waits(lambda comm: comm.barrier()), timeout=0.5)


def _scratch_peaks(comm, n, op):
    from minizero.comm.collectives import all_reduce, reduce_scatter
    from minizero.ledger import MemoryLedger, set_ledger

    ledger = set_ledger(MemoryLedger())
    x = np.ones(n, dtype=np.float64)
    ledger.track(x, "comm_buffers")  # the caller's bucket
    (all_reduce if op == "all_reduce" else reduce_scatter)(comm, x)
    return ledger.peak["comm_scratch"], ledger.current["comm_scratch"], ledger.peak_total


def _reduce_scatter_chunks(n, w, r):
    """Receive buffers of ceil(n/N): the last step receives into the result, the one before into a chunk, the
    others alternate between a second chunk and the result where a largest chunk fits in it (n = 1001: rank 0)."""
    return 0 if w <= 2 else 1 if w == 3 or shard_range(n, w, r)[1] == -(-n // w) else 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op, elements", [("all_reduce", lambda n, w, r: -(-n // w) if w > 1 else 0),
                                          ("reduce_scatter", lambda n, w, r: _reduce_scatter_chunks(n, w, r) *
                                           -(-n // w))])
def test_collective_scratch_is_in_the_ledger_peak(world, op, elements, ring_all_reduce):
    """Issue 19: the ring's receive chunk (reduce-scatter's one or two) count while they live."""
    from minizero.comm.threads import run_in_threads

    n = 1001
    for rank, (peak, current, total) in enumerate(run_in_threads(world, _scratch_peaks, n, op)):
        assert peak == elements(n, world, rank) * 8 and current == 0  # freed when the call returns
        assert total == n * 8 + peak  # the per-rank peak: the bucket and the scratch beside it


@pytest.mark.timeout(30)
def test_nonblocking_wait_times_out_naming_the_neighbour():
    """A non-blocking ring whose neighbour never joins: CommTimeoutError after the communicator's timeout,
    in the words every waiting communicator uses (comm.base.timeout_message: MPI, NCCL, requests)."""
    from minizero.comm import CommTimeoutError
    from minizero.comm.nonblocking import RingCollective

    body = _rank_0_waits(lambda comm: RingCollective(comm, np.ones(4), "all_reduce", tag=77,
                                                     name="all_reduce test").start().wait())
    with pytest.raises(CommTimeoutError, match=r"^\[rank 0/2\] rank 0: all_reduce test \(tag 77\) waited 0\.5 s for "
                                               r"rank 1 of a communicator of 2 \(the communicator's timeout\); a rank is stalled"):
        run_in_threads(2, body, timeout=0.5)


@pytest.mark.timeout(30)
def test_a_stream_waits_for_one_collective_and_names_it_when_a_neighbour_never_joins():
    """``Stream.wait_for`` (ZeRO's overlapped reduce-scatters and prefetches): advances the queue until the awaited
    collective is done, and times out naming what was awaited and the peer the running collective waits on."""
    from minizero.comm import CommTimeoutError
    from minizero.comm.nonblocking import RingCollective, Stream

    ended = threading.Event()

    def body(comm):
        stream = Stream(comm)
        colls = [RingCollective(comm, np.full(4, 1.0 + i), "all_reduce", tag=80 + i) for i in range(2)]
        for c in colls:
            stream.submit(c)
        stream.wait_for(colls[1])  # the first one runs (and ends) before it
        assert [c.done for c in colls] == [True, True] and colls[1].buf.tolist() == [4.0] * 4
        if comm.rank == 0:
            try:
                stream.submit(late := RingCollective(comm, np.ones(4), "all_reduce", tag=90))
                stream.wait_for(late, "prefetch of 'h.0'")
            finally:
                ended.set()
        else:
            ended.wait(120)  # still there until rank 0's wait ends (as _rank_0_waits)

    with pytest.raises(CommTimeoutError, match=r"^\[rank 0/2\] rank 0: prefetch of 'h.0' waited 0\.5 s for rank 1 "):
        run_in_threads(2, body, timeout=0.5)


# --------------------------------------------------------------------------- waiting: spin, then sleep
def test_a_wait_spins_without_sleeping_for_spin_s_then_sleeps(monkeypatch):
    from minizero.comm import base

    sleeps = []
    monkeypatch.setattr(base.time, "sleep", sleeps.append)
    polls = iter([False] * 50 + [True])
    base.poll_until(lambda: next(polls), timeout=60, describe=str, spin_s=60)
    assert sleeps == []  # a rank with a core of its own sees the message at once
    polls = iter([False] * 5 + [True])
    base.poll_until(lambda: next(polls), timeout=60, describe=str, spin_s=0.0)
    assert sleeps == [0.0, 1e-5, 2e-5, 4e-5, 8e-5]  # oversubscribed: back off at once, as before


def test_spin_only_where_each_rank_has_a_core_and_the_timeout_still_fires():
    from minizero.comm import base

    cores = len(os.sched_getaffinity(0))
    assert base.spin_seconds(cores) == base.SPIN_S and base.spin_seconds(cores + 1) == 0.0
    start = time.monotonic()
    with pytest.raises(base.CommTimeoutError, match="stalled"):
        base.poll_until(lambda: False, timeout=0.05, describe=lambda: "stalled", spin_s=10.0)
    assert time.monotonic() - start < 5  # the spin never outlasts the timeout


def test_blocking_ring_runs_exactly_ring_steps():
    """The one ring: the blocking ring_ sends and adds exactly the (send, recv, add) steps ring_steps lists."""
    from minizero.comm import collectives

    class Recorder:
        world_size, rank = 4, 1

        def __init__(self):
            self.calls = []

        def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
            self.calls.append((sendbuf.size, dest, recvbuf.size, source))
            recvbuf[...] = 0

    comm = Recorder()
    buf = np.arange(10.0)
    collectives.ring_(comm, buf, "all_reduce", tmp=np.empty(3))
    steps = collectives.ring_steps("all_reduce", 10, 4, 1)
    assert comm.calls == [(ss, 2, rs, 0) for (_, ss), (_, rs), _ in steps]


def _ring_order_reduce_scatter(xs, rank):
    """The sums the ring reduce-scatter has always made, in its order: chunk c starts as rank c+1's and each rank
    after it adds its own as ``add(mine, incoming)``: x_c + (x_{c-1} + (... + (x_{c+2} + x_{c+1})))."""
    N = len(xs)
    lo, hi = _span(xs[0].size, N, rank)
    acc = xs[(rank + 1) % N][lo:hi].copy()
    for k in range(2, N + 1):
        acc = xs[(rank + k) % N][lo:hi] + acc
    return acc


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7])
def test_reduce_scatter_is_bitwise_the_ring_order_sum_whatever_its_scratch(world_size):
    """The two-chunk scratch reduce-scatter adds the same numbers in the same order per element as the ring always
    did (the old n + chunk scratch), for n divisible by N, not, and n < N; x is not modified."""
    sizes = [0, 1, world_size - 1, world_size, world_size + 1, 4 * world_size, 1001, 4099]

    def body(comm):
        xs = [np.random.default_rng([q, 7]).standard_normal(max(sizes)) * 10.0 ** (np.arange(max(sizes)) % 33 - 16)
              for q in range(comm.world_size)]  # magnitudes 1e-16..1e16: another association changes the bits
        got = []
        for n in sizes:
            x = xs[comm.rank][:n].copy()
            got.append((reduce_scatter(comm, x), np.array_equal(x, xs[comm.rank][:n])))
        return xs, got

    reordered = 0
    for rank, (xs, got) in enumerate(run_in_threads(world_size, body)):
        for n, (shard, untouched) in zip(sizes, got):
            want = _ring_order_reduce_scatter([x[:n] for x in xs], rank)
            assert untouched and shard.dtype == np.float64 and np.array_equal(shard, want), (n, rank)
            reordered += not np.array_equal(want, np.sum([x[:n] for x in xs], axis=0)[slice(*_span(n, world_size,
                                                                                                    rank))])
    assert world_size == 2 or reordered  # the data tells one order of addition from another


@pytest.mark.parametrize("n, world_size, rank", [(10, 4, 0), (10, 4, 3), (12, 4, 1), (9, 3, 2), (3, 5, 4), (7, 2, 1)])
def test_reduce_scatter_runs_ring_steps_and_never_receives_into_what_it_sends(n, world_size, rank):
    """The reduce-scatter without a working copy takes ring_steps' messages; each step sends the buffer the step
    before received into and summed, and receives into another one (MPI's Sendrecv needs them apart)."""
    from minizero.comm import collectives

    calls = []

    class Recorder:
        def __init__(self):
            self.world_size, self.rank = world_size, rank

        def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
            assert not np.shares_memory(sendbuf, recvbuf)
            calls.append((sendbuf, dest, recvbuf, source))
            recvbuf[...] = 0

    out = np.empty(shard_range(n, world_size, rank)[1])
    tmp = np.empty(collectives.reduce_scatter_scratch(n, world_size, rank))
    collectives.ring_reduce_scatter_into(Recorder(), np.arange(float(n)), out, tmp)
    steps = collectives.ring_steps("reduce_scatter", n, world_size, rank)
    assert [(s.size, d, r.size, q) for s, d, r, q in calls] == [
        (ss, (rank + 1) % world_size, rs, (rank - 1) % world_size) for (_, ss), (_, rs), _ in steps]
    assert all(calls[i][0] is calls[i - 1][2] for i in range(1, len(calls)))  # a partial sum is sent on as made
    assert calls[-1][2].base is out or calls[-1][2] is out  # the last step receives into the result
