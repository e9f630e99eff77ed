"""NcclCommunicator's ordering and grouping, against an in-process fake NCCL (tests/fake_nccl.py).

Ranks are threads (``run_in_threads``); each builds the real ``NcclCommunicator`` over its
``ThreadCommunicator`` (the bootstrap that carries the unique id), with the fake standing in
for ``cupy.cuda.nccl`` and ``cupy.cuda``. The same collective checks as tests/test_collectives.py
run on top: results equal NumPy, bytes equal the thread communicator's ledger. The fake moves
real bytes but no device runs: the real test is bench/gpu_check.py on a GPU.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from minizero import backend
from minizero.comm import broadcast, reduce_scatter, run_in_threads, shard_range
from minizero.comm.nccl import NcclCommunicator
from tests import fake_nccl
from tests.conftest import REPO_ROOT
from tests.test_collectives import _all_collectives, _span, lengths

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _strict(strict_backend):
    """NCCL moves device memory: every test here runs on strict (device) arrays, as the fake requires."""
    yield


def _dev(a):
    return backend.to_device(np.asarray(a))
CASES = [(N, n) for N in WORLD_SIZES for n in lengths(N)]


def _nccl(comm, **kw):
    return NcclCommunicator(comm, nccl=fake_nccl, cuda=fake_nccl.cuda, timeout=30.0, **kw)


def _collectives_on_nccl(comm, n):
    """The collectives of test_collectives on NCCL, and the same calls' bytes on the thread communicator."""
    x, results, sent = _all_collectives(_nccl(comm), n)
    _, _, sent_threads = _all_collectives(comm, n)
    return x, results, sent, sent_threads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,n", CASES)
def test_collectives_on_nccl_match_numpy_and_the_thread_ledger(world_size, n):
    out = run_in_threads(world_size, _collectives_on_nccl, n)
    xs = np.stack([o[0] for o in out])
    total = xs.sum(axis=0)
    gathered = np.concatenate([xs[q][slice(*_span(n, world_size, q))] for q in range(world_size)])
    for r, (_, results, sent, sent_threads) in enumerate(out):
        off, size = shard_range(n, world_size, r)
        for impl in ["ring", "native"]:
            np.testing.assert_allclose(results["all_reduce", impl], total, rtol=0, atol=1e-12)
            np.testing.assert_allclose(results["reduce_scatter", impl], total[off:off + size], rtol=0, atol=1e-12)
            assert results["reduce_scatter", impl].shape == (size,)
            assert np.array_equal(results["all_gather", impl], gathered)
            assert np.array_equal(results["broadcast", impl], xs[world_size - 1])
        assert np.array_equal(results["all_reduce", "ring"], out[0][1]["all_reduce", "ring"])
        assert sent == sent_threads  # the same traffic ledger, hand-written and native


def _ring_calls(comm):
    ncomm = _nccl(comm)
    ncomm.comm.log.clear()
    reduce_scatter(ncomm, _dev(np.arange(12.0)))
    return ncomm.comm.log


@pytest.mark.timeout(60)
def test_every_ring_step_is_one_group_of_send_then_recv():
    logs = run_in_threads(3, _ring_calls)
    for r, calls in enumerate(logs):
        assert calls == [("send", (r + 1) % 3, 32, True), ("recv", (r - 1) % 3, 32, True)] * 2


class _UngroupedSendrecv(NcclCommunicator):
    """The mistake the groups prevent: send, then receive, each alone."""

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._send(sendbuf, dest, tag)
        self._recv(recvbuf, source, tag)


@pytest.mark.timeout(60)
def test_an_ungrouped_ring_deadlocks_in_the_fake(monkeypatch):
    monkeypatch.setattr(fake_nccl, "DEADLOCK_S", 1.0)

    def ring(comm):
        ncomm = _UngroupedSendrecv(comm, nccl=fake_nccl, cuda=fake_nccl.cuda)
        reduce_scatter(ncomm, _dev(np.arange(12.0)))

    with pytest.raises(fake_nccl.FakeDeadlock, match="never received"):
        run_in_threads(3, ring)


