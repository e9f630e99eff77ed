"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): equal to one process, norms in step, bytes as the formula."""
import json

import numpy as np
import pytest

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.autograd import Tensor
from minizero.comm import recursive_doubling, run_in_threads
from minizero.comm.collectives import bytes_sent
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.attribution import layer_bytes, saved_by_module
from minizero.memory.estimator import ModelShape, Strategy, comm_bytes_per_step, layer_activation_bytes
from minizero.memory.estimator.traffic import tensor_parallel_bytes
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT, get_config
from minizero.parallel.pipeline import PipelineStage
from minizero.parallel.sequence_parallel import (gather_from_sequence_parallel_region, gathered_linear,
                                                 reduce_scatter_to_sequence_parallel_region,
                                                 scatter_to_sequence_parallel_region, sequence_parallelize)
from minizero.parallel.strategy import VALIDATION
from minizero.parallel.tensor_parallel import shard_array, tensor_parallelize
from minizero.parallel.vocab_parallel import vocab_parallelize
from minizero.train import parse_args


def test_gather_and_reduce_scatter_are_conjugate_along_the_sequence():
    """g: forward all-gather, backward reduce-scatter; ḡ: forward reduce-scatter, backward all-gather; scatter."""
    t, b, s, h = 3, 2, 6, 4
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(t, b, s, h))  # rank r's full-length input
    ws = rng.normal(size=(t, b, s, h))  # rank r's weights of the loss sum(w * y)

    def rank(comm):
        r, n = comm.rank, s // t
        x = Tensor(xs[r][:, r * n:(r + 1) * n].copy(), requires_grad=True)
        y = gather_from_sequence_parallel_region(x, comm)
        (y * Tensor(ws[r])).sum().backward()
        z = Tensor(xs[r], requires_grad=True)
        w = reduce_scatter_to_sequence_parallel_region(z, comm)
        (w * Tensor(ws[r][:, r * n:(r + 1) * n].copy())).sum().backward()
        u = Tensor(xs[0], requires_grad=True)
        v = scatter_to_sequence_parallel_region(u, comm)
        (v * Tensor(ws[r][:, r * n:(r + 1) * n].copy())).sum().backward()
        return y.data, x.grad, w.data, z.grad, v.data, u.grad

    n = s // t
    full_x = np.concatenate([xs[r][:, r * n:(r + 1) * n] for r in range(t)], axis=1)
    w_mine = np.concatenate([ws[r][:, r * n:(r + 1) * n] for r in range(t)], axis=1)
    for r, (y, gx, w, gz, v, gu) in enumerate(run_in_threads(t, rank)):
        sl = slice(r * n, (r + 1) * n)
        np.testing.assert_array_equal(y, full_x)  # all-gather in rank order
        np.testing.assert_allclose(gx, ws.sum(axis=0)[:, sl], rtol=1e-14)  # reduce-scatter of the gradients
        np.testing.assert_allclose(w, xs.sum(axis=0)[:, sl], rtol=1e-14)  # reduce-scatter
        np.testing.assert_array_equal(gz, w_mine)  # all-gather of the slices' gradients
        np.testing.assert_array_equal(v, xs[0][:, sl])  # scatter keeps this rank's rows
        np.testing.assert_array_equal(gu, w_mine)


