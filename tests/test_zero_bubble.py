"""Zero-bubble pipelines (Qi et al. 2024, arXiv:2401.10241): ZB-H1 and ZB-V as data, and both run equal to one process.

* Schedules: every F, B, W once, W after its B; the simulated bubble of ZB-H1 is the paper's
  (p-1)(T_F+T_B-T_W) / (m(T_F+T_B+T_W)) with equal times, a third of 1F1B's; ZB-H1 holds at most
  1F1B's peak of micro-batches in flight (p, on every stage); ZB-V's bubble and peak.
* Engine: the split backward gives bitwise 1F1B's gradients; ZB-H1's largest activation peak in the
  ledger is 1F1B's to the byte (context 64, pp 2 m 4, pp 4 m 8).
* Equivalence (float64, tests/mp_reference.py): ZB-H1 at pp 2 m 4 and pp 4 m 8 (m >= p: the same
  schedule code at any m), ZB-V at pp 2 m 4 (m >= 2p-1) and pp 4 m 4 (m < 2p-1: ops dropped), alone; at
  pp 2 m 4 with dp 2 and ZeRO-1 (ZeRO acts after the schedule, whatever its p and m), dp 2 alone, TP and
  recompute; ZB-H1's FP16, BF16 and FP8 bitwise 1F1B's; ZB-V's FP16, BF16 and FP8 one process's of that
  precision; ZB-V's messages turn at rank p-1; each schedule once under mpiexec. The engine and equivalence
  tests run the tiny model's width (16) at the depths pp needs (tests/test_pipeline.add_deep_narrow_presets).
"""
import json
from fractions import Fraction

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.comm import run_in_threads
from minizero.ledger import get_ledger
from minizero.memory.fp8 import FP8Linear, fp8_state, use_fp8
from minizero.nn import get_config
from minizero.parallel.pipeline import PipelineEngine
from minizero.parallel.schedule import (ascii_timeline, bubble_ratio, make_schedule, one_f_one_b, peak_in_flight,
                                        simulate, zb_h1, zb_h1_bubble_ratio, zb_v)
from minizero.parallel.three_d import build_stage
from minizero.parallel.topology import Topology
from minizero.train import parse_args, train
from tests.test_pipeline import CFG, add_deep_narrow_presets, micro_batches, run_engine


@pytest.fixture(autouse=True)
def one_blas_thread():
    with threadpool_limits(limits=1):
        yield


def _exact_ratio(timeline) -> Fraction:
    makespan = max(end for stage in timeline for _, _, end in stage)
    busy = sum(end - start for stage in timeline for _, start, end in stage)
    return Fraction(len(timeline) * makespan - busy) / Fraction(busy)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8, 16])
def test_every_op_runs_once_and_w_follows_its_b(name, p, m):
    sched = make_schedule(name, p, m)
    chunks = 2 if name == "zb-v" else 1
    for ops in sched:
        keys = [(o.kind, o.mb, getattr(o, "chunk", 0)) for o in ops]
        assert sorted(keys) == sorted((k, i, c) for k in "FBW" for i in range(m) for c in range(chunks))
        assert all(keys.index(("F", i, c)) < keys.index(("B", i, c)) < keys.index(("W", i, c))
                   for i in range(m) for c in range(chunks))
    simulate(sched)  # raises if any op waits forever


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_the_papers_a_third_of_1f1b_with_1f1b_peak(p, m):
    """Equal F, B, W (t = 1 slot): ZB-H1 idles (p-1)(F+B-W) per stage, 1F1B (p-1)(F+B+W); busy m(F+B+W)."""
    zb = _exact_ratio(simulate(zb_h1(p, m), f=1, b=2, w=1))
    plain = _exact_ratio(simulate(one_f_one_b(p, m), f=1, b=2, w=1))
    assert zb == Fraction((p - 1) * (1 + 1 - 1), m * 3) == Fraction(zb_h1_bubble_ratio(p, m)).limit_denominator(10 ** 6)
    assert plain == Fraction(p - 1, m) and zb == plain / 3
    assert [peak_in_flight(ops) for ops in zb_h1(p, m)] == [p] * p  # every stage holds 1F1B's stage 0's p
    assert max(peak_in_flight(ops) for ops in one_f_one_b(p, m)) == p


