"""``python -m minizero.plan``: parsing, refusals, the ranking, JSON, the plot, and speed at 1T x 1024 GPUs."""
import json
import os
import re
import subprocess
import sys

import pytest

from minizero import plan as P
from minizero.memory.estimator import comm_bytes_per_step, estimate_stages
from minizero.memory.estimator.messages import comm_messages_per_step
from minizero.models import MODELS, get_model

from .conftest import REPO_ROOT, mpi_env


def run_main(capsys, *argv):
    """(exit status, stdout, stderr) of ``plan.main(argv)``."""
    try:
        code = P.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_parse_bytes_units():
    assert P.parse_bytes("80GB") == 80 * 10 ** 9
    assert P.parse_bytes("80GiB") == 80 * 2 ** 30
    assert P.parse_bytes("8e10") == 8 * 10 ** 10
    assert P.parse_bytes("1.5 TB") == 1_500_000_000_000
    assert P.parse_bytes("25MiB") == 25 * 2 ** 20
    assert P.parse_bytes("300GB/s") == 300 * 10 ** 9
    with pytest.raises(ValueError, match="'80G' is not a byte size .*ambiguous: write GB"):
        P.parse_bytes("80G")
    with pytest.raises(ValueError, match="'lots' is not a byte size"):
        P.parse_bytes("lots")
    # the command line's rule needs a unit: its refusal of '80XB' must not offer the bare 8e10 (before: it did)
    with pytest.raises(ValueError, match=r"'80XB' is not a byte size; allowed: a number with a unit, .*8e10B"):
        P.parse_bytes("80XB", unit_required=True)
    with pytest.raises(ValueError, match="at least 1 byte"):
        P.parse_bytes("0GB")


def test_plan_llama3_70b_table(capsys):
    code, out, err = run_main(capsys, "--model", "llama3-70b", "--gpus", "64", "--gpu-memory", "80GB",
                              "--seq-len", "4096")
    assert code == 0, err
    assert "64 GPUs x 80.00 GB" in out and "GB (10^9 bytes)" in out
    assert "ranking: " + P.RANKING_RULE in " ".join(out.split())  # the header is wrapped at 100 columns
    assert "why:" in out and (" beats #" in out or " is ranked above #" in out)
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s+\d+\s", line) and "|" in line]
    assert len(rows) == 10


def test_plan_json_is_ranked_and_fits(capsys):
    code, out, _ = run_main(capsys, "--model", "llama2-13b", "--gpus", "16", "--gpu-memory", "40GB",
                            "--json", "--top", "0")
    assert code == 0
    d = json.loads(out)
    assert d["units"] == "bytes" and d["fit"] == len(d["candidates"]) > 0
    speeds = [round(c["tokens_per_s"], 6) for c in d["candidates"]]  # the ranking rule's key (ties: memory)
    assert speeds == sorted(speeds, reverse=True)
    model = get_model("llama2-13b")
    from minizero.memory.estimator import Strategy

    for c in d["candidates"][:50]:
        st = Strategy(**c["strategy"])
        assert st.world_size == 16
        for e in estimate_stages(model, st, d["seq_len"]):  # every stage fits, not only the fullest
            assert e.total <= 40 * 10 ** 9
        assert sum(v for k, v in c["memory_bytes"].items() if k != "offloaded") == c["device_total_bytes"]
    # ties on step time go to less memory
    for a, b in zip(d["candidates"], d["candidates"][1:]):
        if a["tokens_per_s"] == b["tokens_per_s"]:
            assert a["device_total_bytes"] <= b["device_total_bytes"]


