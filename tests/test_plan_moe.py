"""MoE and expert parallelism in the estimator and the planner (issue 31): parameter counts, the expert
all-to-all and model-state bytes against the trainer's ledgers, the presets, and ``plan`` searching ep."""
import pytest

from minizero.memory.estimator import ModelShape, Strategy
from minizero.nn import GPT, get_config
from minizero.parallel.expert_parallel import MoEConfig, use_moe


# ---- 1: the shape and its parameter counts ------------------------------------------------------
@pytest.mark.parametrize("every", [1, 2])
def test_tiny_moe_parameters_equal_moeconfig_and_the_model(every):
    cfg, moe = get_config("tiny"), MoEConfig(4, top_k=2, every=every)
    shape = ModelShape.from_gpt_config(cfg, moe=moe)
    model = GPT(cfg)
    use_moe(model, moe, seed=0)
    assert (shape.num_parameters(), shape.active_parameters()) == moe.parameters(cfg)
    assert shape.num_parameters() == model.num_parameters() == sum(shape.tensor_sizes())
    assert shape.moe_layers() == moe.layers(cfg.n_layer)


def test_a_dense_shape_is_unchanged_by_the_moe_fields():
    cfg = get_config("tiny")
    shape = ModelShape.from_gpt_config(cfg)
    assert shape.num_parameters() == shape.active_parameters() == cfg.num_parameters()
    assert shape.moe_layers() == []


@pytest.mark.parametrize("kw,words", [
    (dict(experts=4, top_k=5), "top_k must be in 1..experts=4"),
    (dict(experts=4, top_k=1, capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
    (dict(experts=4, dense_layers=2), "no block has an MoE layer"),
    (dict(experts=4, moe_every=0), "moe_every must be >= 1"),
    (dict(shared_experts=1), "need experts > 0"),
    (dict(experts=-1), "experts must be an integer >= 0"),
])
def test_bad_moe_shapes_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        ModelShape("x", 2, 16, 2, 2, 64, 256, 16, **kw).validate()


@pytest.mark.parametrize("kw,words", [
    (dict(dp=4, ep=3), "ep=3 must divide dp=4"),
    (dict(dp=8, ep=8), "ep=8 must divide x's 4 experts"),
])
def test_bad_ep_is_refused(kw, words):
    m = ModelShape("x", 2, 16, 2, 2, 64, 256, 16, experts=4, top_k=2)
    with pytest.raises(ValueError, match=words):
        Strategy(**kw).validate(m)
    with pytest.raises(ValueError, match="a dense model: use ep=1"):
        Strategy(dp=2, ep=2).validate(ModelShape("y", 2, 16, 2, 2, 64, 256, 16))


# ---- 2: the expert all-to-all and the model states against the trainer -------------------------
from minizero.callbacks import Callback  # noqa: E402
from minizero.comm import run_in_threads  # noqa: E402
from minizero.ledger import get_ledger  # noqa: E402
from minizero.loop import train  # noqa: E402
from minizero.memory.estimator import (comm_bytes_per_step, estimate_memory, expert_all_to_all_bytes,  # noqa: E402
                                       precision_for_dtype, stage_state_bytes)
from minizero.train import parse_args  # noqa: E402

STEPS = 3
#: capacity factor 0.25: each expert's C = ceil(0.5 T k / E) slots fill on every rank (the estimate is exact there)
MOE = ["--model", "tiny", "--dtype", "float64", "--steps", str(STEPS), "--eval-batches", "1", "--eval-every", "0",
       "--progress", "none", "--seed", "3", "--no-save", "--micro-batch-size", "2", "--moe-experts", "4",
       "--moe-top-k", "2", "--moe-capacity-factor", "0.25"]


class _Measure(Callback):
    """The expert all-to-all bytes of the training steps only (validation routes without capacity) and the
    ledger's model-state bytes in the second step, gradients reduced (Adam's state exists since the first)."""

    def on_train_start(self, run):
        self.start = run.strategy.traffic_by_kind()["expert_all_to_all"]
        get_ledger().reset_peaks()

    def after_grads(self, step, params, opt):
        if step == 1:
            cur = get_ledger().current
            self.states = {c: cur[c] for c in ("parameters", "gradients", "optimizer_state")}

    def on_train_end(self, run):
        self.a2a = run.strategy.traffic_by_kind()["expert_all_to_all"] - self.start
        self.dropped = sum(t[-1] for t in run.strategy.expert_load.total.values())
        self.activations = get_ledger().peak["activations"]


def _measure(comm, flags):
    args = parse_args([*MOE, *flags], comm.world_size)
    m = _Measure()
    train(args, comm, log=lambda s: None, after_grads=m.after_grads, callbacks=[m])
    return m.a2a, m.states, m.dropped, args, m.activations


def _shape_and_strategy(args):
    cfg = get_config("tiny")
    moe = MoEConfig(args.moe_experts, args.moe_top_k, args.moe_capacity_factor, args.moe_every)
    precision = {"fp16": "mixed", "bf16": "bf16"}.get(args.precision, precision_for_dtype(args.dtype))
    st = Strategy(dp=args.dp, ep=args.ep, zero=args.zero, precision=precision, micro_batch=args.micro_batch_size,
                  micro_batches=args.grad_accum, recompute=args.recompute)
    return ModelShape.from_gpt_config(cfg, moe=moe), st


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,flags", [
    (2, ["--ep", "2"]),
    (4, ["--ep", "4"]),
    (4, ["--ep", "2", "--grad-accum", "2", "--moe-every", "2"]),
    (2, ["--ep", "2", "--recompute", "full"]),
])
def test_expert_all_to_all_bytes_equal_the_traffic_ledger(n, flags):
    results = run_in_threads(n, _measure, flags, timeout=300)
    shape, st = _shape_and_strategy(results[0][3])
    want = expert_all_to_all_bytes(shape, st)
    assert want["total"] > 0 and comm_bytes_per_step(shape, st)["ep"] == want["total"]
    for a2a, _, dropped, *_ in results:
        assert dropped > 0  # capacity bites: the regime where every expert is full
        assert a2a == STEPS * want["total"]  # exactly, on every rank


