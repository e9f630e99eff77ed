"""Pipeline schedules as data: which micro-batch each stage runs forward (F), backward (B) or weight-gradient (W),
in order.

A schedule is a list per stage of :class:`Op` ``(kind, mb)`` (chunked: ``(kind, mb, chunk)``), run as is by
:mod:`minizero.parallel.pipeline` and timed in slots by :func:`simulate` (sends free).
Sources: GPipe, arXiv:1811.06965, section 2.3; 1F1B and interleaved 1F1B, Narayanan et al.,
arXiv:2104.04473, section 2.2; ZB-H1 and ZB-V, Qi et al., arXiv:2401.10241, sections 2.1 and 6.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from minizero.pngs import MARK

SCHEDULES = ("gpipe", "1f1b")  #: one chunk per stage: ``make_schedule(name, p, m)`` for any p, m
ZERO_BUBBLE = ("zb-h1", "zb-v")  #: B and W split (zb-v: two chunks per rank, V-shaped)
V_SHAPED = ("zb-v",)  #: rank r holds virtual stages r and 2p-1-r (parallel/interleaved.py's v_shape)
ALL_SCHEDULES = SCHEDULES + ("interleaved",) + ZERO_BUBBLE  #: interleaved: v chunks per stage, m a multiple of p


class Op(NamedTuple):
    """One unit of pipeline work: ``kind`` "F" (forward), "B" (backward) or "W" (weight gradients) of ``mb``."""

    kind: str
    mb: int
    chunk = 0  # not a field: a one-chunk schedule's ops all run the stage's one chunk

    def __str__(self):
        return f"{self.kind}{self.mb}"

    def virtual_stage(self, rank: int, p: int) -> int:
        """Which of the schedule's stages this op runs: the rank's own."""
        return rank


class ChunkOp(NamedTuple):
    """F or B of micro-batch ``mb`` on model chunk ``chunk`` (virtual stage chunk*p + r); written ``F3``, ``F3.1``."""

    kind: str
    mb: int
    chunk: int

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")

    def virtual_stage(self, rank: int, p: int) -> int:
        """Chunk c of rank r is virtual stage c p + r (round robin)."""
        return self.chunk * p + rank


class VChunkOp(ChunkOp):
    """An op of ZB-V: chunk 0 of rank r is virtual stage r, chunk 1 is 2p-1-r (the V)."""

    __slots__ = ()

    def virtual_stage(self, rank: int, p: int) -> int:
        return rank if self.chunk == 0 else 2 * p - 1 - rank


def gpipe(p: int, m: int) -> list[list[Op]]:
    """GPipe: on every stage F0..F(m-1), then B0..B(m-1). Peak in flight: m per stage."""
    return [[Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Op]]:
    """1F1B: stage s runs w = min(p-s-1, m) warm-up forwards, F/B pairs, then w backwards;
    peak min(p - s, m) in flight."""
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(w)]
        for i in range(m - w):
            ops += [Op("F", w + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - w, m)]
        out.append(ops)
    return out


def interleaved(p: int, m: int, v: int) -> list[list[ChunkOp]]:
    """Interleaved 1F1B over v chunks per rank, in Megatron-LM's order (groups of p micro-batches per chunk).

    Rank r runs w = min(2(p-r-1) + (v-1)p, m v) warm-up forwards, F/B pairs, then the remaining backwards.
    Raises ValueError: m not a multiple of p (Megatron-LM's rule).
    """
    if m % p:
        raise ValueError(f"the interleaved schedule needs the micro-batches m={m} to be a multiple of pp={p}")

    def op(kind, k):  # the rank's k-th F (or B): groups of p micro-batches per chunk; B walks the chunks backwards
        c = (k // p) % v
        return ChunkOp(kind, (k // (p * v)) * p + k % p, c if kind == "F" else v - 1 - c)

    total, out = m * v, []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [op("F", k) for k in range(w)]
        for i in range(total - w):
            ops += [op("F", w + i), op("B", i)]
        ops += [op("B", k) for k in range(total - w, total)]
        out.append(ops)
    return out


def zb_h1(p: int, m: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al. 2024, section 2.1): 1F1B with each B split into B and W; stage s runs W(i) after B(i+s).

    Peak in flight (F run, W not): min(p, m) on every stage.
    """
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(w)]
        for i in range(m):
            if w + i < m:
                ops.append(Op("F", w + i))
            ops.append(Op("B", i))
            if i >= s:  # W lags B by s
                ops.append(Op("W", i - s))
        out.append(ops + [Op("W", i) for i in range(max(m - s, 0), m)])
    return out