def test_gathered_linear_equals_the_whole_column_parallel_linear():
    t, rng = 2, np.random.default_rng(1)
    x, w, bias, g = rng.normal(size=(2, 4, 3)), rng.normal(size=(6, 3)), rng.normal(size=6), rng.normal(size=(2, 4, 6))
    xt, wt, bt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True), Tensor(bias, requires_grad=True)
    ((xt @ wt.transpose(1, 0) + bt) * Tensor(g)).sum().backward()

    def rank(comm):
        r = comm.rank
        xl = Tensor(x[:, 2 * r:2 * r + 2].copy(), requires_grad=True)
        wl, bl = Tensor(shard_array(w, 0, r, t), requires_grad=True), Tensor(shard_array(bias, 0, r, t), requires_grad=True)
        y = gathered_linear(xl, wl, comm, bl)
        (y * Tensor(shard_array(g, 2, r, t))).sum().backward()
        return y.data, xl.grad, wl.grad, bl.grad

    for r, (y, gx, gw, gb) in enumerate(run_in_threads(t, rank)):
        np.testing.assert_allclose(y, shard_array(x @ w.T + bias, 2, r, t), rtol=1e-13)
        np.testing.assert_allclose(gx, xt.grad[:, 2 * r:2 * r + 2], rtol=1e-13)
        np.testing.assert_allclose(gw, shard_array(wt.grad, 0, r, t), rtol=1e-13)
        np.testing.assert_allclose(gb, shard_array(bt.grad, 0, r, t), rtol=1e-13)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, model, extra", [(2, "tiny", []), (2, "tiny", ["--dropout", "0.1", "--zero", "1"]),
                                              (2, "tiny", ["--recompute", "selective"]),
                                              (4, "default", [])])
def test_sequence_parallel_equals_single_process(tp, model, extra):
    """Gradients of step 0 (1e-12) and weights after 3 steps (2e-12) equal one process's; the norms stay identical.

    tiny has 2 heads, so tp = 4 runs on the default model (4 heads, 4 layers) at context 16.
    With dropout, the slices' masks are cut from the unsplit model's draws, so even they agree.
    """
    ref = run_in_threads(1, R.run_single, model, 2, 2, extra)[0]
    got = run_in_threads(tp, R.run_parallel, model, 2, 1, tp, 1, 2, "1f1b", ["--sequence-parallel", *extra])
    R.assert_matches(ref, got, f"tp {tp} sequence parallel {extra}")
    recompute = extra[extra.index("--recompute") + 1] if "--recompute" in extra else "none"
    _assert_tensor_bytes_predicted(got, model, Strategy(tp=tp, sequence_parallel=True, micro_batches=2,
                                                        recompute=recompute))
    for name in got[0]["params"]:
        if ".ln_" in name or name.endswith("c_proj.bias"):  # layer norms and row-parallel biases: bitwise identical
            for other in got[1:]:
                np.testing.assert_array_equal(other["params"][name], got[0]["params"][name], err_msg=name)


def _assert_tensor_bytes_predicted(got, model, st, cfg=None):
    """Every rank's tensor-group bytes per step outside validation (the trainer's tensor_parallel_activations) =
    the estimator's ``comm_bytes_per_step(..., accounting="minizero")["tp"]`` for its stage (R.base_argv's runs)."""
    cfg = cfg or get_config(model, dtype="float64", block_size=16)
    st = Strategy(**{**vars(st), "micro_batch": 2, "precision": "fp64"})
    for r in got:
        by = r["traffic"]["tp"]["by_op"]
        want = comm_bytes_per_step(cfg, st, stage=r["coords"][2], accounting="minizero")["tp"]
        assert sum(by.values()) - by.get(VALIDATION, 0) == R.STEPS * want, (r["coords"], by)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, model, extra", [(2, "tiny", []), (2, "tiny", ["--recompute", "full"]),
                                              (2, "tiny", ["--sequence-parallel", "--recompute", "full"]),
                                              (4, "default", []), (2, "tiny", ["--sequence-parallel", "--cp", "2"]),
                                              (2, "tiny", ["--moe-experts", "2", "--moe-every", "2"])])
