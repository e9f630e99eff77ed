"""Every program's output paths are checked as train's are, before any work: '' refused, nothing the user has lost."""
import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from minizero import compare, finetune
from minizero.nn.gpt import GPTConfig
from minizero.files import atomic_write, check_writable_file
from minizero.overwrite import check_output
from minizero.quantize import main as quantize_main
from tests.conftest import REPO_ROOT, earlier_json, png_bytes


def one_line(printed: str) -> str:
    return " ".join(printed.split())


@pytest.mark.parametrize("argv,says", [
    (["--json", ""], "--json '': expected a file path"),  # before: every run trained, then "could not write ''"
    (["--out", ""], "--out must name a directory, got ''"),  # before: compare.md written into the current folder
])
def test_compare_refuses_empty_outputs_before_any_run(argv, says):
    with pytest.raises(compare.UsageError, match=says):
        compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", *argv])


@pytest.mark.parametrize("path,says", [
    ("/dev/full", "--json '/dev/full' cannot be written (No space left on device); give a file on a writable file "
                  "system"),
    ("{tmp}", "--json '{tmp}' is a directory; give a file path"),
    ("{tmp}/missing/c.json", "--json '{tmp}/missing/c.json': directory '{tmp}/missing' does not exist"),
])
def test_compare_refuses_an_unwritable_json_before_any_run(tmp_path, path, says):
    """Before: /dev/full and a missing folder were found after every run (the folder made, or the write failing)."""
    if path == "/dev/full" and not os.path.exists(path):
        pytest.skip("needs /dev/full (Linux)")
    path, says = path.format(tmp=tmp_path), says.format(tmp=tmp_path)
    with pytest.raises(compare.UsageError) as e:
        compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--out",
                            str(tmp_path / "out"), "--json", path])
    assert says in str(e.value)
    compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--out", str(tmp_path), "--json",
                        os.devnull])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_train_refuses_a_full_device_before_any_step(tmp_path, flag):
    """Before: a device was never probed, so --json /dev/full failed after the last step."""
    from minizero.args import UsageError, parse_args

    with pytest.raises(UsageError, match=f"^{flag} '/dev/full' cannot be written \\(No space left on device\\); "
                                         "give a file on a writable file system$"):
        parse_args(["--model", "tiny", "--out", str(tmp_path), flag, "/dev/full"], 1)
    parse_args(["--model", "tiny", "--out", str(tmp_path), flag, os.devnull], 1)  # written into, as before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux), which takes no new file")
def test_every_program_says_an_output_it_cannot_write_alike(tmp_path):
    """Before: train said "--json PATH cannot be written (WHY); give another path", compare, finetune and quantize
    "--json PATH: cannot write there (WHY)", compare's --out "--out: cannot write in PATH (WHY)", consolidate
    "--out PATH: cannot write there (WHY)": now one line, from temporaries.unwritable, with what to give."""
    from minizero.args import UsageError, parse_args
    from minizero.checkpoint import CheckpointError
    from minizero.checkpoint.cli import check_out
    from tests.test_bench_args import load

    def said(call) -> str:
        try:
            return call()
        except (UsageError, ValueError, CheckpointError) as e:
            return str(e)

    ran = ["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--out"]
    why = "('/proc' takes no file named '{}' (No such file or directory)); give a {} on a writable file system"
    for flag, path, call in [
            ("--json", "/proc/x.json", lambda: parse_args(["--out", str(tmp_path), "--json", "/proc/x.json"], 1)),
            ("--trace", "/proc/x.json", lambda: parse_args(["--out", str(tmp_path), "--trace", "/proc/x.json"], 1)),
            ("--json", "/proc/x.json", lambda: compare.parse_args([*ran, str(tmp_path), "--json", "/proc/x.json"])),
            ("--json", "/proc/x.json", lambda: check_output("/proc/x.json")),  # finetune's, quantize's
            ("--out", "/proc/x.npz", lambda: check_out("/proc/x.npz")),  # consolidate's
            ("--json", "/proc/x.json", lambda: load("gpu_check").json_target_problem("/proc/x.json"))]:
        assert said(call) == f"{flag} {path!r} cannot be written " + why.format(os.path.basename(path), "file")
    assert said(lambda: compare.parse_args([*ran, "/proc/o"])) == ("--out '/proc/o' cannot be written "
                                                                    + why.format("manifest.json", "folder"))


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_an_output_refused_for_permission_says_to_give_a_path_one_can_write_to(code):
    """Before: "Permission denied); give a file on a writable file system", though the file system may be writable
    (a folder of another user's on it)."""
    from minizero.temporaries import unwritable
    e = OSError(code, os.strerror(code))
    assert unwritable("--json", "/srv/x.json", e) == (f"--json '/srv/x.json' cannot be written ({os.strerror(code)}); "
                                                      "give a path you can write to")
    assert unwritable("--out", "/srv/o", e, "folder").endswith("; give a path you can write to")


