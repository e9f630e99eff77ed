"""The analytic model against the papers' numbers and against minizero's own ledger."""
import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from minizero.autograd import manual_seed
from minizero.comm import run_in_threads
from minizero.memory import estimator as E
from minizero.memory.estimator import ModelShape, Strategy, estimate_memory, gb, model_state_bytes
from minizero.ledger import CATEGORIES as LEDGER_CATEGORIES
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.recompute import apply_recompute
from minizero.models import MODELS, REAL_MODELS, get_model
from minizero.nn import GPT, PRESETS, get_config
from minizero.nn.gpt import GPTConfig
from minizero.optim import AdamW

GPT3 = get_model("gpt3-175b")


# ---- ZeRO: Rajbhandari et al. 2020 ------------------------------------------------------------
def model_states_gb(psi, dp, stage):
    return gb(sum(model_state_bytes(int(psi), dp, stage).values()))


def test_zero_figure1_7_5b_on_64_ranks():
    # Figure 1: Psi = 7.5B, K = 12, N_d = 64; GB = 10^9 bytes
    assert model_states_gb(7.5e9, 64, 0) == 120.0
    assert round(model_states_gb(7.5e9, 64, 1), 1) == 31.4
    assert round(model_states_gb(7.5e9, 64, 2), 1) == 16.6
    assert round(model_states_gb(7.5e9, 64, 3), 1) == 1.9
    assert model_states_gb(7.5e9, 64, 3) == 1.875


# Table 1 as printed (GB): {model: {N_d: (P_os, P_os+g, P_os+g+p)}}. Some cells are truncated
# (513 for 513.5), some rounded (0.12 for 0.117); each must be the exact value cut to the
# digits printed, within 0.5% or half a unit of the last printed digit.
TABLE1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.25, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


@pytest.mark.parametrize("psi", sorted(TABLE1))
def test_zero_table1(psi):
    for dp, cells in TABLE1[psi].items():
        for stage, printed in zip((1, 2, 3), cells):
            got = model_states_gb(psi, dp, stage)
            digits = len(str(printed).split(".")[1]) if "." in str(printed) else 0
            half_unit = 0.5 * 10 ** -digits
            assert abs(got - printed) <= max(0.005 * printed, half_unit) or int(got) == printed, \
                (psi, dp, stage, got, printed)


def test_model_states_other_precisions():
    psi = 1000
    assert model_state_bytes(psi, 1, 0, "fp32") == {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000}
    assert model_state_bytes(psi, 1, 0, "fp64")["optimizer_state"] == 16000
    # 8-bit Adam, mixed: fp32 master 4 + two 1-byte moments + two fp32 absmax per 256 elements
    assert model_state_bytes(256 * 100, 1, 0, "mixed", "adam8bit")["optimizer_state"] == 256 * 100 * 6 + 100 * 8
    # a shard is ceil(Psi / N_d) elements (the padded flat buffer)
    assert model_state_bytes(10, 4, 3, "fp32") == {"parameters": 12, "gradients": 12, "optimizer_state": 24}


# ---- activations: Korthikanti et al. 2022 -----------------------------------------------------
@pytest.mark.parametrize("kw,expected", [
    ({}, 2_868_903_936),
    ({"tp": 8}, 578_813_952),
    ({"tp": 8, "sequence_parallel": True}, 358_612_992),
    ({"tp": 8, "recompute": "selective"}, 327_155_712),
    ({"tp": 8, "sequence_parallel": True, "recompute": "selective"}, 106_954_752),
    ({"recompute": "full"}, 50_331_648),
    ({"tp": 8, "recompute": "full"}, 50_331_648),
])
def test_korthikanti_gpt3_per_layer(kw, expected):
    assert E.layer_activation_bytes(GPT3, 2048, 1, **kw) == expected


@pytest.mark.parametrize("s,h,a,b,t", [(2048, 12288, 96, 1, 8), (1024, 4096, 32, 4, 2), (512, 1024, 16, 3, 4)])
def test_korthikanti_table2_formulas(s, h, a, b, t):
    m = ModelShape("x", 2, h, a, a, 4 * h, 1000, s)
    sbh = s * b * h
    f = lambda **kw: E.layer_activation_bytes(m, s, b, **kw)  # noqa: E731
    assert f() == sbh * (34 + Fraction(5 * a * s, h))
    assert f(tp=t) == sbh * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t))
    assert f(tp=t, sequence_parallel=True) == sbh * (Fraction(34, t) + Fraction(5 * a * s, h * t))
    assert f(tp=t, recompute="selective") == sbh * (10 + Fraction(24, t))
    assert f(tp=t, sequence_parallel=True, recompute="selective") == sbh * Fraction(34, t)
    assert f(recompute="full") == 2 * sbh
    # documented deviation from Table 2: the layer input kept by full recompute is split along s under SP
    assert f(tp=t, sequence_parallel=True, recompute="full") == 2 * sbh // t