def test_plan_one_trillion_on_1024_gpus_searches_a_bounded_space(capsys):
    # The search's size, counted, not timed (a wall-time bound failed on a loaded machine): 1,230 strategies for
    # 1024 GPUs, each estimated once; an enumeration that grew with the GPU count would change the count.
    code, out, _ = run_main(capsys, "--model", "megatron-1t", "--gpus", "1024", "--gpu-memory", "80GB")
    assert code == 0
    assert "1008.04 B parameters" in out
    assert "1,230 strategies enumerated, 174 fit" in " ".join(out.split())


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama3-8b", "--gpus", "0"], "--gpus must be a positive integer, got 0"),
    (["--model", "gpt5", "--gpus", "8"], "unknown model 'gpt5'; allowed: deepseek-v3, gpt3-175b"),
    (["--model", "llama3-70b", "--gpus", "8", "--gpu-memory", "1MB"],
     "--gpu-memory 1MB (1.00 MB) is below the smallest per-GPU footprint"),  # 0.00 GB before
    (["--model", "tiny", "--gpus", "1", "--gpu-memory", "1KB"], "Allowed: --gpu-memory of at least 47.49 KB"),
    (["--model", "tiny", "--gpus", "1", "--gpu-memory", "100KiB", "--host-memory", "1B", "--units", "GiB"],
     "--host-memory 1B (1.00 B) is too small: every strategy that fits 100.00 KiB per GPU"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80G"], "ambiguous: write GB"),
    (["--model", "gpt3-175b", "--gpus", "8", "--seq-len", "4096"], "learned position table of 2048"),
    (["--model", "llama3-70b", "--gpus", "1", "--gpu-memory", "80GB"], "--host-memory 128GB"),
    (["--model", "llama3-8b", "--gpus", "8", "--units", "MB"], "invalid choice: 'MB'"),
    (["--model", "tiny", "--gpus", "2", "--strategy", " "], "--strategy ' ': give the strategy's words"),
    (["--model", "tiny", "--gpus", "2", "--strategy", ",,,"], "--strategy ',,,': give the strategy's words"),
    (["--model", "tiny", "--gpus", "2", "--plot", ""], "--plot '': give a file name for the PNG"),
    (["--model", "tiny", "--gpus", "2", "--lora-rank", "4"], "give --finetune lora or qlora too"),
    (["--model", "tiny", "--gpus", "2", "--finetune", "lora", "--lora-rank", "17"], "--lora-rank must be in 1..16"),
])
def test_plan_refuses_bad_input(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert message in " ".join(err.split()), err  # its lines of <= 120 columns read whole
    assert "Traceback" not in err and out == ""


def test_plan_cli_exit_status_without_traceback():
    r = subprocess.run([sys.executable, "-m", "minizero.plan", "--model", "llama3-8b", "--gpus", "0"],
                       capture_output=True, text=True, cwd=REPO_ROOT, env=mpi_env(), timeout=60)
    assert r.returncode == 2 and "--gpus must be a positive integer" in r.stderr
    assert "Traceback" not in r.stderr


def test_plot_writes_png(capsys, tmp_path):
    path = tmp_path / "plan.png"
    code, out, _ = run_main(capsys, "--model", "llama2-7b", "--gpus", "8", "--top", "4", "--plot", str(path))
    assert code == 0 and f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000
    code, _, err = run_main(capsys, "--model", "llama2-7b", "--gpus", "8", "--plot", str(tmp_path / "no" / "x.png"))
    assert code == 2 and "cannot write the PNG" in " ".join(err.split())


def test_enumeration_respects_constraints():
    m = get_model("llama2-70b")  # 80 layers, 64 heads, 8 KV heads
    seen = list(P.enumerate_strategies(m, 64, global_batch=512))
    assert seen and all(s.world_size == 64 for s in seen)
    assert all(s.tp <= 8 and m.n_kv_head % s.tp == 0 and m.n_layer % s.pp == 0 for s in seen)
    assert all(not (s.zero >= 2 and s.pp > 1) for s in seen)
    assert all(s.sequence_parallel <= (s.tp > 1) for s in seen)
    assert any(s.sequence_parallel and s.zero >= 2 for s in seen)  # the trainer runs sp with ZeRO 2-3 too
    assert all(s.dp * s.micro_batch * s.micro_batches >= 512 for s in seen)


def test_plan_huge_gpu_counts_are_refused_before_the_search(capsys, monkeypatch):
    assert P._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and P._divisors(1) == [1]

    def no_search(*args, **kwargs):
        raise AssertionError("searched before refusing --gpus")
    monkeypatch.setattr(P, "plan", no_search)
    monkeypatch.setattr(P, "enumerate_strategies", no_search)
    code, _, err = run_main(capsys, "--model", "llama3-8b", "--gpus", "1000000007")
    assert code == 2 and "--gpus 1000000007 is too many; allowed: 1..1,048,576" in " ".join(err.split())
    assert P._divisors(1000000007) == [1, 1000000007]  # trial division to sqrt(n): 31,623 tries for a prime


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory", "1e400"], "--gpu-memory '1e400' is infinite"),
    (["--gpu-memory=-80GB"], "--gpu-memory '-80GB' must be positive"),
    (["--schedule", "interleaved", "--virtual-stages", "100"], "--virtual-stages 100: with --schedule interleaved"),
    (["--plot", "x.pdf"], "must end in .png"),
    # before: accepted, a step of nan (or 1e300) seconds in the table
    (["--gpu-flops", "1e-300"], "--gpu-flops must be in [1e+09, 1e+18] FLOP/s per GPU, got 1e-300"),
    (["--gpu-flops", "inf"], "--gpu-flops must be in [1e+09, 1e+18]"),
    (["--efficiency", "1e-300"], "--efficiency must be in [0.001, 1] (a fraction of peak), got 1e-300"),
    (["--efficiency", "nan"], "--efficiency must be in [0.001, 1]"),
    # before: accepted and ignored (the default 1f1b schedule has no virtual stages)
    (["--virtual-stages", "4"], "--virtual-stages 4 only applies with --schedule interleaved; got --schedule 1f1b"),
    (["--gpus-per-node", "3"], "--gpus 8 is not a whole number of nodes of --gpus-per-node 3; allowed: --gpus up "
                               "to 3, or a multiple of it"),
    # before: accepted, where train refuses an interleaved schedule of one virtual stage
    (["--schedule", "interleaved", "--virtual-stages", "1"], "32 layers with pp >= 2; allowed: 2, 4, 8, 16"),
    # before: accepted, no PNG written and no word said
    (["--strategy", "dp8", "--plot", "x.png"], "--plot draws the searched strategies' memory; it does not apply to "
                                               "--strategy (leave it out)"),
    (["--finetune", "lora", "--plot", "x.png"], "it does not apply to --finetune lora (leave it out)"),
    # before: accepted and ignored, the same table printed
    (["--finetune", "lora", "--top", "3", "--bucket", "1MB", "--gpu-flops", "1e15"],
     "--top, --gpu-flops, --bucket do(es) not apply to --finetune lora (it tabulates memory per ZeRO stage: no search,"
     " no step time); leave it out"),
    # before: accepted and ignored, "dp4 cp2" planned with ring attention
    (["--strategy", "dp4 cp2", "--cp-attention", "ulysses"], "--cp-attention ulysses chooses among the searched "
                                                             "strategies; with --strategy name it in its words: "
                                                             "cp_attention=ulysses"),
    # before: accepted and ignored, the one strategy printed
    (["--strategy", "dp8", "--top", "3"], "--top 3 chooses how many searched strategies to show; --strategy plans one "
                                          "(leave it out)"),
    (["--ep", "0"], "--ep must be a positive integer, got 0"),
    # before: the way out named --seq-len and more memory or GPUs only
    (["--micro-batch", "16777216"], "or a shorter --seq-len, or a smaller --micro-batch than 16777216"),
])
def test_plan_refuses_more_bad_input(capsys, argv, message):
    code, out, err = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", *argv)
    assert code == 2 and message in " ".join(err.split()) and out == ""


