"""Every summary (``--json``) and trace (``--trace``) minizero writes carries its mark (minizero.jsons).
The real summaries of every program: tests/test_output_paths.py."""
import json

import pytest

from minizero.args import UsageError, parse_args
from tests.conftest import earlier_json


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

