"""ZeRO stages 0-3 equal the single process, and hold and send the bytes the paper says.

Equivalence (float64, as tests/test_data_parallel.py): N ranks with micro-batch b against
one process with micro-batch N*b, 3 steps, gradient accumulation 2, clipping active. The
owned gradient shard of every unit must equal the same slice of the single process's
flattened gradients to 1e-12 (relative to the unit's largest gradient), the gradient norms
to 1e-12 and the parameters after 3 steps to 1e-12. Ranks run as threads (fast); a subset
runs under mpiexec.

Bytes (float32): the ledger at the optimizer step against Figure 1 of the ZeRO paper, the
traffic ledger per step against section 7.2 (stage 2 reduce-scatters once per micro-batch,
stage 3 gathers and reduce-scatters once per micro-batch; see minizero/zero/).
"""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import recursive_doubling, run_in_threads
from minizero.ledger import get_ledger
from minizero.zero import ShardMap, model_state_formula, traffic_formula, zero_optimizer
from minizero.zero.stage3 import is_placeholder
from minizero.nn import GPT, get_config
from minizero.train import UsageError, parse_args, train
from tests.conftest import REPO_ROOT, mpi_env
from tests.mpi_scripts import zero_check

MICRO = 2
GRAD_RTOL, PARAM_RTOL = 1e-12, 1e-12
STAGES, WORLD_SIZES = [0, 1, 2, 3], [1, 2, 3, 4]


@functools.lru_cache(maxsize=None)
def single_process(n, extra=()):
    """One rank, stage 0, micro-batch n * MICRO: the baseline every float64 run must equal."""
    return run_in_threads(1, zero_check.run, 0, n * MICRO, extra=extra)[0]


def shard_map(n, dtype="float64"):
    return ShardMap.from_model(GPT(get_config("tiny", dtype=dtype)), n)


def assert_matches(ref, got, stage, n, rank, label):
    assert (ref["grad_norms"] > zero_check.CLIP).all(), "clipping must be active in this test"
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=GRAD_RTOL, err_msg=f"{label}: grad norms")
    if stage == 0:
        for name, a in ref["grads0"].items():
            np.testing.assert_allclose(got["grads0"][name], a, rtol=0, atol=GRAD_RTOL * np.abs(a).max(),
                                       err_msg=f"{label}: grad of {name}")
    else:
        sm = shard_map(n)
        for i, unit in enumerate(sm.units):
            flat = sm.flatten(i, ref["grads0"])  # the single process's gradients, laid out as the unit
            off, size = sm.shard(i, rank)
            np.testing.assert_allclose(got["grads0"][f"unit{i}"], flat[off:off + size], rtol=0,
                                       atol=GRAD_RTOL * np.abs(flat).max(),
                                       err_msg=f"{label}: owned gradient shard of {unit.name}")
    for name, a in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], a, rtol=PARAM_RTOL, atol=PARAM_RTOL * np.abs(a).max(),
                                   err_msg=f"{label}: {name} after {zero_check.STEPS} steps")


# --------------------------------------------------------------------------- equivalence
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_threads_zero_equals_single_process(stage, n):
    ref = single_process(n)
    for rank, got in enumerate(run_in_threads(n, zero_check.run, stage, MICRO)):
        assert_matches(ref, got, stage, n, rank, f"stage {stage}, rank {rank}/{n}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mpi_zero_equals_single_process(stage, mpiexec, tmp_path):
    n = 3  # uneven: every unit needs padding
    ref = single_process(n)
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "zero_check.py")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, script, str(tmp_path), str(stage), str(MICRO)],
                          env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(n):
        data = np.load(tmp_path / f"rank{rank}.npz")
        got = {"grads0": {k[2:]: data[k] for k in data.files if k.startswith("g:")},
               "params": {k[2:]: data[k] for k in data.files if k.startswith("p:")},
               "grad_norms": data["grad_norms"]}
        assert_matches(ref, got, stage, n, rank, f"mpi stage {stage}, rank {rank}/{n}")
        meta = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert meta["world_size"] == n


@pytest.mark.timeout(120)
def test_float32_loss_curve_stage3_equals_stage0():
    """The float32 loss curve of --zero 3 follows --zero 0 within 1e-3 over 25 steps (4 ranks, tiny model)."""
    curves = {stage: run_in_threads(4, zero_check.run, stage, MICRO, "float32", 25, 1, 1.0, "tiny", 3e-3)[0]
              for stage in (0, 1, 3)}
    diff = np.abs(curves[3]["train_losses"] - curves[0]["train_losses"]).max()
    assert diff < 1e-3, f"max |loss(zero 3) - loss(zero 0)| = {diff:.2e} over 25 steps"
    assert curves[0]["train_losses"][-1] < curves[0]["train_losses"][0] - 0.5, "the model must actually learn"
    # stages 1 and 3 share units and chunks, so every sum is added in the same order: bit for bit equal
    np.testing.assert_array_equal(curves[3]["train_losses"], curves[1]["train_losses"])


