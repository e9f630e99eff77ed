"""Pictures of where the bytes live: the per-rank memory timeline and the sequence-length sweep.

matplotlib is optional: :func:`have_matplotlib` says whether it can be imported, and the
callers print one line (``pip install matplotlib``) instead of a picture when it cannot.
Files are written through :func:`minizero.files.atomic_write` (PNG, 100 dpi).
"""
from __future__ import annotations

import importlib.util

import numpy as np

from minizero.files import atomic_write
from minizero.ledger import CATEGORIES

INSTALL_HINT = "no memory plot: matplotlib is not installed (pip install matplotlib)"


def have_matplotlib() -> bool:
    """True when ``import matplotlib`` would succeed."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(path: str, timeline, title: str = "") -> None:
    """Write a PNG: per rank, bytes per category over the steps (stacked), the peak marked.

    Args:
        path: the PNG to write.
        timeline: (ranks, steps, len(CATEGORIES)) bytes, each step's breakdown at its peak
            (:func:`minizero.memory.monitor.gather_timeline`).
    Raises:
        ImportError: matplotlib missing (check :func:`have_matplotlib` first).
        ValueError: ``timeline`` is not 3-D with len(CATEGORIES) columns.
    Source: the stacked-by-category view of PyTorch's memory snapshot viewer.
    """
    t = np.asarray(timeline, dtype=np.float64)
    if t.ndim != 3 or t.shape[2] != len(CATEGORIES):
        raise ValueError(f"timeline must be (ranks, steps, {len(CATEGORIES)}), got {t.shape}")
    plt = _pyplot()
    ranks, steps = t.shape[0], t.shape[1]
    cols = min(ranks, 4)
    rows = -(-ranks // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False, sharey=True)
    x = np.arange(1, steps + 1)
    used = [i for i, _ in enumerate(CATEGORIES) if t[:, :, i].any()]
    mib = t / 2**20
    for r in range(rows * cols):
        ax = axes[r // cols][r % cols]
        if r >= ranks:
            ax.axis("off")
            continue
        ax.stackplot(x, *[mib[r, :, i] for i in used], labels=[CATEGORIES[i] for i in used], step="post")
        total = mib[r].sum(axis=1)
        k = int(total.argmax())
        ax.plot([x[k]], [total[k]], "v", color="black")
        ax.annotate(f"peak {total[k]:.2f} MiB\nstep {x[k]}", (x[k], total[k]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
        ax.set_ylim(0, mib.sum(axis=2).max() * 1.3 or 1)
        ax.set_title(f"rank {r}", fontsize=9)
        ax.set_xlabel("step")
        if r % cols == 0:
            ax.set_ylabel("MiB at the step's peak")
    axes[0][0].legend(loc="lower left", fontsize=7)
    fig.suptitle(title or "ledger memory per rank, by category (each step at its peak)", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)


def plot_seq_sweep(path: str, seq_lens, measured: dict, formula: dict, split: dict | None = None,
                   title: str = "") -> None:
    """Write a PNG: saved activation bytes per layer against sequence length s (log-log).

    Args:
        seq_lens: the s values. measured, formula: ``{label: [bytes per layer, one per s]}``
            (ledger points and the formula's curve, e.g. one label per recompute mode).
        split: optional ``{label: [bytes, one per s]}`` drawn dashed (e.g. the a*s^2*b term
            alone), to show where the quadratic attention term takes over.
    Raises:
        ImportError: matplotlib missing.
    Source: Korthikanti et al. 2022, section 4.1 (sbh(34 + 5as/h)): linear in s below
        s ~ h/a, quadratic above.
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
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)
