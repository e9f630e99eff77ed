"""Overlap (issue 16): non-blocking rings, the overlapped DP reducer, and the --trace timeline.

Every check that overlap changes nothing compares final weights *bitwise* with ``--no-overlap``;
every check that it overlaps reads the trace: an in-flight all-reduce span must intersect a
backward span on every rank (with ``--no-overlap`` none does, which the test also asserts, so
it can fail).
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from minizero import trace
from minizero.args import parse_args
from minizero.comm import run_in_threads
from minizero.comm.collectives import all_reduce, reduce_scatter
from minizero.comm.nonblocking import RingCollective, Stream, ring_steps
from minizero.loop import train
from minizero.zero import ShardMap, zero_optimizer
from minizero.nn import GPT, get_config
from minizero.parallel.tracing import TraceUnits
from tests.conftest import REPO_ROOT, mpi_env

BASE = ["--model", "tiny", "--steps", "2", "--eval-batches", "1", "--eval-every", "0", "--sample-tokens", "1",
        "--progress", "none", "--lr", "1e-2", "--seed", "3", "--no-save", "--bucket-mb", "0.01"]


# ------------------------------------------------------------------------------ the non-blocking ring
@pytest.mark.parametrize("n", [2, 3, 4])
def test_nonblocking_ring_is_bitwise_the_blocking_ring_with_the_same_bytes(n, ring_all_reduce):
    def rank(comm):
        rng = np.random.default_rng(comm.rank)
        xs = [rng.standard_normal(k).astype(dt) for k in (1, 7, 1000) for dt in (np.float32, np.float64)]
        blocking = [all_reduce(comm, x) for x in xs]
        before = comm.traffic.snapshot()
        stream, bufs = Stream(comm), [x.copy() for x in xs]
        for i, b in enumerate(bufs):
            stream.submit(RingCollective(comm, b, "all_reduce", tag=1003, bucket=i))
        stream.synchronize()
        after = comm.traffic.snapshot()
        rs = RingCollective(comm, xs[-1].copy(), "reduce_scatter", tag=1004).start()
        rs.wait()
        return ([np.array_equal(a, b) for a, b in zip(blocking, bufs)], before, after,
                rs.buf, reduce_scatter(comm, xs[-1]))

    for r, (same, before, after, rs_buf, rs_ref) in enumerate(run_in_threads(n, rank, timeout=60)):
        assert all(same)
        assert after["by_op"]["all_reduce"] == 2 * before["by_op"]["all_reduce"]  # same bytes as blocking
        assert after["calls"]["all_reduce"] == 2 * before["calls"]["all_reduce"]  # one call per collective
        from minizero.comm.collectives import shard_range
        off, size = shard_range(rs_buf.size, n, r)
        np.testing.assert_array_equal(rs_buf[off:off + size], rs_ref)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_nonblocking_all_gather_is_the_blocking_one_and_needs_no_scratch(n):
    """ZeRO-3's prefetch ring: bitwise ``all_gather``, and no receive chunk (only reduce steps add one)."""
    from minizero.comm.collectives import all_gather, shard_range

    def rank(comm):
        mine = np.random.default_rng(comm.rank).standard_normal(1000)
        off, size = shard_range(1000, n, comm.rank)
        buf = np.zeros(1000)
        buf[off:off + size] = mine[off:off + size]
        coll = RingCollective(comm, buf, "all_gather", tag=1005)
        coll.start().wait()
        return buf, all_gather(comm, mine[off:off + size].copy(), 1000), coll.tmp

    for got, want, tmp in run_in_threads(n, rank, timeout=30):
        assert np.array_equal(got, want) and tmp is None


def test_ring_steps_are_the_blocking_ring_s_and_bad_ops_are_refused():
    assert len(ring_steps("all_reduce", 10, 4, 1)) == 6 and len(ring_steps("all_gather", 10, 4, 1)) == 3
    assert ring_steps("reduce_scatter", 10, 4, 1)[0] == ((0, 3), (8, 2), True)  # sends chunk r-1, adds r-2
    with pytest.raises(ValueError, match="op='broadcast'"):
        ring_steps("broadcast", 10, 4, 1)
    with pytest.raises(ValueError, match="op='broadcast'"):  # before: accepted on one rank (no steps to plan)
        run_in_threads(1, lambda comm: RingCollective(comm, np.ones(4), "broadcast", tag=1006))


