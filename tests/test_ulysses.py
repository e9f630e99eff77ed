"""DeepSpeed-Ulysses (parallel/ulysses.py): attention over a split sequence by two all-to-alls.

* The core equals whole causal attention in float64 (1e-12), output and the gradients of q, k, v,
  at 1, 2 and 4 ranks; the bytes are ulysses_bytes; the gathered time order is the sequence's.
* Training (``--cp c --cp-attention ulysses``) equals one process in float64 alone, with dp 2,
  ZeRO-1, tp 2, pp 2, selective recompute and flash attention inside; once under mpiexec.
* Refused: heads not divisible by c (dropout runs: each head group reads its heads of the unsplit mask).
"""
import math
import re

import numpy as np
import pytest

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.autograd import Tensor
from minizero.autograd.functional import causal_softmax
from minizero.comm import run_in_threads
from minizero.memory.estimator import Strategy, comm_bytes_per_step, layer_activation_bytes
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT, PRESETS, get_config
from minizero.nn.gpt import GPTConfig
from minizero.parallel.context_parallel import (context_parallelize, split_for_context_parallel,
                                                unsplit_from_context_parallel)
from minizero.parallel.pipeline import PipelineStage
from minizero.parallel.ulysses import UlyssesAttentionCore, sequence_order, ulysses_bytes
from minizero.train import parse_args
from tests.test_context_parallel import _measure


def test_gathered_rows_are_put_in_sequence_order():
    cp, n = 3, 2  # rank i holds chunks i and 5-i of 6 chunks of 2 rows
    gathered = np.concatenate([split_for_context_parallel(np.arange(2 * cp * n), i, cp, 0) for i in range(cp)])
    np.testing.assert_array_equal(gathered[sequence_order(cp, n)], np.arange(2 * cp * n))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ulysses_equals_whole_causal_attention(cp):
    b, h, s, d = 2, 4, 16, 3
    rng = np.random.default_rng(0)
    q, k, v, w = (rng.normal(size=(b, h, s, d)) for _ in range(4))
    qt, kt, vt = (Tensor(a, requires_grad=True) for a in (q, k, v))
    ref = causal_softmax((qt @ kt.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d))) @ vt
    (ref * Tensor(w)).sum().backward()

    def rank(comm):
        r = comm.rank
        ql, kl, vl = (Tensor(split_for_context_parallel(a, r, cp, 2), requires_grad=True) for a in (q, k, v))
        out = UlyssesAttentionCore(comm)(ql, kl, vl, lambda a: a)
        sent = comm.traffic.bytes_sent
        (out * Tensor(split_for_context_parallel(w, r, cp, 2))).sum().backward()
        return out.data, ql.grad, kl.grad, vl.grad, sent, comm.traffic.bytes_sent - sent

    res = run_in_threads(cp, rank)
    for i, want in enumerate([ref.data, qt.grad, kt.grad, vt.grad]):
        got = unsplit_from_context_parallel([r_[i] for r_ in res], 2)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max(), err_msg=str(i))
    expect = ulysses_bytes(b, h, s, d, 8, cp)
    for r_ in res:
        assert (r_[4], r_[5]) == (expect["forward"], expect["backward"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp, dp, tp, pp, m, extra", [
    (2, 1, 1, 1, 1, []),  # (cp 4, tp 2 and flash without dropout: the same paths as the dropout cases below)
    (2, 2, 1, 1, 1, ["--zero", "1"]),
    (2, 1, 1, 2, 2, []),
    (2, 1, 1, 1, 1, ["--recompute", "selective"]),
    (4, 1, 1, 1, 1, ["--dropout", "0.2"]),  # each head group's rows of the whole (b, H, T, T) mask
    (2, 1, 2, 1, 1, ["--dropout", "0.2"]),  # the tensor rank's head offset kept
    (2, 1, 1, 1, 1, ["--dropout", "0.2", "--attention", "flash", "--attention-block", "4"]),
])
def test_ulysses_training_equals_single_process(monkeypatch, cp, dp, tp, pp, m, extra):
    model = "four-heads"  # 4 / (tp x cp) whole heads per rank; 2 layers (one per stage at pp 2), width 32
    monkeypatch.setitem(PRESETS, model, GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16))
    ref = run_in_threads(1, R.run_single, model, 2 * dp, m, [a for a in extra if a not in ("--attention", "flash",
                                                                                          "--attention-block", "4")])[0]
    got = run_in_threads(dp * tp * pp * cp, R.run_parallel, model, 2, dp, tp, pp, m, "1f1b",
                         ["--cp", str(cp), "--cp-attention", "ulysses", *extra])
    R.assert_matches(ref, got, f"ulysses cp {cp} dp {dp} tp {tp} pp {pp} {extra}")