def _split_and_reduce(comm):
    ncomm = _nccl(comm)
    sub = ncomm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each colour
    x = _dev(np.full(5, float(comm.rank)))
    sub.barrier()
    from minizero.comm import all_reduce
    got = backend.to_host(all_reduce(sub, x))
    return sub.rank, sub.world_size, got, sub.traffic.snapshot()["bytes_sent"], ncomm.traffic.snapshot()["bytes_sent"]


@pytest.mark.timeout(60)
def test_split_makes_one_nccl_communicator_per_colour():
    out = run_in_threads(4, _split_and_reduce)
    members = {0: [0, 2], 1: [1, 3]}
    for r, (sub_rank, size, got, sub_bytes, parent_bytes) in enumerate(out):
        group = members[r % 2]
        assert size == 2 and sub_rank == sorted(group, reverse=True).index(r)
        assert np.array_equal(got, np.full(5, float(sum(group))))
        assert sub_bytes > 0 and parent_bytes == sub_bytes  # the child's bytes show in the parent ledger


@pytest.mark.timeout(60)
def test_tree_broadcast_sends_outside_groups():
    def bcast(comm):
        ncomm = _nccl(comm)
        ncomm.comm.log.clear()
        return backend.to_host(broadcast(ncomm, _dev(np.full(3, float(comm.rank))), root=0)), ncomm.comm.log

    out = run_in_threads(4, bcast)
    assert all(np.array_equal(x, np.zeros(3)) for x, _ in out)
    assert all(not grouped for _, calls in out for *_, grouped in calls)


@pytest.mark.timeout(60)
def test_dtypes_nccl_lacks_are_refused_by_name():
    def native(comm):
        from minizero.comm import all_reduce
        all_reduce(_nccl(comm), _dev(np.zeros(4, dtype=np.complex128)), native=True)

    with pytest.raises(TypeError, match="complex128"):
        run_in_threads(1, native)


_NO_CUPY = "import sys; sys.modules['cupy'] = None\n"


def _python(code):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-c", _NO_CUPY + code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)


@pytest.mark.timeout(90)
def test_the_module_imports_without_cupy_and_the_constructor_says_how_to_install():
    done = _python("import minizero.comm.nccl\n"
                   "from minizero.comm import run_in_threads\n"
                   "try:\n    run_in_threads(1, minizero.comm.nccl.NcclCommunicator)\n"
                   "except ImportError as e:\n    print('refused:', e)\n")
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "[gpu]" in done.stdout and "or use MPI" in done.stdout


def test_comm_flag_defaults_to_mpi_on_the_cpu_and_refuses_nccl_there(tmp_path):
    from minizero.args import UsageError, parse_args
    base = ["--steps", "1", "--out", str(tmp_path)]
    assert parse_args(base).comm == "mpi"
    assert parse_args(base + ["--comm", "mpi"]).comm == "mpi"
    with pytest.raises(UsageError, match="--comm nccl .*--device cuda"):
        parse_args(base + ["--comm", "nccl"])


def test_host_arrays_are_refused_by_real_nccl():
    from minizero.comm.nccl import pointer
    with pytest.raises(TypeError, match="device memory.*numpy.ndarray"):
        pointer(np.zeros(3))
    x = backend.xp.zeros(3)
    assert pointer(x) == backend.data_ptr(x) > 0  # a device (strict) array: its first element's address


@pytest.mark.timeout(60)
def test_host_arrays_travel_over_the_bootstrap():
    from minizero.comm import all_gather, all_reduce

    def run(comm):
        ncomm = NcclCommunicator(comm, nccl=fake_nccl, cuda=fake_nccl.cuda)  # device buffers only, as NCCL
        got = (all_reduce(ncomm, np.full(4, float(comm.rank))), all_gather(ncomm, np.array([comm.rank]), 3),
               all_reduce(ncomm, np.full(4, float(comm.rank)), native=True))
        return got, ncomm.comm.log, ncomm.traffic.snapshot()["bytes_sent"]

    for got, calls, sent in run_in_threads(3, run):
        assert np.array_equal(got[0], np.full(4, 3.0)) and np.array_equal(got[2], np.full(4, 3.0))
        assert np.array_equal(got[1], [0, 1, 2])
        assert calls == [] and sent > 0  # nothing reached NCCL; the bytes are still in this ledger


