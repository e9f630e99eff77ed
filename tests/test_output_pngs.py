"""Every PNG minizero writes carries its mark (``pngs.MARK``, a tEXt chunk); an output path holding a PNG without it
(the user's own, or a plot of a minizero older than the mark) is refused before any work by every program that draws:
train (OUT/loss.png, OUT/memory.png), compare (OUT/compare.png) and plan --plot. finetune draws nothing.

Before: any file starting with the PNG signature was taken for an earlier plot and replaced."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero import compare
from minizero import plan as P
from minizero.args import UsageError, parse_args
from minizero.pngs import is_marked
from tests.conftest import REPO_ROOT, mpi_env, png_bytes

REFUSED = "does not hold a plot minizero wrote, marked by the text key 'minizero' (an older minizero's plot has none: delete it)"


def test_the_mark_is_read_by_hand_without_matplotlib(tmp_path):
    """Reading the mark is cheap: no matplotlib imported, a torn or foreign file is simply unmarked."""
    files = {"marked": png_bytes(), "unmarked": png_bytes(marked=False), "torn": png_bytes()[:40],
             "notes": b"my notes\n", "empty": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    code = ("import sys; from minizero.overwrite import refuse_foreign; from minizero.pngs import is_marked; "
            f"print([is_marked({str(tmp_path)!r} + '/' + n) for n in {list(files)!r}], 'matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert proc.stdout.split("\n")[0] == "[True, False, False, False, False] False", proc.stderr


def _draw(kind: str, path: str) -> None:
    """One of minizero's PNG writers, drawing something small at ``path``."""
    if kind == "loss":
        from minizero.plots import plot_losses
        plot_losses(path, [3.0, 2.9, 2.8], [(3, 2.9)])
    elif kind == "trace":
        from minizero.plots import plot_timelines
        plot_timelines(path, [("t", [{"ph": "X", "pid": 0, "tid": 0, "cat": "forward", "ts": 0, "dur": 8}])])
    elif kind == "memory":
        from minizero.ledger import CATEGORIES
        from minizero.memory.plots import plot_timeline
        plot_timeline(path, np.ones((1, 3, len(CATEGORIES)), dtype=np.int64) << 20)
    elif kind == "seq_sweep":
        from minizero.memory.plots import plot_seq_sweep
        plot_seq_sweep(path, [64, 128], {"a": [1 << 20, 4 << 20]}, {"a": [1 << 20, 4 << 20]})
    elif kind == "compare":
        from minizero.compare_report import MIB, SHOWN, plot
        plot([{"ok": True, "ranks": 1, "strategy": "baseline", "estimate": {"total": 8 * MIB},
               "measured": {"per_rank": [{c: MIB for c in SHOWN}], "tokens_per_s": 100.0}}], path, "t")
    else:
        from minizero.parallel.schedule import make_schedule, plot_timeline, simulate
        import matplotlib.pyplot as plt
        plt.close(plot_timeline(simulate(make_schedule("1f1b", 2, 3), 1, 2), path))


@pytest.mark.parametrize("kind", ["loss", "trace", "memory", "seq_sweep", "compare", "schedule"])
def test_every_png_minizero_writes_is_marked(tmp_path, kind):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / f"{kind}.png")
    _draw(kind, path)
    assert is_marked(path)


@pytest.mark.parametrize("name", ["loss.png", "memory.png"])
def test_train_refuses_a_users_own_png_in_out_and_takes_its_own(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIZERO_PLOTS", "1")
    (tmp_path / "o").mkdir()
    mine = tmp_path / "o" / name
    mine.write_bytes(png_bytes(marked=False))
    with pytest.raises(UsageError, match=re.escape(f"--out 'o/{name}' exists and {REFUSED}: --out replaces only such "
                                                   "a file (an earlier output); give another folder, or move that "
                                                   "one away")):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    assert mine.read_bytes() == png_bytes(marked=False)
    mine.write_bytes(png_bytes())  # an earlier run's
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_train_with_plots_off_leaves_a_file_under_a_plots_name_alone(tmp_path, monkeypatch):
    """MINIZERO_PLOTS=0 draws neither plot: a file of the user's named loss.png or memory.png loses nothing, so the
    run is not refused (before: refused as if the plot were drawn over it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIZERO_PLOTS", "0")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "loss.png").write_text("my notes\n")
    (tmp_path / "o" / "memory.png").write_bytes(png_bytes(marked=False))
    parse_args(["--model", "tiny", "--out", "o"], world_size=1)
    monkeypatch.setenv("MINIZERO_PLOTS", "1")
    with pytest.raises(UsageError, match=re.escape(f"--out 'o/loss.png' exists and {REFUSED}")):
        parse_args(["--model", "tiny", "--out", "o"], world_size=1)


def test_a_second_train_run_replaces_the_first_runs_plots(tmp_path):
    """The plots a run draws are its next run's to replace (the mark is written, not only checked)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "o"
    stamps = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "2",
                               "--no-progress", "--out", str(out)], capture_output=True, text=True, timeout=300,
                              env=dict(mpi_env(), MINIZERO_PLOTS="1"), cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stderr
        stamps.append([os.stat(out / n).st_ino for n in ("loss.png", "memory.png")])
        assert is_marked(str(out / "loss.png")) and is_marked(str(out / "memory.png"))
    assert stamps[0][0] != stamps[1][0] and stamps[0][1] != stamps[1][1]  # replaced (a new file renamed in)