def test_zb_h1_at_p4_m8_is_one_eighth_against_three_eighths():
    assert _exact_ratio(simulate(zb_h1(4, 8))) == Fraction(1, 8) == Fraction(zb_h1_bubble_ratio(4, 8))
    assert _exact_ratio(simulate(one_f_one_b(4, 8))) == Fraction(3, 8)


@pytest.mark.parametrize("p, m", [(2, 4), (3, 5), (4, 8), (4, 16)])
def test_zb_v_bubble_and_peak(p, m):
    """Chunk ops of half a stage (f = b - w = w = 1): only the ramp idles, (p-1) chunk slots per rank;
    peak 2p chunks in flight on every rank = p micro-batches of a whole stage, 1F1B's stage 0."""
    assert _exact_ratio(simulate(zb_v(p, m), 1, 2, 1)) == Fraction(p - 1, 6 * m)
    assert [peak_in_flight(ops) for ops in zb_v(p, m)] == [2 * p] * p
    assert _exact_ratio(simulate(zb_v(p, m))) < _exact_ratio(simulate(zb_h1(p, m)))


def test_the_picture_has_f_b_and_w_cells():
    text = ascii_timeline(simulate(zb_h1(2, 3)))
    assert text.splitlines() == ["stage 0 |F0F1..B0W0F2B1W1B2W2|",
                                 "stage 1 |..F0B0F1B1W0F2B2W1W2|"]
    assert "W3.1" in ascii_timeline(simulate(zb_v(2, 4)))
    assert bubble_ratio(simulate(zb_h1(2, 3))) == pytest.approx(1 / 9)


def test_zero_bubble_is_refused_where_it_does_not_run():
    base = ["--model", "default"]
    with pytest.raises(UsageError, match="zb-v needs 2 x --pp 4 = 8 virtual stages .* the model has 4 layers"):
        parse_args([*base, "--pp", "4", "--schedule", "zb-v"], 4)
    with pytest.raises(UsageError, match="zb-v needs --pp >= 2"):
        parse_args([*base, "--schedule", "zb-v"], 1)
    with pytest.raises(UsageError, match=r"zb-v with --sequence-parallel is not supported: .*; use --schedule 1f1b "
                       r"\(its backward not split; one chunk per stage, not zb-v's two\)"):  # not "the same pipeline"
        parse_args([*base, "--pp", "2", "--tp", "2", "--schedule", "zb-v", "--sequence-parallel"], 4)
    with pytest.raises(UsageError, match="zb-h1 needs --pp >= 2"):
        parse_args([*base, "--schedule", "zb-h1"], 1)
    with pytest.raises(UsageError, match="with --sequence-parallel is not supported"):
        parse_args([*base, "--pp", "2", "--tp", "2", "--schedule", "zb-h1", "--sequence-parallel"], 4)
    with pytest.raises(UsageError, match=r"with --offload-activations cpu is not supported: .*; use --schedule 1f1b "
                       r"\(its backward not split\)$"):
        parse_args([*base, "--pp", "2", "--schedule", "zb-h1", "--offload-activations", "cpu"], 2)
    with pytest.raises(UsageError, match="--zero 2 with --pp 2 is not supported"):
        parse_args([*base, "--pp", "2", "--schedule", "zb-h1", "--zero", "2"], 2)
    assert parse_args([*base, "--pp", "2", "--schedule", "zb-h1", "--zero", "1"], 2).schedule == "zb-h1"


@pytest.mark.timeout(120)
def test_split_backward_gives_1f1b_gradients_bitwise():
    pp, m = 4, 8
    plain = run_in_threads(pp, run_engine, pp, m, "1f1b")
    zb = run_in_threads(pp, run_engine, pp, m, "zb-h1")
    for s, (a, b) in enumerate(zip(plain, zb)):
        assert a["loss"] == b["loss"]
        assert all(np.array_equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), s
        assert a["traffic"]["by_op"] == b["traffic"]["by_op"]
        assert b["in_flight"] == min(pp, m)