def test_plot_reports_the_real_path_and_header_the_real_schedule(capsys, tmp_path):
    code, out, _ = run_main(capsys, "--model", "llama2-7b", "--gpus", "8", "--top", "2", "--schedule", "interleaved",
                            "--plot", str(tmp_path / "jdir"))
    assert code == 0 and f"wrote {tmp_path / 'jdir.png'}" in out and (tmp_path / "jdir.png").exists()
    assert "interleaved pipeline schedule (2 virtual stages" in out
    assert [p.name for p in tmp_path.iterdir()] == ["jdir.png"]  # no temporary left
    code, out, err = run_main(capsys, "--model", "llama2-7b", "--gpus", "8", "--plot", str(tmp_path))
    assert code == 2 and "is a directory" in " ".join(err.split()) and out == ""


# ---- context parallelism -----------------------------------------------------------------------
def _best_and_all(capsys, *argv):
    code, out, err = run_main(capsys, *argv, "--json", *(() if "--strategy" in argv else ("--top", "0")))
    assert code == 0, err
    d = json.loads(out)
    return d["candidates"][0]["strategy"], [c["strategy"] for c in d["candidates"]]


def test_plan_recommends_context_parallelism_for_a_long_sequence(capsys):
    """llama3-8b at 131072 tokens on 8 x 80 GB: no layout without cp fits (the s^2 attention scores, or
    even the s-sized rows, of a whole sequence), so the best is context parallel; at 4096 tokens the
    search keeps every rank's whole sequence (cp 2 would leave 2048 < MIN_CP_TOKENS_PER_RANK tokens per rank),
    while ``--strategy cp2`` is still planned when asked for."""
    best, every = _best_and_all(capsys, "--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80GB",
                                "--seq-len", "131072")
    assert best["cp"] > 1 and every and all(st["cp"] > 1 for st in every)
    best, every = _best_and_all(capsys, "--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80GB",
                                "--seq-len", "4096")
    assert every and all(st["cp"] == 1 for st in every)
    from minizero.plan_search import MIN_CP_TOKENS_PER_RANK
    assert 4096 // 2 < MIN_CP_TOKENS_PER_RANK <= 131072 // 16
    best, every = _best_and_all(capsys, "--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096",
                                "--strategy", "dp4 cp2")
    assert best["cp"] == 2
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--top", "3")
    assert code == 0 and re.search(r"#\s+dp\s+ep\s+cp\s+tp\s+pp", out)


