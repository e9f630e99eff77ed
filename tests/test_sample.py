"""Sampling: top-k, the weights' shape read back, ``python -m minizero.sample`` and the main job's sample."""
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minizero.nn import GPT, get_config
from minizero.sample import next_token_probs, sample, sample_text
from minizero.weights import config_for, infer_preset, load_gpt, shape_from_state
from tests.conftest import REPO_ROOT, mpi_env


def test_top_k_keeps_the_k_largest():
    logits = np.array([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 5.0, 5.0, 0.0, 1.0]])
    p = next_token_probs(logits, 1.0, top_k=2)
    assert np.allclose(p.sum(axis=1), 1)
    assert list(np.flatnonzero(p[0])) == [1, 3] and p[0, 1] / p[0, 3] == pytest.approx(np.e)
    assert list(np.flatnonzero(p[1])) == [0, 1, 2]  # a tie at the k-th value keeps every tied entry
    full = next_token_probs(logits, 0.5)
    assert np.all(full > 0) and full[0, 1] / full[0, 3] == pytest.approx(np.e ** 2)  # temperature 0.5 doubles
    assert np.array_equal(next_token_probs(logits, 1.0, top_k=99), next_token_probs(logits, 1.0))


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                dict(temperature=1.0, top_k=0)])
def test_bad_sampling_values_raise(kw):
    with pytest.raises(ValueError):
        next_token_probs(np.zeros((1, 4)), **kw)


def test_temperature_zero_is_greedy():
    """Temperature 0 (how most tools ask for greedy decoding): all mass on the largest logit, the first of ties;
    sample() then takes it without a draw, as GPT.generate(temperature=0) does."""
    p = next_token_probs(np.array([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 0.0, 1.0]]), 0.0)
    assert np.array_equal(p, [[0, 1, 0, 0], [1, 0, 0, 0]])
    model = GPT(get_config("tiny", dtype="float64"), seed=3)
    idx = np.array([[84, 104, 101, 32]])
    greedy = model.generate(idx, 20, temperature=0)
    assert np.array_equal(sample(model, idx, 20, 0.0, None, np.random.default_rng(1)), greedy)
    assert np.array_equal(sample(model, idx, 20, 0, 5, np.random.default_rng(2)), greedy)


def test_sample_without_top_k_draws_as_generate_does():
    model = GPT(get_config("tiny", dtype="float64"), seed=3)
    idx = np.array([[84, 104, 101, 32]])
    ours = sample(model, idx, 20, 0.8, None, np.random.default_rng(5))
    theirs = model.generate(idx, 20, temperature=0.8, rng=np.random.default_rng(5))
    assert np.array_equal(ours, theirs) and ours.shape == (1, 24)
    top1 = sample(model, idx, 20, 0.8, 1, np.random.default_rng(5))
    assert np.array_equal(top1, model.generate(idx, 20, temperature=0, rng=np.random.default_rng(0)))  # greedy


def test_weights_whose_head_differs_from_the_tied_embedding_are_refused(tmp_path):
    """Before: an .npz whose lm_head.weight differed from transformer.wte.weight (edited, or another tool's untied
    head) loaded without a word, the head's values put in the embedding too (one Parameter under both names)."""
    state = {k: np.array(v) for k, v in GPT(get_config("tiny"), seed=1).state_dict().items()}
    np.savez(tmp_path / "model.npz", **state)
    assert np.array_equal(load_gpt(str(tmp_path / "model.npz")).transformer.wte.weight.data, state["lm_head.weight"])
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    np.savez(tmp_path / "model.npz", **state)
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight, which minizero's GPT "
                                         "ties"):
        load_gpt(str(tmp_path / "model.npz"))