@pytest.mark.timeout(300)
def test_expert_states_per_rank_equal_the_ledger_at_ep2():
    results = run_in_threads(2, _measure, ["--ep", "2"], timeout=300)
    shape, st = _shape_and_strategy(results[0][3])
    want = stage_state_bytes(shape, st, vocab_parallel=False)
    assert {k: v for k, v in estimate_memory(shape, st, accounting="minizero").as_dict().items()
            if k in want} == want
    # each rank holds E/ep = 2 of the 4 experts of each MoE block: the dense part plus half the expert weights
    c = shape.hidden
    assert want["parameters"] == 8 * (shape.num_parameters() - len(shape.moe_layers()) * 2 * 8 * c * c)
    for _, states, *_ in results:
        assert states == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_expert_states_with_zero_equal_the_ledger(zero):
    """--ep 2 --zero N on 4 ranks (ExpertZero: experts sharded over their 2 expert-data ranks): the estimate's
    model states per rank equal the ledger's (the tiny model's units need no padding)."""
    results = run_in_threads(4, _measure, ["--ep", "2", "--zero", zero], timeout=300)
    shape, st = _shape_and_strategy(results[0][3])
    want = stage_state_bytes(shape, st, vocab_parallel=False)
    for _, states, *_ in results:
        assert states == want


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,flags", [(1, []), (2, ["--ep", "2"]), (4, ["--ep", "4"]), (1, ["--moe-every", "2"]),
                                     (2, ["--ep", "2", "--recompute", "full"]), (1, ["--dtype", "float32"]),
                                     (1, ["--precision", "fp16", "--dtype", "float32"]),
                                     (2, ["--ep", "2", "--precision", "bf16", "--dtype", "float32"])])
def test_routed_activations_equal_the_ledger_when_every_expert_is_full(n, flags):
    """Also in float32, fp16 (routing in float32: before, 864 bytes under the ledger) and bf16 (each expert product
    saves its input and weight as bits: before, 25,824 bytes under)."""
    results = run_in_threads(n, _measure, flags, timeout=300)
    shape, st = _shape_and_strategy(results[0][3])
    est = estimate_memory(shape, st, accounting="minizero").activations
    assert [r[4] for r in results] == [est] * n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,flags", [(1, []), (2, ["--ep", "2"])])