def test_compare_refuses_a_users_own_png_in_out_and_takes_its_own(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "compare.png").write_bytes(png_bytes(marked=False))
    with pytest.raises(compare.UsageError, match=re.escape(
            f"--out {str(out)!r}: {str(out / 'compare.png')!r} is there and is not the compare.png compare writes, "
            "marked by the text key 'minizero' (an older minizero's plot has none: delete it); it replaces only an earlier one")):
        compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--out", str(out)])
    assert (out / "compare.png").read_bytes() == png_bytes(marked=False)
    (out / "compare.png").write_bytes(png_bytes())  # an earlier run's
    compare.parse_args(["--model", "tiny", "--strategies", "baseline", "--ranks", "1", "--out", str(out)])


def _plan(capsys, *argv):
    try:
        code = P.main(["--model", "tiny", "--gpus", "2", *argv])
    except SystemExit as e:
        code = e.code
    return code, " ".join(capsys.readouterr().err.split())


def test_plan_plot_refuses_a_users_own_png_and_a_dash(tmp_path, monkeypatch, capsys):
    """Before: --plot mine.png replaced any PNG; --plot - wrote ./-.png."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.png").write_bytes(png_bytes(marked=False))
    code, err = _plan(capsys, "--plot", "mine.png")
    assert code == 2 and f"--plot 'mine.png' exists and {REFUSED}" in err, err
    assert (tmp_path / "mine.png").read_bytes() == png_bytes(marked=False)
    code, err = _plan(capsys, "--plot", "-")
    assert code == 2 and ("--plot '-': give a file name for the PNG (it is not written to standard output; ./- "
                          "writes ./-.png)") in err, err
    assert sorted(os.listdir(tmp_path)) == ["mine.png"]
    (tmp_path / "old.png").write_bytes(png_bytes())  # an earlier plan's
    code, err = _plan(capsys, "--plot", "old")
    assert code == 0 and is_marked(str(tmp_path / "old.png")) and (tmp_path / "old.png").read_bytes() != png_bytes()


def test_a_benchmarks_png_path_keeps_a_users_own_png(tmp_path):
    """bench/ checks --png and --figure with overwrite.check_output (bench/_args.check_output_path): the same rule."""
    from minizero.overwrite import check_output

    (tmp_path / "mine.png").write_bytes(png_bytes(marked=False))
    (tmp_path / "old.png").write_bytes(png_bytes())
    with pytest.raises(ValueError, match=re.escape(f"--png {str(tmp_path / 'mine.png')!r} exists and {REFUSED}")):
        check_output(str(tmp_path / "mine.png"), "--png")
    check_output(str(tmp_path / "old.png"), "--png")


def test_a_png_of_a_million_empty_chunks_is_judged_quickly(tmp_path):
    """Before: is_marked walked every chunk header to the mark at the end (a million reads and seeks for 12 MB);
    now it gives up after pngs.CHUNKS chunks, where matplotlib's mark never is."""
    import time
    from minizero.pngs import CHUNKS, KEY
    text = KEY.encode() + b"\0x"
    mark = len(text).to_bytes(4, "big") + b"tEXt" + text + b"\0" * 4
    head = png_bytes()[:33]  # the signature and IHDR
    path = tmp_path / "chunks.png"
    path.write_bytes(head + b"\0\0\0\0zzZz\0\0\0\0" * 1_000_000 + mark)
    start = time.perf_counter()
    assert not is_marked(str(path)) and time.perf_counter() - start < 0.5
    path.write_bytes(head + b"\0\0\0\0zzZz\0\0\0\0" * (CHUNKS - 2) + mark)  # within the bound: still found
    assert is_marked(str(path))
