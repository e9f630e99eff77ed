"""The files that describe a saved model: model.json (written with model.npz) and a run's summary.json.

Their fields are checked in one place (``weights.check_model_fields``), every program reads them by one rule
(``weights.model_config``: --model, model.json, summary.json's config.model, the preset of the shapes), and
``python -m minizero.checkpoint consolidate`` writes model.json beside its model.npz as train does.
"""
import dataclasses
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero.nn import GPT, get_config
from minizero.weights import load_gpt, load_trained, read_weights
from tests.conftest import mpi_env, one_refusal

TINY = dataclasses.asdict(get_config("tiny"))


@pytest.fixture
def tiny_weights(tmp_path):
    """A tiny GPT's model.npz and model.json, as train writes them."""
    np.savez(tmp_path / "model.npz", **GPT(get_config("tiny"), seed=1).state_dict())
    (tmp_path / "model.json").write_text(json.dumps(TINY))
    return tmp_path / "model.npz"


def _programs_refuse(weights, capsys):
    """sample's and quantize's exit status and one-line error (the same for both), before any measuring."""
    from minizero.quantize import main as quantize_main
    from minizero.sample import main as sample_main
    said = []
    for main, argv in ((sample_main, ["--tokens", "2"]), (quantize_main, ["--eval-batches", "1"])):
        assert main(["--weights", str(weights), *argv]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        said.append(one_refusal(err).split("error: ", 1)[1])  # read whole: its lines of <= 120 columns joined
    assert said[0] == said[1]
    return said[0]


@pytest.mark.parametrize("field,value,needle", [
    ("dtype", "int8", "dtype 'int8' is not allowed; allowed: float16, float32, float64"),
    ("dtype", 32, "dtype 32 is not allowed; allowed: float16, float32, float64"),
    ("block_size", "16", "block_size '16' is a string; allowed: an integer in [1, 1,024] (a JSON number, no quotes)"),
    ("n_layer", True, "n_layer True is true/false; allowed: an integer in [1, 12]"),
    ("n_head", 0, "n_head 0 is below 1; allowed: an integer in [1, 12]"),
    ("n_head", 3, "n_embd 16 is not divisible by n_head 3; allowed: n_head dividing n_embd"),
    ("n_embd", 10 ** 6, "n_embd 1,000,000 exceeds 768, the largest any preset"),
    ("dropout", 1.5, "dropout 1.5 is not allowed; allowed: a number in [0, 1)"),
    ("dropout", 0.999999999, "dropout 0.999999999 is not allowed; allowed: a number in [0, 1), at most 0.99999994"),
    ("heads", 2, "unknown field(s) ['heads']; allowed: n_layer, n_head, n_embd, block_size, vocab_size, dropout, dtype"),
])
def test_a_bad_model_json_field_is_named_with_the_file_and_what_is_allowed(tiny_weights, capsys, field, value,
                                                                         needle):
    """Before: dtype "int8" was accepted (the arrays' dtype silently used) and block_size "16" was refused as
    "disagrees with the array headers: block_size 16 vs 16"."""
    (tiny_weights.parent / "model.json").write_text(json.dumps(dict(TINY, **{field: value})))
    err = _programs_refuse(tiny_weights, capsys)
    assert err.startswith(f"{str(tiny_weights.parent / 'model.json')!r} (beside --weights): {needle}"), err
    assert err.endswith("fix or remove it")


def test_finetune_refuses_a_bad_model_json_with_exit_2(tiny_weights):
    (tiny_weights.parent / "model.json").write_text(json.dumps(dict(TINY, dtype="int8")))
    proc = subprocess.run([sys.executable, "-m", "minizero.finetune", "--weights", str(tiny_weights), "--steps", "1"],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "(beside --weights): dtype 'int8' is not allowed; allowed: float16, float32, float64" in \
        one_refusal(proc.stderr)


def _quantize_notes(weights, capsys, *flags):
    """quantize's stderr (its notes) after a run on ``weights`` that must succeed."""
    from minizero.quantize import main as quantize_main
    capsys.readouterr()
    assert quantize_main(["--weights", str(weights), "--eval-batches", "1", *flags]) == 0
    return capsys.readouterr().err


@pytest.mark.parametrize("summary, why", [
    ({"config": {"model": dict(TINY, n_layer="2")}}, "config.model's n_layer '2' is a string"),
    ({"config": {"model": dict(TINY, n_layer=3)}}, "its config.model disagrees with the arrays: n_layer 3 vs 2"),
    ({"rows": []}, "it has no config.model section"),
    ([1, 2], "it has no config.model section"),
])
def test_a_summary_json_that_does_not_describe_the_weights_is_set_aside_with_a_note(tiny_weights, capsys, summary,
                                                                                    why):
    """summary.json is never fatal (sample never needed it; a copy of another run's may sit beside the weights):
    it is set aside, and quantize, which would read the run's data and seed from it, says so. Before (review):
    sample and quantize exited 2, and quantize --model then refused as well."""
    from minizero.sample import main as sample_main
    from minizero.weights import model_config
    (tiny_weights.parent / "summary.json").write_text(json.dumps(summary))
    for side in (True, False):  # with model.json, then without (the preset of the shapes)
        if not side:
            (tiny_weights.parent / "model.json").unlink()
        cfg, _, kept, note = model_config(str(tiny_weights), read_weights(str(tiny_weights)))
        assert cfg == get_config("tiny") and kept == {} and why in note, note
        assert sample_main(["--weights", str(tiny_weights), "--tokens", "2"]) == 0
        assert why in _quantize_notes(tiny_weights, capsys)
        assert why in _quantize_notes(tiny_weights, capsys, "--model", "tiny")


def test_advice_names_model_only_for_the_program_that_has_it(tmp_path, capsys):
    """A model of no preset's shapes and no model.json: the head count is unknown. quantize has --model; sample and
    finetune do not, so their advice is model.json alone (before, review: every program said 'pass --model')."""
    from minizero.quantize import main as quantize_main
    from minizero.sample import main as sample_main
    np.savez(tmp_path / "model.npz", **GPT(get_config("tiny", block_size=8), seed=1).state_dict())
    assert sample_main(["--weights", str(tmp_path / "model.npz"), "--tokens", "2"]) == 2
    err = one_refusal(capsys.readouterr().err)
    assert "so the head count is unknown; write model.json with n_head beside the weights" in err
    assert "--model" not in err
    assert quantize_main(["--weights", str(tmp_path / "model.npz"), "--eval-batches", "1"]) == 2
    assert "beside the weights, or pass --model" in capsys.readouterr().err


def test_model_json_disagreeing_with_the_arrays_dtype_is_refused(tiny_weights, capsys):
    (tiny_weights.parent / "model.json").write_text(json.dumps(dict(TINY, dtype="float64")))
    assert "disagrees with the arrays of --weights" in _programs_refuse(tiny_weights, capsys)


@pytest.mark.parametrize("other", [{"n_layer": 3}, {"n_head": 4}])
def test_sample_and_quantize_read_model_json_over_a_disagreeing_summary(tiny_weights, capsys, other):
    """Before: sample read model.json, quantize summary.json: n_layer 3 made quantize fail ("does not fit the
    model shape from summary.json") and n_head 4 made it measure another model than sample's (2 heads)."""
    from minizero.quantize import build_parser, run
    from minizero.sample import main as sample_main
    from minizero.weights import model_config
    summary = {"config": {"model": dict(TINY, **other), "train": {"eval_batches": 1}}}
    (tiny_weights.parent / "summary.json").write_text(json.dumps(summary))
    state = read_weights(str(tiny_weights))
    cfg, source, kept, note = model_config(str(tiny_weights), state)
    assert cfg == get_config("tiny") and source == str(tiny_weights.parent / "model.json")
    assert kept == {}  # the summary describes other weights: its train section is not used either
    assert "set aside: its config.model " in note
    assert load_gpt(str(tiny_weights)).config == load_trained(str(tiny_weights))[0].config == cfg
    assert sample_main(["--weights", str(tiny_weights), "--tokens", "2"]) == 0
    capsys.readouterr()
    result = run(build_parser().parse_args(["--weights", str(tiny_weights), "--eval-batches", "1"]))
    assert result["config"] == TINY
    assert "summary.json' set aside: its config.model disagrees" in " ".join(capsys.readouterr().err.split())  # said
    (tiny_weights.parent / "model.json").unlink()  # no model.json: the summary is the config (when it fits), for both
    want = get_config("tiny", **other) if "n_head" in other else get_config("tiny")  # n_layer 3: not these arrays
    assert load_gpt(str(tiny_weights)).config == load_trained(str(tiny_weights))[0].config == want


def test_model_flag_disagreeing_with_model_json_is_refused(tiny_weights, capsys):
    from minizero.quantize import main as quantize_main
    (tiny_weights.parent / "model.json").write_text(json.dumps(dict(TINY, n_head=4)))
    assert quantize_main(["--weights", str(tiny_weights), "--model", "tiny", "--eval-batches", "1"]) == 2
    assert "--model tiny disagrees with " in one_refusal(capsys.readouterr().err)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_consolidate_writes_model_json_that_sample_reads(tmp_path, capsys, monkeypatch):
    """Before: consolidate wrote model.npz alone; a model of no preset's shape (--block-size 8) then could not be
    sampled ("the head count is unknown") without writing model.json by hand."""
    from minizero.checkpoint.cli import main as checkpoint_main
    from minizero.sample import main as sample_main
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--block-size", "8",
                           "--steps", "2", "--save-every", "2", "--eval-every", "0", "--eval-batches", "1",
                           "--sample-tokens", "0", "--no-progress", "--out", str(run)],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "c" / "model.npz"
    assert checkpoint_main(["consolidate", str(run / "checkpoints"), "--out", str(out)]) == 0
    assert json.loads((out.parent / "model.json").read_text()) == json.loads((run / "model.json").read_text())
    # what it wrote, then from where, then the count (before, one line read "...tied to transformer.wte.weight from
    # RUN/checkpoints/step_00000002, and c/model.json", 163 columns for a short path)
    step = run / "checkpoints" / "step_00000002"
    n = len(np.load(out))
    assert capsys.readouterr().out == (f"wrote {out} and {out.parent / 'model.json'} from {step}\n  {n} tensors: "
                                       f"{n - 1} parameters, lm_head.weight tied to transformer.wte.weight\n"
                                       f"  config: {out.parent / 'model.json'}, beside the weights;\n"
                                       f"  sample, quantize and finetune --weights {out} read it from there\n")
    texts = []
    for weights in (run / "model.npz", out):  # the checkpoint of the last step is the run's model
        assert sample_main(["--weights", str(weights), "--tokens", "20"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    # the same model.json already there: kept; another one: refused before any tensor is read, nothing written
    assert checkpoint_main(["consolidate", str(run / "checkpoints"), "--out", str(out)]) == 0
    assert "model.json, beside the weights (already there: this model);\n  sample" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # lesson 09's command, relative paths: every line fits 120 columns (one was 153)
    assert checkpoint_main(["consolidate", "run/checkpoints", "--out", "run/consolidated.npz"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 120
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.json").write_text(json.dumps(TINY))
    before = _sha(other / "model.json")
    assert checkpoint_main(["consolidate", str(run / "checkpoints"), "--out", str(other / "model.npz")]) == 2
    err = capsys.readouterr().err
    assert f"{str(other / 'model.json')!r} exists beside it" in one_refusal(err), err
    assert _sha(other / "model.json") == before and not (other / "model.npz").exists()
    target = tmp_path / "t" / "w.npz"  # --out a link: model.json beside the weights it leads to, and said so
    target.parent.mkdir()
    target.write_bytes(out.read_bytes())
    (tmp_path / "l.npz").symlink_to(target)
    assert checkpoint_main(["consolidate", str(run / "checkpoints"), "--out", str(tmp_path / "l.npz")]) == 0
    assert f"and {target.parent / 'model.json'} from" in capsys.readouterr().out
    assert (target.parent / "model.json").exists() and not (tmp_path / "model.json").exists()


def test_consolidate_through_a_link_checks_the_model_json_beside_the_weights_it_replaces(tmp_path):
    """Before: --out LINK wrote the weights through the link, model.json beside the link: the target's folder kept
    another model's model.json beside the new weights (sample then refused them, or built the wrong head count)."""
    from minizero.checkpoint.cli import CheckpointError, sidecar_to_write
    from minizero.nn import GPTConfig

    run = tmp_path / "run"
    run.mkdir()
    np.savez(run / "model.npz", a=np.zeros(1))
    (run / "model.json").write_text(json.dumps(dict(TINY, n_head=4)))
    (tmp_path / "latest.npz").symlink_to(run / "model.npz")
    with pytest.raises(CheckpointError, match=re.escape(f"{str(run / 'model.json')!r} exists beside it")):
        sidecar_to_write(str(tmp_path / "latest.npz"), GPTConfig(**TINY))
    assert sidecar_to_write(str(tmp_path / "new.npz"), GPTConfig(**TINY)) == str(tmp_path / "model.json")


def test_model_json_without_n_head_or_holding_null_is_refused(tiny_weights, capsys):
    """Attacker: without n_head every program built the model with a default head count (4, not the trained 2),
    and a model.json of JSON null was taken for no file at all."""
    side = tiny_weights.parent / "model.json"
    side.write_text(json.dumps({k: v for k, v in TINY.items() if k != "n_head"}))
    assert "has no n_head, the head count the arrays do not hold" in _programs_refuse(tiny_weights, capsys)
    side.write_text("null")
    assert "is null, not a JSON object of model fields" in _programs_refuse(tiny_weights, capsys)


@pytest.mark.parametrize("text, why", [("null", "it has no config.model section"),
                                       (json.dumps({"config": {"model": {"n_layer": 2}}}),
                                        "its config.model has no n_head")])
def test_a_summary_json_of_null_or_without_n_head_is_set_aside_with_a_note(tiny_weights, capsys, text, why):
    (tiny_weights.parent / "summary.json").write_text(text)
    assert why in _quantize_notes(tiny_weights, capsys)


def test_consolidate_help_says_where_the_config_goes(capsys):
    """A newcomer: `--out /tmp/x.npz` also wrote /tmp/model.json, which --help did not say."""
    from minizero.checkpoint.cli import main as checkpoint_main
    with pytest.raises(SystemExit):
        checkpoint_main(["consolidate", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "the model's config goes to model.json in the same folder (one of another model there is refused, never " \
        "replaced), where sample, quantize and finetune --weights OUT read it" in said, said


def test_consolidate_names_model_json_as_out_was_given(tmp_path, monkeypatch, capsys):
    """Before: `--out model.npz` printed "wrote model.npz and /abs/cwd/model.json": one path relative, one absolute."""
    from minizero.checkpoint.cli import main as checkpoint_main
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "1", "--save-every",
                           "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
                           "--no-save", "--save-dir", str(tmp_path / "ck")],
                          env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.chdir(tmp_path)
    assert checkpoint_main(["consolidate", "ck", "--out", "model.npz"]) == 0
    assert capsys.readouterr().out.startswith("wrote model.npz and model.json from ck")
