"""``--device strict`` trains bitwise as ``--device cpu``: the compute path leaks nothing to the host.

The strict array module (:mod:`minizero.strict`) refuses every implicit host transfer the way
CuPy does, so a technique that runs here also runs on a GPU without a hidden copy, and one
that leaks fails on a CPU-only CI. Each case trains the tiny model in float64 twice -- NumPy,
then strict -- and every parameter, loss and gradient norm must be the same bits.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero import backend, strict
from minizero.comm import run_in_threads
from minizero.train import parse_args, train
from tests.conftest import REPO_ROOT, mpi_env

BASE = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "2",
        "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "5", "--dropout", "0.1",
        "--micro-batch-size", "2"]

#: name -> (rank threads, flags): the in-process equivalence suite (other techniques add their cases here)
CASES = {
    "dp2": (2, ["--grad-accum", "2"]),
    "zero1": (2, ["--zero", "1"]),
    "zero2": (2, ["--zero", "2"]),
    "zero3": (2, ["--zero", "3"]),
    "tp2": (2, ["--tp", "2"]),
    "tp2-sequence-parallel": (2, ["--tp", "2", "--sequence-parallel"]),
    "pp2-1f1b": (2, ["--pp", "2", "--grad-accum", "2"]),
    "recompute-full": (1, ["--recompute", "full"]),
    "recompute-selective-dp2": (2, ["--recompute", "selective"]),
    "fp16": (1, ["--precision", "fp16", "--dtype", "float32"]),
    "fp16-zero2-dp2": (2, ["--precision", "fp16", "--dtype", "float32", "--zero", "2"]),
    "pp2-gpipe": (2, ["--pp", "2", "--grad-accum", "2", "--schedule", "gpipe"]),
    "pp2-interleaved": (2, ["--model", "default", "--block-size", "8", "--pp", "2", "--grad-accum", "2",
                            "--schedule", "interleaved", "--virtual-stages", "2"]),
    "cp2": (2, ["--cp", "2", "--dropout", "0"]),  # ring attention has no attention dropout
    "dp2-tp2-pp2": (8, ["--dp", "2", "--tp", "2", "--pp", "2", "--grad-accum", "2"]),
    "dp4-hierarchical-no-overlap": (4, ["--allreduce", "hierarchical", "--no-overlap"]),
    "dp2-native-comm": (2, ["--native-comm"]),
}


def _train_rank(comm, argv):
    args = parse_args(argv, comm.world_size)
    result = train(args, comm, log=lambda s: None)
    with result["strategy"].full_parameters():  # ZeRO-3: whole parameters (collective)
        params = [backend.to_host(p.data).copy() for p in result["stage"].parameters()]
    return {"params": params, "train_losses": result["train_losses"], "grad_norms": result["grad_norms"],
            "val": [v for _, v in result["val_history"]], "loss_scales": result["loss_scales"]}


def run_on(device: str, world: int, flags) -> list:
    """Train ``flags`` on ``world`` rank threads with ``backend`` set to ``device``; per-rank results (host)."""
    backend.set_device(device)
    try:
        return run_in_threads(world, _train_rank, BASE + list(flags), timeout=60)
    finally:
        backend.set_backend("numpy")


def assert_same_bits(got, want):
    """Every array and number of two per-rank result lists is the same bits."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert len(g["params"]) == len(w["params"]) > 0
        for a, b in zip(g["params"], w["params"]):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
        for key in ("train_losses", "grad_norms", "val", "loss_scales"):
            assert np.array_equal(np.asarray(g[key], dtype=float), np.asarray(w[key], dtype=float)), key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_strict_device_equals_numpy_bitwise(case):
    world, flags = CASES[case]
    want = run_on("cpu", world, flags)
    strict.reset_transfers()
    got = run_on("strict", world, flags)
    assert strict.transfers["to_device"] > 0  # it really ran on the strict module (batches were copied in)
    assert_same_bits(got, want)


def test_a_host_leak_fails_under_strict(strict_backend):
    """The suite can fail: NumPy code on a device array raises instead of computing on the host."""
    from minizero.autograd import Tensor

    t = Tensor(backend.xp.zeros((2, 3)))
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(t.data)
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        t.data + np.ones((2, 3))


def _cli(mpiexec, n, device, flags, out):
    argv = ["--model", "tiny", "--steps", "3", "--dtype", "float64", "--progress", "none", "--sample-tokens", "8",
            "--device", device, *flags, "--out", str(out)]
    cmd = ([mpiexec, "-n", str(n)] if n > 1 else []) + [sys.executable, "-m", "minizero.train", *argv]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=150, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(np.load(os.path.join(out, "model.npz"))), proc.stdout


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n, flags", [(1, []), (2, ["--zero", "3"]), (2, ["--tp", "2"])], ids=["one", "zero3", "tp2"])
def test_cli_strict_equals_cpu_bitwise(mpiexec, tmp_path, n, flags):
    """The issue's check: ``python -m minizero.train --device strict --model tiny --steps 3 --dtype float64``
    writes the same model.npz bits as ``--device cpu``, alone and under ``mpiexec -n 2`` with ZeRO-3 and TP."""
    want, out_cpu = _cli(mpiexec, n, "cpu", flags, tmp_path / "cpu")
    got, out_strict = _cli(mpiexec, n, "strict", flags, tmp_path / "strict")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    loss = [line for line in out_cpu.splitlines() if line.startswith("validation loss")]
    assert loss and loss[0].split(" after")[0] in out_strict  # same validation loss, printed from host values


def test_device_cuda_without_cupy_is_one_clear_line(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--device", "cuda", "--model", "tiny", "--steps", "1",
                           "--out", str(tmp_path)], env=mpi_env(), capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert proc.returncode == 2
    assert "CuPy" in proc.stderr and "pip install" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "model.npz")
