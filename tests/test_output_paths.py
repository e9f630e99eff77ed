"""Every program's output paths are checked as train's are, before any work: '' refused, nothing the user has lost."""
import os

import pytest

from minizero import compare, finetune
from minizero.quantize import main as quantize_main


def one_line(printed: str) -> str:
    return " ".join(printed.split())


@pytest.mark.parametrize("argv,says", [
    (["--json", ""], "--json '': expected a file path"),  # before: every run trained, then "could not write ''"
    (["--out", ""], "--out must name a directory, got ''"),  # before: compare.md written into the current folder
])
def test_compare_refuses_empty_outputs_before_any_run(argv, says):
    with pytest.raises(compare.UsageError, match=says):
        compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", *argv])


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
    import json

    from minizero.args import UsageError, parse_args
    from minizero.files import check_output

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "old_trace.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    for flag, name, what in [("--json", "notes.txt", "a JSON object"), ("--json", "list.json", "a JSON object"),
                             ("--trace", "old.json", "a trace"), ("--plot", "notes.txt", "a PNG image")]:
        with pytest.raises(ValueError, match=f"{flag} '{name}' exists and does not hold {what}"):
            check_output(name, flag)
    for flag, name in [("--json", "old.json"), ("--trace", "old_trace.json"), ("--plot", "plot.png")]:
        check_output(name, flag)  # an earlier output of the same kind is replaced
    for flag in ("--json", "--trace"):
        with pytest.raises(UsageError, match=f"{flag} 'notes.txt' exists and does not hold"):
            parse_args(["--out", "o", flag, "notes.txt"], world_size=1)
    assert quantize_main(["--weights", "none.npz", "--json", "notes.txt"]) == 2
    assert "--json 'notes.txt' exists and does not hold a JSON object" in one_line(capsys.readouterr().err)
    assert (tmp_path / "notes.txt").read_text() == "notes\n"
