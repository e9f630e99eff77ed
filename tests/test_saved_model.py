"""model.npz and model.json written as one pair (minizero.saved_model): a save interrupted between the two files,
and an --out whose model.npz is a link, no longer leave weights beside another model's config."""
import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from minizero.nn import GPT, get_config
from minizero.saved_model import save_model
from minizero.weights import load_gpt, read_weights
from tests.conftest import mpi_env, one_refusal

TINY = get_config("tiny")  # 2 heads
FOUR = get_config("tiny", n_head=4)  # the same arrays' shapes, 4 heads: told apart by model.json alone

#: finetune's __main__, its second write (model.json) interrupted as Ctrl-C would
INTERRUPTED_FINETUNE = """import sys, minizero.saved_model as saved, minizero.finetune as ft
def interrupt(*args): raise KeyboardInterrupt
saved.write_model_json = interrupt
from minizero.interrupts import interruptible
sys.exit(interruptible("minizero.finetune", ft.WHOLE, ft.main, guarded=True))"""


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def base(tmp_path):
    """A tiny model (2 heads) saved as train saves it."""
    return save_model(str(tmp_path / "base"), GPT(TINY, seed=1).state_dict(), TINY)


def test_the_weights_are_np_savez_s_arrays_with_their_config_in_the_zip_comment(tmp_path, base):
    state = GPT(TINY, seed=1).state_dict()
    with np.load(base) as z:  # what np.load (and a nanoGPT-style loader) sees: the same names and arrays
        assert sorted(z.files) == sorted(state) and all(np.array_equal(z[k], state[k]) for k in state)
    comment = zipfile.ZipFile(base).comment
    assert json.loads(comment.removeprefix(b"minizero model.json ")) == dataclasses.asdict(TINY)
    assert json.loads((tmp_path / "base" / "model.json").read_text()) == dataclasses.asdict(TINY)
    assert load_gpt(base).config == TINY