def test_routed_activations_are_a_bound_when_experts_are_not_full(n, flags):
    """Capacity factor 4: nothing is dropped and the experts' loads differ; the estimate counts full experts."""
    results = run_in_threads(n, _measure, flags + ["--moe-capacity-factor", "4"], timeout=300)
    shape, st = _shape_and_strategy(results[0][3])
    est = estimate_memory(shape, st, accounting="minizero").activations
    dense = estimate_memory(get_config("tiny", dtype="float64"), Strategy(dp=st.dp, precision="fp64", micro_batch=2),
                            accounting="minizero").activations
    for *_, measured in results:
        assert dense < measured <= est  # routed top-2 rows outweigh the dense MLP's here


# ---- 3: the presets ---------------------------------------------------------------------------
from minizero.memory.estimator import model_flops_per_step  # noqa: E402
from minizero.models import get_model  # noqa: E402


@pytest.mark.parametrize("name,total,active,tol", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),  # Mistral AI: 46.7B total, 12.9B per token
    # DeepSeek-V3 report: 671B total, 37B activated (rounded; MLA counted exactly, the input embedding as active)
    ("deepseek-v3", 671e9, 37e9, 0.02),
])
def test_moe_presets_parameter_counts(name, total, active, tol):
    m = get_model(name)
    assert m.num_parameters() == pytest.approx(total, rel=tol)
    assert m.active_parameters() == pytest.approx(active, rel=tol)


def test_deepseek_v3_total_to_a_tenth_of_a_percent():
    assert get_model("deepseek-v3").num_parameters() == pytest.approx(671e9, rel=0.001)
    assert get_model("deepseek-v3").moe_layers() == list(range(3, 61))


def test_moe_flops_follow_the_active_parameters():
    """Less the attention core (QK^T and softmax x V, 3 x 2s x dims per token and layer), 6 x the active matrix
    parameters x tokens: the input embedding is a lookup and the norms are no matmul (both < 0.01% here)."""
    s = 4096
    cores = {"mixtral-8x7b": 4 * s * 4096, "deepseek-v3": 2 * s * 128 * (128 + 64) + 2 * s * 128 * 128}
    for name, core in cores.items():
        m = get_model(name)
        flops = model_flops_per_step(m, 1, s)
        matmuls = flops - 3 * s * m.n_layer * core
        assert matmuls == pytest.approx(6 * s * (m.active_parameters() - m.vocab_size * m.hidden), rel=1e-4)
        assert flops < 6 * m.num_parameters() * s / 3  # far below the total's


# ---- 4: the planner searches ep and the attention kind -----------------------------------------
from minizero import plan as P  # noqa: E402
from minizero.plan_search import Hardware, enumerate_strategies, plan  # noqa: E402
from minizero.plan_strategy import parse_strategy  # noqa: E402
from tests.conftest import one_refusal  # noqa: E402


def _main(capsys, *argv):
    try:
        code = P.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_mixtral_on_32_gpus_of_80gb_plans_with_expert_parallelism():
    m = get_model("mixtral-8x7b")
    fits, count, _ = plan(m, 32, Hardware(gpu_memory=80 * 10 ** 9), 4096, global_batch=1024)
    assert fits and count > len(fits) > 0
    assert all(c.memory.total <= 80 * 10 ** 9 for c in fits)
    assert all(c.strategy.dp % c.strategy.ep == 0 and 8 % c.strategy.ep == 0 for c in fits)
    # expert parallelism shrinks the gradient all-reduce: its best ties the fastest within the model's 1% (before the
    # step time counted message steps it led by 0.2%; its 9 all-to-alls of ep-1 steps per block and micro-batch at
    # 5 us a step now put dp2 tp2 pp8 0.2% ahead)
    best_ep = next(c for c in fits if c.strategy.ep > 1)
    assert best_ep.tokens_per_s > 0.99 * fits[0].tokens_per_s and fits.index(best_ep) < 3
    assert best_ep.comm["ep"] > 0 and best_ep.time["ep"] > 0
    assert {c.strategy.ep for c in fits} >= {1, 2, 4, 8}
    # on one mesh and ZeRO stage 0-2 the parameters per GPU shrink as ep grows: E/ep experts per rank (ZeRO-3's
    # shard of them, E/ep experts over N/ep ranks, does not depend on ep)
    groups = {}
    for c in fits:
        st = c.strategy
        if st.offload == "none" and st.zero < 3:
            groups.setdefault((st.tp, st.pp, st.cp, st.zero), {})[st.ep] = c.memory.parameters
    assert max(len(g) for g in groups.values()) >= 3
    for g in groups.values():
        eps = sorted(g)
        assert all(g[a] > g[b] for a, b in zip(eps, eps[1:])), g