# --------------------------------------------------------------------------- bytes held and sent
def float32_run(stage, n, accum, extra=()):
    """One cached run per all-reduce size rule. The byte tests all take the ring at every size (ring_all_reduce),
    so the ledger's, the buffers' and the traffic's checks read the same runs."""
    return _float32_run(stage, n, accum, tuple(extra), recursive_doubling.SMALL_ALLREDUCE_MAX_BYTES)


@functools.lru_cache(maxsize=None)
def _float32_run(stage, n, accum, extra, small_allreduce_max_bytes):
    return run_in_threads(n, zero_check.run, stage, MICRO, "float32", 2, accum, extra=extra)


@pytest.mark.usefixtures("ring_all_reduce")  # the byte tests share their runs (float32_run)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_ledger_model_state_bytes_match_paper(stage, n):
    sm = shard_map(n, "float32")
    num, padded, own = sm.numel, sm.padded, sm.shard_numel(0)
    exact = {0: dict(parameters=4 * num, gradients=4 * num, optimizer_state=8 * num),
             1: dict(parameters=4 * padded, gradients=4 * padded, optimizer_state=8 * own),
             2: dict(parameters=4 * padded, gradients=4 * own, optimizer_state=8 * own),
             3: dict(parameters=4 * own, gradients=4 * own, optimizer_state=8 * own)}[stage]
    paper = model_state_formula(stage, num, n)  # 16, 4+4+8/N, 4+12/N, 16/N bytes per parameter
    for rank, res in enumerate(float32_run(stage, n, 2)):
        got = res["state_bytes"]
        for cat, want in exact.items():
            assert got[cat] == want, f"stage {stage}, rank {rank}/{n}: {cat} {got[cat]} != {want}"
            assert abs(got[cat] - paper[cat]) <= 8 * (padded - num), f"{cat} further than padding from the paper"
        if stage > 0:  # nothing transient is alive at the optimizer step
            assert got["gathered"] == 0 and got["comm_buffers"] == 0


@pytest.mark.usefixtures("ring_all_reduce")  # the byte tests share their runs (float32_run)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_transient_buffers_are_one_layer_plus_embedding(stage, n):
    """Gathered parameters (stage 3) and full gradient buckets (stages 2-3) never exceed one
    block's unit plus the tied embedding's (held from the token lookup to the LM head), without
    prefetch (``--no-overlap``; with it, see test_prefetch_holds_at_most_two_units_plus_embedding)."""
    sm = shard_map(n, "float32")
    sizes = {u.name: u.padded for u in sm.units}
    embedding = sizes["transformer.wte"]
    layer = max(v for k, v in sizes.items() if k != "transformer.wte")
    for res in float32_run(stage, n, 2, ("--no-overlap",)):
        assert res["peak"]["comm_buffers"] <= 4 * (layer + embedding)
        if stage == 3:
            assert 4 * layer <= res["peak"]["gathered"] <= 4 * (layer + embedding)
            assert res["peak"]["gathered"] < 4 * sm.numel, "stage 3 must never hold the whole model"
        else:
            assert res["peak"]["gathered"] == 0