def test_an_interrupted_save_leaves_a_pair_that_every_reader_refuses(tmp_path, monkeypatch):
    """Before: the new weights (2 heads) beside the previous model.json (4 heads) were built with 4 heads, silently."""
    from minizero import saved_model
    from minizero.sample import main as sample_main
    folder = tmp_path / "out"
    save_model(str(folder), GPT(FOUR, seed=1).state_dict(), FOUR)

    def interrupt(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(saved_model, "write_model_json", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_model(str(folder), GPT(TINY, seed=2).state_dict(), TINY)
    assert json.loads((folder / "model.json").read_text())["n_head"] == 4  # the previous config is still there
    weights, side = str(folder / "model.npz"), str(folder / "model.json")
    want = (f"{side!r} (n_head 4) is not the model.json saved with --weights {weights!r} (n_head 2): a save "
            "interrupted between its two files")
    with pytest.raises(ValueError) as e:
        read_weights(weights)
    assert str(e.value).startswith(want) and '"n_head": 2' in str(e.value)
    assert sample_main(["--weights", weights, "--tokens", "2"]) == 2


def test_an_interrupted_save_of_the_same_config_and_older_saves_load(tmp_path, monkeypatch):
    """Equal configs: the pair on disk is what the whole save writes. Weights without the comment (np.savez, a save
    from before it) are read as before: model.json checked against the arrays' shapes only."""
    from minizero import saved_model
    folder = tmp_path / "out"
    save_model(str(folder), GPT(TINY, seed=1).state_dict(), TINY)
    monkeypatch.setattr(saved_model, "write_model_json", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_model(str(folder), GPT(TINY, seed=2).state_dict(), TINY)
    assert load_gpt(str(folder / "model.npz")).config == TINY
    np.savez(folder / "model.npz", **GPT(TINY, seed=3).state_dict())
    (folder / "model.json").write_text(json.dumps(dataclasses.asdict(FOUR)))
    assert load_gpt(str(folder / "model.npz")).config == FOUR


@pytest.mark.timeout(200)
def test_finetune_interrupted_between_its_two_files_leaves_weights_sample_refuses(tmp_path, base, capsys):
    """The interrupt where it hurts: finetune --out over an earlier model of 4 heads (reproduced before the fix:
    exit 130, then sample built the fine-tuned 2-head weights with 4 heads and exited 0)."""
    from minizero.sample import main as sample_main
    out = tmp_path / "ft"
    save_model(str(out), GPT(FOUR, seed=1).state_dict(), FOUR)
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_FINETUNE, "--weights", base, "--method", "full",
                           "--steps", "1", "--eval-batches", "1", "--progress", "none", "--out", str(out)],
                          env=mpi_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 130, proc.stderr
    assert sample_main(["--weights", str(out / "model.npz"), "--tokens", "2"]) == 2
    assert "is not the model.json saved with --weights" in one_refusal(capsys.readouterr().err)


def test_finetune_refuses_an_out_whose_model_npz_is_a_link(tmp_path, base, capsys):
    """Before: the weights replaced the link's target (another folder, beside its own model.json) and model.json
    went beside the link: DIR held a link, the other folder a split pair. Now: refused before any work."""
    from minizero.finetune import main as finetune_main
    store = tmp_path / "store"
    save_model(str(store), GPT(FOUR, seed=1).state_dict(), FOUR)
    out = tmp_path / "ft"
    out.mkdir()
    (out / "model.npz").symlink_to(store / "model.npz")
    before = _sha(store / "model.npz")
    assert finetune_main(["--weights", base, "--method", "full", "--steps", "1", "--out", str(out)]) == 2
    err = one_refusal(capsys.readouterr().err)
    assert (f"--out {str(out)!r}: {str(out / 'model.npz')!r} is a link to {str(store / 'model.npz')!r}; the weights "
            "would be written there, away from the model.json written beside the link") in err, err
    assert "remove the link or give another folder" in err
    assert _sha(store / "model.npz") == before and sorted(p.name for p in out.iterdir()) == ["model.npz"]


def test_train_refuses_an_out_whose_model_npz_is_a_link_too(tmp_path, monkeypatch):
    from minizero.args import UsageError, parse_args
    monkeypatch.chdir(tmp_path)
    (tmp_path / "o").mkdir()
    np.savez(tmp_path / "w.npz", a=np.zeros(1))
    (tmp_path / "o" / "model.npz").symlink_to(tmp_path / "w.npz")
    with pytest.raises(UsageError, match="'o/model.npz' is a link to .*remove the link or give another folder"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_a_model_json_edited_to_another_dropout_still_pairs_with_its_weights(tmp_path):
    """Before: refused as 'not the model.json saved with --weights' (dropout 0.1 vs 0.0): every field was compared,
    training's dropout too, which does not change what the weights mean."""
    folder = tmp_path / "out"
    weights = save_model(str(folder), GPT(TINY, seed=1).state_dict(), TINY)
    (folder / "model.json").write_text(json.dumps(dict(dataclasses.asdict(TINY), dropout=0.1)))
    assert load_gpt(weights).config == dataclasses.replace(TINY, dropout=0.1)


@pytest.mark.parametrize("field, value", [("n_head", 4), ("dtype", "float64")])
def test_a_model_json_of_another_shape_or_dtype_is_still_refused(tmp_path, field, value):
    folder = tmp_path / "out"
    weights = save_model(str(folder), GPT(TINY, seed=1).state_dict(), TINY)
    (folder / "model.json").write_text(json.dumps(dict(dataclasses.asdict(TINY), dropout=0.1, **{field: value})))
    with pytest.raises(ValueError, match=f"\\({field} {value!r}\\) is not the model.json saved with --weights"):
        read_weights(weights)


def test_a_zip_comment_nested_too_deeply_is_not_a_comment_minizero_wrote(tmp_path, base):
    """Before: a comment of TAG and 60,000 '[' stopped every reader with a RecursionError traceback."""
    with zipfile.ZipFile(base, "a") as zf:
        zf.comment = b"minizero model.json " + b"[" * 60000
    assert load_gpt(base).config == TINY


def test_a_forged_zip_comment_is_not_echoed_whole(tmp_path, base):
    """Before: a comment of TAG and a config of 60,000 characters came back whole in the refusal."""
    forged = dict(dataclasses.asdict(TINY), n_head=4, dtype="x" * 30000, pad="y" * 30000)  # 64 KiB at most
    with zipfile.ZipFile(base, "a") as zf:
        zf.comment = b"minizero model.json " + json.dumps(forged).encode()
    with pytest.raises(ValueError) as e:
        read_weights(base)
    said = str(e.value)
    assert "is not the model.json saved with --weights" in said and "n_head 4" in said and len(said) < 1000
    assert "dtype 'xxxx" in said and "xxx..." in said and "yyy..." not in said  # a short prefix, an ellipsis


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_weights_of_another_float_dtype_load_in_that_dtype_bit_for_bit(tmp_path, dtype):
    """A float64 (or an FP16 run's float16) model.npz is read back as saved: its config's dtype is the arrays', the
    arrays equal. (Mutation audit: the arrays' dtype read as float32 always passed every test, all float32.)"""
    cfg = get_config("tiny", dtype=dtype)
    state = GPT(cfg, seed=1).state_dict()
    weights = save_model(str(tmp_path / "out"), state, cfg)
    model = load_gpt(weights)
    assert model.config == cfg
    got = model.state_dict()
    for k, a in state.items():
        assert got[k].dtype == a.dtype and np.array_equal(got[k], a), k


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, value):
    """(Mutation audit: read_weights' finiteness check removed passed every test.)"""
    state = GPT(TINY, seed=1).state_dict()
    state["transformer.wpe.weight"][0, :3] = value
    weights = save_model(str(tmp_path / "out"), state, TINY)
    with pytest.raises(ValueError) as e:
        read_weights(weights)
    assert str(e.value) == (f"--weights {weights!r}: tensor 'transformer.wpe.weight' has 3 non-finite value(s) (NaN "
                            f"or inf) of {state['transformer.wpe.weight'].size}; sampling, quantizing and fine-tuning "
                            "need finite weights")