def _ledger_peaks(comm, pp, m, schedule, t):
    cfg = get_config("tiny", n_layer=4, n_head=4, dtype="float64", block_size=t)
    topo = Topology(comm, 1, 1, pp)
    engine = PipelineEngine(build_stage(cfg, 0, topo), topo.pp_comm, schedule)
    get_ledger().reset_peaks()
    engine.forward_backward(micro_batches(m, t=t))
    return get_ledger().peak["activations"], get_ledger().peak["comm_buffers"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])  # any m >= p holds min(p, m) = p in flight: one m per pp
def test_zb_h1_activation_peak_in_the_ledger_equals_1f1b(pp, m):
    """A W keeps only the blocks' matrix products' (x, dy) (pipeline.deferred_weights): at context 64 (4 layers of
    width 16, 4 heads) the most any rank holds is 1F1B's stage 0's, to the byte. The received dy a W keeps is a
    comm buffer."""
    plain = run_in_threads(pp, _ledger_peaks, pp, m, "1f1b", 64)
    zb = run_in_threads(pp, _ledger_peaks, pp, m, "zb-h1", 64)
    assert max(a for a, _ in zb) == max(a for a, _ in plain) == plain[0][0] == zb[0][0]
    assert all(z[1] >= p[1] for z, p in zip(zb, plain))
    if (pp, m) == (4, 8):  # context 16: attention's (T, T) scores are small, the last stage's Ws hold more
        short = [run_in_threads(pp, _ledger_peaks, pp, m, s, 16) for s in ("1f1b", "zb-h1")]
        assert max(a for a, _ in short[1]) > max(a for a, _ in short[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, dp, tp, pp, m, extra", [  # m >= p: every stage's warm-up min(p-s-1, m) uncapped
    ("tiny", 1, 1, 2, 4, []),
    ("tiny4", 1, 1, 4, 8, []),  # middle stages (receive and send both ways)
    ("tiny", 2, 1, 2, 4, ["--zero", "1"]),
    ("tiny", 2, 1, 2, 4, []),
    ("tiny", 1, 2, 2, 4, ["--recompute", "full"]),
])
def test_zb_h1_equals_single_process(monkeypatch, model, dp, tp, pp, m, extra):
    add_deep_narrow_presets(monkeypatch)
    ref = run_in_threads(1, R.run_single, model, dp, m, extra)[0]
    got = run_in_threads(dp * tp * pp, R.run_parallel, model, 1, dp, tp, pp, m, "zb-h1", extra)
    R.assert_matches(ref, got, f"zb-h1 dp {dp} tp {tp} pp {pp} m {m} {extra}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, dp, tp, pp, m, extra", [
    ("tiny4", 1, 1, 2, 4, []),  # m >= 2p-1: laid out for m micro-batches, no op dropped
    ("tiny12", 1, 1, 4, 4, []),  # m < 2p-1: laid out for 2p-1, the ops of the missing ones dropped; middle ranks
    ("tiny4", 2, 1, 2, 4, ["--zero", "1"]),
    ("tiny4", 2, 1, 2, 4, []),
    ("tiny4", 1, 2, 2, 4, ["--recompute", "full"]),
])
def test_zb_v_equals_single_process(monkeypatch, model, dp, tp, pp, m, extra):
    """ZB-V: rank r runs virtual stages r and 2p-1-r; rank 0 holds both ends (one tied Parameter, as one process).
    tiny4 (4 layers) gives pp 2's 4 virtual stages a block each, tiny12 pp 4's 8 stages 1 or 2 blocks."""
    add_deep_narrow_presets(monkeypatch)
    ref = run_in_threads(1, R.run_single, model, dp, m, extra)[0]
    got = run_in_threads(dp * tp * pp, R.run_parallel, model, 1, dp, tp, pp, m, "zb-v", extra)
    R.assert_matches(ref, got, f"zb-v dp {dp} tp {tp} pp {pp} m {m} {extra}")