def test_pipeline_in_flight():
    one = Strategy(pp=4, micro_batches=8)
    assert [E.in_flight(one, i)[0] for i in range(4)] == [4, 3, 2, 1]  # 1F1B: p - i
    assert E.in_flight(Strategy(pp=4, micro_batches=2), 0)[0] == 2  # capped at m
    assert E.in_flight(Strategy(pp=4, micro_batches=8, schedule="gpipe"), 3)[0] == 8
    inter = Strategy(pp=4, micro_batches=8, schedule="interleaved", virtual_stages=2)
    chunks, v = E.in_flight(inter, 0)
    # first stage: p (1 + (p-1)/(pv)) micro-batches of L/p layers (Korthikanti et al. 2022, 4.2.3)
    assert Fraction(chunks, v) == 4 * (1 + Fraction(3, 8))
    # the first stage holds L layers' worth under 1F1B, whatever p (section 4.2.3), plus the embedding's
    # mask per micro-batch in flight, and the one layer whose attention core is being recomputed
    m = GPT3
    per_layer = E.layer_activation_bytes(m, 2048, 1, tp=8, sequence_parallel=True, recompute="selective")
    rows = E.saved_per_layer(m, 2048, 1)
    core = sum(r.per_rank(8, True) for r in rows if r.part == "core")
    post = sum(r.per_rank(8, True) for r in rows if r.part == "post")
    emb, head = (sum(r.per_rank(8, True) for r in part) for part in E.saved_outside_layers(m, 2048, 1))
    # section 4.3: the embedding's dropout mask sbh; the final norm's and output projection's inputs 2sbh each, the
    # fp32 logits 4sbV; all split by t (sequence and vocabulary parallel)
    assert (emb, head) == (2048 * m.hidden / 8, (4 * 2048 * m.hidden + 4 * 2048 * m.vocab_size) / 8)
    for p in (1, 4, 16):
        st = Strategy(tp=8, pp=p, sequence_parallel=True, recompute="selective", micro_batches=64)
        acts, _ = E.activation_bytes(m, st, 2048, stage=0)
        h = head if p == 1 else 0
        expected = 96 * per_layer + emb * p + h + max(0, core - post - h)
        assert acts == expected, p  # bytes: exact


# ---- FLOPs ------------------------------------------------------------------------------------
def test_flops_match_korthikanti_appendix_a():
    b, s, L, h, V = 1536, 2048, 96, 12288, 50257
    assert E.model_flops_per_step(GPT3, b, s) == pytest.approx(E.korthikanti_flops(b, s, L, h, V), rel=1e-12)
    full = E.model_flops_per_step(GPT3, b, s, recompute="full")
    assert full == pytest.approx(96 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * h * L)), rel=1e-12)
    sel = E.model_flops_per_step(GPT3, b, s, recompute="selective")
    assert sel - E.model_flops_per_step(GPT3, b, s) == pytest.approx(4 * b * s * s * h * L, rel=1e-12)
    # the 6N rule (Kaplan et al. 2020) leaves out attention; within 10% at GPT-3's shape
    six_n = E.kaplan_flops(GPT3.num_parameters(), b * s)
    assert 0.9 < six_n / E.model_flops_per_step(GPT3, b, s) < 1.0


# ---- presets ----------------------------------------------------------------------------------
def test_real_model_parameter_counts():
    # published sizes (Hugging Face config parameter counts; GPT-3 175B; Megatron 1008B)
    expected = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
                "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}
    for name, n in expected.items():
        assert get_model(name).num_parameters() == n, name
    assert abs(get_model("gpt3-175b").num_parameters() / 175e9 - 1) < 0.01
    assert abs(get_model("megatron-1t").num_parameters() / 1008e9 - 1) < 0.001
    for name, m in REAL_MODELS.items():
        assert m.source and m.validate() is m
        assert sum(m.tensor_sizes()) == m.num_parameters()


def test_minizero_presets_match_gptconfig():
    for name, cfg in PRESETS.items():
        assert MODELS[f"minizero-{name}"].num_parameters() == cfg.num_parameters()
    with pytest.raises(ValueError, match="unknown model 'gpt5'; allowed: .*llama3-70b"):
        get_model("gpt5")


def test_categories_are_ledger_categories():
    assert set(E.CATEGORIES) <= set(LEDGER_CATEGORIES)


