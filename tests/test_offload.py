"""Activation offload through saved_tensors_hooks: exact gradients, lower process peak, no files left."""
import os
import tracemalloc

import numpy as np
import pytest

from minizero.memory.offload import ActivationOffload, OffloadError, check_offload_dir
from tests.test_recompute import grads_and_peak


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_offload_gradients_bitwise_equal(kind, recompute, tmp_path):
    ref, _, _ = grads_and_peak("none", 1)
    off = ActivationOffload(kind, str(tmp_path))
    got, peak, _ = grads_and_peak(recompute, 1, offload=off)
    for i, (a, b) in enumerate(zip(ref, got)):
        np.testing.assert_array_equal(a, b, err_msg=f"param {i}")
    assert off.bytes_offloaded > 0
    off.close()
    assert os.listdir(tmp_path) == []


def test_the_estimator_keeps_the_offloads_small_array_threshold():
    from minizero.memory.estimator.model import OFFLOAD_MIN_BYTES
    from minizero.memory.offload import MIN_BYTES
    assert ActivationOffload("cpu").min_bytes == MIN_BYTES == OFFLOAD_MIN_BYTES


def test_cpu_offload_moves_bytes_to_offloaded_category(tmp_path):
    from minizero.nn import get_config
    cfg, b = get_config("small"), 2
    _, none_peak, _ = grads_and_peak("none", 1, "small", 0.0, "float32", b)
    _, cpu_peak, _ = grads_and_peak("none", 1, "small", 0.0, "float32", b, offload=ActivationOffload("cpu"))
    # what is left, byte for byte: the arrays under 1 KiB, float32 (b, s) rows (each LayerNorm's mean and rstd, the
    # loss's log-sum-exp) and the int64 positions (s,); the token ids (b * s * 8 = 1 KiB) go
    stats = 2 * (2 * cfg.n_layer + 1) + 1
    assert cpu_peak == stats * 4 * b * cfg.block_size + 8 * cfg.block_size < none_peak, (cpu_peak, none_peak)


def test_nvme_offload_lowers_process_peak(tmp_path):
    def measured(offload):
        tracemalloc.start()
        tracemalloc.reset_peak()
        grads_and_peak("none", 1, "small", 0.0, "float32", batch=8, offload=offload)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    base = measured(None)
    off = ActivationOffload("nvme", str(tmp_path))
    nvme = measured(off)
    off.close()
    assert nvme < 0.8 * base, (nvme, base)
    assert os.listdir(tmp_path) == []


def test_offload_dir_checked_before_work(tmp_path):
    with pytest.raises(OffloadError, match="not an existing directory"):
        ActivationOffload("nvme", str(tmp_path / "missing"))
    with pytest.raises(OffloadError, match="bytes free"):
        check_offload_dir(str(tmp_path), need_bytes=1 << 62)
    with pytest.raises(ValueError, match="'disk'"):
        ActivationOffload("disk")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", [None, "1:3:kill", "0:2:raise"])
def test_main_job_with_nvme_offload_leaves_nothing_behind(mpiexec, tmp_path, fault):
    import subprocess
    import sys

    from tests.conftest import mpi_env

    env = mpi_env()
    if fault:
        env["MINIZERO_FAULT"] = fault
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "6",
           "--eval-batches", "1", "--sample-tokens", "4", "--no-progress", "--no-save", "--recompute", "selective",
           "--offload-activations", "nvme", "--offload-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert (proc.returncode == 0) == (fault is None), proc.stderr
    assert os.listdir(tmp_path) == []


def test_bad_offload_dir_is_a_usage_error(tmp_path):
    from minizero.train import UsageError, parse_args

    with pytest.raises(UsageError, match="is not an existing directory"):
        parse_args(["--offload-activations", "nvme", "--offload-dir", str(tmp_path / "nope")])
    with pytest.raises(UsageError, match="only used with --offload-activations nvme"):
        parse_args(["--offload-dir", str(tmp_path)])


# ---- optimizer offload ------------------------------------------------------------------
def _train_params(comm, argv):
    from minizero.ledger import MemoryLedger, get_ledger, set_ledger
    from minizero.train import parse_args, train

    set_ledger(MemoryLedger())
    args = parse_args(["--model", "tiny", "--dtype", "float64", "--steps", "3", "--grad-accum", "2",
                       "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--grad-clip", "0.05"] + argv,
                      comm.world_size)
    res = train(args, comm, log=lambda s: None)
    opt = res["opt"]
    with opt.full_parameters() if hasattr(opt, "full_parameters") else contextlib.nullcontext():
        params = [p.data.copy() for p in res["model"].parameters()]
    return params, res["state_bytes"], get_ledger().peak, opt.store.disk_bytes


import contextlib  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1, 3])
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_optimizer_offload_is_exact_and_moves_the_state(zero, kind, tmp_path):
    from minizero.comm import run_in_threads

    ref = run_in_threads(2, _train_params, ["--zero", str(zero)])
    extra = ["--zero", str(zero), "--offload-optimizer", kind] + (["--offload-dir", str(tmp_path)] if kind == "nvme"
                                                                  else [])
    got = run_in_threads(2, _train_params, extra)
    for (p_ref, sb_ref, _, _), (p_got, sb_got, peak, disk) in zip(ref, got):
        for a, b in zip(p_ref, p_got):
            np.testing.assert_array_equal(a, b)
        assert sb_got["optimizer_state"] == 0 and sb_ref["optimizer_state"] > 0
        if kind == "cpu":
            assert peak["offloaded"] == sb_ref["optimizer_state"]
        else:
            assert peak["offloaded"] == 0 and disk == sb_ref["optimizer_state"]
    assert os.listdir(tmp_path) == []


