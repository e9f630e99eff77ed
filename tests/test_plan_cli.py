"""``python -m minizero.plan``'s command line: units, one given strategy, "why" over shown rows, the trainer's
model names, quiet pipes, help text, one-line errors."""
import json
import re
import subprocess
import sys

import pytest

from minizero import plan as P
from minizero.memory.estimator import Strategy
from minizero.models import get_model

from .conftest import REPO_ROOT, mpi_env


def run_main(capsys, *argv):
    try:
        code = P.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_refusal(err: str) -> bool:
    """One refusal: one ``error:`` line, a long one going on over indented lines of <= 120 columns."""
    lines = err.splitlines()
    return err.count("error:") == 1 and max(map(len, lines)) <= 120 and all(ln.startswith("  ") for ln in lines[1:])


@pytest.mark.parametrize("flag", ["--gpu-memory", "--host-memory", "--pcie-bw", "--bucket"])
def test_sizes_need_a_unit(capsys, flag):
    code, out, err = run_main(capsys, "--model", "llama3-8b", "--gpus", "8", flag, "80")
    assert code == 2 and out == ""
    assert one_refusal(err) and f"{flag} '80' has no unit" in " ".join(err.split()) and "80GB" in err and "80GiB" in err
    assert not err.startswith("usage:")
    assert P.parse_bytes("8e10") == 8 * 10 ** 10 and P.parse_bytes("8e10B", unit_required=True) == 8 * 10 ** 10


@pytest.mark.parametrize("units,other", [("GB", "GiB"), ("GiB", "GB")])
def test_one_unit_family_throughout(capsys, units, other):
    code, out, _ = run_main(capsys, "--model", "llama2-7b", "--gpus", "8", "--gpu-memory", "80GiB",
                            "--units", units, "--top", "5")
    assert code == 0
    assert re.search(rf"\b{units}\b", out) and not re.search(rf"\b{other}\b", out)
    gpu = 80 * 2 ** 30 / (1e9 if units == "GB" else 2 ** 30)
    assert f"8 GPUs x {gpu:.2f} {units}" in out


@pytest.mark.parametrize("units,small", [("GB", "KB"), ("GiB", "KiB")])
def test_a_tiny_models_sizes_are_in_a_unit_they_reach(capsys, units, small):
    """Before: every memory column of --model tiny read 0.00 GB (and step s 0.000, --finetune's 0.00 B
    parameters): the table, its why lines, --strategy's verdict and --finetune's rows take KB (KiB) instead."""
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "8", "--top", "3", "--units", units)
    power = {"KB": "10^3", "KiB": "2^10"}[small]
    assert code == 0 and f"every size in the table in {small} ({power} bytes)" in " ".join(out.split()), out
    rows = [line.split("|")[1].split() for line in out.splitlines() if re.match(r"\s+[0-9]+ .*\|", line)]
    assert len(rows) == 3 and all(float(r[5]) >= 1 and float(r[8]) > 0 for r in rows), rows  # total; step s
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "2", "--strategy", "dp=2", "--units", units)
    assert code == 0 and re.search(rf"fits: device [1-9][0-9.]* {small} of [0-9.]+ {units} per GPU", out), out
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "1", "--gpu-memory", "500KB", "--host-memory", "1MB")
    assert code == 0 and "1 GPUs x 500.00 KB (--gpu-memory 500KB;" in out and "host 1.00 MB per GPU" in out, out
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "2", "--finetune", "lora", "--lora-rank", "8")
    assert code == 0 and "(10,944 parameters, frozen)" in out and "every size in KB (10^3 bytes)" in out, out


def test_finetune_s_default_rank_fits_a_narrow_model(capsys):
    """Before: --model tiny --finetune lora was refused, "--lora-rank must be in 1..16, got 64", a flag not given."""
    code, out, err = run_main(capsys, "--model", "tiny", "--gpus", "2", "--finetune", "lora")
    assert code == 0 and "adapters of rank 16 on" in " ".join(out.split()), err