def test_ring_collective_refuses_a_buffer_it_cannot_receive_into():
    def rank(comm):
        read_only = np.ones(4)
        read_only.flags.writeable = False
        for buf, match in ((np.ones((2, 2)), "1-D"), (np.ones(8)[::2], "C-contiguous"), (read_only, "read-only"),
                           ([1.0, 2.0], "must be an array")):
            with pytest.raises((ValueError, TypeError), match=match):
                RingCollective(comm, buf, "all_reduce", tag=1006)
        return True

    assert all(run_in_threads(2, rank, timeout=30))


def test_irecv_refuses_a_message_of_another_dtype():
    def rank(comm):
        if comm.rank == 0:
            comm.isend(np.ones(4, np.float32), 1, tag=5)
            return None
        req = comm.irecv(np.empty(4, np.int32), 0, tag=5)
        with pytest.raises(ValueError, match="float32"):
            while not req.test():
                pass
        return True

    assert run_in_threads(2, rank, timeout=30)[1]


@pytest.mark.timeout(60)
def test_irecv_wait_receives_and_times_out_naming_the_sender():
    """Before: irecv's request had test() only (isend's had wait() too): ``req.wait()`` raised AttributeError."""
    from minizero.comm.base import CommTimeoutError

    def rank(comm):
        if comm.rank == 0:
            comm.isend(np.arange(4.0), 1, tag=5).wait()
            comm.recv(np.empty(1), 1, tag=7)  # alive while rank 1 times out (a returned peer is another error)
            return None
        buf = np.empty(4)
        comm.irecv(buf, 0, tag=5).wait()
        comm.timeout = 0.2
        with pytest.raises(CommTimeoutError, match=r"rank 1: irecv \(tag 6\) waited 0.2 s for rank 0"):
            comm.irecv(np.empty(1), 0, tag=6).wait()  # never sent
        comm.send(np.empty(1), 0, tag=7)
        return buf.tolist()

    assert run_in_threads(2, rank, timeout=30)[1] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(30)
def test_irecv_wait_in_a_split_group_names_world_ranks_as_recv_does():
    """Before: irecv's wait() in a group of ranks 1 and 3 said 'rank 0 ... for rank 1' where recv says which ranks
    of the job those are."""
    from minizero.comm.base import CommTimeoutError

    def rank(comm):
        group = comm.split(comm.rank % 2)
        if comm.rank == 1:
            group.timeout = 0.2
            with pytest.raises(CommTimeoutError) as e:
                group.irecv(np.empty(1), 1, tag=3).wait()  # rank 3 never sends; it waits below, alive
            comm.send(np.empty(1), 3, tag=4)
            return str(e.value)
        if comm.rank == 3:
            comm.recv(np.empty(1), 1, tag=4)
        return None

    said = run_in_threads(4, rank, timeout=20)[1]
    assert said.startswith("rank 0 (world rank 1): irecv (tag 3) waited 0.2 s for rank 1 (world rank 3) of a "
                           "communicator of 2"), said


# ------------------------------------------------------------------------------ bitwise, on threads
def _final_weights(n, flags):
    def rank(comm):
        args = parse_args(BASE + flags, world_size=comm.world_size, quiet=True)
        res = train(args, comm, log=lambda s: None)
        with res["strategy"].full_parameters():  # ZeRO-3: whole parameters (collective)
            model = res["model"]
            return None if model is None else {k: v.copy() for k, v in model.state_dict().items()}
    return run_in_threads(n, rank, timeout=120)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,flags", [
    (2, ["--dtype", "float32", "--grad-accum", "3"]),
    (4, ["--dtype", "float64", "--grad-accum", "2"]),
    (4, ["--dtype", "float32"]),
    (2, ["--dtype", "float64", "--zero", "2"]),
    (4, ["--dtype", "float64", "--dp", "2", "--pp", "2"]),
    (4, ["--dtype", "float64", "--dp", "2", "--pp", "2", "--bucket-mb", "64"]),
], ids=["dp2-f32-accum3", "dp4-f64-accum2", "dp4-f32", "zero2", "dp2-pp2", "dp2-pp2-one-bucket"])
def test_overlap_gives_bitwise_the_weights_of_no_overlap(n, flags):
    """(ZeRO-3: test_zero3_prefetch_and_reduce_scatters_are_in_flight_only_with_overlap compares its weights; dp 2
    without accumulation in float64 repeated the paths of dp 4's cases.)"""
    on, off = _final_weights(n, flags), _final_weights(n, flags + ["--no-overlap"])
    assert set(on) == set(off)
    for name in on:
        assert np.array_equal(on[name], off[name]), name