def test_strategy_validation_names_the_field():
    with pytest.raises(ValueError, match="zero=4"):
        Strategy(zero=4).validate()
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        Strategy(sequence_parallel=True).validate()
    with pytest.raises(ValueError, match="offload='params' needs zero=3"):
        Strategy(zero=2, offload="params").validate()
    with pytest.raises(ValueError, match="Strategy.overlap must be True or False, got 'yes'"):
        Strategy(overlap="yes").validate()
    with pytest.raises(ValueError, match="tp=5 does not divide n_head=96"):
        estimate_memory(GPT3, Strategy(tp=5))
    with pytest.raises(ValueError, match="96 layers do not split into .* 5"):
        estimate_memory(GPT3, Strategy(pp=5))
    with pytest.raises(ValueError, match="use precision='fp32'"):
        estimate_memory(get_config("tiny"), Strategy(precision="mixed"))


def test_estimate_stage_choice_and_offload():
    m = get_model("llama3-70b")
    st = Strategy(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True, recompute="selective", micro_batches=16)
    first, last, middle = E.estimate_stages(m, st, 4096)  # stage 1: the middle stages' kind
    assert first.activations > last.activations  # p micro-batches in flight on the first stage, 1 on the last
    assert estimate_memory(m, st, 4096).total == max(first.total, last.total)
    off = estimate_memory(m, Strategy(dp=8, zero=3, offload="params", offload_activations=True), 4096)
    assert off.parameters == off.gradients == off.optimizer_state == 0 and off.offloaded > 0


def test_comm_bytes_zero_section_7():
    # ZeRO section 7: P_os and P_os+g move the same as DP (2 Psi), P_os+g+p 1.5x (3 Psi), per rank x (N-1)/N
    m = get_model("llama2-7b")
    psi, n = m.num_parameters(), 64
    dp = {z: E.comm_bytes_per_step(m, Strategy(dp=n, zero=z))["dp"] for z in range(4)}
    # bytes, exact (psi divides by 64): at pytest.approx's 1e-6 the final norm's 4096 elements (6e-7) could go missing
    assert dp[0] == 2 * (n - 1) / n * 2 * psi and dp[1] == dp[2] == dp[0] and dp[3] == 1.5 * dp[0]
    # tensor parallel: 4 all-reduces of sbh per layer (6 with full recompute), 2(t-1)/t each
    g = E.comm_bytes_per_step(GPT3, Strategy(tp=8, pp=96))["tp"]
    x = 2 * 2048 * 12288
    assert g == (4 + 1) * 2 * 7 / 8 * x  # one layer + the embedding's all-reduce on stage 0
    # sequence parallelism, paper accounting: Korthikanti et al.'s count, tensor parallelism's bytes (the embedding's
    # exit, a reduce-scatter forward and an all-gather backward, costs the all-reduce's), without the backward
    # re-gathers for dW that accounting="minizero" adds (measured in test_sequence_parallel.py)
    assert E.comm_bytes_per_step(GPT3, Strategy(tp=8, pp=96, sequence_parallel=True))["tp"] == g


# ---- against minizero's ledger ----------------------------------------------------------------
def measured_peaks(cfg, batch, recompute="none"):
    """Ledger peaks over one forward+backward of a single-rank GPT (and its AdamW's state)."""
    ledger = set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    apply_recompute(model, recompute)
    opt = AdamW(model.parameters())  # noqa: F841  (kept alive: its state stays in the ledger)
    manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
    y = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
    ledger.reset_peaks()
    model(x, y)[1].backward()
    peak = dict(ledger.peak)
    set_ledger(MemoryLedger())
    return peak


@pytest.mark.parametrize("preset,batch,recompute,dropout,dtype", [
    ("default", 2, "none", 0.0, "float32"),
    ("deep", 1, "full", 0.0, "float32"),
    ("small", 3, "selective", 0.1, "float32"),
    ("small", 2, "full", 0.1, "float64"),
])
def test_minizero_accounting_matches_ledger(preset, batch, recompute, dropout, dtype):
    cfg = get_config(preset, dropout=dropout, dtype=dtype)
    peak = measured_peaks(cfg, batch, recompute)
    st = Strategy(precision=E.precision_for_dtype(dtype), micro_batch=batch, recompute=recompute)
    est = estimate_memory(cfg, st, accounting="minizero")
    for cat in ("parameters", "optimizer_state", "activations"):
        assert est.as_dict()[cat] == peak[cat], cat  # bytes: exact, not within a percentage
    if recompute == "none":  # recompute's checkpoint inputs get transient .grad arrays the ledger counts too
        assert est.gradients == peak["gradients"]


def test_minizero_accounting_selective_when_scores_dominate():
    # many heads, long sequence, narrow model: the recomputed attention core outgrows what was freed
    cfg = GPTConfig(n_layer=2, n_head=8, n_embd=16, block_size=64, vocab_size=32)
    for mode in ("none", "selective", "full"):
        est = estimate_memory(cfg, Strategy(precision="fp32", micro_batch=2, recompute=mode), accounting="minizero")
        assert est.activations == measured_peaks(cfg, 2, mode)["activations"], mode


