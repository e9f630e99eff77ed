"""Every summary (``--json``) and trace (``--trace``) minizero writes carries its mark (minizero.jsons), and an output
path naming one of the process's streams (``--json /dev/stdout``) is written into that stream (minizero.streams).
The real summaries of every program: tests/test_output_paths.py."""
import json
import os
import subprocess
import sys

import pytest

from minizero.args import UsageError, parse_args
from minizero.files import atomic_write
from minizero.overwrite import check_output
from minizero.streams import lockable
from tests.conftest import earlier_json, mpi_env


def test_train_trace_replaces_only_a_trace_minizero_marked(tmp_path, monkeypatch):
    """Before: --trace replaced any JSON with a traceEvents list: a PyTorch or Chrome profiler's trace was lost."""
    monkeypatch.chdir(tmp_path)
    events = [{"name": "aten::mm", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]
    older = {"traceEvents": events, "displayTimeUnit": "ms"}  # what minizero wrote before the mark
    for data in ({"schemaVersion": 1, "traceEvents": events, "traceName": "torch"}, older):
        (tmp_path / "t.json").write_text(json.dumps(data))
        with pytest.raises(UsageError) as e:
            parse_args(["--out", "o", "--trace", "t.json"], world_size=1)
        assert str(e.value) == (
            "--trace 't.json' exists and does not hold a trace minizero wrote, marked by the key 'minizero' in its "
            "otherData (an older minizero's has none: delete it): --trace replaces only such a file (an earlier "
            "output); give another file, or move that one away")
        assert json.loads((tmp_path / "t.json").read_text()) == data
    (tmp_path / "t.json").write_text(earlier_json("--trace"))
    assert parse_args(["--out", "o", "--trace", "t.json"], world_size=1).trace == "t.json"


def test_json_to_stdout_redirected_to_a_log_keeps_the_log_and_a_pipe_is_taken(tmp_path):
    """Before: --json /dev/stdout > log renamed the summary over the log (the report lost, what followed written to
    the unlinked file), and --trace /dev/stderr with stderr a pipe was refused as a FIFO waiting for a reader."""
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "1",
                               "--no-progress", "--sample-tokens", "0", "--out", str(tmp_path / "o"),
                               "--json", "/dev/stdout", "--trace", "/dev/stderr"], stdout=log, stderr=subprocess.PIPE,
                              text=True, timeout=300, env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = (tmp_path / "log").read_text()
    assert printed.startswith("minizero: 1 rank(s)")  # the report, kept
    start = printed.index("\n{\n") + 1
    summary, end = json.JSONDecoder().raw_decode(printed, start)
    assert summary["minizero"].startswith("a summary minizero wrote") and summary["world_size"] == 1
    assert printed[end:].startswith("\nwrote ") and "and /dev/stdout\n" in printed[end:]  # what follows: its lines
    trace = json.loads(next(line for line in proc.stderr.splitlines() if line.startswith('{"traceEvents"')))
    assert trace["otherData"]["minizero"].startswith("a trace minizero wrote")
    assert not os.path.exists(tmp_path / "o" / "summary.json")


def test_a_stream_is_written_where_it_stands_and_a_closed_one_is_refused(tmp_path):
    """Before: /dev/fd/N of an open file was renamed over (the file's text lost); a closed descriptor was probed as
    a folder to write in; a job locked /dev/.stdout.lock (a file in /dev, refused there to all but root)."""
    with open(tmp_path / "log", "w") as log:
        log.write("printed before\n")
        log.flush()
        path = f"/dev/fd/{log.fileno()}"
        check_output(path)
        atomic_write(path, lambda f: f.write('{"a": 1}'), mode="w")
        log.write("printed after\n")
    assert (tmp_path / "log").read_text() == 'printed before\n{"a": 1}\nprinted after\n'
    with pytest.raises(ValueError, match="^--json '/dev/fd/987': file descriptor 987 is not open; give a file path$"):
        check_output("/dev/fd/987")
    with open(tmp_path / "log") as read_only:
        with pytest.raises(ValueError, match="is open for reading only; give a file path"):
            check_output(f"/proc/self/fd/{read_only.fileno()}", "--trace")
    assert not lockable("/dev/stdout") and not lockable("/dev//stderr") and lockable(str(tmp_path / "log"))


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_big_json_is_judged_by_its_ends_not_parsed_whole(tmp_path, monkeypatch, flag):
    """Before: any file starting with '{' was parsed whole: a 200 MB JSON of the user's took 15 s and 1 GB before
    its refusal, and an earlier output (a long run's trace) as long before its replacement."""
    import minizero.overwrite
    from minizero import jsons
    monkeypatch.setattr(minizero.overwrite, "read_json", lambda path: pytest.fail("parsed whole"))
    pad = "0," * (jsons.BIG // 2)
    data = jsons.summary({"x": []}) if flag == "--json" else jsons.trace([])
    ours = json.dumps(data, indent=1 if flag == "--json" else None).replace("[]", f"[{pad}0]")
    for text, kept in ((ours, False), (json.dumps({"a": 1}).replace("1", f"[{pad}0]"), True),
                       (ours.replace("wrote", "wrote!"), True)):
        (tmp_path / "big.json").write_text(text)
        if kept:
            with pytest.raises(ValueError, match="exists and does not hold"):
                check_output(str(tmp_path / "big.json"), flag)
        else:
            check_output(str(tmp_path / "big.json"), flag)