# --------------------------------------------------------------------------- the whole training loop on it
TRAIN = ["--device", "strict", "--model", "tiny", "--dtype", "float64", "--eval-batches", "1", "--eval-every", "0", "--progress", "none",
         "--no-save", "--steps", "3", "--seed", "1"]


def _train(comm, flags, over_nccl, wrapped=False):
    from minizero.train import parse_args, train
    if over_nccl:
        comm = _nccl(comm)
        if wrapped:  # as minizero.train.nccl_world hands it to the loop: inside the node-aware wrapper
            from minizero.comm.nodes import NodeLayout, NodeTrafficCommunicator
            comm = NodeTrafficCommunicator(comm, NodeLayout.single(comm.world_size))
            assert not comm.nonblocking  # NCCL has no isend/irecv, wrapped or not
    res = train(parse_args(TRAIN + flags, comm.world_size), comm, log=lambda s: None)
    full = res["strategy"].full_model()
    with res["strategy"].full_parameters():
        params = None if full is None else {n: backend.to_host(p.data) for n, p in full.named_parameters()}
    return res["train_losses"], params


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,flags", [(2, []), (2, ["--native-comm"]), (2, ["--zero", "3"]),
                                              (4, ["--tp", "2", "--pp", "2"])])
def test_training_over_nccl_equals_training_over_threads(world_size, flags):
    """Every group split, every collective and every pipeline message of a run through the NCCL code."""
    fake_nccl.CALLS.clear()
    losses, params = run_in_threads(world_size, _train, flags, True, timeout=120)[0]
    kinds = {c[0] for c in fake_nccl.CALLS}
    assert ("allReduce" in kinds) if "--native-comm" in flags else {"send", "recv"} <= kinds
    ref_losses, ref_params = run_in_threads(world_size, _train, flags, False, timeout=120)[0]
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    assert all(np.array_equal(params[k], ref_params[k]) for k in params)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,flags", [(2, []), (2, ["--zero", "3"]), (2, ["--pp", "2", "--grad-accum", "2"]),
                                              (2, ["--pp", "2", "--grad-accum", "2", "--schedule", "gpipe"])])
def test_training_over_nccl_inside_the_node_wrapper_takes_the_blocking_paths(world_size, flags):
    """What ``--comm nccl`` runs: NcclCommunicator inside NodeTrafficCommunicator. The wrapper used to
    claim isend/irecv, so data-parallel overlap, ZeRO-3's prefetch and the pipeline's sends called
    NcclCommunicator.isend and failed; they take their blocking paths, equal to threads."""
    losses, params = run_in_threads(world_size, _train, flags, True, True, timeout=120)[0]
    ref_losses, ref_params = run_in_threads(world_size, _train, flags, False, timeout=120)[0]
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    assert all(np.array_equal(params[k], ref_params[k]) for k in params)


@pytest.mark.timeout(60)
def test_the_interleaved_schedule_is_refused_over_nccl(tmp_path):
    """Its sends are all isend/irecv, which NCCL lacks: refused by name at parse time (--comm nccl is
    the default on --device cuda) and by the engine, instead of failing at the first send."""
    from minizero.args import UsageError, parse_args
    from minizero.nn import GPT, get_config
    from minizero.parallel.interleaved import InterleavedStage, interleave
    from minizero.parallel.pipeline import PipelineEngine

    flags = ["--model", "default", "--steps", "1", "--out", str(tmp_path), "--device", "cuda", "--pp", "2",
             "--schedule", "interleaved", "--virtual-stages", "2", "--grad-accum", "2"]
    with pytest.raises(UsageError, match="--schedule interleaved .*--comm nccl does not have; use --comm mpi"):
        parse_args(flags, 2)
    assert parse_args(flags + ["--comm", "mpi"], 2).comm == "mpi"

    def build(comm):
        model = GPT(get_config("default"), seed=0)
        PipelineEngine(InterleavedStage(interleave(model, comm.rank, 2, 2), 2), _nccl(comm), "interleaved")

    with pytest.raises(ValueError, match="isend/irecv, which NcclCommunicator does not have"):
        run_in_threads(2, build)