def _data_parallel_peaks(comm, stage):
    from minizero.zero import zero_optimizer
    from minizero.parallel.data_parallel import DataParallel

    ledger = set_ledger(MemoryLedger())
    cfg = get_config("small")
    model = GPT(cfg, seed=0)
    if stage == 0:
        reducer, opt = DataParallel(model.parameters(), comm), AdamW(model.parameters())
        reduce = reducer.allreduce_gradients
    else:
        opt = zero_optimizer(model, comm, stage)
        reduce = opt.reduce_gradients
    x = np.random.default_rng(comm.rank).integers(0, 256, (2, cfg.block_size))
    ledger.reset_peaks()
    model(x, x)[1].backward()
    reduce()
    opt.step()
    return dict(ledger.peak)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_minizero_accounting_data_parallel_and_zero(stage):
    peak = run_in_threads(2, _data_parallel_peaks, stage)[0]
    est = estimate_memory(get_config("small"), Strategy(dp=2, zero=stage, precision="fp32", micro_batch=2),
                          accounting="minizero").as_dict()
    for cat in ("parameters", "gradients", "optimizer_state", "comm_buffers", "gathered"):
        assert est[cat] == peak.get(cat, 0), cat  # bytes: exact (a shard's padding or a bucket off by a layer shows)


def _tensor_parallel_peaks(comm, recompute):
    from minizero.parallel.tensor_parallel import tensor_parallelize
    from minizero.parallel.pipeline import PipelineStage
    from minizero.parallel.vocab_parallel import vocab_parallelize

    ledger = set_ledger(MemoryLedger())
    cfg = get_config("small", dropout=0.1)
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    tensor_parallelize(stage, comm)  # as the trainer's build_stage does
    vocab_parallelize(stage, comm)
    apply_recompute(stage, recompute)
    manual_seed(0)
    x = np.random.default_rng(0).integers(0, 256, (2, cfg.block_size))
    ledger.reset_peaks()
    stage(x, x).backward()
    return dict(ledger.current), dict(ledger.peak)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_minizero_accounting_tensor_parallel(recompute):
    current, peak = run_in_threads(2, _tensor_parallel_peaks, recompute)[0]
    st = Strategy(tp=2, precision="fp32", micro_batch=2, recompute=recompute)
    est = estimate_memory(get_config("small", dropout=0.1), st, accounting="minizero")
    assert est.parameters == current["parameters"]  # layers split, the vocabulary too (the position embedding not)
    assert est.activations == peak["activations"]  # vocab_parallel.py's local ids, targets and masks included


def _pipeline_peaks(comm, schedule, m, recompute):
    from minizero.parallel.pipeline import PipelineEngine, PipelineStage

    ledger = set_ledger(MemoryLedger())
    cfg = get_config("small", dropout=0.1)
    model = GPT(cfg, seed=0)
    apply_recompute(model, recompute)
    engine = PipelineEngine(PipelineStage(model, comm.rank, comm.world_size), comm, schedule)
    manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (2, cfg.block_size)), rng.integers(0, 256, (2, cfg.block_size)))
               for _ in range(m)]
    ledger.reset_peaks()
    engine.forward_backward(batches)
    return dict(ledger.peak)


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("gpipe", "full")])
def test_minizero_accounting_pipeline(schedule, recompute):
    m = 3
    peaks = run_in_threads(2, _pipeline_peaks, schedule, m, recompute)
    st = Strategy(pp=2, precision="fp32", micro_batch=2, micro_batches=m, schedule=schedule, recompute=recompute)
    for stage, peak in enumerate(peaks):
        est = estimate_memory(get_config("small", dropout=0.1), st, accounting="minizero", stage=stage)
        assert (est.activations, est.comm_buffers) == (peak["activations"], peak.get("comm_buffers", 0)), stage


def _cli_peaks(comm, flags):
    from minizero.args import parse_args
    from minizero.ledger import get_ledger
    from minizero.loop import train

    set_ledger(MemoryLedger())
    train(parse_args(flags, world_size=comm.world_size, quiet=True), comm, log=lambda s: None)
    return dict(get_ledger().peak)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset,n,zero,accum", [("tiny", 2, 2, 1), ("small", 4, 2, 2), ("small", 2, 3, 1)])
