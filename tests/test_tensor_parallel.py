"""Tensor parallelism (Megatron-LM) equals the single process, sends what the derivation says, holds 1/tp.

Equivalence (float64, tests/mp_reference.py): every tensor rank's gradient shards of step 0
match the same slices of the single process's gradients to 1e-12 (relative to the tensor's
largest entry), its parameter shards after 3 steps to 2e-12, losses to 1e-13.

Communication, derived in minizero/parallel/tensor_parallel.py: per block and micro-batch
(B sequences of T tokens, width C), 2 all-reduces of a (B, T, C) array in forward (the g
after each row-parallel layer) and 2 in backward (the f before each column-parallel layer);
a ring all-reduce sends 2(tp-1)/tp * B*T*C*itemsize bytes per rank.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from minizero.autograd import Tensor
from minizero.comm import bytes_sent, run_in_threads
from minizero.ledger import get_ledger
from minizero.nn import GPT, get_config
from minizero.nn.module import Linear
from minizero.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, allreduce_bytes_per_block,
                                               copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                               shard_array, tensor_parallelize, unshard_arrays)
from minizero.parallel.three_d import build_stage
from minizero.parallel.topology import Topology
from tests import mp_reference as R


@pytest.fixture(autouse=True)
def one_blas_thread():
    """Ranks are threads here: one BLAS thread each (oversubscribed BLAS is ~100x slower on 2 cores)."""
    with threadpool_limits(limits=1):
        yield


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), stride=st.sampled_from([1, 3]), dim=st.sampled_from([0, 1]),
       rows=st.integers(1, 3), cols=st.integers(1, 3))
def test_shard_then_unshard_is_the_identity(tp, stride, dim, rows, cols):
    shape = [rows * 12, cols * 12]
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    shards = [shard_array(full, dim, r, tp, stride) for r in range(tp)]
    assert all(s.shape[dim] == shape[dim] // tp for s in shards)
    np.testing.assert_array_equal(unshard_arrays(shards, dim, stride), full)


def test_qkv_split_keeps_each_ranks_heads_together():
    """c_attn's (3C, C) weight, stride 3: rank r gets rows [rC/tp, (r+1)C/tp) of Q, of K and of V."""
    c, tp = 4, 2
    w = np.repeat(np.arange(3 * c)[:, None], 2, axis=1)  # row index as value
    assert shard_array(w, 0, 1, tp, stride=3)[:, 0].tolist() == [2, 3, 6, 7, 10, 11]


def test_f_and_g_are_conjugate():
    """f: forward identity, backward all-reduce; g: forward all-reduce, backward identity."""
    def rank(comm):
        r = comm.rank
        x = Tensor(np.full(3, r + 1.0), requires_grad=True)
        y = copy_to_tensor_parallel_region(x, comm)
        fwd_f = y.data.copy()
        (y * Tensor(np.full(3, 10.0 ** r))).sum().backward()
        z = Tensor(np.full(3, r + 1.0), requires_grad=True)
        w = reduce_from_tensor_parallel_region(z, comm)
        (w * Tensor(np.full(3, 10.0 ** r))).sum().backward()
        return fwd_f, x.grad, w.data, z.grad, comm.traffic.calls.get("all_reduce", 0)

    for r, (fwd_f, gx, fwd_g, gz, calls) in enumerate(run_in_threads(3, rank)):
        np.testing.assert_array_equal(fwd_f, r + 1.0)  # f forward: identity
        np.testing.assert_array_equal(gx, 111.0)  # f backward: sum of 1, 10, 100
        np.testing.assert_array_equal(fwd_g, 6.0)  # g forward: 1 + 2 + 3
        np.testing.assert_array_equal(gz, 10.0 ** r)  # g backward: identity
        assert calls == 2  # one all-reduce each


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_parallel_equals_the_full_layers(tp):
    rng = np.random.default_rng(0)
    a, b = Linear(8, 16, dtype="float64", rng=rng), Linear(16, 8, dtype="float64", rng=rng)
    b.bias.data[...] = rng.normal(size=8)
    x = rng.normal(size=(2, 3, 8))
    y = b(a(Tensor(x, requires_grad=True)).tanh())
    (y * y).sum().backward()

    def rank(comm):
        col, row = ColumnParallelLinear.from_linear(a, comm), RowParallelLinear.from_linear(b, comm)
        xt = Tensor(x, requires_grad=True)
        out = row(col(xt).tanh())
        (out * out).sum().backward()
        return out.data, xt.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad

    for r, (out, gx, gca, gcb, gra, grb) in enumerate(run_in_threads(tp, rank)):
        np.testing.assert_allclose(out, y.data, rtol=1e-13)
        np.testing.assert_allclose(gca, shard_array(a.weight.grad, 0, r, tp), rtol=1e-12)
        np.testing.assert_allclose(gcb, shard_array(a.bias.grad, 0, r, tp), rtol=1e-12)
        np.testing.assert_allclose(gra, shard_array(b.weight.grad, 1, r, tp), rtol=1e-12)
        np.testing.assert_allclose(grb, b.bias.grad, rtol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, model, dropout", [(2, "tiny", None), (4, "default", None), (2, "tiny", "0.1"),
                                               (2, "default", "0.1")])