def test_context_parallel_step_time_charges_the_ring():
    """cp's step-time part is the estimator's ring bytes over the link its group uses plus its message steps x alpha
    (the ring's c-1 passes forward, twice under recompute, and 2c-1 backward, per layer and micro-batch); cp 1: none.
    cp 16 spans 2 nodes: of each lap of c-1 steps 1 crosses them (NCCL's nodes-1), of the c-step lap back 2."""
    m = get_model("llama3-8b")
    hw = P.Hardware()
    for cp, bw in [(1, hw.intra_node_bw), (4, hw.intra_node_bw), (16, hw.inter_node_bw)]:
        st = P.parse_strategy(f"dp1 cp{cp} tp1 pp1 recompute=selective", m, cp, seq_len=65536)
        comm = comm_bytes_per_step(m, st, 65536)
        t = P.step_time(m, st, hw, 65536, comm)
        steps = st.micro_batches * m.n_layer * (2 * (cp - 1) + 2 * cp - 1) if cp > 1 else 0
        assert comm_messages_per_step(m, st, 65536)["cp"] == steps
        inter = st.micro_batches * m.n_layer * (3 * 1 + 2) if cp == 16 else 0
        alpha = (steps - inter) * hw.latency + inter * hw.inter_node_latency
        assert (comm["cp"] > 0) == (cp > 1) and t["cp"] == comm["cp"] / bw + alpha
    assert "cp=4" in P.describe(P.parse_strategy("dp2 cp4 tp8", m, 64, seq_len=8192))