def test_a_tied_head_holding_nan_is_not_called_a_different_head(tmp_path):
    """Before: 'lm_head.weight differs from transformer.wte.weight' for one array under both names (NaN != NaN);
    a state passed in is not read_weights' (which refuses non-finite values)."""
    from minizero.weights import load_trained
    state = {k: np.array(v) for k, v in GPT(get_config("tiny"), seed=1).state_dict().items()}
    np.savez(tmp_path / "model.npz", **state)
    state["transformer.wte.weight"][0, 0] = np.nan
    state["lm_head.weight"] = state["transformer.wte.weight"].copy()
    model = load_trained(str(tmp_path / "model.npz"), state=state)[0]
    assert np.isnan(model.transformer.wte.weight.data[0, 0])


def test_shape_is_read_from_the_arrays(tmp_path):
    cfg = get_config("default", n_layer=3, n_head=8, n_embd=32, block_size=24)
    state = GPT(cfg).state_dict()
    assert shape_from_state(state) == dict(n_layer=3, n_embd=32, block_size=24, vocab_size=256)
    assert infer_preset(state) is None
    np.savez(tmp_path / "model.npz", **state)
    with pytest.raises(ValueError, match="head count is unknown"):  # no model.json, no preset of this shape
        config_for(str(tmp_path / "model.npz"), state)
    (tmp_path / "model.json").write_text(json.dumps({"n_head": 8}))
    assert config_for(str(tmp_path / "model.npz"), state) == cfg
    (tmp_path / "model.json").write_text(json.dumps({"n_head": 8, "n_layer": 4}))
    with pytest.raises(ValueError, match="n_layer 4 vs 3"):
        config_for(str(tmp_path / "model.npz"), state)
    os.remove(tmp_path / "model.json")
    tiny = GPT(get_config("tiny"), seed=1).state_dict()
    np.savez(tmp_path / "model.npz", **tiny)
    model = load_gpt(str(tmp_path / "model.npz"))  # the preset of these shapes gives n_head
    assert model.config == get_config("tiny")
    assert all(np.array_equal(v, tiny[k]) for k, v in model.state_dict().items())


def one_refusal(err: str) -> bool:
    """One refusal: one ``error:`` line, a long one going on over indented lines of <= 120 columns."""
    lines = err.splitlines()
    return err.count("error:") == 1 and max(map(len, lines)) <= 120 and all(ln.startswith("  ") for ln in lines[1:])


