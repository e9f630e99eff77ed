"""``--device strict`` trains bitwise as ``--device cpu``: the compute path leaks nothing to the host.

The strict array module (:mod:`minizero.strict`) refuses every implicit host transfer the way
CuPy does, so a technique that runs here also runs on a GPU without a hidden copy, and one
that leaks fails on a CPU-only CI. Each case trains the tiny model in float64 twice -- NumPy,
then strict -- and every parameter, loss and gradient norm must be the same bits.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero import backend, strict
from minizero.comm import run_in_threads
from minizero.train import parse_args, train
from tests.conftest import REPO_ROOT, mpi_env

BASE = ["--model", "tiny", "--dtype", "float64", "--steps", "2", "--eval-batches", "1", "--eval-every", "1",
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
    # GPipe's schedule is other data for the same engine (schedule.py): no case of its own
    # blocking sends (one sendrecv per send and the next receive); the isends: pp2-interleaved, dp2-tp2-pp2 and the
    # command line's pp2-isend-irecv
    "pp2-1f1b-blocking": (2, ["--pp", "2", "--grad-accum", "2", "--no-overlap"]),
    "recompute-full": (1, ["--recompute", "full"]),
    "recompute-selective-dp2": (2, ["--recompute", "selective"]),
    "fp16": (1, ["--precision", "fp16", "--dtype", "float32"]),
    "fp16-zero2-dp2": (2, ["--precision", "fp16", "--dtype", "float32", "--zero", "2"]),
    "pp2-interleaved": (2, ["--model", "default", "--block-size", "8", "--pp", "2", "--grad-accum", "2",
                            "--schedule", "interleaved", "--virtual-stages", "2"]),
    "cp2": (2, ["--cp", "2"]),  # the dropout masks read by block and by chunk
    "cp2-ulysses": (2, ["--cp", "2", "--cp-attention", "ulysses"]),
    "moe-ep2": (2, ["--moe-experts", "4", "--ep", "2", "--moe-capacity-factor", "1.0", "--moe-bias-update", "0.01"]),
    "moe-ep2-bf16": (2, ["--moe-experts", "4", "--ep", "2", "--precision", "bf16", "--dtype", "float32"]),
    "moe-ep2-fp16": (2, ["--moe-experts", "4", "--ep", "2", "--precision", "fp16", "--dtype", "float32"]),
    # ExpertZero under hybrid sharding: the dense part and the experts each sharded over 2 and replicated (the
    # dense part is the plain ZeRO optimizer with its replica group: hybrid ZeRO's replica all-reduce on the
    # device); the replica check (on by default here) compares both parts' optimizer state. Its ZeRO-3 FP16 twin
    # (the loss scaler in the check too) is test_strict_techniques' FP16 overflow test: these flags and BASE, 3 steps
    # on both devices, the same bits (the step after the skipped one included)
    "moe-ep2-zero1-hybrid-dp4": (4, ["--moe-experts", "4", "--ep", "2", "--zero", "1", "--dp-shard", "2"]),
    "dp2-tp2-pp2": (8, ["--dp", "2", "--tp", "2", "--pp", "2", "--grad-accum", "2"]),
    "dp4-hierarchical-no-overlap": (4, ["--allreduce", "hierarchical", "--no-overlap"]),
    "dp2-native-comm": (2, ["--native-comm"]),
    "quantized-comm-zero2": (2, ["--quantized-comm", "--zero", "2"]),
    "prune-global-zero3": (2, ["--prune-sparsity", "0.5", "--prune-scope", "global", "--prune-step", "1", "--zero", "3"]),
    "flash-tp2": (2, ["--attention", "flash", "--attention-block", "5", "--tp", "2"]),  # dropout masks read by block
    "bf16": (1, ["--precision", "bf16", "--dtype", "float32"]),
    "bf16-flash-zero3-dp2": (2, ["--precision", "bf16", "--dtype", "float32", "--attention", "flash", "--zero", "3"]),
    "fp8-delayed-dp2": (2, ["--precision", "fp8", "--dtype", "float32"]),
    "fp8-current": (1, ["--precision", "fp8", "--dtype", "float32", "--fp8-scaling", "current"]),
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
            # equal_nan: an FP16 step skipped for overflow has a NaN gradient norm on both
            assert np.array_equal(np.asarray(g[key], dtype=float), np.asarray(w[key], dtype=float), equal_nan=True), key


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


CLI_ARGV = ["--model", "tiny", "--steps", "3", "--dtype", "float64", "--progress", "none", "--sample-tokens", "8"]
#: id -> flags of test_cli_strict_equals_cpu_bitwise's cases, each trained on strict, then on cpu, in one launch
CLI_CASES = {"zero3": ["--zero", "3"], "tp2": ["--tp", "2"], "pp2-isend-irecv": ["--pp", "2", "--grad-accum", "2"],
             "native-mpi-collectives": ["--native-comm", "--zero", "2"]}
#: the command line's main per case and device, one after another in the same process(es) (one start-up, not one
#: per run); rank 0 keeps each run's standard output beside its --out folder
_CLI_JOB = """
import contextlib, io, json, os, sys
from mpi4py import MPI
from minizero.train import main
out, argv = sys.argv[1], json.loads(sys.argv[2])
for case, flags in json.loads(sys.argv[3]).items():
    for device in ("strict", "cpu"):
        folder, shown = os.path.join(out, case, device), io.StringIO()
        with contextlib.redirect_stdout(shown):
            code = main(argv + ["--device", device, *flags, "--out", folder])
        if code:
            sys.exit(code)
        if MPI.COMM_WORLD.rank == 0:
            with open(folder + ".stdout", "w") as f:
                f.write(shown.getvalue())