def test_nccl_without_nccl_or_with_fewer_gpus_than_ranks_is_one_line_before_any_work(monkeypatch, tmp_path):
    """--device cuda (so --comm nccl) where CuPy has no NCCL, or with more ranks on a node than GPUs: the
    device selection every rank runs before any work returns the reason (exit 2), instead of a traceback
    from NCCL's set-up."""
    from minizero import backend
    from minizero import train as train_module
    from minizero.args import parse_args
    from minizero.comm import nccl
    from minizero.comm.nodes import NodeLayout

    def no_nccl():
        raise ImportError("CuPy is installed without NCCL (cupy.cuda.nccl.available is False); use --comm mpi")

    monkeypatch.setattr(backend, "set_device", lambda device, rank_on_node=0: f"{device}:0")
    monkeypatch.setattr(nccl, "import_nccl", no_nccl)
    args = parse_args(["--model", "tiny", "--steps", "1", "--out", str(tmp_path), "--device", "cuda"], 2)
    assert args.comm == "nccl"

    class Comm:
        rank, nodes = 1, NodeLayout.single(2)

    class World:  # mpi4py's allgather of the two ranks' errors (rank 0 fine, rank 1 not)
        @staticmethod
        def allgather(error):
            return [None, error]

    assert train_module._select_device(args, Comm(), World()) == (
        "[rank 1] CuPy is installed without NCCL (cupy.cuda.nccl.available is False); use --comm mpi")
    args.comm = "mpi"  # --comm mpi does not need NCCL
    assert train_module._select_device(args, Comm(), World()) is None
    args.comm = "nccl"  # NCCL present, but 2 ranks on a node with 1 GPU: NCCL would refuse the duplicate GPU
    monkeypatch.setattr(nccl, "import_nccl", lambda: (fake_nccl, fake_nccl.cuda))  # 1 device
    assert "2 ranks on this node, 1 GPU(s) visible; use --comm mpi" in train_module._select_device(args, Comm(),
                                                                                                   World())


# --------------------------------------------------------------------------- CuPy 13 / 14 unique ids, async errors
def test_the_fake_follows_cupy_14_bytes_id():
    uid = fake_nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(TypeError, match="commId must be bytes"):
        fake_nccl.NcclCommunicator(1, tuple(uid), 0)


class _Cupy13Fake:
    """The fake as CuPy 13 has it: the id is a tuple of 128 signed chars, and the constructor takes a tuple."""

    def __getattr__(self, name):
        return getattr(fake_nccl, name)

    @staticmethod
    def get_unique_id():
        return tuple(b - 256 if b > 127 else b for b in fake_nccl.get_unique_id())

    @staticmethod
    def NcclCommunicator(ndev, comm_id, rank):  # noqa: N802
        assert isinstance(comm_id, tuple) and all(-128 <= v < 128 for v in comm_id)
        return fake_nccl.NcclCommunicator(ndev, bytes(v % 256 for v in comm_id), rank)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nccl", [fake_nccl, _Cupy13Fake()], ids=["cupy14-bytes", "cupy13-tuple"])
def test_the_unique_id_travels_as_get_unique_id_returned_it(nccl):
    from minizero.comm import all_reduce

    def run(comm):
        ncomm = NcclCommunicator(comm, nccl=nccl, cuda=fake_nccl.cuda, timeout=30.0)
        return backend.to_host(all_reduce(ncomm, _dev(np.full(3, float(comm.rank + 1))), native=True)), ncomm.comm.world

    out = run_in_threads(3, run)
    assert all(np.array_equal(x, np.full(3, 6.0)) for x, _ in out)
    assert out[0][1] is out[1][1] is out[2][1]  # every rank joined the same world: the same id


