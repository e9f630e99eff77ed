"""Ring attention (context parallelism): equal to whole causal attention in float64, load-balanced chunks."""
import math
import subprocess
import sys

import numpy as np
import pytest

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.autograd import Tensor, causal_softmax
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.attribution import layer_bytes, saved_by_module
from minizero.memory.estimator import Strategy, comm_bytes_per_step, layer_activation_bytes
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT, get_config
from minizero.autograd.rng import get_rng_state, manual_seed
from minizero.nn.module import Dropout
from minizero.parallel.context_parallel import (ContextParallelDropout, chunk_ids, context_parallelize,
                                                ring_attention, ring_bytes, split_for_context_parallel,
                                                unsplit_from_context_parallel)
from minizero.parallel.pipeline import PipelineStage
from minizero.parallel.sequence_parallel import sequence_parallelize
from minizero.parallel.tensor_parallel import tensor_parallelize
from minizero.parallel.vocab_parallel import vocab_parallelize
from minizero.loop import train
from minizero.train import parse_args
from tests.conftest import REPO_ROOT, mpi_env
from tests.test_pipeline import add_deep_narrow_presets


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = np.arange(16)
    shards = [split_for_context_parallel(x, r, 2, 0) for r in range(2)]
    assert shards[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and shards[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    np.testing.assert_array_equal(unsplit_from_context_parallel(shards, 0), x)
    with pytest.raises(ValueError, match="divisible by 2 x cp = 6"):
        split_for_context_parallel(x, 0, 3, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_equals_whole_causal_attention(cp):
    """Outputs and the gradients of q, k, v (1e-12), every rank's chunks; bytes sent as ring_bytes says."""
    b, h, s, d = 2, 3, 16, 4
    rng = np.random.default_rng(0)
    q, k, v, w = (rng.normal(size=(b, h, s, d)) for _ in range(4))
    qt, kt, vt = (Tensor(a, requires_grad=True) for a in (q, k, v))
    att = causal_softmax((qt @ kt.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d)))
    ref = att @ vt
    (ref * Tensor(w)).sum().backward()

    def rank(comm):
        r = comm.rank
        ql, kl, vl = (Tensor(split_for_context_parallel(a, r, cp, 2), requires_grad=True) for a in (q, k, v))
        out = ring_attention(ql, kl, vl, comm)
        sent = comm.traffic.bytes_sent
        (out * Tensor(split_for_context_parallel(w, r, cp, 2))).sum().backward()
        return out.data, ql.grad, kl.grad, vl.grad, sent, comm.traffic.bytes_sent - sent

    res = run_in_threads(cp, rank)
    for i, want in enumerate([ref.data, qt.grad, kt.grad, vt.grad]):
        got = unsplit_from_context_parallel([r_[i] for r_ in res], 2)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max(), err_msg=str(i))
    expect = ring_bytes(b, h, s, d, 8, cp)
    for r_ in res:
        assert (r_[4], r_[5]) == (expect["forward"], expect["backward"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ring_attention_sends_what_ring_bytes_counts(dtype):
    """The communicator's ledger, forward and backward, equals ring_bytes: k, v in their own dtype, dk, dv
    accumulated and sent in float32 (float16 inputs: 2-byte k, v blocks beside 4-byte dk, dv)."""
    b, h, s, d, cp = 2, 4, 64, 16, 2
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(b, h, s, d)).astype(dtype) for _ in range(3))

    def rank(comm):
        ql, kl, vl = (Tensor(split_for_context_parallel(a, comm.rank, cp, 2), requires_grad=True) for a in (q, k, v))
        out = ring_attention(ql, kl, vl, comm)
        sent = comm.traffic.bytes_sent
        out.sum().backward()
        assert kl.grad.dtype == np.dtype(dtype)
        return sent, comm.traffic.bytes_sent - sent

    expect = ring_bytes(b, h, s, d, np.dtype(dtype).itemsize, cp)
    assert run_in_threads(cp, rank) == [(expect["forward"], expect["backward"])] * cp


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_dropout_equals_dense_attention_with_the_same_mask(cp):
    """The dense core's dropout (one process, the same seed) read by block on every rank: outputs and gradients
    (1e-12); the generator ends where the dense core's ends."""
    b, h, s, d, p = 2, 3, 16, 4, 0.3
    rng = np.random.default_rng(1)
    q, k, v, w = (rng.normal(size=(b, h, s, d)) for _ in range(4))
    qt, kt, vt = (Tensor(a, requires_grad=True) for a in (q, k, v))
    manual_seed(11)
    ref = Dropout(p)(causal_softmax((qt @ kt.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d)))) @ vt
    (ref * Tensor(w)).sum().backward()
    after = get_rng_state()

    def rank(comm):
        manual_seed(11)
        ql, kl, vl = (Tensor(split_for_context_parallel(a, comm.rank, cp, 2), requires_grad=True) for a in (q, k, v))
        out = ring_attention(ql, kl, vl, comm, Dropout(p))
        (out * Tensor(split_for_context_parallel(w, comm.rank, cp, 2))).sum().backward()
        return out.data, ql.grad, kl.grad, vl.grad, get_rng_state()

    res = run_in_threads(cp, rank)
    for i, want in enumerate([ref.data, qt.grad, kt.grad, vt.grad]):
        got = unsplit_from_context_parallel([r_[i] for r_ in res], 2)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max(), err_msg=str(i))
    assert all(r_[4] == after for r_ in res)
    no_drop = run_in_threads(cp, lambda comm: ring_attention(
        *(Tensor(split_for_context_parallel(a, comm.rank, cp, 2)) for a in (q, k, v)), comm).data)
    assert not np.allclose(unsplit_from_context_parallel(no_drop, 2), ref.data)  # the mask did something


