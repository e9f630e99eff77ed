"""8-bit Adam, quantization, offload, quantized communication, the replica check and its faults, checkpoints
(saved, resharded, resumed), anomaly detection and data-parallel fine-tuning under the strict array module.

``backend.set_backend("strict")`` makes ``backend.xp`` :mod:`minizero.strict`: NumPy underneath,
but its arrays raise on every implicit host transfer (``np.asarray``, ``float`` of a vector,
mixing with NumPy arrays, iteration), as CuPy's do. Each test runs a technique once on NumPy and
once under strict, from the same host inputs, and asserts the results are equal bit for bit:
so the technique computes on the device (a leak would raise) and computes the same thing.
The first test proves that the fixture can fail: a host leak raises under strict.
"""
import numpy as np
import pytest

from minizero import backend, strict
from minizero.comm import run_in_threads
from minizero.ledger import get_ledger


def _host(x):
    """Host copies of the arrays in a (nested) result; other values as they are."""
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return np.array(backend.to_host(x), copy=True)
    return x


def _on(name, fn, *args, host_sizes=None, **kwargs):
    """``fn(*args)`` with ``backend.xp`` = ``name``'s module; host copies of its result; NumPy again after.

    ``host_sizes``: a list that receives the element count of every ``backend.to_host`` call made
    while ``fn`` runs (so a test can assert that only one-number checks came to the host).
    """
    backend.set_backend(name)
    real = backend.to_host
    if host_sizes is not None:
        def counted(a):
            host_sizes.append(int(a.size) if hasattr(a, "size") else 1)
            return real(a)
        backend.to_host = counted
    try:
        out = fn(*args, **kwargs)
    finally:
        backend.to_host = real
        backend.set_backend("numpy")
    return _host(out)


def _assert_same(a, b, where="result"):
    """Equal bit for bit (dtype and shape too), recursing into lists, tuples and dicts."""
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same(u, v, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), f"{where} differs between numpy and strict"
    else:
        assert a == b, where


def _data(seed, n, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-4, 1, n))).astype(dtype)


# --------------------------------------------------------------------------- the fixture can fail
def test_strict_refuses_a_host_leak(strict_backend):
    x = backend.xp.asarray(_data(0, 8))
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        x + np.ones(8, np.float32)  # mixing a host array into device arithmetic
    with pytest.raises(TypeError, match="numpy.concatenate"):
        np.concatenate([x, x])  # an np. call where backend.xp belongs
    with pytest.raises(TypeError, match="iterating"):
        list(x)
    with pytest.raises(TypeError):
        float(x)
    # what the technique modules did before they moved to backend.xp: a host array fed to a device one
    from minizero.quantization import quantize_blockwise
    from minizero.optim.adam8bit import make_codes
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        quantize_blockwise(x, make_codes(device=False)[0])