def test_the_search_tries_ulysses_where_heads_split_and_only_ep_1_for_dense_models():
    m = get_model("llama3-8b")  # 32 heads, 8 KV heads
    sts = list(enumerate_strategies(m, 16, seq_len=131072, global_batch=16))
    assert {s.ep for s in sts} == {1}
    kinds = {(s.cp, s.tp, s.cp_attention) for s in sts if s.cp > 1}
    assert (2, 1, "ulysses") in kinds and (2, 1, "ring") in kinds
    assert all(((8 // tp) % cp == 0) for cp, tp, kind in kinds if kind == "ulysses")
    assert (16, 1, "ring") in kinds and (16, 1, "ulysses") not in kinds  # 8 KV heads do not split 16 ways


def test_the_report_shows_ep_and_the_attention_kind(capsys):
    code, out, _ = _main(capsys, "--model", "mixtral-8x7b", "--gpus", "16", "--gpu-memory", "80GB", "--seq-len",
                         "4096", "--ep", "4", "--top", "3")
    assert code == 0, out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert head.split()[1:5] == ["dp", "ep", "cp", "tp"]
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]  # not "  12 bytes/"
    assert len(rows) == 3 and all(r[2] == "4" for r in rows)
    assert "12.88 B active; 8 experts top-2" in out
    code, out, _ = _main(capsys, "--model", "llama3-8b", "--gpus", "16", "--seq-len", "131072",
                         "--strategy", "dp2 cp8 cp_attention=ulysses tp1")
    assert code == 0 and "cp_attention=ulysses" in out and re.search(r"^\s+1\s+2\s+1\s+8u\s+1\s", out, re.M)


def test_a_strategy_round_trips_through_describe():
    m = get_model("mixtral-8x7b")  # a real model: cp with experts, as Megatron-LM runs it (minizero.train does not)
    st = parse_strategy("dp8 ep4 cp2 cp_attention=ulysses tp4 zero1", m, 64, seq_len=32768)
    assert (st.ep, st.cp, st.cp_attention) == (4, 2, "ulysses")
    assert parse_strategy(P.describe(st), m, 64, seq_len=32768) == st


import re  # noqa: E402


@pytest.mark.parametrize("argv,words", [
    (["--model", "mixtral-8x7b", "--gpus", "64", "--ep", "3"], "--ep 3 must divide mixtral-8x7b's 8 experts per MoE "
                                                               "block; allowed: 1, 2, 4, 8"),
    (["--model", "llama2-7b", "--gpus", "8", "--ep", "2"], "--ep 2: llama2-7b is a dense model"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "0"], "--ep must be a positive integer, got 0"),
    (["--model", "deepseek-v3", "--gpus", "8", "--ep", "16"], "--ep 16 must divide --gpus 8"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--strategy", "dp2 tp4 ep4"], "ep 4 must divide dp 2"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--strategy", "dp16 ep16"], "ep 16 must divide mixtral-8x7b's 8"),
    (["--model", "llama3-8b", "--gpus", "8", "--strategy", "dp8 cp_attention=ulysses"],
     "cp_attention=ulysses needs cp > 1"),
    (["--model", "llama3-8b", "--gpus", "16", "--seq-len", "131072", "--strategy", "dp1 cp16 cp_attention=ulysses"],
     "needs cp to divide the 32 heads and 8 KV heads"),
])
def test_bad_ep_values_are_one_line_errors(capsys, argv, words):
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == "" and words in one_refusal(err), err


def test_zero3_gathers_a_block_with_its_rank_s_experts_only():
    """ZeRO-3 gathers one block at a time (and prefetches the next): under ep a block holds E/ep experts."""
    m = get_model("mixtral-8x7b")
    for ep in (1, 2, 8):
        est = estimate_memory(m, Strategy(dp=64, ep=ep, zero=3), 4096)
        assert est.gathered == 2 * 2 * m.layer_parameters(1, 0, ep)
    assert m.layer_parameters(1, 0, 8) == m.layer_parameters(1, 0, 1) - 7 * m.expert_parameters()