@pytest.mark.timeout(60)
def test_context_parallel_dropout_keeps_the_whole_masks_chunks():
    """ContextParallelDropout's (b, 2n, h) mask = this rank's chunks of the mask one process draws for (b, T, h)."""
    x = np.ones((2, 16, 5))
    manual_seed(3)
    want = Dropout(0.5)(Tensor(x)).data

    def rank(comm):
        manual_seed(3)
        return ContextParallelDropout(0.5, comm)(Tensor(split_for_context_parallel(x, comm.rank, 4, 1))).data

    np.testing.assert_array_equal(unsplit_from_context_parallel(run_in_threads(4, rank), 1), want)

    def sp_rank(comm):  # cp 2 x a sequence-parallel group of 3: rows of 2 of a chunk pair (n = 3), one straddling
        cp_comm = comm.split(color=comm.rank % 3, key=comm.rank // 3)
        sp_comm = comm.split(color=comm.rank // 3, key=comm.rank % 3)
        manual_seed(3)
        pair = split_for_context_parallel(x[:, :12], cp_comm.rank, 2, 1)
        mine = pair[:, 2 * sp_comm.rank:2 * sp_comm.rank + 2]
        return ContextParallelDropout(0.5, cp_comm, sp_comm)(Tensor(mine)).data

    manual_seed(3)
    want = Dropout(0.5)(Tensor(x[:, :12])).data
    got = run_in_threads(6, sp_rank)
    pairs = [np.concatenate(got[3 * c:3 * c + 3], axis=1) for c in range(2)]
    np.testing.assert_array_equal(unsplit_from_context_parallel(pairs, 1), want)


# --------------------------------------------------------------------------- in training (--cp)
_REF = {}


def _reference(micro_batch, flags, m=1):
    """One process on the same rows (``R.run_single``), run once per module for the cases that share it."""
    key = (micro_batch, m, *flags)
    if key not in _REF:
        _REF[key] = run_in_threads(1, R.run_single, "tiny", micro_batch, m, flags)[0]
    return _REF[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp, dp, tp, extra", [(2, 1, 1, ["--zero", "1"]),
                                               (4, 1, 1, ["--zero", "1", "--recompute", "selective"]),
                                               (2, 2, 2, []),
                                               (2, 1, 1, ["--dropout", "0.2"]), (2, 1, 2, ["--dropout", "0.2"]),
                                               (2, 1, 1, ["--dropout", "0.2", "--recompute", "selective"]),
                                               (2, 1, 1, ["--dropout", "0.2", "--recompute", "full"]),
                                               (2, 1, 2, ["--dropout", "0.2", "--sequence-parallel"]),
                                               (2, 1, 1, ["--dropout", "0.2", "--cp-attention", "ulysses"]),
                                               (2, 1, 1, ["--dropout", "0.2", "--cp-attention", "ulysses",
                                                          "--recompute", "selective"])])
def test_context_parallel_equals_single_process(cp, dp, tp, extra):
    """Gradients of step 0 (1e-12), weights after 3 steps (2e-12), the losses: one process's, on the same rows.
    (Plain --cp 2: the dropout case's layout without its masks.)"""
    one = [a for a in extra if a not in ("--cp-attention", "ulysses", "--sequence-parallel")]  # the same masks
    ref = _reference(2 * dp, one)
    got = run_in_threads(dp * tp * cp, R.run_parallel, "tiny", 2, dp, tp, 1, 1, "1f1b", ["--cp", str(cp), *extra])
    R.assert_matches(ref, got, f"cp {cp} dp {dp} tp {tp} {extra}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, schedule, extra", [("tiny", "1f1b", ["--recompute", "full"]),
                                                    ("tiny", "gpipe", ["--cp-attention", "ulysses"])])
def test_context_parallel_with_dropout_equals_the_same_pipeline_without_cp(model, schedule, extra):
    """--pp 2 with dropout: cp 2 reads the masks cp 1 reads, in the schedule's order and in recompute's replay;
    losses and gathered weights (1e-12). (Both equal one process's too: tests/test_dropout_layouts.py.)"""
    flags = ["--dropout", "0.2", *extra]
    one = [a for a in flags if a not in ("--cp-attention", "ulysses")]
    ref = run_in_threads(2, R.run_parallel, model, 2, 1, 1, 2, 2, schedule, one)
    got = run_in_threads(4, R.run_parallel, model, 2, 1, 1, 2, 2, schedule, ["--cp", "2", *flags])
    want, full = ([r["full"] for r in res if r["full"] is not None][0] for res in (ref, got))
    for name, a in want.items():
        np.testing.assert_allclose(full[name], a, rtol=0, atol=1e-12 * np.abs(a).max(), err_msg=name)
    for r_ in got:
        np.testing.assert_allclose(r_["losses"], ref[0]["losses"], rtol=1e-13)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp, extra", [(1, 2, ["--zero", "1"]), (2, 1, ["--sequence-parallel", "--zero", "1"]),
                                           (2, 2, ["--sequence-parallel"])])