# --------------------------------------------------------------------------- quantizers
def _quantizers():
    from minizero import quantization as Q
    from minizero.optim.adam8bit import make_codes

    xp, out = backend.xp, []
    w = backend.to_device(_data(1, 37 * 19).reshape(37, 19))
    for bits in (8, 4):
        for gran in ("tensor", "row", "block"):
            q, s = Q.quantize(w, bits, gran, 16)
            t = Q.QuantizedTensor.from_array(w, bits, gran, 16)
            out += [q, s, Q.dequantize(q, s, w.shape, bits, gran, 16, dtype=np.float64), t.dequantize(), t.nbytes]
    codes = xp.asarray(np.arange(-8, 8, dtype=np.int8).repeat(3))
    out.append(Q.unpack_int4(Q.pack_int4(codes), codes.size))
    signed, unsigned = make_codes("dynamic")
    for offset in (0, 5, 300):
        c, a = Q.quantize_blockwise(w.reshape(-1), signed, 64, offset)
        out += [c, a, Q.dequantize_blockwise(c, a, signed, 64, offset), Q.block_absmax(w.reshape(-1), 64, offset)]
    c, a = Q.quantize_blockwise(xp.abs(w).reshape(-1), unsigned, 256)
    out += [c, a, Q.dequantize_blockwise(c, a, unsigned, 256, dtype=np.float64)]
    bad = xp.asarray(np.array([1.0, np.inf], np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize(bad)
    return out


def test_int8_int4_and_blockwise_quantizers_equal_numpy(strict_backend):
    sizes = []
    got = _on("strict", _quantizers, host_sizes=sizes)
    _assert_same(_on("numpy", _quantizers), got)
    assert sizes and set(sizes) == {1}  # nothing came to the host but one-number checks


# --------------------------------------------------------------------------- 8-bit Adam
def _adam8bit(steps=3):
    from minizero.nn.module import Parameter
    from minizero.optim.adam8bit import Adam8bit

    shapes = [(64, 80), (300,), (40, 50)]
    params = [Parameter(backend.to_device(_data(10 + i, int(np.prod(s))).reshape(s))) for i, s in enumerate(shapes)]
    opt = Adam8bit(params, lr=1e-2, block_size=48, min_8bit_size=1000, master_weights=True)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = backend.to_device(_data(100 * step + i, p.size).reshape(p.shape))
        opt.step()
    return [p.data for p in params], opt.dequantized_state(), opt.state_nbytes(), opt


def test_adam8bit_steps_equal_numpy(strict_backend):
    *ref, ref_opt = _on("numpy", _adam8bit)
    sizes = []
    *got, opt = _on("strict", _adam8bit, host_sizes=sizes)
    assert sizes and set(sizes) == {1}  # the steps brought nothing to the host but one-number checks
    assert isinstance(opt.m[0].codes, strict.StrictArray) and isinstance(opt.m[0].code, strict.StrictArray)
    _assert_same(ref + [ref_opt.state_dict()], got + [opt.state_dict()])  # state_dict: host copies by contract


def _sharded(comm, steps=3, block=48, min_8bit=200):
    from minizero.zero import ShardMap
    from minizero.nn import GPT, get_config
    from minizero.optim.adam8bit import ShardedAdam8bit

    model = GPT(get_config("tiny", dtype="float64"))
    smap = ShardMap.from_model(model, comm.world_size)
    state = ShardedAdam8bit(smap, comm, np.float64, block_size=block, min_8bit_size=min_8bit)
    shards = []
    for i, u in enumerate(smap.units):
        off, size = smap.shard(i, comm.rank)
        full = np.concatenate([_data(j, int(np.prod(s)), np.float64) for j, s in enumerate(u.shapes)])
        shards.append(backend.to_device(full[off:off + size]))
    for step in range(1, steps + 1):
        for i, u in enumerate(smap.units):
            off, size = smap.shard(i, comm.rank)
            g = np.concatenate([_data(1000 * step + j, int(np.prod(s)), np.float64) for j, s in enumerate(u.shapes)])
            state.step_unit(i, shards[i], backend.to_device(g[off:off + size]), step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    pieces = [[(m, v) for _, m, v in state.dequantized_pieces(i)] for i in range(len(smap.units))]
    return shards, pieces, sum(len(s) for s in state.shared)


@pytest.mark.timeout(60)
def test_sharded_adam8bit_with_cut_blocks_equals_numpy(strict_backend):
    ref = _on("numpy", run_in_threads, 2, _sharded)
    sizes = []
    got = _on("strict", run_in_threads, 2, _sharded, host_sizes=sizes)
    assert sizes and set(sizes) == {1}
    assert ref[0][2] > 0  # blocks cut by a shard boundary: the absmax all-reduce ran
    _assert_same(ref, got)


# --------------------------------------------------------------------------- quantized communication
def _collectives(comm, n=1000, block=64):
    from minizero.comm import shard_range
    from minizero.comm.quantized import quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter

    x = backend.to_device(_data(comm.rank, n))
    off, size = shard_range(n, comm.world_size, comm.rank)
    gathered = quantized_all_gather(comm, x[off:off + size].copy(), n, block_size=block)
    scattered = quantized_reduce_scatter(comm, x, block_size=block)
    reduced = quantized_all_reduce(comm, x, block_size=block)
    overflow = backend.to_device(np.where(np.arange(n) == 7 + comm.rank, np.inf, _data(comm.rank, n)))
    return gathered, scattered, reduced, quantized_all_reduce(comm, overflow, block_size=block), comm.traffic.snapshot()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_quantized_collectives_equal_numpy(strict_backend, world_size):
    ref = _on("numpy", run_in_threads, world_size, _collectives)
    sizes = []
    got = _on("strict", run_in_threads, world_size, _collectives, host_sizes=sizes)
    assert sizes and set(sizes) == {1}  # quantized, sent and summed on the device
    assert np.isnan(ref[0][3][:64]).all()  # the overflowed block arrives as NaN on both
    _assert_same(ref, got)


# --------------------------------------------------------------------------- offload
def _activation_offload(kind, folder):
    from minizero.memory.offload import ActivationOffload

    off = ActivationOffload(kind, offload_dir=folder, min_bytes=16)
    arrays = [backend.to_device(_data(i, 300).reshape(15, 20)) for i in range(3)]
    packed = [off.pack(a) for a in arrays] + [off.pack(arrays[0])]  # the last one shares the first's copy
    offloaded = get_ledger().current["offloaded"]
    back = [off.unpack(p) for p in packed]
    assert all(type(b) is type(arrays[0]) for b in back)  # on the device again
    return back, off.bytes_offloaded, off.saves_shared, offloaded


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_activation_offload_equals_numpy(strict_backend, tmp_path, kind):
    ref = _on("numpy", _activation_offload, kind, str(tmp_path))
    strict.reset_transfers()
    got = _on("strict", _activation_offload, kind, str(tmp_path))
    assert strict.transfers["to_host"] >= 3 and strict.transfers["to_device"] >= 4  # real copies, each way
    _assert_same(ref, got)


def _offloaded_adamw(kind, folder, steps=3):
    from minizero.nn.module import Parameter
    from minizero.optim import AdamW
    from minizero.optim.state_store import OptimizerStateStore

    params = [Parameter(backend.to_device(_data(20 + i, 600).reshape(20, 30).astype(np.float16))) for i in range(2)]
    opt = AdamW(params, lr=1e-2, master_weights=True, store=OptimizerStateStore(kind, folder))
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = backend.to_device(_data(7 * step + i, 600).reshape(20, 30).astype(np.float16))
        opt.step(grad_scale=0.5)
    if backend.name == "strict":  # offloaded state is on the host, the rest on the device
        assert all(isinstance(m, np.ndarray) for m in opt.m + opt.v + opt.masters) == (kind != "none")
    return [p.data for p in params], opt.state_dict(), get_ledger().current["offloaded"] > 0


@pytest.mark.parametrize("kind", ["none", "cpu", "nvme"])
def test_offloaded_optimizer_state_equals_numpy(strict_backend, tmp_path, kind):
    ref = _on("numpy", _offloaded_adamw, "none", str(tmp_path))[:2]
    _assert_same(ref, _on("strict", _offloaded_adamw, kind, str(tmp_path))[:2])


# --------------------------------------------------------------------------- pruning
def _pruning(scope):
    from minizero.memory.sparsity import Pruner
    from minizero.nn import GPT, get_config

    model = GPT(get_config("tiny", dtype="float64"))
    for i, p in enumerate(model.parameters()):
        p.data[...] = backend.to_device(_data(i, p.size, np.float64).reshape(p.shape))
        p.grad = backend.to_device(_data(50 + i, p.size, np.float64).reshape(p.shape))
    pruner = Pruner(model, 0.6, scope)
    pruner.prune_()
    pruner.mask_gradients_()
    return [p.data for p in model.parameters()], [p.grad for p in model.parameters()], pruner.packed, pruner.report()


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_pruning_equals_numpy(strict_backend, scope):
    sizes = []
    got = _on("strict", _pruning, scope, host_sizes=sizes)
    assert sizes and set(sizes) == {1}
    _assert_same(_on("numpy", _pruning, scope), got)


# --------------------------------------------------------------------------- whole training runs
#: name -> (rank threads, flags), run by tests/test_strict_device.py's harness: these techniques end to end. Activation
#: offload (cpu, nvme) and unsharded 8-bit Adam on one rank: the CLI cases below (train on strict and cpu, 3 steps)
TRAINING = {
    "offload-optimizer-cpu-fp16": (1, ["--offload-optimizer", "cpu", "--precision", "fp16", "--dtype", "float32"]),
    "offload-optimizer-nvme-zero2": (2, ["--offload-optimizer", "nvme", "--zero", "2"]),
    "adam8bit-zero3-cut-blocks": (2, ["--optimizer", "adam8bit", "--adam8bit-block-size", "48", "--zero", "3"]),
    "quantized-comm-dp2": (2, ["--quantized-comm"]),
    "quantized-comm-zero3": (2, ["--quantized-comm", "--zero", "3"]),
    "pruning-adam8bit": (1, ["--prune-sparsity", "0.5", "--prune-scope", "global", "--optimizer", "adam8bit"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_with_the_technique_equals_numpy(case, tmp_path):
    from tests.test_strict_device import assert_same_bits, run_on

    world, flags = TRAINING[case]
    flags = flags + (["--offload-dir", str(tmp_path)] if "nvme" in flags else [])
    want = run_on("cpu", world, flags)
    strict.reset_transfers()
    got = run_on("strict", world, flags)
    assert strict.transfers["to_device"] > 0  # it ran on the strict module
    assert_same_bits(got, want)


#: id -> flags: ``python -m minizero.train``'s main with these on strict, then on cpu, in one process (no mpiexec)
CLI = {"adam8bit-offload-activations-nvme": ["--optimizer", "adam8bit", "--adam8bit-block-size", "48",
                                             "--offload-activations", "nvme"],
       "offload-optimizer-and-activations-cpu": ["--offload-optimizer", "cpu", "--offload-activations", "cpu"]}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    from tests.test_strict_device import run_cli_job

    out = tmp_path_factory.mktemp("strict_cli_one_process")
    return run_cli_job(out, {case: flags + (["--offload-dir", str(out)] if "nvme" in flags else [])
                             for case, flags in CLI.items()})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CLI))
def test_cli_strict_equals_cpu_with_offload_and_8bit_adam(cli_runs, case):
    """``python -m minizero.train --device strict`` with offload / 8-bit Adam writes ``--device cpu``'s model.npz bits
    (the program's main, in one process for both cases and devices: test_strict_device's run_cli_job)."""
    from tests.test_strict_device import assert_cli_same_bits

    assert_cli_same_bits(cli_runs, case)


@pytest.mark.timeout(300)
def test_quantize_cli_strict_equals_cpu(tmp_path, capsys):
    """``python -m minizero.quantize --device strict`` (weight-only INT8/INT4 with FP32 outlier columns:
    calibration, quantization and evaluation on the device) measures what ``--device cpu`` does: its main, in this
    process, on a tiny float64 model as train writes it (model.npz and model.json)."""
    import dataclasses
    import json

    from minizero.nn import GPT, get_config
    from minizero.quantize import main

    cfg = get_config("tiny", dtype="float64")
    np.savez(tmp_path / "model.npz", **GPT(cfg, seed=5).state_dict())
    (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    out = {}
    for device in ("cpu", "strict"):
        try:
            code = main(["--weights", str(tmp_path / "model.npz"), "--table", "--outlier-threshold", "0.5",
                         "--eval-batches", "1", "--device", device, "--json", str(tmp_path / f"{device}.json")])
        finally:
            backend.set_backend("numpy")
        assert code == 0, capsys.readouterr().err
        out[device] = json.load(open(tmp_path / f"{device}.json"))
    assert out["cpu"]["rows"] and out["cpu"]["calibration"]["columns_at_threshold"] > 0
    assert out["strict"] == out["cpu"]


# --------------------------------------------------------------------------- replica check, faults, checkpoints
def _error_of(device, world, flags):
    """The message (without its ``[rank r/N]`` prefix: whichever rank raised first) a run on ``device`` ends with."""
    from tests.test_strict_device import run_on

    with pytest.raises(Exception) as e:
        run_on(device, world, flags)
    return type(e.value).__name__, str(e.value).split("] ", 1)[-1]


#: MINIZERO_FAULT spec -> (rank threads, flags): a replica drifts; --check-replicas 1 names it the next step
DIVERGE = {
    "1:1:diverge": (2, []),
    "1:1:diverge_state": (2, ["--optimizer", "adam8bit", "--adam8bit-block-size", "48"]),  # a code moves by 1
    "3:1:diverge_state": (4, ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--dp-shard", "2"]),  # ExpertZero
    "2:0:diverge_state": (4, ["--zero", "1", "--dp-shard", "2", "--precision", "fp16", "--dtype", "float32"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", list(DIVERGE))
def test_a_diverged_replica_is_named_the_same_under_strict(monkeypatch, spec):
    """The fault moves a device array in place; the check hashes on the host and locates the first element."""
    world, flags = DIVERGE[spec]
    monkeypatch.setenv("MINIZERO_FAULT", spec)
    flags = flags + ["--check-replicas", "1"]
    want = _error_of("cpu", world, flags)
    assert want[0] == "ReplicaMismatchError" and ("optimizer state" in want[1]) == spec.endswith("state"), want
    assert _error_of("strict", world, flags) == want


@pytest.mark.timeout(60)
def test_an_fp16_overflow_fault_on_one_replica_skips_the_step_on_both_devices(monkeypatch):
    """``inf`` on one rank of hybrid ExpertZero: every rank skips the step and halves the scale together."""
    from tests.test_strict_device import assert_same_bits, run_on

    monkeypatch.setenv("MINIZERO_FAULT", "1:1:inf")
    flags = ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--dp-shard", "2", "--precision", "fp16",
             "--dtype", "float32", "--steps", "3"]  # the step after the skipped one too
    want = run_on("cpu", 4, flags)
    assert np.isnan(want[0]["grad_norms"][1]) and want[0]["loss_scales"][1] == 2 * want[0]["loss_scales"][2]
    assert_same_bits(run_on("strict", 4, flags), want)


def _saved_and_resumed(device, folder, saved, resumed):
    """Train ``saved`` = (ranks, flags) 2 steps with a checkpoint each step; resume it as ``resumed`` for step 3.
    Returns the resumed run's per-rank results and the checkpoint: {file: its tensors, or the manifest without
    the files' SHA-256 (safetensors writes its metadata's keys in either order, so a file's bytes may differ)}."""
    import json
    import os

    from safetensors.numpy import load_file

    from tests.test_strict_device import run_on

    run_on(device, saved[0], saved[1] + ["--out", str(folder), "--save-every", "1", "--steps", "2"])
    got = run_on(device, resumed[0], resumed[1] + ["--out", str(folder / "resumed"),
                                                   "--resume", str(folder / "checkpoints"), "--steps", "3"])
    step = folder / "checkpoints" / "step_00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    for entry in manifest["files"]:
        entry.pop("sha256")
    files = {name: load_file(str(step / name)) for name in os.listdir(step) if name.endswith(".safetensors")}
    return got, {"manifest.json": manifest, **files}


#: name -> (saved as (ranks, flags), resumed as (ranks, flags)): the layout changes between them (resharding)
RESUMED = {
    "moe-ep2-zero3-hybrid-fp16-to-ep1-zero1": (
        (4, ["--moe-experts", "4", "--ep", "2", "--zero", "3", "--dp-shard", "2", "--moe-bias-update", "0.01",
             "--precision", "fp16", "--dtype", "float32"]),
        (2, ["--moe-experts", "4", "--zero", "1", "--moe-bias-update", "0.01", "--precision", "fp16",
             "--dtype", "float32"])),
    "adam8bit-zero3-pad-to-one-rank": ((2, ["--optimizer", "adam8bit", "--adam8bit-block-size", "48", "--zero", "3",
                                            "--pad"]),
                                       (1, ["--optimizer", "adam8bit", "--adam8bit-block-size", "48", "--pad"])),
    "prune-zero2-to-dp2": ((2, ["--prune-sparsity", "0.5", "--prune-step", "1", "--zero", "2"]),
                           (2, ["--prune-sparsity", "0.5", "--prune-step", "1"])),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(RESUMED))
def test_a_checkpoint_saved_and_resumed_under_strict_is_numpys(tmp_path, case):
    """The checkpoint (manifest: data digest, --pack/--pad, MoE coefficients and routing biases, the loss scaler;
    shards: parameters, optimizer state, masks) holds the same bits, and the resharded run goes on the same."""
    from tests.test_strict_device import assert_same_bits

    saved, resumed = RESUMED[case]
    want, want_files = _saved_and_resumed("cpu", tmp_path / "cpu", saved, resumed)
    got, got_files = _saved_and_resumed("strict", tmp_path / "strict", saved, resumed)
    assert len(want[0]["train_losses"]) == 1  # it resumed after step 2
    assert got_files.keys() == want_files.keys() and len(want_files) == saved[0] + 1  # the manifest, a file per rank
    assert want_files["manifest.json"]["data"]["text"]  # the data text's digest
    _assert_same(want_files, got_files, "checkpoint")
    assert_same_bits(got, want)


# --------------------------------------------------------------------------- anomaly detection, fine-tuning
@pytest.mark.timeout(60)
def test_detect_anomaly_finds_the_same_non_finite_gradient_under_strict(monkeypatch):
    """The finding's ranges (finite min and max, the non-finite count) come to the host as single numbers."""
    monkeypatch.setenv("MINIZERO_FAULT", "1:1:inf")
    want = _error_of("cpu", 2, ["--detect-anomaly"])
    assert want[0] == "AnomalyError" and "not finite" in want[1]
    assert _error_of("strict", 2, ["--detect-anomaly"]) == want


def _finetune(comm, folder, method, flags):
    import io
    import re

    from minizero.data import load_tokens
    from minizero.finetune import build_parser, finetune
    from minizero.progress import Progress

    args = build_parser().parse_args(["--weights", str(folder / "model.npz"), "--data", str(folder / "data.txt"),
                                      "--steps", "2", "--batch-size", "4", "--eval-batches", "1", *flags])
    shown = io.StringIO()
    row, _, merged = finetune(args, method, load_tokens(args.data), comm, Progress("log", 2, 64, out=shown, every=1))
    return row["val_before"], row["val_after"], merged, re.findall(r"loss \S+", shown.getvalue())  # not tok/s


@pytest.fixture(scope="module")
def finetune_weights(tmp_path_factory):
    from minizero.nn.gpt import GPTConfig
    from tests.test_lora_tp import _write

    folder = tmp_path_factory.mktemp("strict_finetune")
    _write(folder, GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.1, dtype="float64"))
    return folder


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method, flags", [("full", []), ("lora", ["--zero", "1"]), ("full", ["--zero", "3"])],
                         ids=["full-dp2", "lora-zero1", "full-zero3"])
def test_data_parallel_finetune_with_progress_equals_numpy(finetune_weights, method, flags):
    """``finetune`` on 2 rank threads (the progress line's loss: an all-reduce of one host number)."""
    want = _on("numpy", run_in_threads, 2, _finetune, finetune_weights, method, flags)
    assert len(want[0][3]) == 2  # the progress lines' losses
    _assert_same(want, _on("strict", run_in_threads, 2, _finetune, finetune_weights, method, flags))