def run_sample(*argv, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, "-m", "minizero.sample", *argv], env=mpi_env(), capture_output=True,
                          text=True, timeout=60, cwd=cwd)


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """One FP16 main-job run at 2 ranks (its output and its folder), shared by the tests below."""
    from minizero.files import mpiexec_path
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    out = tmp_path_factory.mktemp("fp16") / "out"
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "12",
           "--eval-every", "4", "--eval-batches", "1", "--sample-tokens", "40", "--precision", "fp16",
           "--prompt", "Th", "--seed", "3", "--out", str(out), "--progress", "log"]
    proc = subprocess.run(cmd, env=dict(mpi_env(), MINIZERO_PLOTS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, out


@pytest.mark.timeout(300)
def test_fp16_is_visible(fp16_run):
    stdout, out = fp16_run
    assert ("fp16 mixed precision: float16 stores, float32 math on float16 values (emulated), float32 master weights, "
            "dynamic loss scale 65536"
            in " ".join(stdout[:stdout.index("\ndevice ")].split()))  # the first header line, wrapped
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "fp16" and len(summary["loss_scale"]) == 12
    assert summary["loss_scale"][0] == 65536 and all(s > 0 for s in summary["loss_scale"])
    assert summary["skipped_steps"] == len(summary["skipped_at"])
    assert all(summary["grad_norm"][s] is None for s in summary["skipped_at"])  # a skipped step has no norm
    last = summary["loss_scale"][-1]
    assert f"fp16: loss scale {last:g} used at the last step" in stdout
    assert f"{summary['skipped_steps']} step(s) skipped" in stdout
    assert "[fp16: scale" in stdout  # the progress lines carry it too
    assert np.load(out / "model.npz")["transformer.wte.weight"].dtype == np.float16
    assert json.loads((out / "model.json").read_text())["dtype"] == "float16"


@pytest.mark.timeout(300)
def test_sample_program_reproduces_the_main_jobs_sample(fp16_run):
    _, out = fp16_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sample"].startswith("Th") and len(summary["sample"].encode()) >= 40
    argv = ["--weights", str(out / "model.npz"), "--prompt", "Th", "--tokens", "40", "--seed", "3"]
    a, b = run_sample(*argv), run_sample(*argv)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # the same seed, the same text
    model = load_gpt(str(out / "model.npz"))
    assert sample_text(model, "Th", 40, 0.8, None, 3) == summary["sample"]  # the main job's code and numbers
    other = run_sample(*argv[:-1], "4")
    assert other.returncode == 0 and other.stdout != a.stdout


@pytest.mark.timeout(300)
def test_quantize_labels_an_fp16_baseline(fp16_run):
    _, out = fp16_run
    proc = subprocess.run([sys.executable, "-m", "minizero.quantize", "--weights", str(out / "model.npz"),
                           "--eval-batches", "1"], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    base = lines[[line.split()[:1] for line in lines].index(["weights"]) + 1]  # the row under the column names
    assert base.split()[0] == "fp16" and "fp32" not in proc.stdout


@pytest.mark.timeout(300)
def test_outputs_are_plain_files(fp16_run):
    _, out = fp16_run
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.npz", "model.json", "summary.json", "loss.png"):
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~umask, name
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "0"], "--tokens must be in 1..100,000, got 0"),
    (["--temperature", "-2"], "--temperature must be 0 (greedy) or a positive finite number, got '-2'"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or a positive finite number, got 'nan'"),
    (["--temperature", "1e999"], "--temperature must be 0 (greedy) or a positive finite number, got '1e999'"),
    (["--top-k", "0"], "--top-k must be in [1, 256] (the byte vocabulary; 256 keeps every byte), got 0"),
    (["--top-k", "257"], "--top-k must be in [1, 256]"),
    (["--prompt", ""], "--prompt must hold at least one character"),
    (["--weights", "/no/such/model.npz"], "'/no/such/model.npz': no such file"),
    (["--tokens", "many"], "invalid int value: 'many'"),
])
def test_bad_values_exit_2_with_one_line(argv, needle):
    proc = run_sample(*argv)
    assert proc.returncode == 2 and proc.stdout == ""
    said = " ".join(proc.stderr.split())
    assert one_refusal(proc.stderr) and needle in said and "usage:" not in proc.stderr, proc.stderr


def test_foreign_weights_exit_2(tmp_path):
    np.savez(tmp_path / "random.npz", a=np.random.default_rng(0).random((3, 4)))
    (tmp_path / "text.npz").write_text("not an archive")
    for name in ("random.npz", "text.npz"):
        proc = run_sample("--weights", str(tmp_path / name))
        assert proc.returncode == 2 and one_refusal(proc.stderr), proc.stderr
        assert "is not a model.npz written by minizero.train" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def test_model_json_disagreeing_with_the_weight_headers_is_refused_before_reading(tmp_path, monkeypatch):
    """Issue 26: model.json's sizes are checked against the .npz headers (no array data read), one line, exit 2."""
    import minizero.weights as W
    np.savez(tmp_path / "model.npz", **GPT(get_config("tiny"), seed=1).state_dict())
    (tmp_path / "model.json").write_text(json.dumps({**dataclasses.asdict(get_config("tiny")), "n_embd": 32,
                                                     "n_layer": 2}))
    monkeypatch.setattr(W.np, "load", lambda *a, **k: pytest.fail("array data read before the headers were checked"))
    with pytest.raises(ValueError, match=r"model.json beside --weights .* disagrees with the array headers: "
                                         r"n_embd 32 vs 16$"):
        W.read_weights(str(tmp_path / "model.npz"))
    monkeypatch.undo()
    proc = run_sample("--weights", str(tmp_path / "model.npz"), "--tokens", "5")
    assert proc.returncode == 2 and one_refusal(proc.stderr), proc.stderr
    assert "disagrees with the array headers: n_embd 32 vs 16" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def test_moe_weights_are_named_as_moe_not_as_foreign(tmp_path):
    """A main-job MoE model.npz is refused in one line that says it is MoE, not 'not written by minizero.train'."""
    from minizero.nn import GPT, GPTConfig
    state = {k: v.data for k, v in GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4)).state_dict().items()
             if ".mlp.c_" not in k}
    state["transformer.h.0.mlp.moe.router"] = np.zeros((8, 4), np.float32)
    np.savez(tmp_path / "model.npz", **state)
    proc = run_sample("--weights", str(tmp_path / "model.npz"))
    assert proc.returncode == 2 and one_refusal(proc.stderr), proc.stderr
    assert "mixture-of-experts" in proc.stderr and "not a model.npz" not in " ".join(proc.stderr.split()), proc.stderr
    assert "the sample its main job prints" in " ".join(proc.stderr.split())
    from minizero import finetune, quantize
    for program in (quantize, finetune):  # before: sample's advice ("an MoE run's text is the sample ...") too
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert program.main(["--weights", str(tmp_path / "model.npz")]) == 2
        said = " ".join(err.getvalue().split())
        assert "mixture-of-experts" in said and "train without --moe-experts" in said and "sample" not in said, said


