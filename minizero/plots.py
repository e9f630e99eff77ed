"""Pictures of a run: ``OUT/loss.png``, the training loss per step with the validation points.

matplotlib is optional at run time (not a dependency of ``pip install .``): without it
:func:`plot_losses` writes nothing and returns the one line to print, which says how to
get it. The figure is drawn with the non-interactive Agg backend (no display needed, safe
under ``mpirun``) and written through :func:`minizero.files.atomic_write`, so a crash never
leaves half a PNG.
"""
from __future__ import annotations

from minizero.files import atomic_write

MISSING = "matplotlib is not installed, so no loss plot was drawn (pip install matplotlib)"


def plot_losses(path: str, train_losses, val_history, skipped_at=(), title: str = "") -> str:
    """Write a PNG of the loss curves to ``path``; returns the line to print about it.

    Args:
        path: the PNG to write (its folder is created).
        train_losses: mean training loss of each optimizer step (nats per token), step i at x = i + 1.
        val_history: ``[(step, loss)]`` validation losses taken after ``step`` optimizer steps.
        skipped_at: 0-based steps FP16's loss scaler skipped (marked on the curve).
        title: the figure's title.
    Returns:
        ``"wrote PATH"``, or :data:`MISSING` when matplotlib cannot be imported.
    Raises:
        OSError: the file cannot be written (any previous ``path`` is left as it was).
    """
    try:
        import matplotlib  # optional at run time: a third-party import, not a minizero module
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return MISSING
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    try:
        steps = range(1, len(train_losses) + 1)
        ax.plot(steps, train_losses, linewidth=1, label="train (mean of the step's batch)")
        if val_history:
            vs, vl = zip(*val_history)
            ax.plot(vs, vl, "o-", markersize=4, label="validation")
        if len(skipped_at):
            ax.plot([s + 1 for s in skipped_at], [train_losses[s] for s in skipped_at], "x", color="red",
                    label="step skipped (fp16 overflow)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return f"wrote {path}"