def test_optimizer_offload_flags():
    from minizero.train import UsageError, parse_args

    with pytest.raises(UsageError, match="works with --optimizer adamw"):
        parse_args(["--optimizer", "adam8bit", "--offload-optimizer", "cpu"])
    with pytest.raises(UsageError, match="'gpu'"):
        parse_args(["--offload-optimizer", "gpu"])


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_buffer_saved_twice_is_offloaded_once(kind, tmp_path):
    """Issue 19: the softmax output without dropout is saved by the softmax and by att @ v: one copy."""
    from minizero.autograd import Tensor, causal_softmax
    from minizero.memory.offload import ActivationOffload

    off = ActivationOffload(kind, str(tmp_path), min_bytes=0)
    a = np.arange(64, dtype=np.float64).reshape(8, 8)
    p1, p2 = off.pack(a), off.pack(a[:])  # the same bytes through another view object
    assert p1 is p2 and off.bytes_offloaded == a.nbytes and off.saves_shared == 1
    assert off.pack(a[:4]) is not p1 and off.bytes_offloaded == a.nbytes + a[:4].nbytes  # other bytes
    assert np.array_equal(off.unpack(off.pack(a.T)), a.T)  # same buffer, address and shape; other strides
    assert np.array_equal(off.unpack(p1), a) and np.array_equal(off.unpack(p2), a)  # both saves read it back
    if kind == "nvme":
        f = p1.file
        assert not f.closed  # readable while a save holds it (retain_graph reads it again)
        del p1, p2
        assert f.closed  # closed, its blocks released, with the last save that held it
    # in a graph: x -> softmax -> (att @ v): att is saved twice, packed once
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((1, 1, 4, 4)), requires_grad=True)
    v = Tensor(rng.standard_normal((1, 1, 4, 4)), requires_grad=True)
    off2 = ActivationOffload(kind, str(tmp_path), min_bytes=0)
    with off2():
        att = causal_softmax(x)
        y = att @ v
    assert off2.saves_shared == 1 and off2.bytes_offloaded == att.data.nbytes + v.data.nbytes  # not 2 att + v
    y.sum().backward()
    ref_x, ref_v = Tensor(x.data.copy(), requires_grad=True), Tensor(v.data.copy(), requires_grad=True)
    (causal_softmax(ref_x) @ ref_v).sum().backward()
    assert np.array_equal(x.grad, ref_x.grad) and np.array_equal(v.grad, ref_v.grad)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_buffer_refilled_in_place_is_packed_anew_by_the_next_forward(kind, tmp_path):
    """Sharing a packed copy lasts while a save holds it. Before: the cpu table kept every copy while the device
    buffer lived, so a buffer refilled in place (an input or receive buffer reused) gave the next forward the
    first one's bytes: the second gradient read 1.0 where 2.0 is right."""
    from minizero.autograd import Tensor
    off = ActivationOffload(kind, str(tmp_path), min_bytes=0)
    buf, w = np.ones((16, 16)), Tensor(np.full((16, 16), 3.0), requires_grad=True)
    for step in (1.0, 2.0):
        buf[...] = step
        with off():
            y = (Tensor(buf) * w).sum()
        w.grad = None
        y.backward()
        assert np.all(w.grad == step)


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_backward_twice_with_retain_graph_reads_the_offloaded_arrays_twice(kind, tmp_path):
    """As without offload (and torch's save_on_cpu): retain_graph keeps the saves readable. Before: nvme closed a
    file at its last save's first unpack, and the second backward raised 'seek of closed file'."""
    from minizero.autograd import Tensor
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((16, 16)), requires_grad=True)
    off = ActivationOffload(kind, str(tmp_path), min_bytes=0)
    with off():
        y = (x.tanh() * x.tanh()).sum()
    y.backward(retain_graph=True)
    first, x.grad = x.grad.copy(), None
    y.backward()
    assert np.array_equal(x.grad, first)


def test_a_buffer_packed_each_forward_is_watched_once():
    """The finalizer that forgets a freed buffer's copy is registered once per buffer. Before: a buffer that lives
    across steps (refilled in place) got one more finalizer each forward, kept for the run."""
    import gc
    import weakref

    from minizero.autograd import Tensor
    off = ActivationOffload("cpu", min_bytes=0)
    buf, w = np.ones((16, 16)), Tensor(np.full((16, 16), 3.0), requires_grad=True)
    counts = []
    for _ in range(5):
        with off():
            y = (Tensor(buf) * w).sum()
        y.backward()
        counts.append(sum(isinstance(o, weakref.finalize) for o in gc.get_objects()))
    assert counts[1:] == counts[:-1], counts


def test_parameters_saved_in_forward_stay_and_only_activations_are_offloaded():
    """A saved weight is the parameter itself: pack returns it (no copy, no bytes counted); an activation array of
    the same bytes is copied out. (A mutant keeping "gradients" instead of "parameters" offloaded every weight.)"""
    from minizero.ledger import MemoryLedger, set_ledger
    from minizero.nn.module import Parameter

    set_ledger(MemoryLedger())
    try:
        w = Parameter(np.ones((16, 16)))  # 2 KiB, tracked as "parameters"
        act = np.ones((16, 16))
        off = ActivationOffload("cpu")
        assert off.pack(w.data) is w.data and off.bytes_offloaded == 0
        packed = off.pack(act)
        assert packed is not act and off.bytes_offloaded == act.nbytes
        np.testing.assert_array_equal(off.unpack(packed), act)
    finally:
        set_ledger(MemoryLedger())