@pytest.mark.parametrize("code,give", [(errno.EACCES, "a path you can write to"),
                                       (errno.ENAMETOOLONG, "a shorter path"),
                                       (errno.EROFS, "a folder on a writable file system")])
def test_save_dir_and_finetune_out_say_what_to_give_by_errno(tmp_path, monkeypatch, capsys, code, give):
    """Before: train's --save-dir and finetune's --out said "give a folder on a writable file system" for every
    OSError, Permission denied and File name too long included."""
    from minizero import args as train_args

    def refuse(*_):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(train_args, "check_writable_folder", refuse)
    monkeypatch.setattr(finetune, "check_writable_folder", refuse)
    save = str(tmp_path / "ck")
    with pytest.raises(train_args.UsageError) as e:
        train_args.parse_args(["--out", str(tmp_path / "o"), "--save-every", "1", "--save-dir", save], 1)
    assert str(e.value) == f"--save-dir {save!r} cannot be written ({os.strerror(code)}); give {give}"
    out = str(tmp_path / "ft")
    assert finetune.main(["--weights", str(tmp_path / "none.npz"), "--out", out]) == 2
    assert one_line(capsys.readouterr().err).endswith(f"--out {out!r} cannot be written ({os.strerror(code)}); "
                                                      f"give {give}")


@pytest.mark.parametrize("argv,says", [
    (["--save-every", "1", "--save-dir", "OUT/model.npz"], "would take the place of the weights (OUT/model.npz)"),
    (["--save-every", "1", "--save-dir", "OUT/loss.png"], "would take the place of the loss plot (OUT/loss.png)"),
    (["--save-every", "1", "--save-dir", "OUT/flight"], "would take the place of OUT/flight, the folder of a failed"),
    (["--json", "OUT/flight"], "would overwrite OUT/flight, the folder of a failed job's flight records"),
    (["--trace", "OUT/flight"], "would overwrite OUT/flight, the folder of a failed job's flight records"),
    (["--json", "OUT/flight/rank_0.json"], "is named like a flight record in OUT/flight"),
    (["--trace", "OUT/flight/rank_1.json"], "is named like a flight record in OUT/flight"),
])
def test_an_output_where_the_run_writes_its_own_file_or_folder_is_refused_before_any_work(tmp_path, argv, says):
    """Before: --save-dir OUT/model.npz trained the whole run, then failed on the weights ("could not write
    'OUT/model.npz': it is a directory"); --json or --trace OUT/flight wrote a file where a failed job's flight
    records go (or a file named like a record there: OUT/flight/rank_0.json), and the next run with that --out was
    refused."""
    from minizero.args import UsageError, parse_args
    out = str(tmp_path / "o")
    argv = [a.replace("OUT", out) for a in argv]
    with pytest.raises(UsageError) as e:
        parse_args(["--out", out] + argv, world_size=1)
    assert str(e.value).startswith(f"{argv[-2]} {argv[-1]!r} ") and says in one_line(str(e.value)), str(e.value)
    assert not os.path.exists(out)


@pytest.mark.parametrize("argv", [["--save-every", "1", "--save-dir", "OUT"],  # checkpoints beside the results
                                  ["--save-every", "1", "--save-dir", "OUT/flight", "--flight-records", "0"],
                                  ["--json", "OUT/flight", "--flight-records", "0"],  # no flight folder then
                                  ["--json", "OUT/flight/notes.json"],  # no record's name: never cleared
                                  ["--save-every", "1", "--save-dir", "OUT/model.npz", "--no-save"]])
def test_an_output_at_a_path_the_run_leaves_alone_is_taken(tmp_path, argv):
    from minizero.args import parse_args
    out = str(tmp_path / "o")
    os.makedirs(os.path.join(out, "flight")) if argv[-1].endswith("notes.json") else None  # a failed run's folder
    parse_args(["--out", out] + [a.replace("OUT", out) for a in argv], world_size=1)


