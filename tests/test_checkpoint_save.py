"""A save's crash safety on disk (minizero.checkpoint.save, format.clean_partial): what a save leaves beside its
checkpoint, in what order it publishes it, and what the next save makes of a killed one's leftovers. Round-5
mutation audit: each test here failed with one planted bug that every other test let through."""
import json
import os

import pytest

from minizero.checkpoint.format import clean_partial, complete, resolve
from minizero.files import WriteError
from minizero.checkpoint import read_manifest
from minizero.checkpoint.save import save_checkpoint
from minizero.comm import run_in_threads
from minizero.train import parse_args, train
from tests.test_checkpoint import BASE, F64, run

SAVE = F64 + ["--steps", "2", "--save-every", "2"]


def _checkpoint(folder, step):
    """A folder a save would have written for ``step`` (a manifest: what complete and resolve look for)."""
    d = folder / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"step": step}))
    return d


def _save_step_2_twice(comm, save_dir):
    """Train 2 steps saving step 2, then save step 2 again from the same state (save_checkpoint itself: train
    refuses a --save-dir holding a later step, so only a caller of the API re-saves a step there); returns the
    folder's files' bytes after each save."""
    res = train(parse_args(BASE + SAVE + ["--save-dir", save_dir], comm.world_size), comm, log=lambda s: None)
    folder = os.path.join(save_dir, "step_00000002")
    man, before = read_manifest(folder), _contents(folder)
    state = {k: v for k, v in man.items() if k not in ("format", "version", "step", "params", "pieces", "files")}
    assert save_checkpoint(res["strategy"], comm, save_dir, 2, state) == folder
    return before, _contents(folder)


def _contents(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


@pytest.mark.timeout(120)
def test_a_step_saved_again_leaves_only_its_new_checkpoint(tmp_path):
    """The older checkpoint of the same step is renamed aside (.trash-step_N) and removed once the new one is in
    place: no second copy left on disk; the same state saves to the same bytes."""
    before, after = run_in_threads(1, _save_step_2_twice, str(tmp_path), timeout=120)[0]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002"]
    assert before == after and len(after) == 2  # manifest.json, rank00000.safetensors


@pytest.mark.timeout(120)
def test_a_save_over_a_killed_saves_folder_of_the_same_step_succeeds(tmp_path):
    """A ``.tmp-step_N`` a killed save left (no --resume to clean it): the next save of step N removes it first."""
    stale = tmp_path / ".tmp-step_00000002"
    stale.mkdir()
    (stale / "rank00000.safetensors").write_bytes(b"half")
    run(1, SAVE + ["--save-dir", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002"]


@pytest.mark.timeout(120)
def test_a_save_that_fails_at_its_rename_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    """``latest`` is moved only after the new folder is renamed into place: it never names a folder not there."""
    real = os.replace

    def fail_the_rename(src, dst):
        if os.path.basename(src) == ".tmp-step_00000004":
            raise OSError(5, "Input/output error", src)
        real(src, dst)
    monkeypatch.setattr(os, "replace", fail_the_rename)
    with pytest.raises(WriteError, match="the previous checkpoint .*step_00000002 is kept"):
        run(1, F64 + ["--steps", "4", "--save-every", "2", "--save-dir", str(tmp_path)])
    assert (tmp_path / "latest").read_text() == "step_00000002"
    assert not (tmp_path / "step_00000004").exists()


def test_a_step_folder_without_its_manifest_is_not_a_checkpoint(tmp_path):
    """A step_N folder with no manifest.json (a copy cut short) is never resumed, however new."""
    two = _checkpoint(tmp_path, 2)
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "rank00000.safetensors").write_bytes(b"x")
    (tmp_path / "latest").write_text("step_00000002")
    assert complete(str(tmp_path)) == [str(two)]
    assert resolve(str(tmp_path)) == str(two)


def test_a_save_stopped_between_its_two_renames_gets_its_previous_checkpoint_back(tmp_path):
    """Re-saving step N renames the old step_N to .trash-step_N, then .tmp-step_N to step_N: killed in between,
    the complete old one is renamed back (not removed: it is the only checkpoint of that step); the .tmp- goes."""
    old = _checkpoint(tmp_path, 2)
    os.replace(old, tmp_path / ".trash-step_00000002")
    (tmp_path / ".tmp-step_00000002").mkdir()
    assert clean_partial(str(tmp_path)) == [".tmp-step_00000002"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    assert json.loads((old / "manifest.json").read_text()) == {"step": 2}