def test_header_names_the_assumed_gpu_and_what_mfu_and_zero_mean(capsys):
    """The defaults (an A100's) are printed in the table's units; MFU is said to follow from --efficiency;
    ZeRO's shards are over dp x cp; the header's prose and the why lines are wrapped at 100 columns (the header's
    lines were 150-300 columns wide)."""
    code, out, _ = run_main(capsys, "--model", "llama3-8b", "--gpus", "8")
    assert code == 0
    said = " ".join(out.split())
    assert "8 GPUs x 85.90 GB (--gpu-memory 80GiB = 85,899,345,920 bytes;" in said
    assert "assumed (an A100-80GB SXM's, the defaults;" in said and "312 TFLOP/s" in said and "60%" in said
    assert "NVLink 300.00 GB/s" in said and "PCIe 25.00 GB/s" in said
    assert "= --efficiency x the share of the step spent computing" in said
    assert "ZeRO stage, sharding over the dp x cp data ranks" in said
    header = out.split("\n\n")[0].splitlines()
    assert len(header) > 8 and max(len(line) for line in header) <= 100
    why = out.split("why:")[1].splitlines()[1:]
    assert len(why) > 3 and max(len(line) for line in why) <= 100
    code, out, _ = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--gpu-flops", "989e12", "--units", "GiB")
    said = " ".join(out.split())
    assert code == 0 and "assumed (an A100-80GB SXM's, the defaults, but --gpu-flops as given;" in said
    assert "989 TFLOP/s" in said and "279.40 GiB/s" in said
    assert "80GiB;" in said  # the flag's unit is the table's: no conversion
    code, out, _ = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--efficiency", "0.3", "--pcie-bw", "32GB")
    said = " ".join(out.split())
    assert code == 0 and "the defaults, but --efficiency, --pcie-bw as given;" in said and "30% of it" in said


def test_trainer_preset_names_are_accepted(capsys):
    a = run_main(capsys, "--model", "gpt2", "--gpus", "4", "--json")
    b = run_main(capsys, "--model", "minizero-gpt2", "--gpus", "4", "--json")
    assert a[0] == b[0] == 0 and json.loads(a[1]) == json.loads(b[1])
    assert json.loads(a[1])["model"]["name"] == "minizero-gpt2"
    code, _, err = run_main(capsys, "--model", "gpt-2", "--gpus", "4")
    assert code == 2 and "unknown model 'gpt-2'" in err and " ".join(err.split()).endswith("(did you mean 'gpt2'?)")


def test_why_names_only_rows_shown(capsys):
    for top in (2, 3, 4):
        code, out, _ = run_main(capsys, "--model", "llama3-70b", "--gpus", "8", "--gpu-memory", "80GB",
                                "--top", str(top))
        assert code == 0
        why = out.split("why:")[1]
        named = {int(n) for n in re.findall(r"#(\d+)", why)}
        assert named and max(named) <= top, (top, why)
    code, out, _ = run_main(capsys, "--model", "llama3-70b", "--gpus", "8", "--gpu-memory", "80GB", "--top", "1")
    assert "nothing to compare" in out


def test_why_names_exposed_seconds_and_all_bytes_sent(capsys):
    """ZeRO-3 ranked above ZeRO-2 for "less exposed data-parallel traffic" beside a larger net column read as a
    contradiction: the line names both rows' exposed seconds (the step time's, not overlapped with compute) and all
    the bytes they send, and the legend says net counts all of them. --strategy's step line names dp traffic hidden
    in full as 0 s of its bytes (before: "step 1.2 s = compute 1.2 s", the 175 GB it sends unmentioned)."""
    from minizero.numerals import significant

    argv = ["--model", "llama3-8b", "--gpus", "8", "--top", "2"]
    code, out, _ = run_main(capsys, *argv, "--json")
    a, b = json.loads(out)["candidates"]
    (ta, tb), (da, db) = [[c[key]["dp"] for c in (a, b)] for key in ("step_time_s", "comm_bytes_per_step")]
    assert (a["strategy"]["zero"], b["strategy"]["zero"]) == (3, 2) and ta < tb and da > db  # the case asked about
    code, out, _ = run_main(capsys, *argv)
    said = " ".join(out.split())  # prose and why lines are wrapped at 100 columns
    assert code == 0 and "net = all bytes each GPU sends per step" in said, said
    assert "step s counts only the exposed traffic (not overlapped with compute)" in said
    assert (f"less exposed data-parallel traffic ({significant(ta)} vs {significant(tb)} s; {da / 1e9:.2f} vs "
            f"{db / 1e9:.2f} GB sent per GPU) (settings: zero 3 vs 2)") in said, said
    gpt2 = ["--model", "gpt2", "--gpus", "16", "--strategy", "dp16 zero3 shard8"]
    code, out, _ = run_main(capsys, *gpt2, "--latency-us", "0")  # its bytes hide in full; its 256 micro-batches'
    said = " ".join(out.split())  # per-unit gathers and reduce-scatters, 21 steps each, do not at 5 us a step
    assert code == 0 and "exposed data-parallel traffic (0 s; " in said
    code, out, _ = run_main(capsys, *gpt2)
    assert code == 0 and "exposed data-parallel traffic (0 s; " not in " ".join(out.split())