@pytest.mark.usefixtures("ring_all_reduce")  # the byte tests share their runs (float32_run)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_holds_at_most_two_units_plus_embedding(n):
    """Stage 3 with prefetch (the default): the next unit's all-gather is in flight while the current
    one runs, so the ledger's gathered peak is more than one block plus the embedding and at most
    two blocks plus the embedding; the weights are bitwise those of --no-overlap."""
    sm = shard_map(n, "float32")
    sizes = {u.name: u.padded for u in sm.units}
    embedding = sizes["transformer.wte"]
    layer = max(v for k, v in sizes.items() if k != "transformer.wte")
    on, off = float32_run(3, n, 2), float32_run(3, n, 2, ("--no-overlap",))
    for a, b in zip(on, off):
        assert 4 * (layer + embedding) < a["peak"]["gathered"] <= 4 * (2 * layer + embedding)
        assert b["peak"]["gathered"] <= 4 * (layer + embedding)
        assert a["step_bytes"] == b["step_bytes"]  # the same gathers, only earlier
        for name in a["params"]:
            assert np.array_equal(a["params"][name], b["params"][name]), name


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_traffic_per_step_matches_paper(stage, n, accum):
    sm = shard_map(n, "float32")
    for rank, res in enumerate(float32_run(stage, n, accum)):
        for step in res["step_bytes"]:
            if stage == 0:
                sent = step["all_reduce"]  # one bucket: the ring's chunks differ by at most one element
                assert abs(sent - traffic_formula(0, sm.numel, n)) <= 2 * 4
                continue
            sent = sum(step[ph] for ph in ("gather_forward", "gather_backward", "reduce_scatter_grads",
                                           "all_gather_params"))
            assert sent == traffic_formula(stage, sm.padded, n, 4, accum), f"stage {stage} rank {rank}/{n}: {step}"
            assert abs(sent - traffic_formula(stage, sm.numel, n, 4, accum)) <= 3 * accum * 4 * (sm.padded - sm.numel)
            if stage == 3:  # the paper's 1.5x: forward gather, backward gather, reduce-scatter, equal thirds
                assert step["gather_forward"] == step["gather_backward"] == step["reduce_scatter_grads"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_composes_with_recompute_and_activation_offload(stage):
    """ZeRO-3's pack hook turns gathered weights into handles and hands activations on to the
    offload pair it shadows: same numbers, activations still offloaded, parameters never."""
    extra = ("--recompute", "full", "--offload-activations", "cpu")
    ref = single_process(2, extra)
    for rank, got in enumerate(run_in_threads(2, zero_check.run, stage, MICRO, extra=extra)):
        assert_matches(ref, got, stage, 2, rank, f"stage {stage} + recompute + offload, rank {rank}/2")
        assert got["peak"]["offloaded"] > 0 and got["peak"]["activations"] < got["peak"]["offloaded"]


def _master_weights_step(comm, stage, master):
    model = GPT(get_config("tiny"), seed=1)
    opt = zero_optimizer(model, comm, stage, lr=1e-2, master_weights=master)
    state = get_ledger().current["optimizer_state"]
    x = np.arange(32).reshape(2, 16) % 256
    for _ in range(2):
        model(x, x)[1].backward()
        opt.reduce_gradients()
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        return state, {n: p.data.copy() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_master_weights_shard_is_counted_and_exact_in_float32(stage):
    """An FP32 master of float32 parameters changes no number, and costs 4/N bytes per parameter."""
    own = shard_map(2, "float32").shard_numel(0)
    plain = run_in_threads(2, _master_weights_step, stage, False)
    master = run_in_threads(2, _master_weights_step, stage, True)
    for (s0, p0), (s1, p1) in zip(plain, master):
        assert s0 == 8 * own and s1 == 12 * own
        for name in p0:
            np.testing.assert_array_equal(p1[name], p0[name], err_msg=name)


# --------------------------------------------------------------------------- the mechanism
def _stage3_forward_backward(comm):
    ledger = get_ledger()
    model = GPT(get_config("tiny", dtype="float64"), seed=1)
    opt = zero_optimizer(model, comm, 3)
    x = np.random.default_rng(comm.rank).integers(0, 256, (2, 16))
    _, loss = model(x, x)
    after_forward = ledger.current["gathered"]
    saved = ledger.current["activations"]
    loss.backward()
    return dict(after_forward=after_forward, saved=saved, after_backward=ledger.current["gathered"],
                buckets=ledger.current["comm_buffers"], grads=[g.copy() for g in opt.grad_shards()],
                placeholder=is_placeholder(model.transformer["wte"].weight.data),  # arithmetic on it raises
                shape=model.transformer["wte"].weight.shape)


@pytest.mark.timeout(60)
def test_stage3_frees_gathered_parameters_between_uses():
    """After forward nothing gathered is alive (saved weights became handles); after backward neither."""
    for res in run_in_threads(2, _stage3_forward_backward):
        assert res["after_forward"] == 0 and res["after_backward"] == 0 and res["buckets"] == 0
        assert res["saved"] > 0
        assert res["placeholder"] and res["shape"] == (256, 16)
        assert all(np.abs(g).max() > 0 for g in res["grads"])


def _placeholders(comm):
    from minizero.nn.module import Linear
    model = Linear(4, 4)
    opt = zero_optimizer(model, comm, 3)
    between = [is_placeholder(p.data) for p in model.parameters()]
    with opt.full_parameters():
        gathered = [is_placeholder(p.data) for p in model.parameters()]
    return between, gathered


def test_stage3_says_which_arrays_are_its_placeholders():
    """Before: the fault injector told ZeRO-3's placeholder by ``0 in strides``, which meta arrays and any other
    broadcast share."""
    from minizero.nn.init import meta
    from minizero.zero.stage3 import placeholder
    for between, gathered in run_in_threads(2, _placeholders, timeout=30):
        assert between == [True, True] and gathered == [False, False], (between, gathered)
    assert is_placeholder(placeholder((2, 3), np.float32))
    others = (np.broadcast_to(np.asarray(np.nan, np.float32), (2, 3)), meta((2, 3), np.float32), np.zeros((2, 3)),
              np.zeros((2, 3))[1:])
    assert not any(is_placeholder(a) for a in others)


def _tied_gradient(comm, stage):
    model = GPT(get_config("tiny", dtype="float64"), seed=1)
    opt = zero_optimizer(model, comm, stage) if stage else None
    x = np.arange(32).reshape(2, 16) % 256
    model(x, x)[1].backward()
    if opt is None:
        return model.transformer["wte"].weight.grad.reshape(-1).copy()
    opt.reduce_gradients()
    return opt.grad_shards()[0]  # unit 0 is transformer.wte (the LM head's weight too)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_embedding_gets_both_uses_gradients(stage):
    full = run_in_threads(1, _tied_gradient, 0)[0]  # same data on every rank: the mean is this gradient
    for rank, shard in enumerate(run_in_threads(2, _tied_gradient, stage)):
        np.testing.assert_allclose(shard, full[rank * shard.size:(rank + 1) * shard.size], rtol=1e-12, atol=1e-15)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["tiny", "small"]), st.integers(1, 9))