def test_minizero_accounting_matches_ledger_with_overlap(preset, n, zero, accum):
    """Issue 16: ZeRO 2-3 as the CLI runs them by default (overlapped reduce-scatter, double-buffered
    buckets; ZeRO-3 prefetch): every category of the ledger's peak equals the estimate to the byte,
    and the overlapped buckets are not the blocking ones (so the flag is what makes it match); the overlapped ring's
    receive chunk is no less than the blocking reduce-scatter's scratch (its result and one chunk by turns). With
    --grad-accum 2 the first micro-batch's token ids and targets stay alive (the step's list holds them)."""
    from minizero.args import parse_args
    from minizero.train import model_config

    flags = ["--model", preset, "--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
             "--progress", "none", "--no-save", "--micro-batch-size", "2", "--zero", str(zero),
             "--grad-accum", str(accum)]
    cfg = model_config(parse_args(flags, n, quiet=True))
    st = Strategy(dp=n, zero=zero, precision=E.precision_for_dtype(cfg.dtype), micro_batch=2, micro_batches=accum,
                  overlap=True)
    est = estimate_memory(cfg, st, accounting="minizero").as_dict()
    blocking = estimate_memory(cfg, dataclasses.replace(st, overlap=False), accounting="minizero").as_dict()
    assert est["comm_buffers"] > blocking["comm_buffers"] and est["comm_scratch"] >= blocking["comm_scratch"]
    assert (est["gathered"] > blocking["gathered"]) == (zero == 3)
    for rank, peak in enumerate(run_in_threads(n, _cli_peaks, flags, timeout=240)):
        for cat in E.CATEGORIES:
            assert est[cat] == peak.get(cat, 0), (rank, cat, est[cat], peak.get(cat, 0))


@pytest.mark.timeout(300)
def test_overlap_estimate_and_trainer_share_one_bucket_constant(monkeypatch):
    """Three buckets alive instead of two (the one constant, set in both places it is read): the
    ledger's peaks move and the estimate moves with them, to the byte."""
    import minizero.memory.estimator.zero_overlap as zo
    import minizero.zero.overlap as zp

    flags = ["--model", "small", "--steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
             "--progress", "none", "--no-save", "--micro-batch-size", "1", "--zero", "2"]
    st = Strategy(dp=2, zero=2, precision="fp32", micro_batch=1, overlap=True)
    two = estimate_memory(get_config("small"), st, accounting="minizero").as_dict()
    monkeypatch.setattr(zp, "REDUCE_BUCKETS", 3)
    monkeypatch.setattr(zo, "REDUCE_BUCKETS", 3)
    three = estimate_memory(get_config("small"), st, accounting="minizero").as_dict()
    assert three["comm_buffers"] > two["comm_buffers"] and three["comm_scratch"] > two["comm_scratch"]
    for rank, peak in enumerate(run_in_threads(2, _cli_peaks, flags, timeout=240)):
        for cat in E.CATEGORIES:
            assert three[cat] == peak.get(cat, 0), (rank, cat, three[cat], peak.get(cat, 0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, zero", [(2, 1), (3, 1)])
def test_blocking_zero_scratch_matches_the_ledger_metrics_row_included(n, zero):
    """Blocking ZeRO's reduce-scatter: no scratch at N = 2, where the end-of-run traffic row's all-reduce
    (METRICS_ROW, kept by hand beside placement.node_traffic) is the peak; one chunk at N = 3; both to the byte."""
    flags = ["--model", "tiny", "--steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
             "--progress", "none", "--no-save", "--micro-batch-size", "1", "--zero", str(zero), "--no-overlap"]
    st = Strategy(dp=n, zero=zero, precision="fp32", micro_batch=1, overlap=False)
    est = estimate_memory(get_config("tiny"), st, accounting="minizero").as_dict()
    for peak in run_in_threads(n, _cli_peaks, flags, timeout=240):
        assert peak.get("comm_scratch", 0) == est["comm_scratch"]


def _trainer_states(comm, flags):
    """The ledger's model-state bytes of the main job's loop after its second step's gradients (Adam's state
    exists since the first), and its peak ZeRO buffers over the steps."""
    from minizero.callbacks import Callback
    from minizero.ledger import get_ledger
    from minizero.loop import train
    from minizero.train import parse_args

    args = parse_args(["--model", "tiny", "--dtype", "float64", "--steps", "2", "--eval-batches", "1",
                       "--eval-every", "0", "--progress", "none", "--no-save", *flags], comm.world_size)
    seen = {}

    class Peaks(Callback):
        def on_train_start(self, run):
            get_ledger().reset_peaks()

        def on_train_end(self, run):
            seen.update({c: get_ledger().peak[c] for c in ("comm_buffers", "gathered", "comm_scratch", "activations")})

    def after_grads(step, params, opt):
        if step == 1:
            seen.update({c: get_ledger().current[c] for c in ("parameters", "gradients", "optimizer_state")})
    train(args, comm, log=lambda s: None, after_grads=after_grads, callbacks=[Peaks()])
    return args, comm.rank // (comm.world_size // args.pp), seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,flags", [(2, ["--tp", "2"]), (4, ["--tp", "2", "--pp", "2"]),
                                     (4, ["--tp", "2", "--dp", "2", "--zero", "1"]),
                                     (4, ["--tp", "2", "--dp", "2", "--zero", "3"]),
                                     (4, ["--tp", "2", "--dp", "2", "--zero", "3", "--no-overlap"]),
                                     (2, ["--tp", "2", "--sequence-parallel"]),
                                     (4, ["--tp", "2", "--dp", "2", "--grad-accum", "2"])])