@pytest.mark.timeout(120)
def test_zb_v_messages_turn_at_the_last_rank_and_it_holds_2p_chunks():
    """Chunk 0 flows 0 -> p-1, chunk 1 back p-1 -> 0: rank p-1 hands its own chunk on (no message),
    rank 0 sends no activation of chunk 1 (the loss is there) and no gradient of chunk 0."""
    pp, m = 2, 4
    act = 2 * 16 * CFG.n_embd * 8  # b T C float64
    runs = run_in_threads(pp, run_engine, pp, m, "zb-v")
    for r, run in enumerate(runs):
        sends = 2 - (r == 0) - (r == pp - 1)  # chunk 0 unless r = p-1, chunk 1 unless r = 0
        assert run["traffic"]["by_op"] == {"pp_activation": sends * m * act, "pp_gradient": sends * m * act}
        assert run["in_flight"] == 2 * pp
    assert runs[0]["loss"] > 0 and runs[1]["loss"] == 0.0
    one = run_in_threads(1, run_engine, 1, m, "1f1b")[0]
    assert runs[0]["loss"] == pytest.approx(one["loss"], rel=1e-12)
    for name, g in one["grads"].items():
        got = next(run["grads"][name] for run in runs if name in run["grads"])
        np.testing.assert_allclose(got, g, rtol=0, atol=1e-12 * np.abs(g).max(), err_msg=name)


