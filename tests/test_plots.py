"""The main job's pictures: memory.png merges ranks with equal ledgers and shows every category; loss.png
speaks in nats per byte. (tests/test_memory_monitor.py runs the main job and checks it writes both.)"""
import math

import numpy as np
import pytest

from minizero.ledger import CATEGORIES, equal_ranks, format_bytes

plt = pytest.importorskip("matplotlib.pyplot")  # a dependency of pip install .; importorskip for --no-deps installs

from minizero.memory.plots import ledgers_of, plot_timeline, timeline_figure  # noqa: E402
from minizero.plots import loss_figure, plot_losses, plot_timelines  # noqa: E402


def _timeline(ranks=8, steps=5):
    """A data-parallel run's timeline: parameters, optimizer state, activations, buckets; gradients never at
    a step's peak (they appear in backward, as the activations that made the peak are freed)."""
    t = np.zeros((ranks, steps, len(CATEGORIES)), dtype=np.int64)
    for c, nbytes in {"parameters": 3 << 20, "optimizer_state": 6 << 20, "activations": 10 << 20,
                      "comm_buffers": 3 << 20}.items():
        t[:, :, CATEGORIES.index(c)] = nbytes
    return t


def _ledgers(t):
    """The ranks' ledger snapshots at the end of ``t``'s run, as the memory table gets them."""
    ledgers = ledgers_of(t)
    for s in ledgers:
        s["peak"]["gradients"], s["peak"]["comm_scratch"] = 3 << 20, 96
    return ledgers


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes[::2]]


def test_memory_rows_merge_ranks_as_the_memory_table_s_columns_do():
    """Before: a dp 2 x tp 2 x pp 2 run drew 4 rows (ranks 0-3, rank 4, rank 5, ranks 6-7) under a table of 2
    columns (r0-3, r4-7): rank 5 held 128 KiB less comm_buffers at its second step's peak (when a message buffer is
    freed moves from run to run), with equal peaks and end bytes."""
    t = _timeline()
    t[4:, :, CATEGORIES.index("activations")] //= 2  # the last pipeline stage
    ledgers = _ledgers(t)
    t[5, 1, CATEGORIES.index("comm_buffers")] -= 128 << 10
    assert equal_ranks(ledgers) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the table's columns
    fig = timeline_figure(t, ledgers=ledgers)
    try:
        titles = _titles(fig)
        assert [t.split(":")[0] for t in titles] == ["ranks 0-3", "ranks 4-7"]
        assert "steps drawn" not in titles[0]
        assert "steps drawn: rank 4's; the others' differ by up to 128.00 KiB in a category" in titles[1]
    finally:
        plt.close(fig)
    ledgers[1]["peak"]["gradients"] += 1  # one byte of difference in a peak is a different ledger
    fig = timeline_figure(t, ledgers=ledgers)
    try:
        assert [t.split(":")[0] for t in _titles(fig)] == ["ranks 0, 2-3", "rank 1", "ranks 4-7"]
    finally:
        plt.close(fig)