def test_a_tiny_temperature_is_greedy_without_an_overflow_warning():
    """Attacker: --temperature 1e-320 leaked numpy's 'overflow encountered in divide'."""
    import warnings

    from minizero.sample import next_token_probs

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = next_token_probs(np.array([[0.5, 2.0, -1.0]]), 1e-320)
    assert p.tolist() == [[0.0, 1.0, 0.0]]


def test_two_stderr_lines_name_the_weights_and_settings_and_stdout_is_the_sample_alone(tmp_path):
    """A run says what it loaded and how it samples (stderr, two lines: one was 173 columns for the default model),
    and ``> file`` still gets only the text (stdout)."""
    weights = tmp_path / "model.npz"
    model = GPT(get_config("tiny"), seed=1)
    np.savez(weights, **model.state_dict())
    proc = run_sample("--weights", str(weights), "--prompt", "Th", "--tokens", "12", "--temperature", "0.5",
                      "--top-k", "40", "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    said = f"{model.num_parameters():,} parameters, float32) 12 tokens, temperature 0.5, top-k 40, seed 7, device cpu"
    assert " ".join(proc.stderr.split()) == (f"python -m minizero.sample: {weights} (2 layers, 2 heads, width 16, "
                                             f"context 16, {said}"), proc.stderr  # a long path: over two lines
    assert max(map(len, proc.stderr.splitlines())) <= 120 and proc.stderr.endswith("seed 7, device cpu\n")
    assert proc.stdout.startswith("Th") and "minizero.sample" not in proc.stdout
    default = run_sample("--weights", str(weights), "--tokens", "3")
    assert "float32)\n  3 tokens, temperature 0.8, top-k all, seed 0, device cpu\n" in default.stderr


def test_cli_temperature_zero_runs_greedy(tmp_path):
    np.savez(tmp_path / "model.npz", **GPT(get_config("tiny"), seed=1).state_dict())
    outs = [run_sample("--weights", str(tmp_path / "model.npz"), "--temperature", "0", "--tokens", "12",
                       "--seed", seed) for seed in ("0", "7")]
    assert all(p.returncode == 0 for p in outs) and "temperature 0," in outs[0].stderr, outs[0].stderr
    assert outs[0].stdout == outs[1].stdout  # no draw: the seed changes nothing


