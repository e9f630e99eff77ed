"""Rank 0's progress (bar, log lines, none), the loss plot, and the main job's output under mpirun to a file."""
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero.plots import MISSING, plot_losses
from minizero.progress import Progress, default_every

LINE = re.compile(r"^step +(\d+)/(\d+)  loss (\d+\.\d{4})  lr (\S+)  +([\d,]+) tok/s  elapsed ([\d.]+ (?:s|min))"
                  r", ETA ([\d.]+ (?:s|min))(  \[fp16: scale (\d+), skipped (\d+)\])?"
                  r"(  mem [\d.]+ \S+, peak [\d.]+ \S+)?$")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _drive(progress, steps, fp16=False):
    for s in range(steps):
        progress.step(s, 5.0 - s / 100, 1e-3, scale=1024.0 if fp16 else None, skipped=s // 10)
    progress.close()


def test_log_lines_every_k_steps_with_every_field():
    out = io.StringIO()
    p = Progress("auto", 60, 512, out=out)  # a StringIO is no terminal: auto picks log lines
    assert p.mode == "log" and p.every == 5  # about 15 lines per run, at round steps
    p.validation(0, 5.5)
    _drive(p, 60)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step  0/60  validation loss 5.5000"
    steps = [int(LINE.match(line).group(1)) for line in lines[1:]]
    assert steps == list(range(5, 61, 5)) and len(steps) == 12
    last = LINE.match(lines[-1])
    assert last.group(3) == "4.4100" and last.group(4) == "1.00e-03" and last.group(7) == "0.0 s"
    assert last.group(8) is None  # no fp16 fields without fp16


def test_a_resumed_run_logs_on_the_same_steps_as_an_unresumed_one():
    """Lines fall on multiples of the interval (and the last step) counted from step 0, not from the resume step:
    405 steps log every 20, so a run resumed at 310 logs 320, 340, ..., 400, 405 as the whole run does."""
    def logged(start):
        out = io.StringIO()
        p = Progress("log", 405, 512, out=out, start_step=start)
        for s in range(start, 405):
            p.step(s, 5.0, 1e-3)
        return [int(LINE.match(line).group(1)) for line in out.getvalue().splitlines()]
    assert logged(310) == [320, 340, 360, 380, 400, 405] == [s for s in logged(0) if s > 310]


@pytest.mark.parametrize("total, every", [(1, 1), (20, 1), (30, 2), (50, 5), (100, 5), (200, 10), (300, 20),
                                          (405, 20), (1000, 50), (5000, 500), (10**6, 50000)])
def test_the_default_interval_is_a_round_number_near_a_fifteenth_of_the_run(total, every):
    """Before: round(steps / 15), so --steps 100 logged steps 7, 14, 21, ...; now 1, 2 or 5 times a power of ten."""
    assert default_every(total) == every


def test_fp16_fields_and_log_every():
    out = io.StringIO()
    _drive(Progress("log", 25, 512, every=10, fp16=True, out=out), 25, fp16=True)
    got = [LINE.match(line) for line in out.getvalue().splitlines()]
    assert [int(m.group(1)) for m in got] == [10, 20, 25]  # and the last step, always
    assert [(m.group(9), m.group(10)) for m in got] == [("1024", "0"), ("1024", "1"), ("1024", "2")]


def test_bar_on_a_terminal_and_when_forced():
    tty = _Tty()
    p = Progress("auto", 30, 512, out=tty)
    assert p.mode == "bar"
    p.validation(10, 4.25)
    _drive(p, 30)
    text = tty.getvalue()
    assert "\r" in text and "30/30" in text and "step 10/30  validation loss 4.2500" in text
    forced = io.StringIO()  # --progress bar under mpirun: not a terminal, drawn anyway
    _drive(Progress("bar", 30, 512, out=forced), 30)
    assert "30/30" in forced.getvalue() and not LINE.search(forced.getvalue())


def test_none_prints_nothing_and_bad_mode_raises():
    out = io.StringIO()
    p = Progress("none", 10, 1, out=out)
    p.validation(0, 1.0)
    _drive(p, 10)
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="'loud'; allowed: auto, bar, log, none"):
        Progress("loud", 10, 1)