@pytest.mark.timeout(120)
def test_the_overlapped_reducer_is_the_synchroniser_and_counts_its_own_bytes():
    """With overlap the strategy's synchroniser is the reducer: it counts the gradient bytes (the report reads
    ``model_state_bytes_per_step``) and leaves its DataParallel's counter alone; the figure is --no-overlap's.
    Over 0 steps both say 0.0 (ZeRO's answer; it was a ZeroDivisionError), a negative count is refused."""
    from minizero.parallel.overlap import OverlappedReducer

    def rank(comm, flags):
        s = train(parse_args(BASE + ["--dtype", "float64", *flags], world_size=2, quiet=True), comm,
                  log=lambda s: None)["strategy"]
        with pytest.raises(ValueError, match="^steps=-1; allowed: an integer >= 0$"):
            s.model_state_bytes_per_step(-1)
        return type(s.sync), s.dp.bytes_sent, s.model_state_bytes_per_step(2), s.model_state_bytes_per_step(0)

    on, off = run_in_threads(2, rank, []), run_in_threads(2, rank, ["--no-overlap"])
    assert [r[:2] for r in on] == [(OverlappedReducer, 0)] * 2 and {r[0] for r in off} != {OverlappedReducer}
    assert [r[2] for r in on] == [r[2] for r in off] and on[0][2] > 0
    assert [r[3] for r in on + off] == [0.0] * 4  # no steps: nothing per step (ZeRO's answer), not ZeroDivisionError


# ------------------------------------------------------------------------------ the timeline
def _overlap_fraction(events, pid):
    """(microseconds of backward during which an all-reduce was in flight, backward microseconds)."""
    bwd = trace.intervals(events, pid, lambda e: e["cat"] == "backward")
    flight = trace.intervals(events, pid, lambda e: e["tid"] == trace.IN_FLIGHT and e["args"]["op"] == "all_reduce")
    return trace.covered_us(flight, bwd), sum(b - a for a, b in bwd)


def _check_trace_format(doc, n):
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert isinstance(e["ts"], int) and e["dur"] >= 0
    assert {e["pid"] for e in events} == set(range(n))
    for r in range(n):
        cats = {e["cat"] for e in events if e["pid"] == r}
        assert {"forward", "backward", "comm", "optimizer"} <= cats, (r, cats)
    return events


@pytest.mark.timeout(300)
def test_trace_on_threads_shows_all_reduce_in_flight_during_backward_only_with_overlap(tmp_path, ring_all_reduce):
    """(The tiny model's one bucket is small enough for recursive doubling, which is not overlapped:
    the ring is forced, as for the default model's 1 MiB buckets.)"""
    path = str(tmp_path / "t.json")

    def rank(comm, flags):
        train(parse_args(BASE + ["--trace", path] + flags, world_size=comm.world_size, quiet=True), comm,
              log=lambda s: None)

    run_in_threads(2, rank, [], timeout=120)
    events = _check_trace_format(json.load(open(path)), 2)
    for r in range(2):
        covered, total = _overlap_fraction(events, r)
        assert total > 0 and covered > 0, r
        buckets = [e for e in events if e["pid"] == r and e["tid"] == trace.IN_FLIGHT]
        assert all(e["args"]["bytes"] > 0 and "bucket" in e["args"] for e in buckets)
    run_in_threads(2, rank, ["--no-overlap"], timeout=120)
    events = _check_trace_format(json.load(open(path)), 2)
    assert not [e for e in events if e["tid"] == trace.IN_FLIGHT]
    assert all(_overlap_fraction(events, r)[0] == 0 for r in range(2))