def test_a_fifo_nobody_reads_is_named_as_one(tmp_path):
    """Before: check_writable_file's open of a FIFO with no reader failed as "No such device or address" (ENXIO),
    and its callers printed that. A FIFO that a process reads is written into, as a device is."""
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(OSError) as e:
        check_writable_file(str(tmp_path / "pipe"))
    assert e.value.errno == errno.ENXIO and e.value.strerror == (
        f"{str(tmp_path / 'pipe')!r} is a named pipe (FIFO) with no reader, not a regular file")
    from minizero.temporaries import unwritable
    assert unwritable("--out", "pipe", e.value).endswith("with no reader, not a regular file); give a regular file")
    reader = os.open(tmp_path / "pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        check_writable_file(str(tmp_path / "pipe"))
    finally:
        os.close(reader)


@pytest.mark.parametrize("argv,says", [
    (["--json", ""], "--json '': expected a file path"),  # before: trained, rc 0, nothing written
    (["--out", ""], "--out must name a directory, got ''"),  # before: "could not write '.lock'"
])
def test_finetune_refuses_empty_outputs(argv, says):
    with pytest.raises(ValueError, match=says):
        finetune.check(finetune.build_parser().parse_args(argv))


def test_quantize_refuses_an_empty_json_before_measuring(tmp_path, capsys):
    assert quantize_main(["--weights", str(tmp_path / "none.npz"), "--json", ""]) == 2  # before: measured, rc 0
    assert "--json '': expected a file path" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_link_to_the_data_is_not_written_over(tmp_path, monkeypatch, flag):
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.txt").write_text("the user's text. " * 200)
    os.symlink("data.txt", "link.txt")  # before: the run wrote its JSON over the link, the data's name lost
    with pytest.raises(UsageError, match=f"{flag} 'link.txt' would overwrite --data"):
        parse_args(["--data", "data.txt", "--out", "o", flag, "link.txt"], world_size=1)


def test_an_output_replaces_only_a_file_of_its_own_kind(tmp_path, monkeypatch, capsys):
    """Before: quantize --json notes.txt, train --trace notes.txt (and --json) replaced the user's notes."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "old.json").write_text(earlier_json(baseline={}, rows=[]))
    (tmp_path / "old_trace.json").write_text(earlier_json("--trace"))
    (tmp_path / "plot.png").write_bytes(png_bytes())  # minizero's (marked, tests/test_output_pngs.py)
    for flag, name, what in [("--json", "notes.txt", "a summary"), ("--json", "list.json", "a summary"),
                             ("--trace", "old.json", "a trace"), ("--plot", "notes.txt", "a plot minizero wrote")]:
        with pytest.raises(ValueError, match=f"{flag} '{name}' exists and does not hold {what}"):
            check_output(name, flag)
    for flag, name in [("--json", "old.json"), ("--trace", "old_trace.json"), ("--plot", "plot.png")]:
        check_output(name, flag)  # an earlier output of the same kind is replaced
    for flag in ("--json", "--trace"):
        with pytest.raises(UsageError, match=f"{flag} 'notes.txt' exists and does not hold"):
            parse_args(["--out", "o", flag, "notes.txt"], world_size=1)
    assert quantize_main(["--weights", "none.npz", "--json", "notes.txt"]) == 2
    assert "--json 'notes.txt' exists and does not hold a summary minizero wrote" in one_line(capsys.readouterr().err)
    assert (tmp_path / "notes.txt").read_text() == "notes\n"


def test_train_keeps_a_users_own_model_files_in_out(tmp_path, monkeypatch):
    """Before: train's OUT/model.json (the user's notes) and OUT/model.npz (not an .npz) were replaced at the end."""
    from minizero.args import UsageError, parse_args
    from minizero.saved_model import write_model_json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "o").mkdir()
    for name, what in [("model.json", "a model config"), ("model.npz", "an .npz")]:
        (tmp_path / "o" / name).write_text("my notes\n")
        with pytest.raises(UsageError, match=f"'o/{name}' is there and is not {what} minizero wrote"):
            parse_args(["--model", "tiny", "--out", "o"], world_size=1)
        parse_args(["--model", "tiny", "--out", "o", "--no-save"], world_size=1)  # nothing written there: fine
        (tmp_path / "o" / name).unlink()
    np.savez(tmp_path / "o" / "model.npz", a=np.zeros(1))  # an earlier run's outputs: replaced as before
    write_model_json(str(tmp_path / "o"), GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=4))
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_train_names_a_model_file_it_cannot_read_and_ignores_a_folder_model_npz_under_no_save(tmp_path, monkeypatch):
    """Before: an OUT/model.json it could not read was "not a model config minizero wrote". A folder OUT/model.npz is
    refused only when weights are written (--no-save skips check_outputs: pinned here)."""
    import builtins

    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "model.npz").mkdir()
    parse_args(["--model", "tiny", "--out", "o", "--no-save"], world_size=1)
    with pytest.raises(UsageError, match="'o/model.npz' is a directory"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    (tmp_path / "o" / "model.npz").rmdir()
    real_open = builtins.open

    def denied(path, *a, **k):  # chmod 000 (the tests may run as root, who reads it anyway)
        if str(path).endswith("model.json"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *a, **k)

    (tmp_path / "o" / "model.json").write_text("{}")
    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(UsageError, match=r"'o/model.json' is there and cannot be read \(Permission denied\); make it "
                                         "readable or move it away"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_train_keeps_a_users_own_summary_and_plots_in_out(tmp_path, monkeypatch):
    """Before: a user's OUT/summary.json (not a summary), loss.png or memory.png (not a PNG) was overwritten."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIZERO_PLOTS", "1")  # plots off: loss.png and memory.png are neither drawn nor checked
    (tmp_path / "o").mkdir()
    for name, what in [("summary.json", "--json 'o/summary.json'"), ("loss.png", "--out 'o/loss.png'"),
                       ("memory.png", "--out 'o/memory.png'")]:
        (tmp_path / "o" / name).write_text("my notes\n")
        with pytest.raises(UsageError, match=f"{what} exists and does not hold"):
            parse_args(["--model", "tiny", "--out", "o"], world_size=1)
        parse_args(["--model", "tiny", "--out", "o", "--no-save"], world_size=1)  # nothing written there: fine
        (tmp_path / "o" / name).unlink()
    (tmp_path / "o" / "loss.png").write_bytes(png_bytes())  # an earlier run's (marked): replaced as before
    (tmp_path / "o" / "summary.json").write_text(earlier_json(train_loss=[], world_size=1, config={}))
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_train_names_an_unreadable_plot_or_summary_in_out_and_says_another_folder(tmp_path, monkeypatch):
    """Before: an OUT/loss.png or summary.json it could not open (chmod 000) escaped parse_args as a PermissionError
    traceback; a user's own loss.png was to be kept by giving "another file", which --out cannot name."""
    import builtins

    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIZERO_PLOTS", "1")  # plots off: loss.png is neither drawn nor checked
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "loss.png").write_text("my notes\n")
    with pytest.raises(UsageError, match=r"--out 'o/loss.png' exists and does not hold a plot minizero wrote, .*; "
                                         r"give another folder, or move that one away"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    real_open = builtins.open

    def denied(path, *a, **k):  # chmod 000 (the tests may run as root, who reads it anyway)
        if str(path).endswith(("loss.png", "summary.json")):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(UsageError, match=r"--out: 'o/loss.png' is there and cannot be read \(Permission denied\); "
                                         "make it readable or move it away"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    (tmp_path / "o" / "loss.png").unlink()
    (tmp_path / "o" / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match=r"--json: 'o/summary.json' is there and cannot be read"):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_an_unreadable_output_is_refused_in_one_wording_by_weights_and_plots_checks(tmp_path, monkeypatch):
    """Before: saved_model.refuse_replacing (model.npz, model.json) and refuse_foreign (plots, --json, --trace) each
    worded a file they cannot read (chmod 000) in their own copy, and the copies differed ("--out:" vs "--out")."""
    import builtins
    import pathlib

    from minizero.overwrite import refuse_foreign
    from minizero.saved_model import refuse_replacing

    path = str(tmp_path / "model.json")
    with open(path, "w") as f:
        f.write("{}")
    real_open = builtins.open

    def denied(p, *a, **k):  # chmod 000 (the tests may run as root, who reads it anyway)
        if str(p) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real_open(p, *a, **k)

    monkeypatch.setattr(builtins, "open", denied)
    said = []
    for refuse in (refuse_replacing, refuse_foreign):
        with pytest.raises(ValueError) as e:
            refuse(path, "--out")
        said.append(str(e.value))
    assert said == [f"--out: {path!r} is there and cannot be read (Permission denied); make it readable or move it "
                    "away"] * 2
    monkeypatch.undo()
    sources = [p.read_text() for p in pathlib.Path(REPO_ROOT, "minizero").rglob("*.py")]
    assert sum(s.count("is there and cannot be read") for s in sources) == 1  # one helper words it, not copies


def test_train_replaces_a_model_config_with_fewer_fields_or_through_a_link(tmp_path, monkeypatch):
    """Before: a model.json without every GPTConfig field (readers take it: check_model_fields fills missing ones;
    one written before a field is added) was refused as the user's own. A link to a config is one; {} is none."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "model.json").write_text(json.dumps({"n_layer": 1, "n_head": 1, "n_embd": 4}))
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    (tmp_path / "o" / "model.json").rename(tmp_path / "cfg.json")
    (tmp_path / "o" / "model.json").symlink_to(tmp_path / "cfg.json")
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    for text in ("{}", json.dumps({"n_layer": 1, "notes": "mine"})):
        (tmp_path / "cfg.json").write_text(text)
        with pytest.raises(UsageError, match="'o/model.json' is there and is not a model config minizero wrote"):
            parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def _written(path) -> bool:
    try:
        atomic_write(str(path), lambda f: f.write("{}"), mode="w")
        return True
    except OSError:
        return False


def _checked(path) -> bool:
    try:
        check_writable_file(str(path))
        return True
    except OSError:
        return False


def test_a_symlink_loop_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Before: exists() said no, so a loop passed as a new file; train, finetune, quantize, compare and the bench
    scripts did all the work, then 'could not write loopA: Too many levels of symbolic links'."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    os.symlink("loopB", "loopA")
    os.symlink("loopA", "loopB")
    for flag in ("--json", "--trace"):
        with pytest.raises(UsageError, match=f"{flag} 'loopA' cannot be written .* is a loop of symbolic links"):
            parse_args(["--out", "o", flag, "loopA"], world_size=1)
    with pytest.raises(ValueError, match="--png 'loopA' cannot be written .* loop of symbolic links.*another path"):
        check_output("loopA", "--png")  # finetune, quantize, compare, plan and the bench scripts
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "1", "--out", "o",
                           "--json", "loopA"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 2 and "is a loop of symbolic links" in proc.stderr, proc.stderr
    assert not os.path.exists("o")  # nothing trained, nothing written


def test_a_name_that_fits_but_whose_temporary_does_not_is_refused(tmp_path):
    """Before: the probe's name (.minizero-probe.X.tmp) was shorter than the write's temporary
    (.NAME.minizero~HOST~PID~RANDOM.tmp): a 240-character --json passed, and failed after training."""
    from minizero.args import UsageError, parse_args

    for n in range(200, 256):  # the check says yes exactly where the write succeeds
        assert _checked(tmp_path / ("j" * n)) == _written(tmp_path / ("j" * n)), n
    long = str(tmp_path / ("j" * 240))
    for flag in ("--json", "--trace"):
        with pytest.raises(UsageError, match=f"{flag} .* cannot be written .*longer than the file system's"):
            parse_args(["--out", str(tmp_path / "o"), flag, long], world_size=1)
    with pytest.raises(ValueError, match="--json .*longer than the file system's"):
        check_output(long)  # finetune's, quantize's, compare's --json


def test_a_path_near_path_max_is_refused(tmp_path):
    """Before: an --out of 4,058 characters passed and its first write (the weights) failed after training."""
    from minizero.args import UsageError, parse_args

    deep = str(tmp_path)
    while len(deep) < 3950:
        deep = os.path.join(deep, "d" * min(200, 3950 - len(deep)))
    os.makedirs(deep)
    for n in range(60, 160, 3):  # the check says yes exactly where the write succeeds
        assert _checked(os.path.join(deep, "f" * n)) == _written(os.path.join(deep, "f" * n)), n
    out = os.path.join(deep, "o" * (4058 - len(deep) - 1))
    with pytest.raises(UsageError, match="--out .* cannot be written .*paths must stay under"):
        parse_args(["--out", out], world_size=1)
    temporary = len(f".manifest.json.minizero~{socket.gethostname()}~{os.getpid()}~XXXXXXXX.tmp")
    save = os.path.join(deep, "s" * (4095 - temporary - 5 - len(deep) - 1))  # its manifest fits, not in .tmp-step_N/
    with pytest.raises(UsageError, match="--save-dir .* cannot be written .*paths must stay under"):
        parse_args(["--out", str(tmp_path / "o"), "--save-every", "1", "--save-dir", save], world_size=1)


def test_a_link_is_written_through_to_its_target(tmp_path):
    """Before: the rename replaced the link with a regular file and left its target stale."""
    (tmp_path / "real.json").write_text('{"old": 1}')
    os.symlink("real.json", tmp_path / "link.json")
    atomic_write(str(tmp_path / "link.json"), lambda f: f.write('{"new": 2}'), mode="w")
    assert os.path.islink(tmp_path / "link.json") and (tmp_path / "real.json").read_text() == '{"new": 2}'
    os.symlink("later/new.json", tmp_path / "ahead.json")  # a link to a file the write makes: the check agrees
    check_writable_file(str(tmp_path / "ahead.json"))
    atomic_write(str(tmp_path / "ahead.json"), lambda f: f.write("{}"), mode="w")
    assert (tmp_path / "later" / "new.json").read_text() == "{}"


def test_consolidate_probes_its_files_own_temporary(tmp_path):
    """Before: its folder was probed with a short name; a 244-character --out read every shard, then failed."""
    from minizero.checkpoint import CheckpointError
    from minizero.checkpoint.cli import check_out

    with pytest.raises(CheckpointError, match="cannot be written .*longer than the file system's .*; give a shorter"):
        check_out(str(tmp_path / ("m" * 240 + ".npz")))


def disk_full_under(folder, fdopen=os.fdopen):
    """``os.fdopen`` (atomic_write's temporary) whose files in ``folder`` take half of a write, then raise ENOSPC:
    the disk that holds ``folder`` fills mid-write (a device such as /dev/full is now refused before any work)."""
    def opened(fd, *args, **kw):
        f = fdopen(fd, *args, **kw)
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == os.path.realpath(folder):
            put = f.write

            def write(data):
                put(data[:len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f
    return opened


_TRAIN_ON_A_FULL_DISK = """
import os, sys
from tests.test_output_paths import disk_full_under
from minizero.train import main
os.fdopen = disk_full_under(sys.argv[1])
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.timeout(200)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open file by /proc/self/fd (Linux)")
@pytest.mark.parametrize("tool", ["finetune", "train"])
def test_json_on_a_disk_that_fills_at_the_end_is_one_line_and_keeps_the_previous_file(tmp_path, monkeypatch, capsys,
                                                                                       tool):
    """The end-of-run write of --json fails (a full disk): one line naming the file, exit 1; --out's model written
    whole before it; the previous --json whole, no temporary left. Before, reached with --json /dev/full only."""
    import json

    import numpy as np

    from minizero.nn import GPT, get_config
    from tests.conftest import mpi_env

    (tmp_path / "base").mkdir()
    np.savez(tmp_path / "base" / "model.npz", **GPT(get_config("tiny"), seed=1).state_dict())
    (tmp_path / "base" / "model.json").write_text(json.dumps(dataclasses.asdict(get_config("tiny"))))
    full, out = tmp_path / "full", tmp_path / "out"
    full.mkdir()
    previous = earlier_json(baseline={}, rows=[])  # an earlier quantize summary
    (full / "s.json").write_text(previous)
    flags = ["--steps", "1", "--eval-batches", "1", "--out", str(out), "--json", str(full / "s.json")]
    if tool == "finetune":
        monkeypatch.setattr(os, "fdopen", disk_full_under(full))
        status = finetune.main(["--weights", str(tmp_path / "base" / "model.npz"), "--method", "full", *flags])
        printed = capsys.readouterr()
        err, said = printed.err, "python -m minizero.finetune: error: could not write"
        assert f"wrote {out / 'model.npz'} (--method full" in printed.out
    else:
        proc = subprocess.run([sys.executable, "-c", _TRAIN_ON_A_FULL_DISK, str(full), "--model", "tiny",
                               "--eval-every", "0", "--sample-tokens", "4", "--no-progress", *flags],
                              capture_output=True, text=True, cwd=REPO_ROOT, env=mpi_env(), timeout=180)
        status, err, said = proc.returncode, proc.stderr, "[rank 0] minizero.train failed: could not write"
    assert status == 1 and "Traceback" not in err and all(len(line) <= 120 for line in err.splitlines()), err
    assert one_line(err) == f"{said} {str(full / 's.json')!r}: no space left on device (the disk is full)", err
    assert (full / "s.json").read_text() == previous and os.listdir(full) == ["s.json"], os.listdir(full)  # no lock
    weights = np.load(out / "model.npz")
    assert sorted(weights) == sorted(GPT(get_config("tiny")).state_dict()) and (out / "model.json").exists()


def test_a_failed_run_names_the_earlier_runs_files_it_left_in_out(tmp_path):
    """Before: a failed run left an earlier run's model.npz, model.json and summary.json in OUT without a word, and
    sample / quantize then read another model as this run's. Files the failed run replaced are not named."""
    out = tmp_path / "o"
    out.mkdir()
    np.savez(out / "model.npz", a=np.zeros(1))  # an earlier run's (minizero's own writes replace them whole)
    (out / "summary.json").write_text(earlier_json(train_loss=[], world_size=1, config={}))
    (out / "loss.png").write_text("")

    def failed_run(folder):
        return subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "3",
                               "--no-progress", "--out", str(folder)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), MINIZERO_FAULT="0:1:raise"))

    proc = failed_run(out)
    said = " ".join(line.strip() for line in proc.stderr.split("Traceback")[0].splitlines())
    assert proc.returncode == 1, proc.stderr
    assert (f"{out / 'model.npz'}, {out / 'loss.png'}, {out / 'summary.json'} are an earlier run's, not this "
            "one's") in said, said
    assert all(len(line) <= 120 for line in proc.stderr.split("Traceback")[0].splitlines())
    fresh = failed_run(tmp_path / "fresh")  # nothing earlier there: nothing named
    assert fresh.returncode == 1 and "earlier run's" not in fresh.stderr, fresh.stderr