def test_a_pipelined_row_shows_the_bytes_its_step_time_counts(capsys):
    """Before: a row's bytes (net, why lines) were its fullest stage's and its step time stage 0's. Under GPipe the
    fullest is the last stage; under pp 4 the middle stages, which send activations both ways, are the slowest. Now
    both are the slowest stage's: every stage runs the same schedule, so the slowest sets the step."""
    m, hw, s = get_model("llama3-8b"), P.Hardware(), 8192
    for text, schedule, fullest, slowest in (("dp1 cp2 pp4", "1f1b", 0, 1), ("dp4 pp2 zero1", "gpipe", 1, 1)):
        st = P.parse_strategy(text, m, 8, seq_len=s, global_batch=64, schedule=schedule)
        c = P.evaluate(m, st, hw, s)
        per_stage = [P.step_time(m, st, hw, s, stage=i) for i in range(st.pp)]
        assert (c.memory.stage, c.stage) == (fullest, slowest), text
        assert c.comm == comm_bytes_per_step(m, st, s, stage=slowest), text
        assert c.time == P.step_time(m, st, hw, s, c.comm, slowest) == max(per_stage, key=lambda t: t["step"]), text
    assert per_stage[1]["dp"] > per_stage[0]["dp"]  # ZeRO-1's all-gather of its own stage's (head's) parameters
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", "--strategy", "dp1 cp2 pp4", "--json")
    row = json.loads(out)["candidates"][0]
    assert code == 0 and row["slowest_stage"] == 1 and row["stage"] == 0
    st = P.parse_strategy("dp1 cp2 pp4", m, 8, seq_len=s, global_batch=2 ** 22 // s)  # the CLI's default batch
    assert row["comm_bytes_per_step"] == comm_bytes_per_step(m, st, s, stage=1)
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", "--strategy", "dp1 cp2 pp4")
    said = " ".join(out.split())
    assert "net and step s are the slowest pipeline stage's" in said and "(pipeline stage 1, the slowest of 4)" in said


def test_lesson_08_names_the_compute_each_zero_stage_hides_data_parallel_traffic_behind():
    """Before, lesson 08: dp traffic is exposed "beyond what hides behind backward"; step_time lets ZeRO-3's hide
    behind forward and backward, ZeRO-2's behind every backward, ZeRO-0/1's behind the last micro-batch's (bytes
    alone: latency 0; its message steps hide in the same window)."""
    m, hw, s = get_model("llama3-8b"), P.Hardware(latency=0.0), 8192
    for z, hidden in ((0, 2 / 3 / 8), (2, 2 / 3), (3, 1)):  # m = 64 / dp 8 = 8 micro-batches
        st = P.parse_strategy(f"dp8 zero{z}", m, 8, seq_len=s, global_batch=64)
        c = P.step_time(m, st, hw, s)["compute"]
        comm = {"dp": 0.9 * c * hw.intra_node_bw, "tp": 0, "pp": 0, "cp": 0, "pcie": 0}  # 0.9 c of dp traffic
        assert P.step_time(m, st, hw, s, comm)["dp"] == pytest.approx(max(0, 0.9 - hidden) * c, rel=1e-9, abs=1e-12), z
    with open(os.path.join(REPO_ROOT, "lessons", "templates", "08_putting_it_together.md")) as f:
        said = " ".join(f.read().split())
    assert "ZeRO-3's gathers and reduce-scatters behind forward and backward" in said
    assert "behind the last micro-batch's backward, ZeRO-2's behind every backward" in said


@pytest.mark.parametrize("model, text, message", [
    ("llama3-8b", "dp1 cp3", "2 x cp = 6 equal chunks"),
    ("llama3-8b", "dp2 cp4 tp2", "dp x cp x tp x pp = 2 x 4 x 2 x 1 must equal --gpus 8"),
])
def test_plan_refuses_context_parallelism_where_it_cannot_run(capsys, model, text, message):
    code, out, err = run_main(capsys, "--model", model, "--gpus", "8" if "cp3" not in text else "3",
                              "--seq-len", "1024", "--strategy", text)
    assert code == 2 and message in " ".join(err.split()) and out == "", err


def test_why_says_tie_under_the_models_accuracy_and_beats_above_it():
    """A lead under ACCURACY is a tie within the first-order model: the line must not say "beats"."""
    import types

    from minizero.memory.estimator import Strategy
    from minizero.plan_report import ACCURACY, explain

    def cand(tok, zero):
        return types.SimpleNamespace(strategy=Strategy(zero=zero), tokens_per_s=tok, step_s=1e4 / tok, comm={"dp": 0},
                                     time={"step": 1e4 / tok, "dp": 1e4 / tok}, memory=types.SimpleNamespace(total=0))
    tie = explain(cand(1000 * (1 + ACCURACY / 2), 3), cand(1000, 2), 1, 2, 1e9, "GB")
    assert tie.startswith("#1 is ranked above #2 by 0.5% tokens/s") and "a tie within the model's accuracy" in tie
    assert "beats" not in tie
    lead = explain(cand(1000 * (1 + 4 * ACCURACY), 3), cand(1000, 2), 1, 2, 1e9, "GB")
    assert lead.startswith("#1 beats #2 by 4% tokens/s") and "tie" not in lead


def test_ranking_keeps_a_near_tie_by_speed_and_breaks_an_equal_one_by_memory(capsys):
    """The header's rule is the order: a 0.5% lead (within the model's ~1%) stays first although it needs more
    memory; only equal tokens/s go to less memory, then fewer techniques; the why line names the smaller row."""
    import types

    from minizero.memory.estimator import Strategy
    from minizero.plan_report import why_lines
    from minizero.plan_search import RANKING_RULE, rank

    def cand(name, tok, total, techniques=1):
        return types.SimpleNamespace(name=name, tokens_per_s=tok, step_s=1e4 / tok, techniques=techniques,
                                     strategy=Strategy(), time={"step": 1e4 / tok, "dp": 1e4 / tok}, comm={"dp": 0},
                                     memory=types.SimpleNamespace(total=total))
    cands = [cand("small_slow", 1000.0, 40e9, 2), cand("big_fast", 1005.0, 80e9), cand("same_fewer", 1000.0, 40e9),
             cand("same_bigger", 1000.0, 60e9), cand("far_smallest", 900.0, 10e9)]
    ranked = [c.name for c in rank(cands)]
    assert ranked == ["big_fast", "same_fewer", "small_slow", "same_bigger", "far_smallest"]
    assert "equal step times go to less device memory" in RANKING_RULE and "ties go to" not in RANKING_RULE
    first = why_lines(rank(cands), 1e9, "GB")[0]
    assert first.startswith("#1 is ranked above #2 by 0.5% tokens/s") and "#2 needing 40.00 GB less per GPU" in first
    # the reasons after it are #1's (before: "#2 needing 40.00 GB less per GPU: ... s less data-parallel traffic")
    assert "#2 needing 40.00 GB less per GPU; #1: " in first, first
    code, out, err = run_main(capsys, "--model", "llama2-7b", "--gpus", "8")
    assert code == 0, err
    said = " ".join(out.split())  # the header is wrapped at 100 columns
    assert "ranking: " + RANKING_RULE in said and "such rows stay in tok/s order" in said


@pytest.mark.parametrize("flag,value", [("--seq-len", "1000000000000"), ("--micro-batch", "1000000000"),
                                        ("--global-batch", "100000000"), ("--gpus-per-node", "99999999999999999999")])
def test_plan_sizes_past_any_plan_are_refused_naming_the_flag(capsys, flag, value):
    """Before: no upper bound, and the error blamed --gpu-memory (--gpus-per-node: the header echoed the 20 digits)."""
    code, _, err = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", flag, value)
    assert code == 2 and f"{flag} {int(value):,} is too large; allowed: 1..16,777,216 (2^24)" in " ".join(err.split())


def test_a_global_batch_rounded_up_is_said_per_row(capsys):
    """Before: --gpus 8 --global-batch 7 planned batches of 8 without a word."""
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "8", "--global-batch", "7", "--strategy", "dp8")
    assert code == 0 and ("--global-batch 7 is not a multiple of dp x micro-batch in every row: m = ceil(B / (dp x b)) "
                          "rounds up, so these rows train more sequences per step: #1 8") in " ".join(out.split())
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "8", "--global-batch", "8", "--top", "3")
    assert code == 0 and "is not a multiple" not in out