@pytest.mark.timeout(300)
def test_zero3_prefetch_and_reduce_scatters_are_in_flight_only_with_overlap(tmp_path):
    """Both traced runs' final weights also equal bit for bit (the ZeRO-3 case of the bitwise test above)."""
    path = str(tmp_path / "t.json")

    def rank(comm, flags):
        res = train(parse_args(BASE + ["--dtype", "float64", "--zero", "3", "--trace", path] + flags,
                               world_size=comm.world_size, quiet=True), comm, log=lambda s: None)
        with res["strategy"].full_parameters():  # whole parameters (collective)
            model = res["model"]
            return None if model is None else {k: v.copy() for k, v in model.state_dict().items()}

    weights = []
    for flags in ([], ["--no-overlap"]):
        weights.append(run_in_threads(2, rank, flags, timeout=120)[0])
        events = _check_trace_format(json.load(open(path)), 2)
        for r in range(2):
            flight = [e for e in events if e["pid"] == r and e["tid"] == trace.IN_FLIGHT]
            assert all(e["args"]["op"] in ("all_gather", "reduce_scatter") and e["args"]["bytes"] > 0 for e in flight)
            for op in ("all_gather", "reduce_scatter"):  # prefetch and the overlapped gradient reduce-scatter
                assert bool([e for e in flight if e["args"]["op"] == op]) == (not flags), (r, flags, op)
    on, off = weights
    assert set(on) == set(off)
    for name in on:
        assert np.array_equal(on[name], off[name]), name


def _zero_steps(comm, stage, overlap_reduce, dtype):
    """3 steps (2 micro-batches each) of the tiny GPT under ZeroOptimizer; (weights, events)."""
    tracer = trace.Tracer(comm.rank)
    trace.set_tracer(tracer)
    model = GPT(get_config("tiny", dtype=dtype), seed=1)
    units = TraceUnits(model)
    opt = zero_optimizer(model, comm, stage, lr=1e-2, overlap_reduce=overlap_reduce, prefetch=overlap_reduce)
    rng = np.random.default_rng(comm.rank)
    for _ in range(3):
        for _ in range(2):
            x = rng.integers(0, 256, (2, 16))
            model(x, x)[1].backward()
        opt.reduce_gradients()
        opt.step()
        opt.zero_grad()
    units.remove()
    trace.set_tracer(None)
    with opt.full_parameters():
        return {k: v.copy() for k, v in model.state_dict().items()}, tracer.events, opt.overlap_reduce


_ZERO_RUNS = {}


def _zero_runs(stage, overlap_reduce, dtype):
    """``run_in_threads(2, _zero_steps, ...)``, once per module: stage 3 in float64 is read by two tests."""
    key = (stage, overlap_reduce, dtype)
    if key not in _ZERO_RUNS:
        _ZERO_RUNS[key] = run_in_threads(2, _zero_steps, stage, overlap_reduce, dtype, timeout=120)
    return _ZERO_RUNS[key]


def _overlap_words(comm, stage, overlap, native, ep):
    from minizero.parallel.expert_parallel import ExpertZero, MoEConfig, expert_groups, use_moe
    model = GPT(get_config("tiny", dtype="float64"), seed=1)
    kw = dict(overlap_reduce=overlap, prefetch=overlap, native=native)
    if ep == 1:
        return zero_optimizer(model, comm, stage, **kw).overlap_words()
    ep_comm, edp_comm = expert_groups(comm, ep)  # the experts' data group: 1 rank, which cannot overlap
    use_moe(model, MoEConfig(4, top_k=2), 0, ep_comm)
    opt = ExpertZero(model, comm, edp_comm, ep, stage, **kw)
    return opt.overlap_words(), [part.overlap_words() for part in opt.parts]


REDUCE, PREFETCH = "reduce-scatters overlap backward", "the next unit's all-gather is prefetched"


@pytest.mark.parametrize("stage, overlap, native, words", [
    (1, True, False, []), (2, True, False, [REDUCE]), (3, True, False, [REDUCE, PREFETCH]),
    (3, False, False, []), (3, True, True, [])])  # native: MPI's blocking collectives