def test_minizero_accounting_under_tp_equals_the_trainers_ledger(n, flags):
    """The trainer splits the vocabulary over the tensor group (vocab_parallel.py), the estimate too: each stage's
    parameters, gradients, Adam's state, activations and ZeRO's buckets and gathered units per rank, exactly (the
    tiny model's units need no padding); the collectives' scratch is bounded."""
    for args, stage, seen in run_in_threads(n, _trainer_states, flags, timeout=280):
        st = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero, precision="fp64",
                      micro_batch=args.micro_batch_size, micro_batches=args.grad_accum, overlap=args.overlap,
                      sequence_parallel=args.sequence_parallel)
        est = estimate_memory(get_config("tiny", dtype="float64"), st, accounting="minizero", stage=stage).as_dict()
        assert 0 < seen.pop("comm_scratch") <= est["comm_scratch"]  # a bound under tp (estimator/scratch.py)
        assert seen == {c: est[c] for c in seen}, (stage, seen)


def _traffic(comm, flags, steps):
    from minizero.loop import train
    from minizero.train import parse_args

    args = parse_args(["--model", "tiny", "--dtype", "float64", "--steps", str(steps), "--eval-batches", "1",
                       "--eval-every", "0", "--progress", "none", "--no-save", *flags], comm.world_size)
    result = train(args, comm, log=lambda s: None)
    sent = {g: result.traffic[g]["bytes_sent"] for g in ("dp", "tp", "pp")}
    return args, comm.rank // (comm.world_size // args.pp), sent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [["--tp", "2", "--pp", "2"], ["--tp", "2", "--pp", "2", "--sequence-parallel"],
                                   ["--dp", "2", "--tp", "2", "--zero", "3"]])
def test_minizero_traffic_under_tp_equals_the_trainers(flags, monkeypatch):
    """Bytes per step and rank (a 3-step run's minus a 2-step run's): tensor and pipeline groups exactly (the pipeline's
    activations whole on each tensor rank, split only under sequence parallelism; the tied embedding's all-reduce
    split by t), the data group's within the few bytes of its per-step bookkeeping."""
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")  # ZeRO's order check would add its headers' bytes
    short, long = (run_in_threads(4, _traffic, flags, steps, timeout=280) for steps in (2, 3))
    for (args, stage, before), (_, _, after) in zip(short, long):
        st = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero, precision="fp64",
                      micro_batch=args.micro_batch_size, micro_batches=args.grad_accum,
                      sequence_parallel=args.sequence_parallel, overlap=args.overlap)
        est = E.comm_bytes_per_step(get_config("tiny", dtype="float64"), st, stage=stage, accounting="minizero")
        step = {g: after[g] - before[g] for g in after}
        assert step["tp"] == est["tp"] and step["pp"] == est["pp"], (stage, step, est)
        assert 0 <= step["dp"] - est["dp"] <= 8, (stage, step, est)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("shard_rank", [99, -1, 2])
def test_tensor_parallel_bytes_refuses_a_shard_rank_out_of_range(shard_rank, sequence_parallel):
    """Before: shard_rank was checked only under sequence parallelism; 99 or -1 without it returned silently."""
    cfg = get_config("default", dtype="float64", block_size=16)
    st = Strategy(dp=2, tp=2, zero=2, sequence_parallel=sequence_parallel, micro_batch=2, precision="fp64")
    with pytest.raises(ValueError, match=rf"shard_rank={shard_rank}; allowed: 0 to 1 \(N = 2\)"):
        E.tensor_parallel_bytes(cfg, st, shard_rank=shard_rank)
    with pytest.raises(ValueError, match=rf"shard_rank={shard_rank}; allowed: 0 to 0 \(N = 1\)"):  # tp 1, dp 1
        E.tensor_parallel_bytes(cfg, Strategy(micro_batch=2, precision="fp64"), shard_rank=shard_rank)
    assert E.tensor_parallel_bytes(cfg, st, shard_rank=1)["total"] > 0


@pytest.mark.parametrize("kw, said", [({"micro_batch": -1}, r"micro_batch must be a positive integer, got -1"),
                                      ({"recompute": "x"}, r"recompute='x' is not one of \('none'"),
                                      ({"tp": 0}, r"tp must be a positive integer, got 0"),
                                      ({"seq_len": 0}, r"seq_len=0; allowed: an int >= 1, or None")])
