"""Pipeline schedules as data: which micro-batch each stage runs forward (F) or backward (B), in order.

A schedule is a list, one entry per stage, of :class:`Op` ``(kind, mb)``. The executor
(:mod:`minizero.parallel.pipeline`) runs exactly these lists; this file also *times*
them in unit slots (a forward costs ``f`` slots, a backward ``b``), draws the timeline
and computes the bubble and the activation memory they imply. p stages, m micro-batches::

    GPipe (Huang et al. 2019): every forward, then every backward (f = b = 1 here)
        stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
        stage 1  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .          bubble = (p-1)/(m+p-1)
        stage 2  .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .          in flight: m micro-batches
        stage 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

    1F1B (PipeDream-Flush, Narayanan et al. 2021): p-s-1 warm-up forwards, then one forward
    and one backward alternately, then the remaining backwards
        stage 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 ...     same bubble,
        ...                                                        in flight: at most p - s

Timing rule (:func:`simulate`): an op starts when the previous op of its stage has
finished and its input exists — F(s, i) needs F(s-1, i), B(s, i) needs B(s+1, i) (the
last stage's B needs its own F). Sends are free. The bubble fraction is the idle share
of ``p * makespan``; with equal stage costs it is (p-1)/(m+p-1) for both schedules,
whatever the ratio b/f (:func:`bubble_formula`).

Sources: Huang et al., "GPipe", arXiv:1811.06965, section 2.3; Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
arXiv:2104.04473, section 2.2 (figures 3-4, the bubble (p-1)/m of the ideal time).
"""
from __future__ import annotations

import math
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Op(NamedTuple):
    """One unit of pipeline work: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``."""

    kind: str
    mb: int

    def __str__(self):
        return f"{self.kind}{self.mb}"


def gpipe(p: int, m: int) -> list[list[Op]]:
    """GPipe: on every stage F0..F(m-1), then B0..B(m-1). Peak in flight: m per stage."""
    return [[Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Op]]:
    """1F1B: stage s runs w = min(p-s-1, m) warm-up forwards, then F/B pairs, then w backwards.

    Peak in flight on stage s: min(p - s, m) <= p micro-batches.
    """
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [Op("F", w + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - w, m)]
        out.append(ops)
    return out


def make_schedule(name: str, p: int, m: int) -> list[list[Op]]:
    """The schedule ``name`` ("gpipe" or "1f1b") for p stages and m micro-batches.

    Raises:
        ValueError: unknown name (allowed listed), p < 1 or m < 1.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; allowed: {SCHEDULES}")
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")
    return gpipe(p, m) if name == "gpipe" else one_f_one_b(p, m)


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches whose forward has run and backward has not, along one stage's ops.

    That many micro-batches' activations are alive at once on the stage.
    """
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(schedule: list[list[Op]], f: float = 1, b: float = 2) -> list[list[tuple[Op, float, float]]]:
    """Time a schedule in slots: per stage, ``(op, start, end)`` in the stage's order.

    Args:
        schedule: per-stage op lists (every stage runs F and B of every micro-batch once).
        f, b: cost of a forward and of a backward in slots (Narayanan et al. take b = 2f).
    Raises:
        ValueError: the schedule cannot run (an op waits for one that never comes).
    """
    p = len(schedule)
    done: dict[tuple[int, Op], float] = {}
    times = [[] for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                op = schedule[s][pos[s]]
                if op.kind == "F":
                    dep = (s - 1, op) if s > 0 else None
                else:
                    dep = (s + 1, op) if s < p - 1 else (s, Op("F", op.mb))
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                end = start + (f if op.kind == "F" else b)
                done[(s, op)] = clock[s] = end
                times[s].append((op, start, end))
                pos[s] += 1
                progress = True
    stuck = [(s, str(schedule[s][pos[s]])) for s in range(p) if pos[s] < len(schedule[s])]
    if stuck:
        raise ValueError(f"schedule deadlocks: stages wait forever at {stuck}")
    return times


def bubble_fraction(timeline) -> float:
    """Idle share of the stages' time: 1 - (busy slots) / (p * makespan), from :func:`simulate`'s output."""
    makespan = max(end for stage in timeline for _, _, end in stage)
    busy = sum(end - start for stage in timeline for _, start, end in stage)
    return 1.0 - busy / (len(timeline) * makespan)


def bubble_formula(p: int, m: int) -> float:
    """(p-1)/(m+p-1): the bubble of GPipe and 1F1B with equal stage costs."""
    return (p - 1) / (m + p - 1)


def ascii_timeline(timeline, f: float = 1, b: float = 2) -> str:
    """The timeline as text: one row per stage, one column group per slot, ``.`` = idle.

    Each op is written as its name (``F3``, ``B3``) padded with ``-`` over its slots; a column group
    stands for gcd(f, b) slots.
    """
    m = 1 + max(op.mb for stage in timeline for op, _, _ in stage)
    width = 1 + len(str(m - 1))  # characters per slot
    makespan = max(end for stage in timeline for _, _, end in stage)
    unit = math.gcd(int(f), int(b)) if float(f).is_integer() and float(b).is_integer() else min(f, b)
    slots = int(round(makespan / unit))
    lines = []
    for s, stage in enumerate(timeline):
        row = ["." * width] * slots
        for op, start, end in stage:
            a, z = int(round(start / unit)), int(round(end / unit))
            text = str(op).ljust(width * (z - a), "-")
            for k in range(a, z):
                row[k] = text[(k - a) * width:(k - a + 1) * width]
        lines.append(f"stage {s} |" + "".join(row) + "|")
    return "\n".join(lines)


def plot_timeline(timeline, path: str | None = None, title: str = "", f: float = 1, b: float = 2):
    """Draw the timeline with matplotlib (forward blue, backward green); save to ``path`` if given.

    Returns the matplotlib Figure. Needs matplotlib (``pip install matplotlib``).
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    p = len(timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * max(e for st in timeline for _, _, e in st)), 0.5 + 0.5 * p))
    for s, stage in enumerate(timeline):
        for op, start, end in stage:
            color = "#4c72b0" if op.kind == "F" else "#55a868"
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=color, edgecolors="white")
            ax.text((start + end) / 2, s, str(op.mb), ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time (slots; forward = {f}, backward = {b})")
    ax.set_title(title or f"bubble {bubble_fraction(timeline):.3f}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