@pytest.mark.timeout(300)
def test_zb_h1_fp16_is_1f1b_bitwise():
    runs = {s: run_in_threads(2, R.run_parallel, "tiny", 1, 1, 1, 2, 4, s, ["--precision", "fp16", "--dtype", "float32"])
            for s in ("1f1b", "zb-h1")}
    for a, b in zip(runs["1f1b"], runs["zb-h1"]):
        assert all(np.array_equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert np.array_equal(a["losses"], b["losses"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, model", [("zb-h1", "tiny"), ("zb-v", "default")])
def test_zero_bubble_from_the_command_line(mpiexec, tmp_path, schedule, model):
    """``mpiexec -n 2 ... --pp 2 --schedule zb-h1 / zb-v``: the final weights are one process's."""
    base = ["--model", model, "--block-size", "16", "--dtype", "float64", "--steps", "3", "--eval-batches", "1",
            "--eval-every", "0", "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3"]
    R.cli_matches_one_process(mpiexec, str(tmp_path), base, ["--pp", "2", "--schedule", schedule, "--micro-batch-size",
                                                             "2", "--micro-batches", "4"],
                              ["--micro-batch-size", "2", "--grad-accum", "4"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_zb_h1_low_precision_is_1f1b_bitwise(precision):
    """BF16 and FP8 (memory/bf16.py, fp8.py) through the split backward: ZB-H1's weights bitwise 1F1B's."""
    flags = ["--precision", precision, "--dtype", "float32"]
    runs = {s: run_in_threads(2, R.run_parallel, "tiny", 1, 1, 1, 2, 4, s, flags) for s in ("1f1b", "zb-h1")}
    full = {s: {n: a for r in rs for n, a in r["params"].items()} for s, rs in runs.items()}
    assert all(np.array_equal(full["zb-h1"][n], a) for n, a in full["1f1b"].items())


def _fp8_casts(comm, schedule):
    cfg = get_config("tiny", n_layer=4, dtype="float32")
    topo = Topology(comm, 1, 1, 2)
    stage = build_stage(cfg, 0, topo, v_shape=schedule == "zb-v")
    use_fp8(stage, "delayed")
    PipelineEngine(stage, topo.pp_comm, schedule).forward_backward(micro_batches(4))
    head = stage.chunks[-1].lm_head if schedule == "zb-v" and stage.is_last else None  # the one the V runs
    return {"state": fp8_state(stage), "head": None if head is None else (head is stage.lm_head, type(head).__name__),
            "stats": {n: {k: c.stats() for k, c in m.casts.items()} for n, m in stage.named_modules()
                      if isinstance(m, FP8Linear)}}


@pytest.mark.timeout(120)
def test_fp8_split_backward_casts_each_gradient_once():
    """A split backward runs a node's backward twice (B: dx, W: dW); the E5M2 cast of dy happens at B only,
    so the amax histories and cast counts are 1F1B's (a second cast at W doubled them)."""
    plain, zb = (run_in_threads(2, _fp8_casts, s) for s in ("1f1b", "zb-h1"))
    for a, b in zip(plain, zb):
        assert a["stats"] == b["stats"] and a["state"] == b["state"]
    v = run_in_threads(2, _fp8_casts, "zb-v")
    assert v[0]["head"] == (True, "FP8Linear")  # the V's head on rank 0: the chunk's is the stage's, converted
    assert v[0]["stats"]["lm_head"]["g"]["elements"] == 4 * 2 * 16 * 256


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_zb_v_low_precision_equals_one_process_of_that_precision(monkeypatch, precision):
    """ZB-V's two chunks both get the low-precision layers (Module.swap_modules reaches a chunk's own head):
    first loss and every step-0 gradient bitwise one process's, but the tied embedding's (head and embedding
    contributions add in another order: within 4 ulp of its largest). Parameters after 3 Adam steps: within
    1e-5 of their largest (bf16, fp8); with fp16 Adam turns that ulp into lr-sized steps, so not compared."""
    add_deep_narrow_presets(monkeypatch)  # small4: on tiny4 (width 16) the tied embedding drifts past 1e-5 in bf16
    flags = ["--precision", precision, "--dtype", "float32"]
    ref = run_in_threads(1, R.run_single, "small4", 1, 4, flags)[0]
    got = run_in_threads(2, R.run_parallel, "small4", 1, 1, 1, 2, 4, "zb-v", flags)
    assert got[0]["losses"][0] == ref["losses"][0]
    # fp16: Adam turns step 0's ulp-level gradient differences into lr-sized steps (measured 1.6e-4 by step 3
    # under OpenBLAS's SkylakeX kernel, below 1e-4 under Haswell)
    np.testing.assert_allclose(got[0]["losses"], ref["losses"], rtol=1e-3 if precision == "fp16" else 1e-4)
    for r in got:
        for name, g in r["grads0"].items():
            a = ref["grads0"][R._ref_name(name)]
            if name == "transformer.wte.weight":
                np.testing.assert_allclose(g, a, rtol=0, atol=4 * np.finfo(a.dtype).eps * np.abs(a).max())
            else:
                assert np.array_equal(g, a), name
        for name, p in r["params"].items() if precision != "fp16" else ():
            a = ref["params"][R._ref_name(name)]
            np.testing.assert_allclose(p, a, rtol=0, atol=1e-5 * np.abs(a).max(), err_msg=name)


@pytest.mark.timeout(120)
def test_a_trace_shows_every_w_as_a_compute_span(tmp_path):
    """``--trace`` under ZB-H1: each W is one span on the compute lane, so a trace's busy time counts it."""
    path = str(tmp_path / "trace.json")

    def run(comm):
        argv = ["--model", "tiny", "--dtype", "float64", "--block-size", "16", "--steps", "1", "--eval-every", "0",
                "--eval-batches", "1", "--no-progress", "--micro-batch-size", "2", "--pp", "2", "--micro-batches", "4",
                "--schedule", "zb-h1", "--trace", path]
        train(parse_args(argv, comm.world_size), comm, log=lambda s: None)

    run_in_threads(2, run)
    events = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X" and e["name"].startswith("W ")]
    assert sorted((e["pid"], e["name"], e["cat"], e["tid"]) for e in events) == sorted(
        (r, f"W mb{i}", "backward", 0) for r in range(2) for i in range(4))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_under_2p_minus_1_micro_batches_is_the_full_layout_with_the_missing_ones_dropped(p):
    """m < 2p-1: the ops of the 2p-1 layout whose micro-batch is < m, in its order (PyTorch's ScheduleZBVZeroBubble);
    simulated, it completes. (Round-3 mutant: laid out for m itself passed every other test; its schedule is another
    valid one, a slot shorter or longer, not the documented one.)"""
    full = zb_v(p, 2 * p - 1)
    for m in range(1, 2 * p - 1):
        assert zb_v(p, m) == [[op for op in ops if op.mb < m] for ops in full], m
        simulate(zb_v(p, m))


def test_zb_v_at_2p_minus_1_micro_batches_is_laid_out_for_exactly_those():
    """m = 2p-1 is the layout itself, no micro-batch dropped: at p=2 rank 1 turns chunk 0's F at once and the bubble
    is 1/18 (Round-4 mutant: laid out for 2p and dropped to 2p-1 passed every test, a valid schedule with twice the
    bubble)."""
    assert " ".join(map(str, zb_v(2, 3)[1])) == ("F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 "
                                                  "B1 B2.1 B2 W1 W2.1 W2")
    assert bubble_ratio(simulate(zb_v(2, 3))) == pytest.approx(1 / 18, abs=1e-12)