def test_layer_activation_bytes_names_a_bad_argument(kw, said):
    """Before: micro_batch=-1 gave negative bytes, recompute='x' the "none" bytes, tp=0 ZeroDivisionError and
    seq_len=0 the model's length; now Strategy's and seq_len_at's checks, as the estimator's entry points."""
    with pytest.raises(ValueError, match=said):
        E.layer_activation_bytes(GPT3, **kw)
    assert E.layer_activation_bytes(GPT3) == E.layer_activation_bytes(GPT3, GPT3.seq_len, 1)


def test_a_vocabulary_t_does_not_divide_costs_its_padded_shard_everywhere():
    """V = 1001 over t = 2 holds ceil(V/t) = 501 rows per rank (Megatron pads the vocabulary), as V = 1002 does:
    the parameters counted that already; the collectives' scratch (ZeRO's embedding unit, the tied gradient's
    all-reduce between the pipeline's ends) and the pipeline's traffic used V h / t. minizero's trainer refuses such
    a t (layout_checks.py), so no ledger can measure it; the planner's gpt3-175b (V = 50257) is such a model."""
    odd, even = (ModelShape("v", 2, 64, 4, 4, 256, v, 16) for v in (1001, 1002))
    for st in (Strategy(dp=3, tp=2, zero=1, precision="fp32", micro_batch=1),
               Strategy(tp=2, pp=2, precision="fp32", micro_batch=1)):
        for stage in range(st.pp):
            est = [estimate_memory(m, st, accounting="minizero", stage=stage).as_dict() for m in (odd, even)]
            assert est[0]["parameters"] == est[1]["parameters"]
            assert est[0]["comm_scratch"] == est[1]["comm_scratch"], (st, stage)
            traffic = [E.comm_bytes_per_step(m, st, stage=stage, accounting="minizero") for m in (odd, even)]
            assert traffic[0]["pp"] == traffic[1]["pp"], (st, stage)
    zero = estimate_memory(odd, Strategy(dp=3, tp=2, zero=1, precision="fp32", micro_batch=1), accounting="minizero")
    assert zero.as_dict()["comm_scratch"] == 4 * 501 * 64 // 3  # one receive chunk of the embedding's unit binds