"""


def run_cli_job(out, cases: dict, n: int = 1):
    """_CLI_JOB on CLI_ARGV and ``cases`` (id -> flags) under ``mpiexec -n n``, or one process without a launcher
    (n = 1); returns ``out``, which holds CASE/DEVICE/model.npz and CASE/DEVICE.stdout."""
    from minizero.files import mpiexec_path

    cmd = [sys.executable, "-c", _CLI_JOB, str(out), json.dumps(CLI_ARGV), json.dumps(cases)]
    if n > 1:
        if mpiexec_path() is None:
            pytest.skip("mpiexec not found (pip install mpich, or a system MPI)")
        cmd = [mpiexec_path(), "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def assert_cli_same_bits(out, case):
    """Case ``case`` of :func:`run_cli_job`: each run on its device, the same model.npz bits, the same validation
    loss printed (from host values)."""
    want, got = (dict(np.load(out / case / device / "model.npz")) for device in ("cpu", "strict"))
    out_cpu, out_strict = ((out / case / f"{device}.stdout").read_text() for device in ("cpu", "strict"))
    assert "device cpu (NumPy" in out_cpu and "device strict (NumPy underneath" in out_strict  # each on its own
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    loss = [line for line in out_cpu.splitlines() if line.startswith("validation loss")]
    assert loss and loss[0].split(" after")[0] in out_strict


@pytest.fixture(scope="module")
def cli_job(tmp_path_factory):
    return run_cli_job(tmp_path_factory.mktemp("strict_cli"), CLI_CASES, n=2)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_strict_equals_cpu_bitwise(cli_job, case):
    """The issue's check: ``python -m minizero.train --device strict --model tiny --steps 3 --dtype float64``
    writes the same model.npz bits as ``--device cpu``, under ``mpiexec -n 2`` with ZeRO-3 and TP (and the
    pipeline's isend/irecv and MPI's own collectives, which stage device buffers through the host): the
    program's main, each case and device in turn in one launch (strict first: nothing ran before it on the
    device but the previous cases). One process alone, without mpiexec: test_strict_techniques' CLI cases
    (offload, 8-bit Adam) through run_cli_job."""
    assert_cli_same_bits(cli_job, case)


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


def test_dropout_masks_are_drawn_on_the_device_and_replay(strict_backend):
    """The counter-based generator: same bits on NumPy and strict, a device array, replayable, per seed."""
    from minizero.autograd import rng

    rng.manual_seed(11)
    state = rng.get_rng_state()
    got = rng.dropout_keep_mask((3, 5, 7), 0.3)
    assert isinstance(got, strict.StrictArray) and got.dtype == np.bool_ and got.shape == (3, 5, 7)
    assert rng.get_rng_state()["offset"] == state["offset"] + 105
    rng.set_rng_state(state)
    assert backend.to_host(rng.dropout_keep_mask((3, 5, 7), 0.3)).tobytes() == backend.to_host(got).tobytes()
    backend.set_backend("numpy")
    rng.manual_seed(11)
    want = rng.dropout_keep_mask((3, 5, 7), 0.3)
    assert isinstance(want, np.ndarray) and want.tobytes() == backend.to_host(got).tobytes()
    rng.manual_seed(12)
    other = rng.dropout_keep_mask((3, 5, 7), 0.3)
    assert not np.array_equal(other, want) and 0.6 < want.mean() < 0.8
    with pytest.raises(ValueError, match="key"):
        rng.set_rng_state({"state": 1})


def _transfers_of(steps, flags):
    def fn(comm):
        args = parse_args(BASE[:4] + ["--steps", str(steps), "--eval-every", "0", "--progress", "none",
                                      "--dropout", "0.1", *flags], comm.world_size)
        train(args, comm, log=lambda s: None)
    strict.reset_transfers()
    run_in_threads(2, fn, timeout=60)
    return dict(strict.transfers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [[], ["--tp", "2"], ["--precision", "fp16", "--dtype", "float32"]],
                         ids=["dp2", "tp2", "fp16"])
def test_a_step_moves_a_few_values_not_one_per_parameter(strict_backend, flags):
    """Per step and rank: the batch in (x, y), the loss, the gradient norm and the FP16 overflow flag out,
    each one explicit transfer -- not one per parameter (the tiny model has 29 parameter arrays)."""
    one, two = _transfers_of(1, flags), _transfers_of(2, flags)
    per_step = {k: (two[k] - one[k]) / 2 for k in one}  # the second step, on 2 ranks
    assert 1 <= per_step["to_device"] <= 6 and 1 <= per_step["to_host"] <= 6, per_step


@pytest.mark.timeout(300)
def test_sample_and_quantize_on_strict_equal_cpu(tmp_path, capsys):
    """``--device`` on the other programs (their main, in this process, on a tiny float64 model as train writes
    it): the same text and the same table on strict as on cpu; cuda without CuPy is one line and exit 2."""
    import dataclasses

    from minizero.nn import GPT, get_config
    from minizero.quantize import main as quantize_main
    from minizero.sample import main as sample_main

    def run(main, *argv):
        try:
            code = main(list(argv))
        finally:
            backend.set_backend("numpy")
        said = capsys.readouterr()
        return code, said.out, said.err

    cfg = get_config("tiny", dtype="float64")
    np.savez(tmp_path / "model.npz", **GPT(cfg, seed=5).state_dict())
    (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    weights = str(tmp_path / "model.npz")
    for main, argv in ((sample_main, ["--tokens", "16"]), (quantize_main, ["--bits", "4"])):
        cpu = run(main, "--weights", weights, *argv, "--device", "cpu")
        on_strict = run(main, "--weights", weights, *argv, "--device", "strict")
        assert cpu[0] == on_strict[0] == 0, cpu[2] + on_strict[2]
        assert on_strict[1] == cpu[1] and cpu[1]
        try:
            import cupy  # noqa: F401
        except ImportError:
            cuda = run(main, "--weights", weights, *argv, "--device", "cuda")
            assert cuda[0] == 2 and "CuPy" in cuda[2] and "Traceback" not in cuda[2]


def _ledger_peaks(comm, argv):
    from minizero.ledger import MemoryLedger, get_ledger, set_ledger

    set_ledger(MemoryLedger())
    train(parse_args(argv, comm.world_size), comm, log=lambda s: None)
    return dict(get_ledger().peak)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--tp", "2"], ["--tp", "2", "--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_the_memory_ledger_measures_the_same_bytes_under_strict(flags):
    """The ledger follows ``.base`` to the owning buffer: a strict view kept its owner only while another
    reference did, so with sequence parallelism strict measured 10% less activation memory than cpu."""
    argv = BASE + ["--steps", "2", "--no-save", "--sample-tokens", "0", *flags]
    peaks = {}
    for device in ("cpu", "strict"):
        backend.set_device(device)
        try:
            peaks[device] = run_in_threads(2, _ledger_peaks, argv, timeout=60)
        finally:
            backend.set_backend("numpy")
    assert peaks["strict"] == peaks["cpu"] and peaks["cpu"][0]["activations"] > 0