def test_without_ledgers_ranks_merge_by_the_timeline_s_peaks_and_last_step():
    t = _timeline()
    t[4:, 2, CATEGORIES.index("activations")] //= 2  # less at a middle step only: the same peaks and end
    assert equal_ranks(ledgers_of(t)) == [list(range(8))]
    t[4:, -1, CATEGORIES.index("activations")] //= 2  # the last step's bytes differ
    assert equal_ranks(ledgers_of(t)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_memory_figure_has_a_row_per_group_and_every_category():
    t = _timeline()
    t[4:, :, CATEGORIES.index("activations")] //= 2
    fig = timeline_figure(t, ledgers=_ledgers(t))
    try:
        axes = fig.axes
        assert len(axes) == 4  # 2 groups x (timeline, per-category peaks)
        assert axes[0].get_title().startswith("ranks 0-3") and axes[2].get_title().startswith("ranks 4-7")
        names = [label.get_text() for label in axes[1].get_yticklabels()]
        assert sorted(names) == sorted(CATEGORIES)  # gradients and the zero categories too
        assert axes[1].get_xlim() == axes[3].get_xlim()  # the peak bars of every row on one scale
        bars = {n: p.get_width() for n, p in zip(names, axes[1].patches)}
        assert bars["gradients"] == pytest.approx(3.0) and bars["offloaded"] == 0  # MiB
        notes = axes[0].get_title()  # in the title, not over the stack
        assert "gradients" in notes and "peak 22.00 MiB" in notes  # not alive at the peak, said so
        fig.canvas.draw()  # the title and labels fit inside the figure
        box = fig.bbox
        for a in axes:
            for artist in [a.title, a.xaxis.label, a.yaxis.label, *a.get_yticklabels()]:
                e = artist.get_window_extent()
                assert e.x0 >= box.x0 - 1 and e.x1 <= box.x1 + 1 and e.y1 <= box.y1 + 1, artist
    finally:
        plt.close(fig)


def test_memory_png_is_written(tmp_path):
    t = _timeline(ranks=2)
    plot_timeline(str(tmp_path / "memory.png"), t, ledgers=_ledgers(t))
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="timeline must be"):
        plot_timeline(str(tmp_path / "bad.png"), t[:, :, :3])
    assert not (tmp_path / "bad.png").exists()


def test_loss_figure_speaks_nats_per_byte_and_marks_a_uniform_guess(tmp_path):
    losses = list(np.linspace(5.5, 2.0, 120))
    fig = loss_figure(plt, losses, [(0, 5.4), (60, 3.0), (120, 1.9)])
    try:
        ax = fig.axes[0]
        assert ax.get_ylabel() == "loss (nats per byte)"
        labels = [line.get_label() for line in ax.get_lines()]
        assert "train: mean of 20 steps around each" in labels and "validation (held-out end of the text)" in labels
        assert any(list(line.get_ydata()) == [math.log(256)] * 2 for line in ax.get_lines())
    finally:
        plt.close(fig)
    assert plot_losses(str(tmp_path / "loss.png"), losses, []) == f"wrote {tmp_path / 'loss.png'}"
    fig = loss_figure(plt, list(np.linspace(2.7, 2.4, 50)), [(100, 2.67), (150, 2.5)], first_step=100)  # resumed
    try:  # before: the ln 256 line stretched the axis to 5.6 and the curve sat in its bottom 15%
        assert not any(list(line.get_ydata()) == [math.log(256)] * 2 for line in fig.axes[0].get_lines())
        assert fig.axes[0].get_ylim()[1] < 3.0
    finally:
        plt.close(fig)


def test_compare_png_axis_holds_every_bar_and_marker(tmp_path, monkeypatch):
    """python -m minizero.compare's picture: the tallest stack (offloaded bytes on top) and every estimate
    marker lie inside the axes."""
    from minizero.compare_report import MIB, SHOWN, plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot() would close, to look at it
    runs = []
    for i, (name, offloaded) in enumerate([("baseline", 0), ("offload", 17), ("combined", 6)]):
        per_rank = {c: (3 + i) * MIB for c in SHOWN}
        per_rank["offloaded"] = offloaded * MIB
        runs.append({"ok": True, "ranks": 2, "strategy": name, "estimate": {"total": (3 + i) * MIB * 8},
                     "measured": {"per_rank": [per_rank], "tokens_per_s": 100.0 * (i + 1)}})
    assert plot(runs, str(tmp_path / "compare.png"), "t")
    ax = figures[0].axes[0]
    tallest = max(p.get_y() + p.get_height() for p in ax.patches)
    assert tallest == pytest.approx(max((3 + i) * (len(SHOWN) - 1) + off for i, off in enumerate([0, 17, 6])))
    assert ax.get_ylim()[1] > tallest and ax.get_ylim()[1] > max((3 + i) * 8 for i in range(3))


def test_a_resumed_run_s_curve_and_skipped_steps_sit_at_their_own_steps():
    """Before: a run resumed at step 100 drew its losses at steps 1-5, and a step skipped after the resume
    (skipped_at holds step numbers, not list indices) raised IndexError after the weights were saved."""
    losses = [3.0, 2.9, 2.8, 2.7, 2.6]
    fig = loss_figure(plt, losses, [(100, 3.1), (105, 2.5)], skipped_at=[102], first_step=100)
    try:
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        assert list(lines["train: each step's batch"].get_xdata()) == [101, 102, 103, 104, 105]
        skipped = lines["step skipped (fp16 overflow)"]
        assert list(skipped.get_xdata()) == [103] and list(skipped.get_ydata()) == [2.8]
    finally:
        plt.close(fig)