def test_a_zero_optimizer_says_what_it_overlaps_as_built(stage, overlap, native, words):
    """Before: the run header read ``overlap_reduce``, ``prefetch`` and ExpertZero's ``parts`` by getattr."""
    assert run_in_threads(2, _overlap_words, stage, overlap, native, 1) == [words, words]
    if stage > 1 and not native:  # ExpertZero: either part's words, once (here the dense part's)
        assert run_in_threads(2, _overlap_words, stage, overlap, native, 2) == [(words, [words, []])] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,dtype", [(2, "float64"), (2, "float32"), (3, "float64")])
def test_zero_overlapped_reduce_scatter_is_bitwise_and_in_flight_during_backward(stage, dtype):
    on, off = _zero_runs(stage, True, dtype), _zero_runs(stage, False, dtype)
    for (w_on, events, used), (w_off, events_off, _) in zip(on, off):
        assert used
        for name in w_on:
            assert np.array_equal(w_on[name], w_off[name]), name
        rs = trace.intervals(events, events[0]["pid"], lambda e: e["tid"] == trace.IN_FLIGHT
                             and e["args"]["op"] == "reduce_scatter")
        bwd = trace.intervals(events, events[0]["pid"], lambda e: e["cat"] == "backward")
        assert rs and trace.covered_us(rs, bwd) > 0
        assert not [e for e in events_off if e["tid"] == trace.IN_FLIGHT]


def test_every_zero3_unit_collective_names_its_unit_and_phase_in_the_trace_blocking_or_in_flight():
    """A blocking gather or reduce-scatter (UnitCollectives) is a span with the args of an overlapped one."""
    units = [u.name for u in ShardMap.from_model(GPT(get_config("tiny")), 2).units]
    ops = {"gather_forward": "all_gather", "gather_backward": "all_gather", "reduce_scatter_grads": "reduce_scatter"}
    for overlap in (False, True):
        _, events, _ = _zero_runs(3, overlap, "float64")[0]
        named = [e for e in events if "unit" in e["args"]]
        for e in named:
            assert e["name"] == f"{ops[e['args']['phase']]} {e['args']['unit']}", e
        blocking = {(e["args"]["unit"], e["args"]["phase"]) for e in named if e["tid"] == trace.COMM}
        assert len(named) == 3 * 2 * 3 * len(units)  # per micro-batch: 2 gathers and a reduce-scatter per unit
        if overlap:  # the tied embedding's gathers stay blocking; everything else is in flight
            assert blocking == {(units[0], "gather_forward"), (units[0], "gather_backward")}, blocking
        else:
            assert blocking == {(u, ph) for u in units for ph in ops}, blocking