def test_tensor_group_bytes_equal_the_estimator(tp, model, extra):
    """Bytes on the tensor group per step = the estimator's minizero accounting, exactly: the all-reduces (the
    recursive doubling of minizero's <= 256 KiB), the vocabulary-parallel loss, the re-forward of full recompute
    and, with sequence parallelism, the backward re-gathers of the column-parallel inputs for dW (lesson 10) and
    the norms' gradient all-reduce. An MoE block keeps its experts whole: only its attention's pair."""
    cp = int(extra[extra.index("--cp") + 1]) if "--cp" in extra else 1
    got = run_in_threads(tp * cp, R.run_parallel, model, 2, 1, tp, 1, 1, "1f1b", extra)
    recompute = extra[extra.index("--recompute") + 1] if "--recompute" in extra else "none"
    moe = parse_args(R.base_argv(model, 2, extra) + ["--tp", str(tp)], tp * cp).moe_config()
    shape = ModelShape.from_gpt_config(get_config(model, dtype="float64", block_size=16), moe=moe)
    _assert_tensor_bytes_predicted(got, model, Strategy(cp=cp, tp=tp, recompute=recompute,
                                                 sequence_parallel="--sequence-parallel" in extra), shape)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--no-overlap"]])
def test_sequence_parallel_with_data_parallel_equals_single_process(extra):
    """--dp 2 --tp 2 --sequence-parallel: the overlapped data-parallel reducer waits for the tensor group's
    sum of the norms' slices (it used to launch their bucket during backward and overwrite that sum)."""
    ref = run_in_threads(1, R.run_single, "tiny", 4, 1)[0]
    got = run_in_threads(4, R.run_parallel, "tiny", 2, 2, 2, 1, 1, "1f1b", ["--sequence-parallel", *extra])
    R.assert_matches(ref, got, f"dp 2 tp 2 sequence parallel {extra}")


def _embedding_exit(comm, cfg, idx, g):
    """The first stage's wte(idx) + wpe(pos) -> drop with sequence parallelism: output, grads, traffic each way."""
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    tensor_parallelize(stage, comm)
    vocab_parallelize(stage, comm)
    sequence_parallelize(stage, comm)
    tr, n = stage.transformer, idx.shape[1] // comm.world_size
    start = comm.traffic.snapshot()["by_op"]
    x = tr["drop"](tr["wte"](idx) + tr["wpe"](np.arange(idx.shape[1])))
    mid = comm.traffic.snapshot()["by_op"]
    (x * Tensor(g[:, comm.rank * n:(comm.rank + 1) * n].copy())).sum().backward()
    end = comm.traffic.snapshot()["by_op"]
    diff = [{k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)} for a, b in ((start, mid), (mid, end))]
    return x.data, tr["wte"].weight.grad, tr["wpe"].weight.grad, *diff


@pytest.mark.parametrize("t", [2, 4])
def test_the_embedding_exit_is_a_reduce_scatter_along_the_sequence(t):
    """Forward one reduce-scatter of (b, s, h), (t-1)/t of it (an all-reduce sends twice that), backward one
    all-gather; wpe is counted once and every rank's wte rows and wpe get the unsplit model's gradients, bitwise."""
    cfg = get_config("default", dtype="float64", block_size=32)
    b, s, h = 2, cfg.block_size, cfg.n_embd
    rng = np.random.default_rng(0)
    idx, g = rng.integers(0, cfg.vocab_size, (b, s)), rng.normal(size=(b, s, h))
    tr = GPT(cfg, seed=0).transformer
    ref = tr["drop"](tr["wte"](idx) + tr["wpe"](np.arange(s)))
    (ref * Tensor(g)).sum().backward()
    for r, (x, gwte, gwpe, fwd, bwd) in enumerate(run_in_threads(t, _embedding_exit, cfg, idx, g)):
        n = s // t
        np.testing.assert_array_equal(x, ref.data[:, r * n:(r + 1) * n])
        np.testing.assert_array_equal(gwte, shard_array(tr["wte"].weight.grad, 0, r, t))
        np.testing.assert_array_equal(gwpe, tr["wpe"].weight.grad)
        assert fwd == {"reduce_scatter": bytes_sent("reduce_scatter", b * s * h, 8, t, r)}  # no all_reduce
        assert bwd == {"all_gather": bytes_sent("all_gather", b * s * h, 8, t, r)}