def test_ulysses_is_refused_where_heads_do_not_split():
    with pytest.raises(UsageError, match="--cp 4 --cp-attention ulysses needs the 2 attention heads per tensor "
                       "rank .* divisible by cp = 4"):
        parse_args(["--model", "tiny", "--cp", "4", "--cp-attention", "ulysses", "--block-size", "16"], 4)
    # the flag as given (before: "--cp 4 must be >= 1 and divide the world size 2" answered --ulysses 4)
    with pytest.raises(UsageError, match="^--ulysses 4 needs the 2 attention heads"):
        parse_args(["--model", "tiny", "--ulysses", "4", "--block-size", "16"], 4)
    with pytest.raises(UsageError, match="^--ulysses 4 must be >= 2 and divide the world size 2; launch a multiple of 4 "
                       r"ranks, e\.g\. mpirun -n 4 python -m minizero\.train \.\.\.$"):
        parse_args(["--model", "default", "--ulysses", "4"], 2)  # tiny's 2 heads: refused first (tests/test_3d.py)
    with pytest.raises(UsageError, match=re.escape("--cp-attention only apply(ies) with --cp > 1")):
        parse_args(["--model", "default", "--cp-attention", "ulysses"], 1)
    assert parse_args(["--model", "default", "--cp", "2", "--cp-attention", "ulysses", "--dropout", "0.1"], 2).cp == 2


def test_ulysses_n_is_cp_n_with_ulysses_attention_and_a_conflict_is_refused():
    args = parse_args(["--model", "default", "--ulysses", "2"], 2)
    assert (args.cp, args.cp_attention) == (2, "ulysses")
    assert (parse_args(["--model", "default", "--ulysses", "2", "--cp", "2"], 2).cp_attention) == "ulysses"
    with pytest.raises(UsageError, match="--ulysses 2 with --cp 4: --ulysses N means --cp N --cp-attention ulysses"):
        parse_args(["--model", "default", "--ulysses", "2", "--cp", "4"], 4)
    with pytest.raises(UsageError, match="--ulysses must be >= 2 .*, got 1"):
        parse_args(["--model", "default", "--ulysses", "1"], 1)


@pytest.mark.timeout(300)
def test_ulysses_from_the_command_line(mpiexec, tmp_path):
    """``mpiexec -n 2 python -m minizero.train --ulysses 2`` (= ``--cp 2 --cp-attention ulysses``): the final weights
    are one process's."""
    base = ["--model", "default", "--block-size", "16", "--dtype", "float64", "--steps", "3", "--eval-batches", "1",
            "--eval-every", "0", "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3",
            "--micro-batch-size", "2"]
    R.cli_matches_one_process(mpiexec, str(tmp_path), base, ["--ulysses", "2"])


def _ulysses_traffic(comm, cfg, b, mode):
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    context_parallelize(stage, comm, "ulysses")
    apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    stage(x, x).backward()
    return comm.traffic.bytes_sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_ulysses_traffic_of_a_training_step_equals_the_estimator(cp, mode):
    """Bytes each rank sends in one micro-batch's forward and backward (the traffic ledger) =
    comm_bytes_per_step(..., cp_attention="ulysses")["cp"], the planner's figure: 4 (c-1)/c blocks per layer each way,
    and the forward's again under recompute; below ring attention's 4(c-1) + 2c blocks."""
    cfg, b = get_config("default", dtype="float64", block_size=32, n_layer=2), 2
    st = Strategy(cp=cp, recompute=mode, precision="fp64", micro_batch=b, cp_attention="ulysses")
    want = comm_bytes_per_step(cfg, st, 32)["cp"]
    assert want > 0 and all(got == want for got in run_in_threads(cp, _ulysses_traffic, cfg, b, mode))
    ring = comm_bytes_per_step(cfg, Strategy(cp=cp, recompute=mode, precision="fp64", micro_batch=b), 32)["cp"]
    assert want < ring


def test_the_estimator_refuses_ulysses_where_heads_do_not_split():
    with pytest.raises(ValueError, match="cp_attention='ulysses' needs cp=8 to divide the 4 heads and 4 KV heads per tensor rank"):
        comm_bytes_per_step(get_config("default"), Strategy(cp=8, cp_attention="ulysses"), 64)
    with pytest.raises(ValueError, match="Strategy.cp_attention='tree' is not one of"):
        Strategy(cp=2, cp_attention="tree").validate()