def test_shard_map_covers_every_element_once(model_name, n):
    sm = ShardMap.from_model(GPT(get_config(model_name)), n)
    for u in sm.units:
        assert u.padded % n == 0 and 0 <= u.padded - u.numel < n
    seen = {}
    for rank in range(n):
        assert sm.shard_numel(rank) == sm.padded // n
        for pc in sm.pieces(rank):
            seen.setdefault(pc.param, []).append((pc.lo, pc.hi))
            assert pc.shard_slice == slice(pc.shard_lo, pc.shard_lo + pc.hi - pc.lo)
    for u in sm.units:
        for name, shape in zip(u.param_names, u.shapes):
            ranges = sorted(seen[name])
            assert ranges[0][0] == 0 and ranges[-1][1] == int(np.prod(shape))
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"{name}: gap or overlap {ranges}"
    assert sm.numel == GPT(get_config(model_name)).num_parameters()
    assert "rank 0 owns" in sm.format() and "params" in sm.draw()


# --------------------------------------------------------------------------- bad input
def test_zero_4_is_refused_with_the_allowed_values():
    with pytest.raises(UsageError, match=r"--zero.*4.*0, 1, 2, 3"):
        parse_args(["--zero", "4"])


def test_show_shards_needs_a_zero_stage():
    with pytest.raises(UsageError, match="--show-shards needs --zero"):
        parse_args(["--show-shards"])


def test_zero_optimizer_rejects_stage_0():
    model = GPT(get_config("tiny"))
    with pytest.raises(ValueError, match="stage=0; allowed: 1, 2, 3"):
        run_in_threads(1, lambda comm: zero_optimizer(model, comm, 0))


def test_the_formulas_refuse_a_stage_outside_0_to_3_in_the_same_words():
    """traffic_formula raised a bare KeyError: 4; model_state_formula names the stage and the ones allowed."""
    for formula in (model_state_formula, traffic_formula):
        with pytest.raises(ValueError, match=r"stage=4; allowed: 0, 1, 2, 3"):
            formula(4, 100, 2)


def _train_logged(comm, argv):
    lines = []
    train(parse_args(argv, comm.world_size), comm, log=lines.append)
    return "\n".join(lines)


@pytest.mark.timeout(60)
def test_zero_on_one_rank_runs_and_says_it_saves_nothing():
    argv = ["--model", "tiny", "--steps", "1", "--eval-batches", "1", "--no-progress", "--zero", "2", "--show-shards"]
    out = run_in_threads(1, _train_logged, argv)[0]
    assert "shards nothing" in out and "ZeRO shard map" in out
    shards = out[out.index("ZeRO shard map"):].splitlines()
    assert max(map(len, shards)) <= 100, shards  # before: one line per unit, 200+ columns


def test_shard_map_text_wraps_each_unit_s_pieces_and_keeps_them():
    sm = shard_map(2, "float32")
    whole, wrapped = sm.format(), sm.format(width=60)
    assert max(map(len, whole.splitlines())) > 60 and max(map(len, wrapped.splitlines())) <= 60
    assert whole.split() == wrapped.split()  # the same pieces, in the same order