def _measure_stage(comm, cfg, b, mode):
    set_ledger(MemoryLedger())
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    tensor_parallelize(stage, comm)
    vocab_parallelize(stage, comm)
    sequence_parallelize(stage, comm)
    apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    return saved_by_module(stage, x, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_bytes_per_layer_equal_the_sequence_parallel_formula(tp, mode, dropout):
    """Ledger bytes per layer = sbh(34/t + 5as/(ht)) in minizero's accounting (fp64), on every rank; and less than tp alone."""
    cfg = get_config("default", dtype="float64", dropout=dropout, block_size=32, n_layer=2)
    b, s = 2, cfg.block_size
    want = layer_activation_bytes(cfg, s, b, tp=tp, sequence_parallel=True, recompute=mode,
                                  accounting="minizero", precision="fp64")
    assert want < layer_activation_bytes(cfg, s, b, tp=tp, recompute=mode, accounting="minizero", precision="fp64")
    for got in run_in_threads(tp, _measure_stage, cfg, b, mode):
        for i in range(cfg.n_layer):
            assert layer_bytes(got, f"transformer.h.{i}") == want, (i, got)


def test_sequence_parallel_is_refused_where_it_cannot_run():
    with pytest.raises(UsageError, match="needs --tp > 1"):
        parse_args(["--model", "tiny", "--sequence-parallel"], 2)
    with pytest.raises(UsageError, match="context length 15 divisible by --tp 2"):
        parse_args(["--model", "tiny", "--tp", "2", "--sequence-parallel", "--block-size", "15"], 2)
    for zero in ("1", "2", "3"):  # ZeRO 2-3: the tensor group sums the pieces of the shards (SequenceParallelGrads)
        assert parse_args(["--model", "tiny", "--tp", "2", "--sequence-parallel", "--zero", zero], 4).sequence_parallel


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero, dp, extra", [(2, 2, []), (3, 2, []), (3, 4, ["--dp-shard", "2"]), (3, 1, ["--cp", "2"])])
def test_sequence_parallel_composes_with_zero_2_and_3(zero, dp, extra):
    """--tp 2 --sequence-parallel --zero 2/3 (and hybrid sharding, context parallelism): backward reduce-scatters the norms' and biases'
    gradients over the data group, then the tensor group sums the pieces each shard holds; every rank's gradient
    pieces (step 0), weights after 3 clipped steps and losses are one process's. Bytes: the pieces partition the
    norms and biases, so the mean over the ranks is the estimator's whole all-reduce / N (plus the first step's
    8-byte layout check); no rank sends the whole one."""
    ref = run_in_threads(1, R.run_single, "tiny", 2 * dp, 2)[0]
    cp = 2 if "--cp" in extra else 1
    got = run_in_threads(2 * dp * cp, R.run_parallel, "tiny", 2, dp, 2, 1, 2, "1f1b",
                         ["--sequence-parallel", "--zero", str(zero), *extra])
    R.assert_matches(ref, got, f"dp{dp} tp2 sp zero{zero} {extra}")
    assert all("zero_grads0" in r for r in got)
    cfg = get_config("tiny", dtype="float64", block_size=16)
    st = Strategy(dp=dp, cp=cp, tp=2, zero=zero, sequence_parallel=True, micro_batch=2, micro_batches=2,
                  precision="fp64", dp_shard=2 if "--dp-shard" in extra else None)
    # tp = 2: ring and recursive doubling both send n elements, so bytes are linear in the pieces' sizes and their
    # mean over the shard ranks is the whole all-reduce's / N; the first step's layout check sends 8 * (tp - 1) bytes
    sent = [r["traffic"]["tp"]["by_op"]["sequence_parallel_grads"] - 8 * (2 - 1) for r in got]
    whole = tensor_parallel_bytes(cfg, Strategy(**{**vars(st), "zero": 1}))["grads"]
    assert np.mean(sent) == R.STEPS * tensor_parallel_bytes(cfg, st)["grads"] == R.STEPS * whole / 2, sent
    assert 0 < min(sent) and max(sent) < R.STEPS * whole, (sent, whole)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("small", [None, 16 * 1024])
def test_sequence_parallel_grad_bytes_per_rank_equal_the_estimator_at_tp_4(zero, small, monkeypatch):
    """--dp 2 --tp 4 --sequence-parallel --zero 2/3 (default model, 4 heads): each rank's bytes of the norms' sum are
    ``tensor_parallel_bytes(..., tp_rank, shard_rank)["grads"]``, exactly; the data ranks' differ (data rank 0's
    pieces hold 2688 of the 3328 elements, 1's 640) and the estimate without ``shard_rank`` is their mean. With the
    small-message limit at 16 KiB the whole (26 KiB) and data rank 0's piece take the ring, rank 1's recursive
    doubling: bytes are not linear in a piece's size at tp >= 4, so that mean is not the whole all-reduce's / N.
    The first step's layout check adds 8 (tp - 1) bytes."""
    if small is not None:  # read at each call, by the trainer's all-reduce and the estimator's bytes_sent alike
        monkeypatch.setattr(recursive_doubling, "SMALL_ALLREDUCE_MAX_BYTES", small)
    got = run_in_threads(8, R.run_parallel, "default", 2, 2, 4, 1, 1, "1f1b",
                         ["--sequence-parallel", "--zero", str(zero)])
    cfg = get_config("default", dtype="float64", block_size=16)
    st = Strategy(dp=2, tp=4, zero=zero, sequence_parallel=True, micro_batch=2, precision="fp64")
    sent = {r["coords"][:2]: r["traffic"]["tp"]["by_op"]["sequence_parallel_grads"] - 8 * (4 - 1) for r in got}
    for (d, t), b in sent.items():
        assert b == R.STEPS * tensor_parallel_bytes(cfg, st, tp_rank=t, shard_rank=d)["grads"], (d, t, sent)
    for t in range(4):
        whole = tensor_parallel_bytes(cfg, Strategy(**{**vars(st), "zero": 1}), tp_rank=t)["grads"]
        mean = tensor_parallel_bytes(cfg, st, tp_rank=t)["grads"]
        assert sent[0, t] != sent[1, t] and (sent[0, t] + sent[1, t]) / 2 == R.STEPS * mean, sent
        assert (mean == whole / 2) == (small is None), (mean, whole)
    assert tensor_parallel_bytes(cfg, Strategy(**{**vars(st), "zero": 1}), tp_rank=t, shard_rank=1)["grads"] == whole
    with pytest.raises(ValueError, match=r"shard_rank=2; allowed: 0 to 1 \(N = 2\)"):
        tensor_parallel_bytes(cfg, st, shard_rank=2)


class _HeldPieces:
    """A synchroniser that reduced in backward and holds elements [lo, lo + 2) of parameter ``p``."""

    def __init__(self, p, lo):
        self.p, self.lo, self.grad = p, lo, np.ones(2)

    def reduce_gradients(self):
        pass

    def held_grad_pieces(self, params):
        return [(self.p, self.lo, self.lo + 2, self.grad)]


def test_the_tensor_ranks_must_hold_the_same_pieces():
    """SequenceParallelGrads checks on the first step that every tensor rank holds the same (parameter, lo, hi)
    pieces: a rank holding other elements is refused on every rank; equal pieces are summed in place."""
    from types import SimpleNamespace

    from minizero.parallel.sequence_parallel import SequenceParallelGrads

    def rank(comm):
        p = SimpleNamespace(sequence_parallel=True)
        grads = SequenceParallelGrads([p], comm)
        with pytest.raises(RuntimeError, match=r"different gradient pieces .* checksums"):
            grads.reduce(_HeldPieces(p, comm.rank))
        same = _HeldPieces(p, 0)
        grads.reduce(same)
        return same.grad

    assert [g.tolist() for g in run_in_threads(2, rank)] == [[2.0, 2.0]] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [2, 3])