def test_a_trace_to_dev_null_is_written_and_analysed_without_reading_it_back(tmp_path):
    """Before: the trace callback read PATH back to analyse it; --trace /dev/null (accepted up front) read nothing,
    and the run failed after training with a JSONDecodeError, before writing the model."""
    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "2", "--no-progress",
                           "--out", str(tmp_path / "o"), "--trace", os.devnull], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {os.devnull} (Chrome trace-event JSON" in proc.stdout
    assert (tmp_path / "o" / "model.npz").is_file() and (tmp_path / "o" / "summary.json").is_file()


def test_a_users_json_object_is_not_replaced(tmp_path, monkeypatch, capsys):
    """Before: finetune --json mine.json and quantize --json mine.json replaced {"mine": "precious"}: any JSON object
    counted as an earlier output. Now only a summary minizero writes does (a key each program's summary has)."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.json").write_text('{"mine": "precious"}')
    said = ("--json 'mine.json' exists and does not hold a summary minizero wrote, marked by its top-level key "
            "'minizero' (an older minizero's has none: delete it): --json replaces only such a file (an earlier "
            "output); give another file, or move that one away")
    with pytest.raises(ValueError) as e:
        finetune.check(finetune.build_parser().parse_args(["--json", "mine.json"]))
    assert str(e.value) == said
    with pytest.raises(UsageError, match="does not hold a summary minizero wrote"):
        parse_args(["--out", "o", "--json", "mine.json"], world_size=1)
    assert quantize_main(["--weights", "none.npz", "--json", "mine.json"]) == 2
    assert said in one_line(capsys.readouterr().err)
    with pytest.raises(compare.UsageError, match="does not hold a summary minizero wrote"):
        compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--json", "mine.json"])
    assert (tmp_path / "mine.json").read_text() == '{"mine": "precious"}'
    for key in ("train_loss", "rows", "runs", "results"):  # one key of a summary's: the user's, kept (replaced before)
        (tmp_path / "old.json").write_text(json.dumps({key: []}))
        with pytest.raises(ValueError, match="does not hold a summary minizero wrote"):
            check_output("old.json", "--json")


def test_each_programs_real_summary_is_replaced_and_a_users_json_with_its_keys_is_not(tmp_path, mpiexec):
    """Before: a JSON object with any one of train_loss, rows, runs or results counted as minizero's summary, so
    --json replaced {"results": [1]}, {"rows": 3, "name": "my spreadsheet"} or {"runs": 0}; then one with all the keys
    a program writes did, and a train --trace replaced any JSON with a traceEvents list (a PyTorch profiler's). Now
    every summary and trace carries minizero's mark (minizero.jsons), checked here on what each one wrote."""
    from minizero.jsons import KEY, MARKS

    def run(*argv, ok=(0,)):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        assert proc.returncode in ok, proc.stderr

    run("-m", "minizero.train", "--model", "tiny", "--steps", "1", "--no-progress", "--sample-tokens", "0",
        "--out", "o", "--json", "train.json", "--trace", "trace.json")
    run("-m", "minizero.quantize", "--weights", "o/model.npz", "--json", "quantize.json")
    run("-m", "minizero.finetune", "--weights", "o/model.npz", "--method", "full", "--steps", "1", "--eval-batches",
        "1", "--json", "finetune.json")
    run("-m", "minizero.compare", "--model", "tiny", "--ranks", "1", "--steps", "1", "--strategies", "baseline",
        "--out", "cmp", "--json", "compare.json", "--timeout", "0.001", ok=(0, 1))  # its run cut: the JSON as ever
    run(os.path.join(REPO_ROOT, "bench", "bench_allreduce.py"), "--json", "bench.json", "--quiet", "--max-bytes",
        "4096", "--warmup", "0")
    users = []
    for name in ("bench", "compare", "finetune", "quantize", "train"):  # each writer's own output: an earlier summary
        check_output(str(tmp_path / f"{name}.json"), "--json")
        with open(tmp_path / f"{name}.json") as f:
            written = json.load(f)
        assert next(iter(written.items())) == (KEY, MARKS["--json"])  # first: the top of the file says it
        users.append({k: v for k, v in written.items() if k != KEY})  # its keys, no mark: a user's (or older) JSON
    with open(tmp_path / "trace.json") as f:
        written = json.load(f)
    assert list(written) == ["traceEvents", "displayTimeUnit", "otherData"]  # Perfetto skips no event
    assert written["otherData"] == {KEY: MARKS["--json"].replace("summary", "trace")}
    check_output(str(tmp_path / "trace.json"), "--trace")
    users += [{"results": [1]}, {"rows": 3, "name": "my spreadsheet"}, {"runs": 0}, {KEY: "mine"}]
    for data in users:
        (tmp_path / "mine.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="does not hold a summary minizero wrote, marked by its top-level key "
                                             "'minizero' \\(an older minizero's has none: delete it\\)"):
            check_output(str(tmp_path / "mine.json"), "--json")
    for data in ({"traceEvents": written["traceEvents"]}, {"traceEvents": [], "schemaVersion": 1}, written | {
            "otherData": {}}, {"traceEvents": [], KEY: MARKS["--trace"]}):  # older minizero's, a profiler's
        (tmp_path / "mine.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="does not hold a trace minizero wrote, marked by the key 'minizero' in"):
            check_output(str(tmp_path / "mine.json"), "--trace")


@pytest.mark.parametrize("name", ["keep.json/", "newf.json/", "keep.json/.", "newf.json/.", "keep.json/..",
                                  "newf.json/.."])
@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_file_path_ending_in_a_slash_is_refused_before_any_work(tmp_path, monkeypatch, capsys, name, flag):
    """Before: abspath and realpath dropped the '/' ('/.' too: today's find), so compare, train, finetune and quantize
    did all the work, then "Not a directory" (keep.json an existing file), or wrote newf.json (then a traceback, or
    silently; --trace printing 'wrote newf.json/.')."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.json").write_text(earlier_json(baseline={}, rows=[]))
    said = f"{flag} {name!r} ends in {name[name.rindex('/'):]!r}: give a file path"
    with pytest.raises(UsageError) as e:
        parse_args(["--out", "o", flag, name], world_size=1)
    assert str(e.value) == said
    if flag == "--json":
        with pytest.raises(ValueError, match=said):
            finetune.check(finetune.build_parser().parse_args(["--json", name]))
        assert quantize_main(["--weights", "none.npz", "--json", name]) == 2
        assert said in one_line(capsys.readouterr().err)
        with pytest.raises(compare.UsageError, match=said):
            compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--json", name])
    assert sorted(os.listdir(tmp_path)) == ["keep.json"]


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_dangling_link_into_a_missing_folder_is_refused(tmp_path, monkeypatch, flag):
    """Before: compare --json danglink (-> nonexist/x.json) made the missing folder, while the folder given directly
    is refused; train did the same."""
    from minizero.args import UsageError, parse_args

    monkeypatch.chdir(tmp_path)
    os.symlink(str(tmp_path / "nonexist" / "x.json"), "danglink")
    said = (f"{flag} 'danglink': folder '{tmp_path}/nonexist' of the link's target '{tmp_path}/nonexist/x.json' "
            "does not exist; create that folder or give another path")  # what to give, as every refusal says
    with pytest.raises(UsageError) as e:
        parse_args(["--out", "o", flag, "danglink"], world_size=1)
    assert str(e.value) == said
    with pytest.raises(ValueError) as e:
        check_output("danglink", flag)  # compare's, finetune's, quantize's
    assert str(e.value) == said
    os.mkdir("nonexist")
    check_output("danglink", flag)  # a link to a new file in a folder that is there: written through it


@pytest.mark.parametrize("name", ["x.json/", "x.json/.", "x.json/..", "/", "/."])
def test_the_rule_names_the_last_component_as_given(tmp_path, monkeypatch, name):
    """A last component '', '.' or '..' is refused by the text as given (abspath drops it); a directory says so
    first."""
    from minizero.overwrite import refuse_slash_or_dangling

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        refuse_slash_or_dangling(name, "--json")
    assert str(e.value) == f"--json {name!r} ends in {name[name.rindex('/'):]!r}: give a file path"
    refuse_slash_or_dangling("x.json", "--json")  # a file path: no refusal
    with pytest.raises(ValueError, match="is a directory"):
        check_output("/", "--json")


@pytest.mark.parametrize("name", ["cdir/", "nodir/.", "m.npz/.", "m.npz/.."])
def test_consolidate_out_ending_in_slash_or_dot_is_refused_before_any_read(tmp_path, monkeypatch, capsys, name):
    """Before: consolidate --out cdir/ wrote a file cdir ('wrote cdir/'), nodir/. a file nodir, m.npz/. failed after
    reading every shard (the check was train's alone)."""
    from minizero.checkpoint.cli import main as checkpoint_main

    monkeypatch.chdir(tmp_path)
    atomic_write("m.npz", lambda f: f.write(b"PK\x03\x04"))
    assert checkpoint_main(["consolidate", "no-such-checkpoint", "--out", name]) == 2
    said = f"--out {name!r} ends in {name[name.rindex('/'):]!r}: give a file path"
    assert said in one_line(capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["m.npz"]


@pytest.mark.parametrize("name", ["pl/", "pl/.", "x.png/."])
def test_plan_plot_ending_in_slash_or_dot_names_the_path_given(tmp_path, monkeypatch, capsys, name):
    """Before: --plot pl/ was refused naming 'pl/.png' (a path the user never gave); pl/. was taken as 'pl/..png'."""
    from minizero.plan import main as plan_main

    monkeypatch.chdir(tmp_path)
    os.mkdir("pl")
    with pytest.raises(SystemExit) as e:
        plan_main(["--model", "llama2-7b", "--gpus", "8", "--plot", name])
    err = one_line(capsys.readouterr().err)
    said = (f"--plot {name!r}: cannot write the PNG: {name!r} is a directory" if os.path.isdir(name) else
            f"--plot {name!r} ends in {name[name.rindex('/'):]!r}: give a file path")  # a directory says so first
    assert e.value.code == 2 and said in err, err
    assert ".png'" not in err.replace(f"{name!r}", "") and os.listdir("pl") == []


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_dev_null_is_taken_where_its_folder_is_not_writable(tmp_path, monkeypatch, flag):
    """Before: train and compare refused --json /dev/null for a user who is not root ("directory '/dev' does not exist
    or is not writable"): a device is written into, never renamed over nor locked, so its folder's mode does not
    matter. A new file in an unwritable folder is still refused. (Root simulated as a user: /dev not W_OK.)"""
    from minizero.args import UsageError, parse_args

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if os.path.abspath(p) == "/dev" and m & os.W_OK
                        else real(p, m, **k))
    monkeypatch.chdir(tmp_path)
    assert getattr(parse_args(["--out", "o", flag, os.devnull], world_size=1), flag[2:]) == os.devnull
    said = f"{flag} '/dev/new.json': directory '/dev' does not exist or is not writable"
    with pytest.raises(UsageError, match=said):
        parse_args(["--out", "o", flag, "/dev/new.json"], world_size=1)
    if flag == "--json":
        assert compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--json",
                                   os.devnull]).json == os.devnull
        with pytest.raises(compare.UsageError, match=said):
            compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--json", "/dev/new.json"])