def test_shard_map_text_says_its_ranges_are_flat_elements_not_rows():
    """Before: `transformer.wte.weight[0:8192]` of a (256, 128) weight read as NumPy's rows 0-8191; now a line
    says the ranges index the flattened parameter."""
    text = shard_map(2, "float32").format(width=100)
    assert "name.reshape(-1)[lo:hi]" in text and text.index("reshape(-1)") < text.index("rank 0 owns:")


def _misuse_stage1(comm):
    model = GPT(get_config("tiny", dtype="float64"))
    opt = zero_optimizer(model, comm, 1)
    model.zero_grad()  # drops the views into the flat gradient buffer
    x = np.zeros((1, 4), dtype=np.int64)
    model(x, x)[1].backward()
    opt.reduce_gradients()


def test_stage1_detects_gradients_moved_out_of_the_flat_buffer():
    with pytest.raises(RuntimeError, match="use ZeroOptimizer.zero_grad"):
        run_in_threads(1, _misuse_stage1)


# --------------------------------------------------------------------------- the main job
@pytest.mark.timeout(300)
def test_cli_zero3_writes_stage_and_per_rank_figures(mpiexec, tmp_path):
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "3",
           "--eval-batches", "1", "--sample-tokens", "8", "--no-progress", "--zero", "3", "--show-shards",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ZeRO shard map" in proc.stdout and "rank 1 owns" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    sm = shard_map(2, "float32")
    assert summary["zero"]["stage"] == 3 and len(summary["zero"]["per_rank"]) == 2
    for fig in summary["zero"]["per_rank"]:
        assert fig["parameters"] == fig["gradients"] == 4 * sm.shard_numel(0)
        assert fig["bytes_sent_per_step"] == traffic_formula(3, sm.padded, 2, 4, 1)
    weights = np.load(tmp_path / "model.npz")  # saved inside full_parameters(): whole, finite
    assert weights["transformer.wte.weight"].shape == (256, 16)
    assert all(np.isfinite(weights[k]).all() for k in weights.files)


def test_the_drawing_names_parameters_too_small_for_a_column():
    """Lesson 02's 64-column row of a tiny block: each column is 51.25 elements, so the 16-element biases and
    ln_2.bias get no column; the drawing says so instead of letting them vanish."""
    h0 = next(part for part in ShardMap.from_model(GPT(get_config("tiny")), 4).draw().split("transformer.")
              if part.startswith("h.0:"))
    assert "(scaled: 1 column = 51.25 elements; b, f, h, l are smaller and fall between columns;" in h0
    assert "scaled" not in ShardMap.from_model(GPT(get_config("tiny")), 4).draw(width=4096)


@pytest.mark.parametrize("model", ["tiny", "default", "deep"])
def test_the_drawing_fits_120_columns(model):
    """Before: the legend of a block, ``a = ln_1.weight (16,), b = ...``, was one line of over 300 columns."""
    drawing = ShardMap.from_model(GPT(get_config(model)), 4).draw()
    assert max(map(len, drawing.splitlines())) <= 120, drawing
    assert "k = mlp.c_proj.weight (16, 64)" in drawing or model != "tiny"


def test_stage3_saves_a_contiguous_view_of_one_gathered_parameter_as_a_handle_and_nothing_else():
    """_view_of_gathered: a C-contiguous view inside one parameter -> (offset, shape) that reads the same elements;
    a view over two parameters, a strided or re-typed one, or a stale entry (p.data re-pointed) -> None."""
    from types import SimpleNamespace
    from minizero.zero.stage3 import ZeroStage3
    buf = np.arange(24.0)
    p, q = SimpleNamespace(data=buf[:12].reshape(3, 4)), SimpleNamespace(data=buf[12:].reshape(3, 4))
    fake = SimpleNamespace(_gathered={id(p.data): p, id(q.data): q})
    handle = ZeroStage3._view_of_gathered(fake, q.data[1:])
    assert handle.param is q and handle.view == (4, (2, 4))
    np.testing.assert_array_equal(handle.array(), q.data[1:])
    unaligned = buf.view(np.uint8)[4:36].view(np.float64)  # float64 elements 4 bytes into p
    for other in (buf[10:14], p.data[:, 1], p.data.view(np.int64)[0], np.ones(3), unaligned):
        assert ZeroStage3._view_of_gathered(fake, other) is None
    # a placeholder (broadcast, nbytes of the whole parameter over one element) whose nominal range covers q
    stale = SimpleNamespace(data=np.broadcast_to(buf[12:13], (3, 4)))
    fake._gathered = {id(q.data): stale}  # its data re-pointed since it was gathered: never matched
    assert ZeroStage3._view_of_gathered(fake, q.data[1:]) is None