def _overlapped_zero_peaks(comm, cfg, tied):
    """Peak elements of ZeRO-3's overlapped buffers over two steps of ``cfg``'s GPT, its head untied unless ``tied``."""
    from minizero.ledger import get_ledger
    from minizero.nn.module import Linear
    from minizero.zero import zero_optimizer

    model = GPT(cfg, seed=1)
    if not tied:  # the trainer always ties; ZeroOptimizer takes any model
        model.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=cfg.dtype)
    opt = zero_optimizer(model, comm, 3, overlap_reduce=True, prefetch=True)
    get_ledger().reset_peaks()
    x = np.random.default_rng(comm.rank).integers(0, cfg.vocab_size, (2, cfg.block_size))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return {c: get_ledger().peak.get(c, 0) // 8 for c in ("comm_buffers", "gathered", "comm_scratch")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,vocab,tied", [(2, 256, False), (3, 256, False), (2, 1024, False), (2, 1024, True)])
def test_overlapped_zero_windows_follow_find_units_untied_too(n, vocab, tied):
    """``wte`` and ``wpe`` are two units (find_units): prefetch and the ring's chunk take them apart, the buckets
    together (both open at the sum of their outputs); each to the element against the ledger."""
    from minizero.memory.estimator import zero_overlap as zo

    cfg = get_config("tiny", dtype="float64", vocab_size=vocab)
    m = dataclasses.replace(E.ModelShape.from_gpt_config(cfg), tied_embeddings=tied)
    st = Strategy(dp=n, zero=3, precision="fp64", overlap=True)
    est = {"comm_buffers": zo.overlapped_buckets(m, st, 0), "gathered": zo.prefetched_units(m, st, 0),
           "comm_scratch": zo.overlapped_ring_scratch(m, st, 0)}
    for peak in run_in_threads(n, _overlapped_zero_peaks, cfg, tied, timeout=100):
        assert peak == est


@pytest.mark.parametrize("tied,pp", [(True, 1), (False, 1), (True, 2)])
def test_zero_units_are_find_units(tied, pp):
    """The estimator's units on each stage are find_units' on that stage's module, padded, in backward order."""
    from minizero.memory.estimator.zero_overlap import zero_units
    from minizero.nn.module import Linear
    from minizero.parallel.pipeline import PipelineStage
    from minizero.zero import ShardMap

    cfg = get_config("tiny")
    model = GPT(cfg, seed=0)
    if not tied:
        model.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
    m = dataclasses.replace(E.ModelShape.from_gpt_config(cfg), tied_embeddings=tied)
    for s in range(pp):
        tie, chain = zero_units(m, Strategy(dp=3, pp=pp), s)
        units = [u.padded for u in ShardMap.from_model(PipelineStage(model, s, pp) if pp > 1 else model, 3).units]
        assert ([tie] if tie else []) + chain[::-1] == units, s


def test_zero_scratch_bounds_the_last_stages_head():
    """ZeRO with pipeline stages reduce-scatters the last stage's head (or its tied copy) too: llama3-8b's head
    (V = 128,256, ceil(V/t) h) is larger than a layer, and the estimate covers its chunk."""
    from minizero.comm.collectives import reduce_scatter_scratch
    from minizero.memory.estimator.scratch import comm_scratch_bytes

    m = get_model("llama3-8b")
    for st in (Strategy(dp=8, pp=2, zero=1, precision="fp32"), Strategy(dp=8, tp=8, pp=4, zero=1, precision="fp32")):
        head = reduce_scatter_scratch(m.vocab_shard(st.tp), 8, 0) * 4  # V h / t divides by 8: no padding
        assert head > reduce_scatter_scratch(m.layer_parameters(st.tp), 8, 0) * 4
        assert comm_scratch_bytes(m, st, st.pp - 1, "minizero") >= head


@pytest.mark.parametrize("n_layer,pp,v", [(12, 2, 3), (12, 3, 2), (8, 2, 2), (16, 4, 2), (6, 3, 1)])
def test_stage_layers_are_the_blocks_the_interleaved_trainer_puts_on_each_rank(n_layer, pp, v):
    """Chunk c of rank r is virtual stage c p + r (parallel/interleaved.py): the estimator's blocks of each stage are
    the ones the trainer places there, also where p != v (chunk j of stage i is j p + i, not j v + i)."""
    from minizero.parallel.interleaved import rank_of_layer

    cfg = get_config("tiny", n_layer=n_layer)
    st = Strategy(pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b", micro_batches=pp)
    for stage in range(pp):
        want = [layer for layer in range(n_layer) if rank_of_layer(n_layer, pp, v, layer) == stage]
        assert sorted(E.stage_layers(cfg, st, stage)) == want, stage


def test_paper_pipeline_buffers_are_two_activations_split_by_t_under_sequence_parallelism():
    """Paper accounting, p > 1: a receive buffer for forward's activation and one for backward's gradient, each
    (b, s, h) in 2-byte elements, the sequence split by t = 2 (not by p = 4), on every stage."""
    m, st = get_model("llama2-7b"), Strategy(tp=2, pp=4, sequence_parallel=True, micro_batches=4)
    assert [estimate_memory(m, st, 4096, stage=i).comm_buffers for i in range(4)] == [2 * 2 * 4096 * 4096 // 2] * 4


def test_without_a_stage_the_estimate_is_the_fullest_stage_s_even_when_it_is_the_last():
    """One micro-batch on two stages: both keep one in flight, the last also the logits, so it is the fullest."""
    m, st = get_model("llama2-7b"), Strategy(pp=2, micro_batches=1)
    first, last = (estimate_memory(m, st, 4096, stage=i) for i in range(2))
    assert last.total > first.total and estimate_memory(m, st, 4096) == last


def test_attention_parameters_by_hand_for_mla_and_for_grouped_query_attention_with_biases():
    """DeepSeek-V3's MLA: W^DQ 7168x1536 and its norm 1536, W^DKV+W^KR 7168x(512+64) and its norm 512 replicated;
    W^UQ 1536x128(128+64), W^UK/W^UV 512x2x128x128, W^O 128x128x7168 split. GQA with biases (h 8, 4 heads, 2 KV
    heads: K and V 4 wide): Wq, Wo 8x8, Wk, Wv 8x4, biases 8 + 4 + 4 split, the output bias 8 replicated."""
    import dataclasses

    assert get_model("deepseek-v3").attention_parameters() == (
        1536 * 128 * 192 + 512 * 2 * 128 * 128 + 128 * 128 * 7168, 7168 * 1536 + 1536 + 7168 * 576 + 512)
    gqa = dataclasses.replace(get_model("llama2-7b"), hidden=8, n_head=4, n_kv_head=2, bias=True)
    assert gqa.attention_parameters() == (2 * 64 + 2 * 32 + 16, 8)


def test_expert_capacity_rounds_up():
    """ceil(1.0 x 100 tokens x top-8 / 256 experts) = ceil(3.125) = 4 slots, as the router's (parallel/moe.py)."""
    assert get_model("deepseek-v3").capacity(100) == 4