def zb_v(p: int, m: int) -> list[list[VChunkOp]]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, rank r holding virtual stages r and 2p-1-r.

    Laid out for max(m, 2p-1) micro-batches, ops of micro-batches >= m dropped (as PyTorch's
    ScheduleZBVZeroBubble). Peak in flight: 2p chunks on every rank.
    """
    n, out = max(m, 2 * p - 1), []
    for r in range(p):
        ops, cnt = [], {k: 0 for k in ("F0", "F1", "B0", "B1", "W0", "W1")}

        def add(kind, c):
            ops.append(VChunkOp(kind, cnt[f"{kind}{c}"], c))
            cnt[f"{kind}{c}"] += 1

        for _ in range(2 * (p - r) - 1):
            add("F", 0)
        for _ in range(r):
            add("F", 1), add("F", 0)
        for _ in range(p - r):
            add("F", 1), add("B", 1), add("W", 1)
        while cnt["F1"] < cnt["F0"] or cnt["F0"] < n:
            if cnt["F0"] < n:
                add("F", 0)
            add("B", 0), add("W", 0), add("F", 1), add("B", 1), add("W", 1)
        for _ in range(r):
            add("B", 0), add("B", 1)
        for _ in range(p - r):
            add("B", 0), add("W", 0)
        while cnt["W1"] < cnt["B1"]:
            add("W", 1)
        while cnt["W0"] < cnt["B0"]:
            add("W", 0)
        out.append([op for op in ops if op.mb < m])
    return out


def make_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The schedule ``name`` (:data:`ALL_SCHEDULES`; "interleaved" with v chunks per rank) for p stages,
    m micro-batches.

    Raises ValueError: unknown name, p, m or v < 1, v > 1 except for "interleaved" (zb-v: 1 or 2), or
    (interleaved) m not a multiple of p.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; allowed: {ALL_SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1 stages, m >= 1 micro-batches and v >= 1 chunks, got p={p}, m={m}, v={v}")
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zb-v" and v in (1, 2):
        return zb_v(p, m)
    if v != 1:
        raise ValueError(f"{v} virtual stages need the interleaved schedule, not {name!r}")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name](p, m)


def split_backwards(ops) -> set:
    """(mb, chunk) of the ops whose backward is split: a W of theirs is in the list."""
    return {(op.mb, op.chunk) for op in ops if op.kind == "W"}


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches (chunks) forwarded and not yet backwarded (W included) on one stage: its live activations."""
    split, live, peak = split_backwards(ops), 0, 0
    for op in ops:
        if op.kind == "F":
            live += 1
        elif op.kind == "W" or (op.mb, op.chunk) not in split:  # the op that frees F's activations (a split B's W)
            live -= 1
        peak = max(peak, live)
    return peak


