"""Pictures of a run: ``OUT/loss.png``, the training loss per step with the validation points.

matplotlib is a dependency of ``pip install .``; where it cannot be imported anyway, :func:`plot_losses` writes nothing
and returns the one line to print, which says how to get it. The figure is drawn with the non-interactive Agg backend
(no display needed, safe under ``mpirun``) and written through :func:`minizero.files.atomic_write`, so a crash never
leaves half a PNG.
"""
from __future__ import annotations

import math

from minizero.files import atomic_write
from minizero.numerals import counted
from minizero.pngs import MARK

SMOOTH = 20  # steps in the running mean drawn over the training loss
MISSING = "matplotlib is not installed, so no loss plot was drawn (pip install matplotlib)"


def steps_drawn(first_step: int, drawn: int, steps: int) -> str:
    """The title's words for the steps :func:`loss_figure` draws: ``'20 steps'``, or where a run resumed (or
    stopped early) draws only its own, ``'steps 11-20 of 20 (resumed from step 10)'``."""
    if first_step == 0 and drawn == steps:
        return counted(steps, "step")
    return (f"steps {first_step + 1}-{first_step + drawn} of {steps}"
            + (f" (resumed from step {first_step})" if first_step else ""))


def plot_losses(path: str, train_losses, val_history, skipped_at=(), title: str = "", first_step: int = 0) -> str:
    """Write a PNG of the loss curves to ``path``; returns the line to print about it.

    ``train_losses``: each step's mean loss (nats per byte), step i at x = first_step + i + 1 (``first_step``: where
    a resumed run began); ``val_history``: [(step, loss)]; ``skipped_at``: 0-based steps FP16 skipped (marked).
    Returns ``"wrote PATH"`` or :data:`MISSING` (no matplotlib). Raises OSError (a previous ``path`` stays).
    """
    try:
        import matplotlib  # a dependency; an install with --no-deps may still lack it
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING
    fig = loss_figure(plt, train_losses, val_history, skipped_at, title, first_step)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, metadata=MARK))
    finally:
        plt.close(fig)
    return f"wrote {path}"


def loss_figure(plt, train_losses, val_history, skipped_at=(), title: str = "", first_step: int = 0):
    """The Figure :func:`plot_losses` writes (``plt``: ``matplotlib.pyplot``); same arguments."""
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    steps = range(first_step + 1, first_step + len(train_losses) + 1)
    ax.plot(steps, train_losses, linewidth=0.8, alpha=0.45, color="C0", label="train: each step's batch")
    if len(train_losses) >= 5 * SMOOTH:  # shorter runs: too few points to smooth
        h = SMOOTH // 2  # centred: a trailing mean would lag the fast early fall
        run = [sum(train_losses[i - h:i + h]) / (2 * h) for i in range(h, len(train_losses) - h + 1)]
        ax.plot(steps[h - 1:len(train_losses) - h], run, linewidth=1.6, color="C0",
                label=f"train: mean of {2 * h} steps around each")
    if val_history:
        vs, vl = zip(*val_history)
        ax.plot(vs, vl, "o", markersize=5, color="C1",  # points only: a line between evaluations 100 steps
                label="validation (held-out end of the text)")  # apart would draw a curve nobody measured
    if len(skipped_at):
        ax.plot([s + 1 for s in skipped_at], [train_losses[s - first_step] for s in skipped_at], "x", color="red",
                label="step skipped (fp16 overflow)")
    highest = max([*train_losses, *(loss for _, loss in val_history)], default=0.0)
    if highest > 0.75 * math.log(256):  # a run from scratch; a resumed run's curve sat in the axis's bottom 15%
        ax.axhline(math.log(256), color="0.5", linewidth=0.8, linestyle=":")
        ax.text(first_step + len(train_losses), math.log(256), "ln 256: a uniform guess over 256 bytes", ha="right",
                va="bottom", fontsize=7, color="0.4")
    ax.set_xlabel("optimizer step")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers: no tick at 2.5
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


LEGEND = {"tab:blue": "forward", "tab:orange": "backward", "tab:green": "optimizer step",
          "tab:red": "blocking communication (waiting)", "0.6": "all-reduce in flight (overlapped)",
          "tab:purple": "other"}


def plot_timelines(path: str, panels, title: str = "") -> str:
    """Write a PNG of trace timelines: one panel per ``(label, events)``, per rank a compute and a comm lane.

    ``events``: a ``--trace`` file's ``"X"`` events (``ts``/``dur`` in us); each panel starts at its first. Lanes:
    forward (blue), backward (orange), optimizer (green), blocking comm (red), comm in flight (grey).
    Returns ``"wrote PATH"`` or :data:`MISSING` (no matplotlib).
    """
    try:
        import matplotlib  # optional at run time: a third-party import, not a minizero module
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    used = set()  # the legend lists only the colours some bar has
    fig, axes = plt.subplots(len(panels), 1, figsize=(9.0, 1.2 + 1.3 * len(panels) * max(
        len({e["pid"] for e in ev}) for _, ev in panels) / 2), squeeze=False)
    try:
        for ax, (label, events) in zip(axes[:, 0], panels):
            xs = [e for e in events if e.get("ph") == "X"]
            t0 = min(e["ts"] for e in xs)
            ranks = sorted({e["pid"] for e in xs})
            ticks, names = [], []
            for i, r in enumerate(ranks):
                base = 3 * (len(ranks) - 1 - i)
                for e in (e for e in xs if e["pid"] == r):
                    x, w = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05)
                    if e["tid"] == 0:
                        y, c = base + 1, colors.get(e["cat"], "tab:purple")
                    else:
                        y, c = base, "tab:red" if e["tid"] == 1 else "0.6"
                    used.add(c)
                    ax.broken_barh([(x, w)], (y + (0.45 if e["tid"] == 2 else 0.05), 0.45 if e["tid"] else 0.9),
                                   color=c, linewidth=0)
                ticks += [base + 0.5, base + 1.5]
                names += [f"rank {r} comm", f"rank {r} compute"]
            ax.set_yticks(ticks)
            ax.set_yticklabels(names, fontsize=7)
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("time (ms)", fontsize=8)
        shown = [(c, name) for c, name in LEGEND.items() if c in used]
        fig.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in shown], [name for _, name in shown],
                   loc="lower center", ncol=len(shown), fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, metadata=MARK))
    finally:
        plt.close(fig)
    return f"wrote {path}"