def test_context_parallel_composes_with_pipeline_and_sequence_parallel(tp, pp, extra):
    """--cp 2 with --pp 2 (activations (b, T/2, C) between stages, cp rank to cp rank) and with --tp 2
    --sequence-parallel (each rank's two chunks split again over the tensor group): one process's
    gradients (1e-12), weights after 3 steps (2e-12) and losses. (Without ZeRO-1: --pp 2 in the dropout cases
    below, --tp 2 --sequence-parallel in test_context_parallel_equals_single_process.)"""
    m = pp  # the pipeline's default: pp micro-batches per step
    ref = _reference(2, [a for a in extra if a != "--sequence-parallel"], m)
    got = run_in_threads(2 * tp * pp, R.run_parallel, "tiny", 2, 1, tp, pp, m, "1f1b", ["--cp", "2", *extra])
    R.assert_matches(ref, got, f"cp 2 tp {tp} pp {pp} {extra}")


@pytest.mark.timeout(300)
def test_context_parallel_with_the_interleaved_schedule(monkeypatch):
    """--cp 2 --pp 2 --schedule interleaved --virtual-stages 2 (4 layers) with dropout: every chunk splits its
    sequence and reads one process's masks in the schedule's order (the dropout cases above, for interleaved);
    the tiny model 4 layers deep."""
    add_deep_narrow_presets(monkeypatch)
    ref = run_in_threads(1, R.run_single, "tiny4", 2, 2, ["--dropout", "0.2"])[0]
    got = run_in_threads(4, R.run_parallel, "tiny4", 2, 1, 1, 2, 2, "interleaved",
                         ["--cp", "2", "--virtual-stages", "2", "--dropout", "0.2"])
    R.assert_matches(ref, got, "cp 2 pp 2 interleaved v 2 dropout")


#: the measured layers' width: the default model's 4 heads at width 48, not 128 (every term of the formulas stays
#: apart from T = 32, h = 4 and b = 2, at about half the time)
WIDTH = 48


def _measure(comm, cfg, b, mode, recompute_first=False, attention="ring"):
    """Bytes block 0 saves for backward on this rank (the ledger) under cp over ``comm`` (also tests/test_ulysses.py)."""
    set_ledger(MemoryLedger())
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    if recompute_first:
        apply_recompute(stage, mode)
    context_parallelize(stage, comm, attention)
    if not recompute_first:
        apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    return layer_bytes(saved_by_module(stage, x, x), "transformer.h.0")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_bytes_per_layer_equal_the_context_parallel_formula(cp, mode, dropout):
    """With dropout: the (b, 2n, C) masks of ContextParallelDropout, none from the ring (it reads its by block)."""
    cfg = get_config("default", dtype="float64", block_size=32, n_embd=WIDTH, dropout=dropout, n_layer=1)
    b = 2  # block 0 measured
    want = layer_activation_bytes(cfg, 32, b, recompute=mode, accounting="minizero", precision="fp64", cp=cp)
    assert all(got == want for got in run_in_threads(cp, _measure, cfg, b, mode))
    one = layer_activation_bytes(cfg, 32, b, recompute=mode, accounting="minizero", precision="fp64")
    assert want < one  # token-sized rows / cp; the (s, s) scores replaced by an (s/cp) output and log-sum-exp