def test_tensor_parallel_equals_single_process(tp, model, dropout):
    """tiny has 2 heads, so tp = 4 runs on the default model (4 heads, 4 layers) at context 16; default at tp = 2
    with dropout: 2 heads per rank, so rank 1's masks start at head 2 (not at its rank).

    With dropout the split model draws every head's mask from the generator the tensor group
    shares, so even the masks are the single process's (HeadParallelDropout).
    """
    extra = ["--dropout", dropout] if dropout else []
    ref = run_in_threads(1, R.run_single, model, 2, 2, extra)[0]
    got = run_in_threads(tp, R.run_parallel, model, 2, 1, tp, 1, 2, "1f1b", extra)
    R.assert_matches(ref, got, f"tp {tp} {model}")


@pytest.mark.usefixtures("ring_all_reduce")  # the ring at every size (small buffers would take recursive doubling)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 4])
def test_allreduce_volume_per_block_and_micro_batch(tp):
    """2 all-reduces of (B, T, C) forward, 2 backward, per block; nothing else in the tensor group."""
    cfg = get_config("default", dtype="float64", block_size=16)
    b, t = 3, 16
    x = np.random.default_rng(0).integers(0, 256, (b, t))

    def rank(comm):
        model = GPT(cfg, seed=1)
        tensor_parallelize(model, comm)
        _, loss = model(x, x)
        after_forward = comm.traffic.snapshot()
        loss.backward()
        return after_forward, comm.traffic.snapshot()

    for r, (fwd, total) in enumerate(run_in_threads(tp, rank)):
        per = allreduce_bytes_per_block(b, t, cfg.n_embd, 8, tp, r)
        one = bytes_sent("all_reduce", b * t * cfg.n_embd, 8, tp, r)
        assert per["forward"] == 2 * one == 2 * 2 * (tp - 1) * b * t * cfg.n_embd * 8 // tp
        assert fwd["calls"]["all_reduce"] == per["calls_forward"] * cfg.n_layer == 2 * cfg.n_layer
        assert fwd["by_op"] == {"all_reduce": per["forward"] * cfg.n_layer}
        assert total["calls"]["all_reduce"] == (per["calls_forward"] + per["calls_backward"]) * cfg.n_layer
        assert per["calls_backward"] == 2
        assert total["by_op"] == {"all_reduce": (per["forward"] + per["backward"]) * cfg.n_layer}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameter_bytes_of_the_split_layers_shrink_as_one_over_tp(tp):
    """The ledger's parameters: 12C^2/tp + 7C/tp + 6C per block; wte split by vocabulary; wpe, ln_f whole."""
    cfg = get_config("default", dtype="float64", block_size=16)
    c, item = cfg.n_embd, 8

    def rank(comm):
        topo = Topology(comm, 1, tp, 1)
        before = get_ledger().current["parameters"]
        stage = build_stage(cfg, 0, topo)
        split = sum(p.data.nbytes for n, p in stage.named_parameters()
                    if any(k in n for k in ("c_attn", "c_fc", "c_proj.weight")))
        return get_ledger().current["parameters"] - before, split

    for held, split in run_in_threads(tp, rank):
        per_block = (12 * c * c // tp + 7 * c // tp + 6 * c) * item
        replicated = (cfg.vocab_size * c // tp + cfg.block_size * c + 2 * c) * item
        assert held == cfg.n_layer * per_block + replicated
        assert split == cfg.n_layer * (12 * c * c + 7 * c) * item // tp


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_head_and_loss_equal_the_whole(tp):
    """Embedding rows, logits and the loss split by tokens; every target falls on some rank's slice."""
    from minizero.parallel.pipeline import PipelineStage
    from minizero.parallel.vocab_parallel import vocab_parallelize

    cfg = get_config("tiny", dtype="float64", n_head=4)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 256, (3, 16)), rng.integers(0, 256, (3, 16))
    whole = PipelineStage(GPT(cfg, seed=2), 0, 1)
    loss = whole(x, y)
    loss.backward()

    def rank(comm):
        stage = PipelineStage(GPT(cfg, seed=2), 0, 1)
        assert vocab_parallelize(stage, comm) == ["transformer.wte", "lm_head", "loss"]
        assert stage.lm_head.weight is stage.transformer["wte"].weight  # still tied, shard by shard
        out = stage(x, y)
        out.backward()
        return out.item(), stage.transformer["wte"].weight.grad, comm.traffic.snapshot()

    g = whole.transformer["wte"].weight.grad
    for r, (value, grad, traffic) in enumerate(run_in_threads(tp, rank)):
        assert value == pytest.approx(loss.item(), rel=1e-14)
        np.testing.assert_allclose(grad, shard_array(g, 0, r, tp), rtol=0, atol=1e-13 * np.abs(g).max())
        assert traffic["calls"] == {"all_reduce": 4, "all_gather": 1}  # embedding g, head f, loss 2 + 1


def test_vocabulary_must_split_evenly():
    from minizero.layout_checks import resolve_sizes

    with pytest.raises(ValueError, match="--tp 3 does not divide the vocabulary size vocab_size=256"):
        resolve_sizes(3, tp=3, vocab_size=256)