def test_ulysses_bytes_with_grouped_kv_heads_count_k_and_v_at_their_own_head_count():
    """GQA (the planner's models): q and the output move H heads, k and v H_kv; with H_kv = H the formula is
    parallel/ulysses.py's ulysses_bytes, which the trainer measures."""
    from minizero.memory.estimator import ulysses_attention_bytes
    assert ulysses_attention_bytes(2, 8, 8, 64, 16, 8, 4) == ulysses_bytes(2, 8, 64, 16, 8, 4)
    got = ulysses_attention_bytes(1, 8, 2, 64, 16, 2, 4)["forward"]
    assert got == 3 * (2 * 8 + 2 * 2) * 16 * 16 * 2 // 4 > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_measured_bytes_per_layer_equal_the_ulysses_formula(cp, mode, dropout):
    """Before: the estimator gave Ulysses ring attention's rows; its dense core keeps (b, H/c, T, T) probabilities
    (and mask) of the whole length, which at long T is far more than the ring's output and log-sum-exp."""
    cfg, b = get_config("default", dtype="float64", block_size=32, dropout=dropout, n_layer=1), 2  # block 0 measured
    want = layer_activation_bytes(cfg, 32, b, recompute=mode, accounting="minizero", precision="fp64", cp=cp,
                                  cp_attention="ulysses")
    assert all(got == want for got in run_in_threads(cp, _measure, cfg, b, mode, False, "ulysses"))
    long = {k: layer_activation_bytes(cfg, 4096, b, accounting="minizero", precision="fp64", cp=cp, cp_attention=k)
            for k in ("ring", "ulysses")}
    assert long["ulysses"] > 4 * long["ring"]  # the s^2 term, / c



def test_ulysses_refuses_an_explicit_ring():
    # before: --ulysses 2 --cp-attention ring ran Ulysses silently; the explicit ulysses stays accepted
    with pytest.raises(UsageError, match="^--ulysses 2 with --cp-attention ring: --ulysses N means --cp N "
                       "--cp-attention ulysses; give one of them$"):
        parse_args(["--model", "tiny", "--ulysses", "2", "--cp-attention=ring"], 2)
    assert parse_args(["--model", "tiny", "--ulysses", "2", "--cp-attention", "ulysses"], 2).cp_attention == "ulysses"
    assert parse_args(["--model", "tiny", "--ulysses", "2"], 2).cp_attention == "ulysses"


def test_cp_attention_not_given_is_none_to_the_parser_and_ring_to_the_run():
    """--cp-attention is parsed with the default None (given = not None, which --ulysses N refuses as ring; before,
    argv was parsed a second time to tell), resolved to ring after the --ulysses check; --help still says ring."""
    import minizero.flags as flags
    from minizero.config import TrainConfig

    assert flags.build_parser().parse_args([]).cp_attention is None
    assert parse_args(["--model", "tiny"]).cp_attention == TrainConfig().cp_attention == "ring"
    assert parse_args(["--model", "tiny", "--cp", "2", "--cp-attention", "ring"], 2).cp_attention == "ring"
    with pytest.raises(UsageError, match="^--ulysses 2 with --cp 4: --ulysses N means --cp N --cp-attention ulysses; "
                       "give one of them$"):  # the --cp conflict is named first
        parse_args(["--model", "tiny", "--ulysses", "2", "--cp", "4", "--cp-attention", "ring"], 4)
    with pytest.raises(UsageError, match="^--ulysses 2 with --cp-attention ring: "):
        parse_args(["--model", "tiny", "--ulysses", "2", "--cp", "2", "--cp-attention", "ring"], 2)
    said = flags.build_parser().format_help().split("--cp-attention {ring,ulysses}")[-1].split("--ulysses N")[0]
    said = " ".join(said.split())
    assert said.endswith("shards to head shards and back) (default: ring)") and said.count("default") == 1, said
    # given = not None, so the default's value given at --cp 1 is refused (before: accepted, while ulysses was not)
    with pytest.raises(UsageError, match="^" + re.escape("--cp-attention only apply(ies) with --cp > 1 (context "
                                                         "parallelism); got --cp 1") + "$"):
        parse_args(["--model", "tiny", "--cp-attention", "ring"])
    assert parse_args(["--model", "tiny", "--ulysses", "2"], 2).cp == 2  # --ulysses N sets cp: not idle