def _grads_and_traffic(comm, cfg, b, mode, recompute_first):
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    if recompute_first:
        apply_recompute(stage, mode)
    context_parallelize(stage, comm)
    if not recompute_first:
        apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    stage(x, x).backward()
    return dict(stage.state_dict()), [p.grad for p in stage.parameters()], comm.traffic.bytes_sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_context_parallel_and_recompute_compose_in_either_order(mode):
    """Recompute before or after context parallelism: same names, bitwise-equal gradients, ring bytes and memory."""
    cfg, b = get_config("tiny", dtype="float64", dropout=0.0), 2
    first = run_in_threads(2, _grads_and_traffic, cfg, b, mode, False)
    second = run_in_threads(2, _grads_and_traffic, cfg, b, mode, True)
    plain = run_in_threads(2, _grads_and_traffic, cfg, b, "none", False)
    for (names_a, grads_a, bytes_a), (names_b, grads_b, bytes_b), (names_0, _, _) in zip(first, second, plain):
        assert list(names_a) == list(names_b) == list(names_0)
        assert bytes_a == bytes_b > 0
        for g, h in zip(grads_a, grads_b):
            np.testing.assert_array_equal(g, h)
    cfg = get_config("default", dtype="float64", block_size=32, n_embd=WIDTH, n_layer=1)
    want = layer_activation_bytes(cfg, 32, b, recompute=mode, accounting="minizero", precision="fp64", cp=2)
    assert all(got == want for got in run_in_threads(2, _measure, cfg, b, mode, True))


def _cores_after_selective_recompute(comm, attention):
    stage = PipelineStage(GPT(get_config("tiny"), seed=0), 0, 1)
    apply_recompute(stage, "selective")
    dense = [block.attn.core.inner for block in stage.transformer["h"]]
    context_parallelize(stage, comm, attention)
    return [(type(c).__name__, type(c.inner).__name__, getattr(c.inner, "inner", None) is d)
            for c, d in zip((block.attn.core for block in stage.transformer["h"]), dense)]


@pytest.mark.parametrize("attention, core, keeps_dense", [("ring", "RingAttentionCore", False),
                                                          ("ulysses", "UlyssesAttentionCore", True)])
def test_context_parallelism_swaps_the_core_inside_a_recompute_wrapper(attention, core, keeps_dense):
    """Recompute first: the new core goes into a new wrapper (Module.map_wrapped); Ulysses wraps the dense core."""
    for cores in run_in_threads(2, _cores_after_selective_recompute, attention):
        assert cores == [("CheckpointWrapper", core, keeps_dense)] * 2


def _ring_traffic(comm, cfg, b, mode):
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    context_parallelize(stage, comm)
    apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    stage(x, x).backward()
    return comm.traffic.bytes_sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_ring_traffic_of_a_training_step_equals_the_estimator(cp, mode):
    """Bytes each rank sends in one micro-batch's forward and backward = comm_bytes_per_step(...)["cp"]
    (the planner's figure): per layer the ring's forward and backward, and its forward again under recompute."""
    cfg, b = get_config("default", dtype="float64", block_size=32, n_embd=WIDTH, n_layer=2), 2
    want = comm_bytes_per_step(cfg, Strategy(cp=cp, recompute=mode, precision="fp64", micro_batch=b), 32)["cp"]
    assert want > 0 and all(got == want for got in run_in_threads(cp, _ring_traffic, cfg, b, mode))