@pytest.mark.parametrize("every", [-3, 2.5, True, "5"])
def test_an_every_not_an_integer_at_least_0_is_refused_by_name(every):
    """every=-3 logged every 3rd step and 2.5 every 5th, silently; NumPy's integers pass, as plain ints."""
    with pytest.raises(ValueError, match=re.escape(f"every={every!r}; allowed: an integer >= 1 (steps between log "
                                                   "lines), or None or 0 (about 15 lines a run)")):
        Progress("log", 10, 1, every=every, out=io.StringIO())
    assert type(Progress("log", 10, 1, every=np.int64(4), out=io.StringIO()).every) is int


def test_loss_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "loss.png"
    assert plot_losses(str(path), [5.0, 4.0, 3.5], [(0, 5.5), (3, 3.6)], skipped_at=[0]) == f"wrote {path}"
    assert path.read_bytes()[:4] == b"\x89PNG" and os.listdir(path.parent) == ["loss.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    other = tmp_path / "none.png"
    assert plot_losses(str(other), [1.0], []) == MISSING and not other.exists()
    assert "pip install matplotlib" in MISSING


@pytest.mark.timeout(300)
def test_progress_under_mpirun_to_a_file(mpiexec, tmp_path):
    """The issue's check: mpirun -n 2 ... --steps 60 --eval-every 20 > log shows progress and validation lines."""
    from tests.conftest import mpi_env
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", "--model", "tiny",
                               "--steps", "60", "--eval-every", "20"], env=dict(mpi_env(), MINIZERO_PLOTS="1"), stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    final = next(i for i, line in enumerate(lines) if line.startswith("validation loss:"))
    progress = [(i, LINE.match(line)) for i, line in enumerate(lines) if LINE.match(line)]
    assert len(progress) >= 5 and all(i < final for i, _ in progress)
    steps = [int(m.group(1)) for _, m in progress]
    assert steps == sorted(steps) and steps[-1] == 60 and all(m.group(2) == "60" for _, m in progress)
    assert all(float(m.group(3)) > 0 for _, m in progress)
    val = {int(m.group(1)): i for i, line in enumerate(lines) if (m := re.match(r"^step +(\d+)/60  validation loss "
                                                                             r"\d+\.\d{4}$", line))}
    assert 20 in val and 40 in val and val[20] < val[40] < final
    assert os.path.isfile(tmp_path / "out" / "model.npz") and os.path.isfile(tmp_path / "out" / "loss.png")


def test_long_notes_go_on_a_line_of_their_own():
    """Before: MoE runs printed 160-column lines (memory plus expert loads after the step's fields)."""
    out = io.StringIO()
    progress = Progress("log", 20, 2048, out=out, every=1)
    progress.step(0, 5.0, 1e-3, extra="mem 1.00 MiB, peak 2.00 MiB")  # short: stays on the step's line
    progress.step(1, 5.0, 1e-3, extra="mem 1.00 MiB, peak 2.00 MiB  " + "experts 10/20/30/40%  dropped 1.0%" * 2)
    lines = out.getvalue().splitlines()
    assert LINE.match(lines[0]) and len(lines) == 3 and LINE.match(lines[1])
    assert lines[2].startswith(" " * 12 + "mem 1.00 MiB") and lines[2][12] == "m"
    assert all(len(line) <= 120 for line in lines)


def test_the_readme_first_line_fits_120_columns_and_its_note_goes_below():
    """Before: the default job's first line was 127 columns, ending "peak 23.38 MiB (max over ranks)"."""
    out = io.StringIO()
    progress = Progress("log", 300, 2048, out=out, every=20)
    progress.t0 -= 3.9
    progress.step(19, 3.3399, 2e-3, extra="mem 12.86 MiB, peak 23.38 MiB\n(mem and peak: max over ranks)")
    progress.step(39, 3.3399, 2e-3, extra="mem 106.88 KiB, peak 216.88 KiB")
    lines = out.getvalue().splitlines()
    assert LINE.match(lines[0]) and lines[0].endswith("peak 23.38 MiB") and LINE.match(lines[2])
    assert lines[1] == " " * 14 + "(mem and peak: max over ranks)"
    assert all(len(line) <= 120 for line in lines), [len(line) for line in lines]