def test_sequence_parallel_with_zero_from_the_command_line(mpiexec, tmp_path, zero):
    """``mpiexec -n 4 python -m minizero.train --tp 2 --sequence-parallel --zero N`` (dropout on): train and
    validation losses and gradient norms in the --json report are one process's (micro-batch 2) within 1e-12."""
    base = ["--model", "tiny", "--dtype", "float64", "--dropout", "0.1", "--steps", "3", "--batch-size", "8",
            "--no-progress", "--eval-every", "0"]
    out = R.cli_summaries(mpiexec, str(tmp_path), base, ["--tp", "2", "--sequence-parallel", "--zero", str(zero)],
                          ["--micro-batch-size", "2"], ranks=4)
    assert out["par"]["zero"]["stage"] == zero and out["par"]["tp"] == 2
    for key in ("train_loss", "val_loss", "grad_norm"):
        np.testing.assert_allclose(out["par"][key], out["one"][key], rtol=1e-12, atol=0, err_msg=key)


@pytest.mark.timeout(300)
def test_sequence_parallel_from_the_command_line(mpiexec, tmp_path):
    """``mpiexec -n 2 python -m minizero.train --tp 2 --sequence-parallel``: the final weights are one process's;
    summary.json's tensor-parallel bytes are the estimator's (minizero accounting: with the backward re-gathers)."""
    base = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3", "--micro-batch-size", "2"]
    R.cli_matches_one_process(mpiexec, str(tmp_path), base, ["--tp", "2", "--sequence-parallel"])
    with open(tmp_path / "par" / "summary.json") as f:
        sent = json.load(f)["bytes_sent_by_kind"]["tensor_parallel_activations"]
    st = Strategy(tp=2, sequence_parallel=True, micro_batch=2, precision="fp64")
    want = comm_bytes_per_step(get_config("tiny", dtype="float64"), st, accounting="minizero")["tp"]
    assert sent == [3 * want] * 2 and want > comm_bytes_per_step(get_config("tiny", dtype="float64"), st)["tp"]