def test_a_resumed_run_s_memory_peak_is_named_by_the_progress_log_s_step():
    """Before: a run resumed after step 100 drew its memory at steps 1-5 and said "peak ... at step 3" for the
    log's step 103."""
    t = _timeline(ranks=1)
    t[0, 2, CATEGORIES.index("activations")] *= 2  # the third step of this run holds the most
    for first, step in ((0, 3), (100, 103)):
        fig = timeline_figure(t, ledgers=_ledgers(t), first_step=first)
        try:
            notes = fig.axes[0].get_title()
            assert f"peak {format_bytes(int(t[0, 2].sum()))} at step {step}" in notes, notes  # the table's units
            assert fig.axes[0].get_xlim() == (first + 0.5, first + 5.5)  # 5 steps: half a step either side
        finally:
            plt.close(fig)


def test_memory_axes_fit_the_data_and_the_first_step_has_a_tick():
    """Before: a 300-step run's flat 22.5 MiB band sat under a y-axis to 34 MiB (room for notes drawn over it),
    the first tick was 50, and the peak marker at step 1 sat on the y-axis, half clipped."""
    t = _timeline(ranks=2, steps=300)
    fig = timeline_figure(t, title="default model, 2 rank(s): dp 2 x tp 1 x pp 1, ZeRO-3, fp32", ledgers=_ledgers(t))
    try:
        ax = fig.axes[0]
        tallest = t[0].sum(axis=1).max() / 2**20
        assert tallest < ax.get_ylim()[1] <= 1.1 * tallest
        assert ax.get_xticks()[0] == 1 and 50 in ax.get_xticks()
        (marker,) = ax.get_lines()
        assert marker.get_xdata()[0] == 1 and ax.get_xlim()[0] < 1 - 0.5 - 2  # clear of the axis
        assert "ZeRO-3" in fig.texts[0].get_text()  # the run's techniques in the suptitle
    finally:
        plt.close(fig)


def test_plot_titles_name_the_run_s_techniques():
    """Before: loss.png of --zero 3 said "dp 4 x tp 1 x pp 1, fp32", as a plain data-parallel run's did."""
    from minizero.config import TrainConfig
    from minizero.header import run_techniques

    plain = TrainConfig(dp=4, tp=1, pp=1, world_size=4)
    assert run_techniques(plain) == "dp 4 x tp 1 x pp 1, fp32"
    many = TrainConfig(dp=2, tp=2, pp=2, world_size=8, zero=3, recompute="selective", precision="bf16",
                       offload_optimizer="cpu", schedule="gpipe", sequence_parallel=True)
    assert run_techniques(many) == ("dp 2 x tp 2 x pp 2, gpipe, ZeRO-3, sp, recompute selective, "
                                    "optimizer state offloaded to cpu, bf16")
    assert "1f1b" not in run_techniques(TrainConfig(dp=1, tp=1, pp=1, world_size=1))  # no pipeline: no schedule


def test_trace_timeline_legend_lists_only_the_colours_it_draws(tmp_path, monkeypatch):
    """Lesson 06's pipeline trace has forwards, backwards and waits: before, its legend also listed an optimizer
    step and an all-reduce in flight, which it never drew."""
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    events = [{"ph": "X", "pid": r, "tid": tid, "cat": cat, "ts": 10 * k, "dur": 8, "name": cat}
              for r in range(2) for k, (tid, cat) in enumerate([(0, "forward"), (1, "comm"), (0, "backward")])]
    assert plot_timelines(str(tmp_path / "trace.png"), [("1F1B", events)]).startswith("wrote")
    try:
        assert [t.get_text() for t in figures[0].legends[0].get_texts()] == [
            "forward", "backward", "blocking communication (waiting)"]
    finally:
        close(figures[0])