def test_plot_naming_an_existing_file_without_extension_is_refused(tmp_path, capsys):
    """Before: --plot /dev/full wrote /dev/full.png."""
    mine = tmp_path / "notes"
    mine.write_text("my notes")
    code, _, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--plot", str(mine))
    said = f"--plot {str(mine)!r} names an existing file, and the PNG would go to {str(mine) + '.png'!r}"
    assert code == 2 and said in " ".join(err.split())
    assert not (tmp_path / "notes.png").exists()
    code, _, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--plot", "/dev/full")  # a device: written into
    assert code == 2 and "--plot '/dev/full' cannot be written (No space left on device)" in " ".join(err.split())


def test_plot_dev_null_is_written_into_as_json_dev_null_is(capsys):
    """Before: --plot /dev/null was refused (the PNG would go to /dev/null.png); a device is written into."""
    import stat
    code, out, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--plot", os.devnull)
    assert code == 0 and f"wrote {os.devnull}" in out and stat.S_ISCHR(os.stat(os.devnull).st_mode), err


def test_plot_replaces_an_earlier_plot_but_no_other_file(tmp_path, capsys):
    """Attacker: --plot user.png overwrote a file that was not a PNG."""
    mine = tmp_path / "notes.png"
    mine.write_text("my notes")
    code, out, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--plot", str(mine))
    assert code == 2 and "exists and does not hold a plot minizero wrote" in " ".join(err.split()) and mine.read_text() == "my notes"
    plot = tmp_path / "plan.png"
    for _ in range(2):  # the second run replaces the first run's PNG
        code, out, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--plot", str(plot))
        assert code == 0 and plot.read_bytes()[:4] == b"\x89PNG"


def test_table_cells_stay_apart_when_a_figure_is_wide():
    """Before: 96.36 GB of optimizer state beside 1147.87 GB of activations printed as '96.361147.87'."""
    from minizero.plan_report import _cell

    assert _cell(96.36, 7) + _cell(1147.87, 7) == "  96.36   1148"
    assert _cell(0.5, 7) == "   0.50" and _cell(1276.38, 8) == " 1276.38" and _cell(12345678.0, 7) == " 1.23e7"


@pytest.mark.parametrize("argv", [
    ("--model", "llama3-8b", "--gpus", "8", "--seq-len", "131072", "--top", "20"),
    ("--model", "mixtral-8x7b", "--gpus", "64", "--seq-len", "4096", "--ep", "4", "--top", "20"),
    ("--model", "llama3-8b", "--gpus", "16", "--seq-len", "131072",
     "--strategy", "dp2 cp8 cp_attention=ulysses tp1 zero3 recompute=selective offload=params+activations"),
    ("--model", "llama3-8b", "--gpus", "8", "--seq-len", "1048576", "--gpu-memory", "1000000TB")])  # 2258008: 123
