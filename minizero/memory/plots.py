"""Pictures of where the bytes live: the per-rank memory timeline and the sequence-length sweep
(matplotlib optional)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

from minizero.files import atomic_write
from minizero.ledger import CATEGORIES, equal_ranks, format_bytes, rank_runs
from minizero.pngs import MARK

INSTALL_HINT = "no memory plot: matplotlib is not installed (pip install matplotlib)"
#: the environment variable that turns the main job's two pictures (OUT/loss.png, OUT/memory.png) off ("0")
PLOTS_ENV = "MINIZERO_PLOTS"
PLOTS_OFF = f"{PLOTS_ENV}=0: neither loss.png nor memory.png was drawn"


def plots_on() -> bool:
    """Whether the main job draws ``OUT/loss.png`` and ``OUT/memory.png`` (``MINIZERO_PLOTS``: unset, empty or
    "1": on; "0": off, for many short runs, where importing matplotlib and drawing are much of each run: the test
    suite sets it).

    Raises ValueError: any other value; the trainer checks it with its arguments, before any work.
    """
    text = os.environ.get(PLOTS_ENV) or "1"  # empty: unset (as every MINIZERO_ variable)
    if text not in ("0", "1"):
        raise ValueError(f"{PLOTS_ENV}={text!r}; allowed: \"1\" (draw loss.png and memory.png, the default) or "
                         "\"0\" (draw neither)")
    return text == "1"


def have_matplotlib() -> bool:
    """True when ``import matplotlib`` would succeed."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ledgers_of(timeline) -> list[dict]:
    """Ledger snapshots made from a (ranks, steps, categories) timeline alone: the last step as current, each
    category's largest step as its peak (for a picture drawn without the ledgers' own snapshots)."""
    t = np.asarray(timeline)
    return [{"current": dict(zip(CATEGORIES, rows[-1].tolist())),
             "peak": dict(zip(CATEGORIES, rows.max(axis=0).tolist())), "peak_total": int(rows.sum(axis=1).max())}
            for rows in t]


def _label(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_runs(ranks, ', ')}"


def plot_timeline(path: str, timeline, title: str = "", ledgers=None, first_step: int = 0) -> None:
    """Write :func:`timeline_figure` as a PNG to ``path`` (same arguments and errors)."""
    plt = _pyplot()
    fig = timeline_figure(timeline, title, ledgers, first_step)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png", metadata=MARK))
    plt.close(fig)