def _on_and_off(mpiexec, n, on, off):
    """One mpiexec launch of ``n`` ranks that runs the main job twice, ``minizero.train.main(on)`` then
    ``main(off)`` (as ``python -m minizero.train`` does): one start-up (imports, MPI_Init) for an overlapped run
    and its --no-overlap reference. Both exit 0; returns their stdout."""
    code = f"import sys; from minizero.train import main; sys.exit(main({on!r}) or main({off!r}))"
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-c", code], env=mpi_env(), capture_output=True,
                          text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_trace_under_mpiexec_4_ranks_overlaps_on_every_rank_and_weights_match(mpiexec, tmp_path, ring_all_reduce):
    """--dp 2 --pp 2: non-blocking pipeline sends and each stage's DP buckets (by the ring) over real MPI
    requests; the weights bitwise --no-overlap's, and an all-reduce in flight during backward on every rank."""
    base = ["--model", "tiny", "--steps", "3", "--dtype", "float64", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--bucket-mb", "0.01", "--dp", "2", "--pp", "2"]
    stdout = _on_and_off(mpiexec, 4, [*base, "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "on")],
                         [*base, "--no-overlap", "--out", str(tmp_path / "off")])
    on, off = (dict(np.load(tmp_path / d / "model.npz")) for d in ("on", "off"))
    assert "wrote" in stdout and "t.json" in stdout
    assert set(on) == set(off)
    for name in on:
        assert np.array_equal(on[name], off[name]), name
    events = _check_trace_format(json.load(open(tmp_path / "t.json")), 4)
    for r in range(4):
        covered, total = _overlap_fraction(events, r)
        assert covered > 0, f"rank {r}: no all-reduce in flight during backward ({total} us of backward)"


def test_tracer_refuses_bad_events():
    t = trace.Tracer(0)
    with pytest.raises(ValueError, match="before its start"):
        t.complete("x", "c", 10, 5)
    with pytest.raises(ValueError, match="tid=7"):
        t.complete("x", "c", 1, 5, tid=7)
    assert trace.covered_us([(0, 10)], [(5, 20)]) == 5
    assert trace.intervals([{"ph": "X", "pid": 0, "ts": 0, "dur": 5}, {"ph": "X", "pid": 0, "ts": 3, "dur": 5}],
                           0, lambda e: True) == [(0, 8)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, flags", [(2, ["--zero", "3"])], ids=["zero3"])
def test_overlap_under_mpiexec_gives_bitwise_the_weights_of_no_overlap(mpiexec, tmp_path, n, flags):
    """ZeRO-3 prefetch over real MPI requests (pipeline sends and DP buckets: the 4-rank trace test above)."""
    base = ["--model", "tiny", "--steps", "2", "--dtype", "float64", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--bucket-mb", "0.01", *flags]
    _on_and_off(mpiexec, n, [*base, "--out", str(tmp_path / "on")],
                [*base, "--no-overlap", "--out", str(tmp_path / "off")])
    on, off = (dict(np.load(tmp_path / d / "model.npz")) for d in ("on", "off"))
    assert set(on) == set(off)
    for name in on:
        assert np.array_equal(on[name], off[name]), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,accum", [("float32", 2)])
def test_zero2_overlapped_reduce_scatter_under_mpiexec_is_bitwise_and_overlaps_backward(mpiexec, tmp_path, dtype,
                                                                                        accum):
    """``--zero 2`` (reduce-scatters during backward, two buckets alive) against ``--no-overlap`` (blocking):
    the same final weights bit for bit, over real MPI requests, float32 with 2 micro-batches (float64 without
    accumulation: in threads above); both traces read: with overlap a reduce-scatter is in flight during a
    backward span on every rank, without none is."""
    base = ["--model", "tiny", "--steps", "2", "--dtype", dtype, "--grad-accum", str(accum), "--zero", "2",
            "--eval-batches", "1", "--eval-every", "0", "--sample-tokens", "1", "--progress", "none"]
    _on_and_off(mpiexec, 2, [*base, "--trace", str(tmp_path / "on.json"), "--out", str(tmp_path / "on")],
                [*base, "--no-overlap", "--trace", str(tmp_path / "off.json"), "--out", str(tmp_path / "off")])
    on, off = (dict(np.load(tmp_path / d / "model.npz")) for d in ("on", "off"))
    events, events_off = (_check_trace_format(json.load(open(tmp_path / f"{d}.json")), 2) for d in ("on", "off"))
    assert set(on) == set(off)
    for name in on:
        assert np.array_equal(on[name], off[name]), name
    for r in range(2):
        rs = trace.intervals(events, r, lambda e: e["tid"] == trace.IN_FLIGHT and e["args"]["op"] == "reduce_scatter")
        bwd = trace.intervals(events, r, lambda e: e["cat"] == "backward")
        assert rs and trace.covered_us(rs, bwd) > 0, f"rank {r}: no reduce-scatter in flight during backward"
    assert not [e for e in events_off if e["tid"] == trace.IN_FLIGHT]


@pytest.mark.timeout(120)
def test_the_overlapped_reducer_refuses_a_step_of_no_micro_batches_on_every_rank():
    """begin_step(0) would wait for hooks that never fire: refused, naming the value and what is allowed."""
    def rank(comm):
        s = train(parse_args(BASE + ["--dtype", "float64"], world_size=2, quiet=True), comm, log=lambda s: None)
        with pytest.raises(ValueError, match=r"micro_steps=0; allowed: >= 1"):
            s["strategy"].reducer.begin_step(0)
        s["strategy"].reducer.begin_step(1)
        return s["strategy"].reducer.micro_steps

    assert run_in_threads(2, rank) == [1, 1]