def simulate(schedule: list[list[Op]], f: float = 1, b: float = 2, w: float = 1) -> list[list[tuple[Op, float, float]]]:
    """Time a schedule in slots: per stage, ``(op, start, end)`` in the stage's order.

    ``f``, ``b``: forward and whole-backward costs (Narayanan et al.: b = 2f); ``w``: W's part of b.
    An op starts when its stage is free and its input exists. Raises ValueError: an op waits forever.
    """
    p = len(schedule)
    last = p * (1 + max(op.chunk for ops in schedule for op in ops)) - 1  # the last virtual stage
    split = [split_backwards(ops) for ops in schedule]
    done: dict[tuple[int, str, int], float] = {}  # (virtual stage, kind, mb) -> end time
    times = [[] for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                op = schedule[s][pos[s]]
                vs = op.virtual_stage(s, p)
                if op.kind == "F":
                    dep = (vs - 1, "F", op.mb) if vs > 0 else None
                elif op.kind == "W":
                    dep = (vs, "B", op.mb)
                else:
                    dep = (vs + 1, "B", op.mb) if vs < last else (vs, "F", op.mb)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                cost = {"F": f, "W": w}.get(op.kind, b - w if (op.mb, op.chunk) in split[s] else b)
                end = start + cost
                done[(vs, op.kind, op.mb)] = clock[s] = end
                times[s].append((op, start, end))
                pos[s] += 1
                progress = True
    stuck = [(s, str(schedule[s][pos[s]])) for s in range(p) if pos[s] < len(schedule[s])]
    if stuck:
        raise ValueError(f"schedule deadlocks: stages wait forever at {stuck}")
    return times


def _makespan_busy(timeline) -> tuple[float, float]:
    makespan = max(end for stage in timeline for _, _, end in stage)
    return makespan, sum(end - start for stage in timeline for _, start, end in stage)


def bubble_fraction(timeline) -> float:
    """Idle share of the stages' time: 1 - (busy slots) / (p * makespan), from :func:`simulate`'s output."""
    makespan, busy = _makespan_busy(timeline)
    return 1.0 - busy / (len(timeline) * makespan)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """(p-1)/(v m+p-1): the idle share of GPipe and 1F1B (v = 1) and of interleaved 1F1B, equal stage costs."""
    return (p - 1) / (v * m + p - 1)


def bubble_over_ideal(p: int, m: int, v: int = 1) -> float:
    """(p-1)/(v m): the bubble as a share of the ideal (bubble-free) time, Narayanan et al. 2021 section 2.2."""
    return (p - 1) / (v * m)


def zb_h1_bubble_ratio(p: int, m: int, t_f: float = 1, t_b: float = 1, t_w: float = 1) -> float:
    """(p-1)(T_F+T_B-T_W) / (m (T_F+T_B+T_W)): ZB-H1's idle over busy time (Qi et al. 2024, Table 2).

    Assumes m >= p and T_W <= T_F + T_B; equal times: (p-1)/(3m), a third of 1F1B's.
    """
    return (p - 1) * (t_f + t_b - t_w) / (m * (t_f + t_b + t_w))


def bubble_ratio(timeline) -> float:
    """Idle time over busy time, (p makespan - busy) / busy: Narayanan et al.'s bubble, (p-1)/(v m) ideally."""
    makespan, busy = _makespan_busy(timeline)
    return (len(timeline) * makespan - busy) / busy


def ascii_timeline(timeline, f: float = 1, b: float = 2, w: float = 1) -> str:
    """The timeline as text: one row per stage, ops as ``F3--``, ``.`` = idle; a column is gcd(f, b, w) slots."""
    width = max(len(str(op)) for stage in timeline for op, _, _ in stage)  # characters per slot
    makespan = max(end for stage in timeline for _, _, end in stage)
    costs = (f, b, w)
    unit = math.gcd(*map(int, costs)) if all(float(c).is_integer() for c in costs) else min(costs)
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
    """Draw the timeline with matplotlib, saved to ``path``; returns the Figure. Colours as the trace plots'
    (``minizero.plots``): F blue, B orange, W brown; a cell reads its micro-batch, ``3.1`` on chunk 1."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    p, colors = len(timeline), {"F": "tab:blue", "B": "tab:orange", "W": "tab:brown"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * max(e for st in timeline for _, _, e in st)), 1.0 + 0.5 * p))
    for s, stage in enumerate(timeline):
        for op, start, end in stage:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=colors[op.kind], edgecolors="white")
            ax.text((start + end) / 2, s, str(op)[1:], ha="center", va="center", color="white", fontsize=7)
    kinds = {"F": "forward", "B": "backward" + (" (input gradients)" if any(
        op.kind == "W" for st in timeline for op, _, _ in st) else ""), "W": "weight gradients"}
    shown = [k for k in kinds if any(op.kind == k for st in timeline for op, _, _ in st)]
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in shown], [kinds[k] for k in shown],
               loc="lower center", ncol=len(shown), fontsize=8, frameon=False)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time (slots; forward = {f}, backward = {b})")
    ax.set_title(title or f"bubble: idle / busy = {bubble_ratio(timeline):.4g} "
                          f"(idle share of the time {bubble_fraction(timeline):.4g})")
    fig.tight_layout(rect=(0, 0.3 / (1.0 + 0.5 * p), 1, 1))  # the legend's row below the axis label
    if path is not None:
        fig.savefig(path, dpi=100, metadata=MARK if str(path).lower().endswith(".png") else None)
    return fig