def test_the_table_fits_120_columns(capsys, argv):
    """Before: 154 columns (recompute and offload spelled out, a separator before host, net/step and step s), then
    128 (attn and SP columns: now cp's 'u' and tp's 's'). Every table line fits 120, the legend says the names."""
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if re.match(r"\s+#\s+dp\s+ep\s+cp\s+tp\s+pp\s+Z\s+rc", line))
    table = lines[top:lines.index("", top)]
    assert len(table) >= 3 and max(map(len, table)) <= 120, max(map(len, table))
    said = " ".join(out.split())
    assert "rc = activation recompute (sel: selective)" in said
    assert "par: + parameters, as ZeRO-Infinity: not in minizero.train; act: activations" in said
    if "--strategy" in argv:
        assert re.search(r" 8u  1 .* sel par\+act ", table[2]), table[2]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_presets_table_fits_120_columns(capsys, name):
    """Before: tiny's and default's m of 262,144 / 32,768 made lines of 121-122 columns (tiny's net of 1434463 KB
    under --top 0 too); a wide m or net now takes the room dp, ep, cp and pp leave unused (net's 1.43e6 form where
    even that is not enough)."""
    tables = 0
    for gpus, top in [(1, "10"), (8, "10"), (64, "10")] + [(2, "0")] * name.startswith("minizero-") + [(1024, "3")]:
        if gpus == 1024 and tables:
            break  # the largest models fit on 1,024 GPUs only
        code, out, err = run_main(capsys, "--model", name, "--gpus", str(gpus), "--top", top)
        assert code == 0 or "error:" in err, err
        assert max(map(len, out.splitlines()), default=0) <= 120, (name, gpus, top)
        tables += " net  step s" in out
    assert tables, f"{name}: no layout fits any of the GPU counts tried, so no table was checked"


def test_a_net_column_wider_than_7_is_printed_in_full_where_the_row_has_room(capsys):
    """tiny on 2 GPUs, --top 0: 1342177 KB sent per step fits once dp, ep, cp and pp give up their unused columns
    (not 1.34e6, which the exponent form printed for every net of 7 digits or more)."""
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "2", "--top", "0")
    assert code == 0 and " 1342177 " in out and "e6 " not in out
    assert max(map(len, out.splitlines())) <= 120


def test_the_search_tries_hybrid_sharding_within_a_node(capsys):
    """ZeRO over one node's data ranks, replicated across nodes (FSDP's HYBRID_SHARD), is a candidate where plain
    ZeRO's group would cross nodes, never within one node; it holds a 1/N shard (the offload time's too), and the
    table marks it 'h' within 128 columns (gpt2 on 64 GPUs: 14 M tokens/s, 10 characters with commas before)."""
    from minizero.plan_search import _state_shard, hybrid_shard, stage_parameters

    m = get_model("minizero-gpt2")
    shards = {s.dp_shard for s in P.enumerate_strategies(m, 64, global_batch=64) if s.tp == 2 and s.pp == 1}
    assert shards == {None, 4}  # dp 32 x tp 2: 4 data ranks of tp 2 fill a node of 8 GPUs
    assert {s.dp_shard for s in P.enumerate_strategies(m, 8, global_batch=64)} == {None}  # one node: nothing to gain
    assert hybrid_shard(12, 1, 8) == 4  # a group of 6 (ranks 6-11) would cross the first node's edge
    hybrid = next(s for s in P.enumerate_strategies(m, 64, global_batch=64) if s.dp_shard and s.offload != "none")
    psi = stage_parameters(m, hybrid, 0)
    assert _state_shard(m, hybrid) == -(-psi // (hybrid.dp_shard * hybrid.cp)) < psi
    code, out, err = run_main(capsys, "--model", "gpt2", "--gpus", "64", "--top", "3")
    assert code == 0, err
    first = next(line for line in out.splitlines() if line.startswith("  1 "))  # lesson 02 says it ranks first
    assert re.match(r"\s+1\s+64\s+1\s+1\s+1\s+1\s+\dh\s", first), first
    assert max(map(len, out.splitlines())) <= 120
    assert "hybrid sharding, Z 1h-3h: replicated across the groups" in " ".join(out.split())


def test_tiny_models_tokens_per_second_fit_the_column(capsys):
    """Before: --model tiny's 22,144,603,774 tok/s took 14 columns of 8 and its 32768 micro-batches 5 of 4 (2.05e+10
    with the latency of its gradient all-reduce's message steps)."""
    from minizero.numerals import in_width
    assert in_width(22_144_603_774, 8) == "2.21e+10" and in_width(32_497, 8) == "  32,497"
    assert in_width(32768, 5) == "32768" and in_width(2**24, 5) == "2e+07"
    from minizero.numerals import column  # one form per column: 3504572 beside 25,642 before
    assert column([3_504_572, 25_642], 8) == ["3.50e+06", "2.56e+04"] and column([4_096, 25_642], 8)[0] == "   4,096"
    from minizero.numerals import significant  # plan's seconds in prose: 1.35e+03 before
    assert [significant(x) for x in (0.0468, 36.94, 999.7, 1353.6, 1.15e-5)] == ["0.0468", "36.9", "1,000", "1,354",
                                                                                    "1.15e-05"]
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "8", "--top", "3")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("tok/s   MFU"))
    rows = lines[head + 2:head + 5]
    assert code == 0 and len(rows) == 3 and all(len(r) == len(lines[head]) for r in rows), rows
    assert all(r.split()[-2] == "2.05e+10" for r in rows[:1]), rows
    assert all(r.split()[9] == "32,768" for r in rows) and "global batch 262,144 sequences" in " ".join(out.split())