@pytest.mark.timeout(300)
def test_sequence_parallel_with_a_pipeline_sends_the_sequence_slices():
    """--tp 2 --pp 2 --sequence-parallel: the stages exchange (b, T/2, C) slices; weights are one process's."""
    ref = run_in_threads(1, R.run_single, "tiny", 2, 2, [])[0]
    got = run_in_threads(4, R.run_parallel, "tiny", 2, 1, 2, 2, 2, "1f1b", ["--sequence-parallel"])
    R.assert_matches(ref, got, "tp 2 pp 2 sequence parallel")
    _assert_tensor_bytes_predicted(got, "tiny", Strategy(tp=2, pp=2, micro_batches=2, sequence_parallel=True))
    for r in got:
        assert r["traffic"]["pp"]["by_op"].get("pp_activation", 0) in (0, 3 * 2 * 2 * 8 * 16 * 8)  # 3 steps x m 2 x (2, 8, 16) f64


def test_experts_and_dense_part_must_reduce_at_the_same_time():
    """A DenseAndExperts whose parts disagree (one reduced in backward, one not) would leave one part's norm pieces
    unsummed, silently (before: None, the whole-gradient path, which skips ZeRO's gradient-less parameters)."""
    from types import SimpleNamespace

    from minizero.parallel.expert_parallel import DenseAndExperts

    whole, pieces = SimpleNamespace(held_grad_pieces=lambda ps: None), SimpleNamespace(held_grad_pieces=lambda ps: [])
    assert DenseAndExperts(whole, whole, ep=2, predivided=False).held_grad_pieces([]) is None
    assert DenseAndExperts(pieces, pieces, ep=2, predivided=False).held_grad_pieces([]) == []
    with pytest.raises(ValueError, match="reduce gradients at different times"):
        DenseAndExperts(pieces, whole, ep=2, predivided=False).held_grad_pieces([])