@pytest.mark.parametrize("temperature", ["0", "0.0"])
def test_top_k_under_greedy_is_refused_naming_both_values(temperature):
    """Greedy takes the largest logit whatever K is: --top-k with --temperature 0 is refused, not silently ignored."""
    from minizero.sample import build_parser, check
    parser = build_parser()
    assert check(parser.parse_args(["--temperature", temperature, "--top-k", "5"])) == (
        f"--top-k 5 has no effect under greedy --temperature {temperature}: drop one of the two")
    assert check(parser.parse_args(["--temperature", temperature])) is None
    assert check(parser.parse_args(["--temperature", "0.5", "--top-k", "5"])) is None
    assert "refused with --temperature 0" in parser.format_help()


def test_the_reports_sample_cuts_long_lines_and_keeps_every_character():
    """A newcomer saw a 188-column sample line in the main job's output (the rest of it keeps to 120 columns)."""
    from minizero.sample import printable
    text = "ab\x01" + "x" * 247 + "\nshort\n"
    shown = printable(text, width=100)
    assert [len(line) for line in shown.split("\n")] == [100, 100, 50, 5, 0]
    assert shown.replace("\n", "") == printable(text).replace("\n", "") and "\ufffd" in shown


def test_the_sample_is_cut_at_terminal_columns():
    """A 1-step tiny run's sample line was 100 characters but 231 bytes of wide characters and U+FFFD: now cut at
    120 columns as a terminal shows them (a wide character takes 2, a tab up to 8), every character kept."""
    from minizero.sample import printable
    text = "\u8679" * 70 + "\n" + "a\t" * 20 + "\nend"
    shown = printable(text, width=120).split("\n")
    assert [len(line.expandtabs()) + sum(c == "\u8679" for c in line) for line in shown] == [120, 20, 120, 40, 3]
    assert "".join(shown) == text.replace("\n", "")


def test_the_report_says_a_wrapped_sample_is_wrapped_for_display_only(capsys):
    """The report's sample header says when its lines were wrapped for display, and that the text has no such breaks
    (it said --json held the text before the summary was written)."""
    from types import SimpleNamespace

    from minizero.report import _print_sample
    args = SimpleNamespace(sample_tokens=8, no_save=False, json="out/summary.json")
    _print_sample(args, "short\nlines")
    assert capsys.readouterr().out == "\nsample:\nshort\nlines\n\n"
    _print_sample(args, "x" * 300)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("sample: (lines past 120 columns wrapped for display only; the text (the summary's 'sample') "
                        "has no such breaks)") and [len(line) for line in lines[2:]] == [120, 120, 60, 0]
    _print_sample(SimpleNamespace(sample_tokens=8, no_save=True, json=None), "x" * 300)  # --no-save: no summary named
    assert capsys.readouterr().out.splitlines()[1] == ("sample: (lines past 120 columns wrapped for display only; the "
                                                       "text has no such breaks)")


def test_sampling_runs_on_one_blas_thread(monkeypatch):
    """Before: sample() ran its one-row forwards on every BLAS thread (cores / 1 in a one-process run); on 2 cores
    shared with other jobs 200 bytes took 29 s instead of 1.7 s. Now each forward sees one thread."""
    from threadpoolctl import threadpool_info
    model = GPT(get_config("tiny", dtype="float64"), seed=3)
    seen, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (
        seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}), forward(*a, **k))[1])
    sample(model, np.array([[84, 104]]), 3, 0.8, None, np.random.default_rng(0))
    assert seen == [{1}] * 3


def test_top_k_256_is_every_byte_and_allowed():
    """--top-k 256 is what the help calls the default (every byte); 257 is refused naming the range."""
    from minizero.sample import build_parser, check

    assert check(build_parser().parse_args(["--top-k", "256"])) is None
    assert check(build_parser().parse_args(["--top-k", "257"])).startswith("--top-k must be in [1, 256]")


def test_sample_without_a_generator_draws_from_seed_0():
    model = GPT(get_config("tiny", dtype="float64"), seed=3)
    idx = np.array([[84, 104, 101, 32]])
    assert np.array_equal(sample(model, idx, 8), sample(model, idx, 8, rng=np.random.default_rng(0)))