@pytest.mark.parametrize("argv", [["--model", "tiny", "--gpus", "1048576", "--gpus-per-node", "8"],  # dp 131072
                                  ["--model", "llama3-8b", "--gpus", "8"]])  # rows past 999, steps past 1000 s
def test_every_row_of_the_table_is_as_wide_as_its_header(capsys, argv):
    """Before: dp 131072 took 6 of its 4 columns, row 1000 4 of 3, a step of 1020.216 s 8 of 7."""
    code, out, _ = run_main(capsys, *argv, "--top", "0")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("tok/s   MFU"))
    rows = [r for r in lines[head + 2:] if " | " in r]
    assert code == 0 and rows and {len(r) for r in rows} == {len(lines[head])}, [r for r in rows if len(r) !=
                                                                                  len(lines[head])][:2]


def test_the_default_global_batch_rounded_up_is_said_too(capsys):
    """Before: --gpus 7 planned 7 x 74 = 518 sequences under a header saying '512 sequences requested', silently
    (the line was printed for --global-batch only; a new user's find)."""
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "7", "--top", "1")
    assert code == 0 and ("the default global batch (512: 2^22 tokens / seq-len, rounded up) is not a multiple of "
                          "dp x micro-batch in every row: m = ceil(B / (dp x b)) rounds up, so these rows train more "
                          "sequences per step: #1 518") in " ".join(out.split())
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", "--top", "3")
    assert code == 0 and "is not a multiple" not in out


def test_why_line_of_rows_training_different_batches_compares_tokens_not_seconds(capsys):
    """--global-batch 7 on dp 24 rounds up to 24 sequences, on dp 12 to 12: #1's step is twice as long yet faster
    per token. Before: "(-0.49 s per step): 0.0145 s less tensor-parallel traffic outweighs 0.504 s more compute"."""
    code, out, err = run_main(capsys, "--model", "llama2-7b", "--gpus", "24", "--global-batch", "7", "--top", "2")
    assert code == 0, err
    line = " ".join(out.split("why:")[1].split())
    assert "#1 beats #2 by 3.1% tokens/s: it trains 2x #2's tokens per step (m rounds the global batch up)" in line
    assert "s per step)" not in line and "outweigh" not in line, line


def test_a_strategy_using_exactly_the_gpu_s_memory_fits():
    """The planner's limit is "at most hw.gpu_memory": a GPU of exactly the smallest footprint runs that strategy."""
    import dataclasses

    from minizero.plan_search import Hardware, plan
    m, hw = get_model("llama2-7b"), Hardware()
    _, _, (smallest, device, host) = plan(m, 2, hw, 4096)
    fits, _, _ = plan(m, 2, dataclasses.replace(hw, gpu_memory=device), 4096)
    assert [(c.strategy, c.memory.total, c.host) for c in fits] == [(smallest, device, host)]


def test_the_interleaved_schedule_rounds_micro_batches_up_to_a_multiple_of_the_stages():
    from minizero.plan_search import micro_batches
    assert [micro_batches(5, 1, 1, s, 4) for s in ("interleaved", "1f1b")] == [8, 5]
    assert micro_batches(16, 2, 2, "interleaved", 4) == 4  # ceil(16 / (2 x 2)) = 4, a multiple of 4 already


def test_context_parallel_sizes_keep_each_rank_s_chunk_divisible_by_tp():
    """s 24 on 8 ranks, t 4: c 2 (24 in 4 chunks, 12 tokens a rank, / 4) only; c 4 leaves 6 tokens, not / 4."""
    from minizero.plan_search import context_parallel_sizes
    assert context_parallel_sizes(8, 24, 4) == [1, 2] and context_parallel_sizes(8, 24, 1) == [1, 2, 4]


def test_an_expert_s_optimizer_shard_spreads_over_its_n_over_ep_holders_only():
    """Mixtral on dp 8, ep 4: a rank holds 2 experts (32 layers x 3 matrices 4096 x 14336), sharded over the 8 / 4 = 2
    ranks that hold them; the dense rest over all 8."""
    from minizero.memory.estimator import Strategy
    from minizero.memory.estimator.states import stage_parameters
    from minizero.plan_search import _state_shard
    m = get_model("mixtral-8x7b")
    st = Strategy(dp=8, ep=4, zero=1).validate(m)
    experts = 32 * 2 * 3 * 4096 * 14336
    assert _state_shard(m, st) == (stage_parameters(m, st, 0) - experts) // 8 + experts // 2