class _NeverDone(fake_nccl.Event):
    done = False  # the device never finishes: only check_async_error can end the wait before the timeout


@pytest.mark.timeout(60)
def test_an_nccl_async_error_raises_at_once_not_after_the_timeout():
    import time
    from types import SimpleNamespace

    cuda = SimpleNamespace(**{**vars(fake_nccl.cuda), "Event": _NeverDone})

    def run(comm):
        ncomm = NcclCommunicator(comm, nccl=fake_nccl, cuda=cuda, timeout=30.0)
        ncomm.comm.async_error = RuntimeError("NCCL_ERROR_REMOTE_ERROR (injected)")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="injected"):
            ncomm._native_allreduce(_dev(np.ones(4)), _dev(np.empty(4)))
        return time.monotonic() - t0

    assert max(run_in_threads(1, run)) < 15.0  # not the 30 s timeout


class _BrokenEvent(fake_nccl.Event):
    ptr = 1  # a stand-in handle for the fake runtime below


def _runtime_with_status(status):
    def event_synchronize(ptr):
        raise RuntimeError(f"cudaErrorIllegalAddress (status {status}, injected)")

    return SimpleNamespace(getDeviceCount=lambda: 1, eventQuery=lambda ptr: status, eventSynchronize=event_synchronize)


@pytest.mark.timeout(60)
def test_a_cuda_error_while_waiting_raises_at_once_not_after_the_timeout():
    """CuPy's Event.done is ``eventQuery(ptr) == 0``: a sticky CUDA error (700, illegal address) reads as
    not done forever. The wait reads the status and raises for anything but ready (0) and not-ready (600)."""
    import time
    cuda = SimpleNamespace(**{**vars(fake_nccl.cuda), "Event": _BrokenEvent, "runtime": _runtime_with_status(700)})

    def run(comm):
        ncomm = NcclCommunicator(comm, nccl=fake_nccl, cuda=cuda, timeout=30.0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress"):
            ncomm._native_allreduce(_dev(np.ones(4)), _dev(np.empty(4)))
        return time.monotonic() - t0

    assert max(run_in_threads(1, run)) < 15.0  # at once, not after the 30 s timeout
    ready = SimpleNamespace(**{**vars(fake_nccl.cuda), "Event": _BrokenEvent, "runtime": _runtime_with_status(0)})

    def done(comm):
        out = _dev(np.zeros(4))
        NcclCommunicator(comm, nccl=fake_nccl, cuda=ready, timeout=30.0)._native_allreduce(_dev(np.ones(4)), out)
        return backend.to_host(out)

    assert np.array_equal(run_in_threads(1, done)[0], np.ones(4))  # status 0: done, as before


@pytest.mark.timeout(60)
def test_a_split_nccl_communicator_gives_its_ranks_world_ranks():
    """The bootstrap's numbering (before: the base class's, its own rank), which the flight recorder names groups by."""
    def world_ranks(comm):
        sub = _nccl(comm).split(comm.rank % 2, key=-comm.rank)
        return [sub.world_rank(k) for k in range(sub.world_size)]

    assert run_in_threads(4, world_ranks) == [[2, 0], [3, 1]] * 2


def test_import_nccl_without_nccl_names_the_pip_package(monkeypatch):
    """CuPy 14 deprecates ``cupyx.tools.install_library`` (its upgrade guide): the error names the NCCL wheel."""
    from types import ModuleType

    from minizero.comm.nccl import import_nccl

    cupy, cuda, nccl = ModuleType("cupy"), ModuleType("cupy.cuda"), ModuleType("cupy.cuda.nccl")
    nccl.available, cuda.nccl, cupy.cuda = False, nccl, cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ImportError, match="pip install nvidia-nccl-cu12") as e:
        import_nccl()
    assert "install_library" not in str(e.value)