def timeline_figure(timeline, title: str = "", ledgers=None, first_step: int = 0):
    """A matplotlib Figure, a row per group of equal ranks: bytes per category over the steps, each category's peak.

    ``timeline``: (ranks, steps, len(CATEGORIES)) bytes; ``ledgers``: each rank's ledger snapshot, whose equal ones
    share a row as they share a column of the memory table (:func:`equal_ranks`; default :func:`ledgers_of`); a row
    draws its first rank's steps and says how far the others' differ (e.g. when a message buffer is freed);
    ``first_step``: the steps before it (a resumed run). Raises ImportError: no matplotlib; ValueError: bad shape.
    """
    t = np.asarray(timeline, dtype=np.float64)
    if t.ndim != 3 or t.shape[2] != len(CATEGORIES):
        raise ValueError(f"timeline must be (ranks, steps, {len(CATEGORIES)}), got {t.shape}")
    plt = _pyplot()
    ledgers = ledgers_of(t) if ledgers is None else ledgers
    groups = equal_ranks(ledgers)
    colors = {c: f"C{i}" for i, c in enumerate(CATEGORIES)}
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 1.0 + 2.8 * len(groups)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]}, layout="constrained")  # room for the titles
    mib = t / 2**20
    x = np.arange(first_step + 1, first_step + t.shape[1] + 1)  # 1-based, as the progress log
    top = mib.sum(axis=2).max() * 1.06 or 1  # just above the tallest stack: the peak marker sits on it
    pad = max(0.5, 0.015 * len(x))  # a marker at the first or last step stays clear of the axis
    widest = max(max(ledgers[r]["peak"][c] for c in CATEGORIES) for ranks in groups for r in ranks) / 2**20
    for (ax, bx), ranks in zip(axes, groups):
        r = ranks[0]
        used = [i for i, _ in enumerate(CATEGORIES) if mib[r, :, i].any()]
        edges = np.append(x - 0.5, x[-1] + 0.5)  # each step a block centred on it, the last one too
        ax.stackplot(edges, *[np.append(mib[r, :, i], mib[r, -1, i]) for i in used],
                     colors=[colors[CATEGORIES[i]] for i in used], step="post")
        total = mib[r].sum(axis=1)
        k = int(total.argmax())
        ax.plot([x[k]], [total[k]], "v", color="black", clip_on=False)
        own = [ledgers[r]["peak"][c] for c in CATEGORIES]
        apart = int(np.abs(t[ranks] - t[r]).max())  # the group's other ranks at the same steps
        absent = [c for i, c in enumerate(CATEGORIES) if own[i] and i not in used]
        # the notes go in the title, not over the stack, so the y-axis can end at the data
        ax.set_title(f"{_label(ranks)}: memory at each step's peak, stacked (colors as on the right)\n"
                     f"\u25bc peak {format_bytes(int(t[r, k].sum()))} at step {x[k]}"
                     # e.g. gradients: made during backward, as the activations that set the peak are freed
                     + (f"; not alive at the step's peak: {', '.join(absent)}" if absent else "")
                     + (f"\nsteps drawn: rank {r}'s; the others' differ by up to {format_bytes(apart)} in a category"
                        if apart else ""), fontsize=9)
        ax.set_xlim(x[0] - pad, x[-1] + pad)
        if len(x) <= 12:  # steps are whole numbers: no tick at 1.5
            ax.set_xticks(x)
        else:  # the first step gets a tick too (the locator alone starts at 50 for 300 steps)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ticks = [v for v in ax.get_xticks() if x[0] < v <= x[-1]]
            gap = (ticks[1] - ticks[0]) / 2 if len(ticks) > 1 else 0
            ax.set_xticks([x[0], *[v for v in ticks if v - x[0] >= gap]])
        ax.set_ylim(0, top)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel("MiB", fontsize=8)
        ys = np.arange(len(CATEGORIES))[::-1]
        bx.barh(ys, np.divide(own, 2**20), color=[colors[c] for c in CATEGORIES])
        bx.set_yticks(ys, CATEGORIES, fontsize=8)
        bx.set_xlim(0, widest * 1.5 or 1)  # one scale for every row: rows compare at a glance
        for y, v in zip(ys, own):
            bx.text(v / 2**20, y, f" {format_bytes(v)}", va="center", fontsize=7)
        bx.set_title("each category's own peak over the run (axis in MiB)", fontsize=9)
        bx.tick_params(axis="x", labelsize=8)
    fig.suptitle((f"{title}\n" if title else "") + "ledger memory per rank by category (ranks with equal peaks and "
                 "end bytes share a row, as the memory table's columns)", fontsize=10)
    return fig


def plot_seq_sweep(path: str, seq_lens, measured: dict, formula: dict, split: dict | None = None,
                   title: str = "") -> None:
    """Write a PNG of saved activation bytes per layer against s (log-log); ``split`` drawn dashed.

    ``measured``, ``formula``: ``{label: [bytes per layer, one per s]}``. Raises ImportError: no matplotlib.
    Source: Korthikanti et al. 2022, section 4.1 (sbh(34 + 5as/h)).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    s = np.asarray(seq_lens)
    for i, (label, ys) in enumerate(formula.items()):
        ax.plot(s, np.asarray(ys) / 2**20, "-", color=f"C{i}", label=f"{label}: formula")
        if label in measured:
            ax.plot(s, np.asarray(measured[label]) / 2**20, "o", color=f"C{i}", label=f"{label}: ledger")
    for label, ys in (split or {}).items():
        ax.plot(s, np.asarray(ys) / 2**20, "--", color="gray", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("saved activations per layer (MiB)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "activation bytes per layer vs s", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png", metadata=MARK))
    plt.close(fig)