def _measure_3d(comm, cfg, b, mode, sp):
    """Rank (cp rank, tp rank) of a cp 2 x tp 2 grid: tensor (and sequence) parallel, then context parallel."""
    set_ledger(MemoryLedger())
    tp_comm = comm.split(color=comm.rank // 2, key=comm.rank % 2)
    cp_comm = comm.split(color=comm.rank % 2, key=comm.rank // 2)
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    tensor_parallelize(stage, tp_comm)
    vocab_parallelize(stage, tp_comm)
    if sp:
        sequence_parallelize(stage, tp_comm)
    context_parallelize(stage, cp_comm)
    apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    got = saved_by_module(stage, x, x)
    return [layer_bytes(got, f"transformer.h.{i}") for i in range(cfg.n_layer)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_bytes_per_layer_equal_the_formula_with_tensor_and_sequence_parallel(sp, mode, dropout):
    """cp 2 x tp 2 (4 ranks), with and without --sequence-parallel and dropout: the ledger's bytes per layer on every
    rank equal ``layer_activation_bytes(..., tp=2, sequence_parallel=sp, cp=2)`` (sequence-parallel rows / (cp tp))."""
    cfg, b = get_config("default", dtype="float64", block_size=32, n_embd=WIDTH, dropout=dropout, n_layer=2), 2
    want = layer_activation_bytes(cfg, 32, b, tp=2, sequence_parallel=sp, recompute=mode, accounting="minizero",
                                  precision="fp64", cp=2)
    for got in run_in_threads(4, _measure_3d, cfg, b, mode, sp):
        assert got == [want] * cfg.n_layer
    if sp:
        assert want < layer_activation_bytes(cfg, 32, b, tp=2, recompute=mode, accounting="minizero",
                                             precision="fp64", cp=2)


def test_context_parallel_is_refused_where_it_cannot_run():
    with pytest.raises(UsageError, match="--cp 3 must be >= 1 and divide the world size 4"):
        parse_args(["--model", "tiny", "--cp", "3", "--block-size", "12"], 4)  # T 16: "2 x cp = 6" first
    with pytest.raises(UsageError, match="divisible by 2 x cp = 4"):
        parse_args(["--model", "tiny", "--cp", "2", "--block-size", "14"], 2)
    assert parse_args(["--model", "tiny", "--cp", "2", "--tp", "2", "--sequence-parallel", "--dropout", "0.1"], 4).cp == 2
    with pytest.raises(UsageError, match="T / cp = 6 divisible by --tp 4"):  # T=24: 24/4 = 6 local rows, 4 tensor ranks
        parse_args(["--model", "default", "--cp", "4", "--tp", "4", "--sequence-parallel", "--block-size", "24"], 16)
    assert parse_args(["--model", "tiny", "--cp", "2", "--tp", "2", "--sequence-parallel", "--zero", "2"], 4).zero == 2
    with pytest.raises(UsageError, match="--zero 2 with --pp 2 is not supported"):  # the pipeline's own rule
        parse_args(["--model", "default", "--cp", "2", "--pp", "2", "--zero", "2"], 4)
    args = parse_args(["--model", "default", "--cp", "2", "--pp", "2", "--tp", "2", "--sequence-parallel"], 8)
    assert (args.dp, args.tp, args.pp, args.cp) == (1, 2, 2, 2)
    args = parse_args(["--model", "tiny", "--cp", "2", "--tp", "2", "--zero", "1"], 8)
    assert (args.dp, args.tp, args.pp, args.cp, args.batch_size) == (2, 2, 1, 2, 4)  # B = b x dp: cp shares rows


@pytest.mark.timeout(300)
def test_context_parallel_from_the_command_line(mpiexec, tmp_path):
    """``mpiexec -n 2 python -m minizero.train --cp 2`` (with dropout): the final weights are one process's (trained
    in this process on the same flags: weights within 1e-13 of max(1, the largest magnitude), as
    ``R.cli_matches_one_process``). (--cp 2 --pp 2: in threads, test_context_parallel_composes_with_pipeline_...)"""
    base = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3", "--micro-batch-size", "2",
            "--dropout", "0.1"]
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", *base, "--cp", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = dict(np.load(tmp_path / "model.npz"))
    one = run_in_threads(1, lambda comm: dict(train(parse_args([*base, "--no-save"], 1), comm,
                                                    log=lambda s: None).model.state_dict()))[0]
    assert set(got) == set(one)
    for name, a in one.items():
        np.testing.assert_allclose(got[name], a, rtol=0, atol=1e-13 * max(1.0, np.abs(a).max()), err_msg=name)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_ring_formula_and_the_planners_estimate_agree(cp):
    """The technique keeps its own ring_bytes (no technique imports the estimator); the planner's
    ring_attention_bytes models the same figure, equal for every shape and itemsize."""
    from minizero.memory.estimator import ring_attention_bytes
    for b, h, s, d, item in [(1, 1, 8 * cp, 4, 2), (2, 4, 32 * cp, 16, 8), (3, 6, 48 * cp, 8, 4)]:
        assert ring_bytes(b, h, s, d, item, cp) == ring_attention_bytes(b, h, s, d, item, cp)