def test_given_strategy_is_the_searched_one(capsys):
    """--strategy gives the same figures as the same strategy's row in the full search."""
    argv = ["--model", "llama2-13b", "--gpus", "16", "--gpu-memory", "40GB", "--json"]
    code, out, _ = run_main(capsys, *argv, "--top", "0")
    assert code == 0
    rows = json.loads(out)["candidates"]
    for want in (rows[0], rows[len(rows) // 2], rows[-1]):
        st = Strategy(**want["strategy"])
        words = P.describe(st)  # a pasted row is accepted as is
        code, out, err = run_main(capsys, *argv, "--strategy", words)
        assert code == 0, err
        got = json.loads(out)
        assert got["fits"] is True and len(got["candidates"]) == 1
        assert {k: v for k, v in got["candidates"][0].items() if k != "rank"} == \
            {k: v for k, v in want.items() if k != "rank"}


def test_given_strategy_text_and_refusals(capsys):
    m = get_model("minizero-gpt2")
    st = P.parse_strategy("dp2 tp4 pp1 zero3 recompute=selective", m, 8)
    assert (st.dp, st.tp, st.pp, st.zero, st.recompute, st.offload) == (2, 4, 1, 3, "selective", "none")
    assert P.parse_strategy("tp2, z1 sp offload=activations", m, 8).dp == 4
    code, out, err = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--strategy",
                              "dp2 tp4 pp1 zero3 recompute=selective")
    assert code == 0 and "strategy: dp=2 tp=4 pp=1 zero=3 recompute=selective" in out and "\nfits: device" in out
    code, out, _ = run_main(capsys, "--model", "llama3-70b", "--gpus", "8", "--gpu-memory", "80GB",
                            "--strategy", "dp8")
    assert code == 0 and "does NOT fit: device" in out  # an evaluation, not an error
    assert "the fullest)" not in out  # one pipeline stage: none to name (it said "stage 0", read as ZeRO's)
    code, out, _ = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--strategy", "dp2 tp2 pp2")
    assert code == 0 and re.search(r"per GPU \(pipeline stage [01], the fullest\), host", out), out
    code, out, _ = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--strategy", "dp2 tp4 sp zero2")
    assert code == 0 and "strategy: dp=2 tp=4 pp=1 zero=2 sp" in out  # the trainer runs sp with ZeRO 2-3 too
    for text, needle in [("dp2 tp4 pp2", "dp x tp x pp = 2 x 4 x 2 must equal --gpus 8"),
                         ("dp2 tp4 bogus", "cannot read 'bogus'"),
                         ("dp4 pp2 zero3", "zero 3 with pp 2 > 1"),
                         ("tp4 sp zero0 offload=params", "offload=params needs zero 3"),
                         ("tp8", "tp 8 must divide minizero-gpt2's 12 heads"),
                         ("dp8 sp", "sp (sequence parallelism) needs tp > 1")]:
        code, out, err = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--strategy", text)
        assert code == 2 and out == "" and needle in " ".join(err.split()) and one_refusal(err), (text, err)


def test_help_text_and_defaults_once():
    parser = P.build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = subprocess.run([sys.executable, "-m", "minizero.plan", "--help"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=mpi_env(), timeout=60).stdout
    blocks = re.split(r"\n  (?=-)", text.split("options:")[1])
    for block in blocks:
        assert block.count("default:") + block.count("default the") <= 1 and "default: None" not in block, block


def test_piping_into_head_ends_quietly(tmp_path):
    err = tmp_path / "err"
    proc = subprocess.run(f"{sys.executable} -m minizero.plan --model llama2-7b --gpus 64 --top 0 2>{err} | head -2",
                          shell=True, capture_output=True, text=True, cwd=REPO_ROOT, env=mpi_env(), timeout=120)
    assert proc.stdout.count("\n") == 2 and proc.stdout.startswith("minizero.plan: llama2-7b")
    assert err.read_text() == ""  # no BrokenPipeError traceback


def test_the_header_names_the_attention_searched(capsys):
    """The header named the precision but not --attention flash, which changes which strategies fit."""
    for attention in ("dense", "flash"):
        code, out, _ = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--top", "1", "--attention", attention)
        assert code == 0 and f"precision, {attention} attention," in " ".join(out.split()), out


def test_why_lines_name_settings_as_words_not_python_fields(capsys):
    """Before: '(settings: offload_activations False vs True)' and 'micro_batches 128 vs 256' in the why lines."""
    code, out, _ = run_main(capsys, "--model", "tiny", "--gpus", "1", "--global-batch", "1", "--seq-len", "1")
    said = " ".join(out.split())
    assert code == 0 and "(settings: " in said, said
    assert not re.search(r"\b(True|False)\b|offload_activations|micro_batches|sequence_parallel|dp_shard", said), said


def test_plot_without_matplotlib_is_refused_before_the_search(capsys, monkeypatch, tmp_path):
    """--plot's optional matplotlib is looked for before any work: one usage error, no file, no table."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it answers
    code, out, err = run_main(capsys, "--model", "gpt2", "--gpus", "8", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == "" and "--plot needs matplotlib (pip install matplotlib" in err and one_refusal(err)
    assert not (tmp_path / "p.png").exists()
