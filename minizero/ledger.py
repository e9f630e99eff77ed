"""The memory ledger: every array minizero keeps alive, counted by category, one ledger per rank (thread-local).

An array is counted by its owning buffer (``a.base`` to the root, once), under the first category that claims
it, until freed (a ``weakref.ref`` callback); per module too (self and inclusive; (b, a, s, s) as ``<scope>:scores``).
Mirrors: ``torch.cuda.memory_summary()``, PyTorch's memory snapshot, ZeRO's model-state accounting (section 3).
"""
from __future__ import annotations

import math

import re
import textwrap
import threading
import weakref

import numpy as np

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "comm_buffers",
    "comm_scratch",
    "gathered",
    "offloaded",
)


#: the scope of arrays tracked while no module's forward runs (parameters, gradients, optimizer state)
OUTSIDE = "(outside forward)"
#: suffix of the pseudo-module holding a scope's (b, a, s, s) arrays (attention scores/probabilities/masks)
SCORES = ":scores"


def _owner(array):
    """Follow ``.base`` to the array that owns the memory (views share it)."""
    root = array
    while getattr(root, "base", None) is not None and hasattr(root.base, "nbytes") and hasattr(root.base, "base"):
        root = root.base
    return root


def allocation_bytes(owner) -> int:
    """Bytes the buffer ``owner`` holds: on CuPy its allocation (``data.mem.size``, rounded up by the
    memory pool to 512-byte blocks, as ``torch.cuda.memory_allocated`` counts), else ``nbytes``."""
    if type(owner).__module__.startswith("cupy"):
        mem = getattr(owner.data, "mem", None)
        if mem is not None and getattr(mem, "size", None) is not None:
            return int(mem.size)
    return int(owner.nbytes)


def owning_buffer(array):
    """The array that owns ``array``'s memory (itself, or the base its views lead to): the ledger's identity."""
    return _owner(array)


class MemoryLedger:
    """Current and peak bytes per category for one rank.

    Attributes: current, peak (category -> bytes); peak_total; by_module, by_prefix ((module, category) ->
    [current, peak], self and inclusive); window_peak, window_at_peak (since :meth:`start_window`).
    """

    def __init__(self):
        # re-entrant: a garbage collection can run inside the locked block (any allocation may
        # trigger one), and the weak reference's callback of a collected array calls _release on this thread
        self._lock = threading.RLock()
        self._live: dict[int, tuple] = {}  # id(owner) -> (category, bytes, (self name, inclusive names), weakref)
        self.current = {c: 0 for c in CATEGORIES}
        self.peak = {c: 0 for c in CATEGORIES}
        self.peak_total = 0
        self.by_module: dict[tuple[str, str], list[int]] = {}
        self.by_prefix: dict[tuple[str, str], list[int]] = {}
        self._scopes: list[str] = []
        self._keys: dict = {}  # (scope, square) -> (self name, inclusive names), built once per scope
        self.window_peak = 0
        self.window_at_peak = dict(self.current)

    # ---- attribution: the scope stack ---------------------------------------
    def push_scope(self, name: str) -> None:
        """Enter module ``name``'s forward (dotted name; ``""`` is the root module)."""
        self._scopes.append(name)

    def pop_scope(self) -> None:
        """Leave the innermost module's forward. Raises IndexError when none is entered."""
        self._scopes.pop()

    def current_scope(self):
        """The innermost module whose forward runs, or None outside any forward."""
        return self._scopes[-1] if self._scopes else None

    def _scope_keys(self, square: bool):
        scope = self._scopes[-1] if self._scopes else None
        keys = self._keys.get((scope, square))
        if keys is None:
            if scope is None:
                keys = (OUTSIDE, (OUTSIDE,))
            else:
                parts = scope.split(".") if scope else []
                incl = tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1)) + ("",)
                name = scope + SCORES if square else scope
                keys = (name, ((name,) if square else ()) + incl)
            self._keys[(scope, square)] = keys
        return keys

    def _entry(self, array, category: str):
        """``(owner, bytes, scope keys)`` of ``array`` counted under ``category``; None: not an array.
        Raises ValueError: unknown category."""
        if category not in self.current:
            raise ValueError(f"unknown ledger category {category!r}; allowed: {CATEGORIES}")
        if type(array) is np.ndarray and array.base is None:  # fast path: a NumPy array that owns its memory
            owner, nbytes = array, array.nbytes
        elif not hasattr(array, "nbytes") or not hasattr(array, "base"):
            return None
        else:
            owner = _owner(array)
            nbytes = allocation_bytes(owner)
        shape = getattr(owner, "shape", ())
        return owner, nbytes, self._scope_keys(category == "activations" and len(shape) == 4 and shape[-1] == shape[-2])

    def track(self, array, category: str) -> bool:
        """Count ``array``'s owning buffer under ``category`` until freed; False if already counted or not an array.

        Raises ValueError: unknown category.
        """
        entry = self._entry(array, category)
        if entry is None:
            return False
        owner, nbytes, keys = entry
        key = id(owner)
        with self._lock:
            if key in self._live:
                return False
            try:  # the entry holds the weak reference: untrack drops both, and no callback comes later
                ref = weakref.ref(owner, lambda _ref, key=key: self._release(key))
            except TypeError:  # object that cannot be weak-referenced: count, never release
                ref = None
            self._live[key] = (category, nbytes, keys, ref)
            self._add(category, nbytes, keys)
        return True

    def track_temporary(self, array, category: str) -> None:
        """Count the new ``array`` under ``category`` at this moment only (added, then subtracted at once).

        For a buffer freed before anything else is tracked, as a collective's scratch: its peaks are reached when it is
        allocated, so current and every peak end as :meth:`track` leaves them once it is freed, without a weak
        reference to set up and fire on every call. Nothing is counted for a buffer counted already.
        Raises ValueError: unknown category.
        """
        entry = self._entry(array, category)
        if entry is None:
            return
        owner, nbytes, keys = entry
        with self._lock:
            if id(owner) not in self._live:
                self._add(category, nbytes, keys)
                self._subtract(category, nbytes, keys)

    def untrack(self, array) -> None:
        """Stop counting ``array``'s buffer now (e.g. before re-tracking it elsewhere)."""
        self._release(id(_owner(array)))

    def retag(self, array, category: str) -> None:
        """Move ``array``'s buffer to another category (e.g. to ``offloaded``)."""
        self.untrack(array)
        self.track(array, category)

    def category_of(self, array):
        """The category ``array``'s buffer is counted under, or None."""
        entry = self._live.get(id(_owner(array)))
        return entry[0] if entry else None

    def _add(self, category, nbytes, keys):
        self.current[category] += nbytes
        if self.current[category] > self.peak[category]:
            self.peak[category] = self.current[category]
        total = sum(self.current.values())
        if total > self.peak_total:
            self.peak_total = total
        if total > self.window_peak:
            self.window_peak = total
            self.window_at_peak = dict(self.current)
        for table, names in ((self.by_module, (keys[0],)), (self.by_prefix, keys[1])):
            for name in names:
                cell = table.get((name, category))
                if cell is None:
                    cell = table[(name, category)] = [0, 0]
                cell[0] += nbytes
                if cell[0] > cell[1]:
                    cell[1] = cell[0]

    def _release(self, key):
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                category, nbytes, keys, _ref = entry
                self._subtract(category, nbytes, keys)

    def _subtract(self, category, nbytes, keys):
        name, inclusive = keys
        self.current[category] -= nbytes
        self.by_module[(name, category)][0] -= nbytes
        for n in inclusive:
            self.by_prefix[(n, category)][0] -= nbytes

    def reset_peaks(self) -> None:
        """Set every peak to the current value (start a new measurement window), per module too."""
        with self._lock:
            self.peak = dict(self.current)
            self.peak_total = sum(self.current.values())
            for table in (self.by_module, self.by_prefix):
                for cell in table.values():
                    cell[1] = cell[0]
            self.start_window()

    def start_window(self) -> None:
        """Start a new :attr:`window_peak` (e.g. each optimizer step), leaving the run's peaks alone."""
        self.window_peak = sum(self.current.values())
        self.window_at_peak = dict(self.current)

    def modules(self, category: str = "activations", inclusive: bool = False) -> dict:
        """``{module name: (current, peak)}`` bytes of one category, self or inclusive (see class doc)."""
        table = self.by_prefix if inclusive else self.by_module
        return {name: (cell[0], cell[1]) for (name, cat), cell in table.items() if cat == category}

    def snapshot(self) -> dict:
        """JSON-able ``{"current": {...}, "peak": {...}, "peak_total": int}`` in bytes."""
        return {"current": dict(self.current), "peak": dict(self.peak), "peak_total": self.peak_total}


_local = threading.local()


def get_ledger() -> MemoryLedger:
    """The calling rank's ledger (one per process, or per rank thread)."""
    ledger = getattr(_local, "ledger", None)
    if ledger is None:
        ledger = _local.ledger = MemoryLedger()
    return ledger


def set_ledger(ledger: MemoryLedger) -> MemoryLedger:
    """Install ``ledger`` as the calling thread's ledger; returns it."""
    _local.ledger = ledger
    return ledger


def format_bytes(n: float) -> str:
    """Human-readable binary units: ``1536 -> '1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


TABLE_WIDTH = 120  #: columns of :func:`memory_summary`'s lines (more groups of ranks go into blocks below)

#: what the "process peak" row of :func:`memory_summary` measured, by source name
PROCESS_PEAK_SOURCES = {
    "tracemalloc": "measured by tracemalloc over the training steps: every allocation of the process, "
                   "incl. NumPy temporaries (--tracemalloc)",
    "rss": "peak resident set size (getrusage ru_maxrss) over the process's life: interpreter, libraries, "
           "set-up and training; free to measure (python -m minizero.train --tracemalloc traces allocations instead)",
}


def memory_summary(per_rank: list[dict] | None = None, process_peaks: list[int] | None = None,
                   notes: list[str] | None = None, process_peak_source: str = "tracemalloc") -> str:
    """A text table as ``torch.cuda.memory_summary()``; ranks with equal ledgers share a column (KiB = 2**10 bytes).

    ``per_rank``: :meth:`MemoryLedger.snapshot` dicts (default this rank's); ``process_peaks``: measured peaks.
    Columns that would pass :data:`TABLE_WIDTH` go into blocks stacked below (tp 2 x pp 4: r0-1, r2-3 | r4-5, r6-7).
    """
    if per_rank is None:
        per_rank = [get_ledger().snapshot()]
    groups = equal_ranks(per_rank)  # ranks whose ledgers agree byte for byte share one column (and memory.png row)
    every = len(groups)
    if every > 4:  # too wide (e.g. MoE: routing makes every rank's activations differ): the extremes only
        totals = [per_rank[g[0]]["peak_total"] for g in groups]
        ends = {totals.index(min(totals)), totals.index(max(totals))}
        groups = [g for i, g in enumerate(groups) if i in ends]
    show_cur = every <= 4  # 'current' columns only while the table stays narrow
    labels = [_rank_label(g) for g in groups]
    kinds = ("current", "peak") if show_cur else ("peak",)
    width = max([12] + [len(f"{lab} current") + 1 for lab in labels])
    lines = ["minizero memory summary (ledger, per rank; peak = high-water mark)"]
    if 16 + len(kinds) * (width + 1) > TABLE_WIDTH:  # a rank label too long for a column: a letter, named here
        lines += wrap("(columns: " + "; ".join(f"{chr(65 + i)} = ranks {rank_runs(g, ', ')}"
                                                for i, g in enumerate(groups)) + ")")
        labels, width = [chr(65 + i) for i in range(len(groups))], 12

    def row(label, values, cols):  # values: (current or None, peak) per group; cols: the groups this block shows
        shown = [values[i] if show_cur else values[i][1:] for i in cols]  # (current, peak), or (peak,) alone
        return " ".join([label.ljust(16)] + [("" if v is None else format_bytes(v)).rjust(width)
                                             for cells in shown for v in cells])

    fit = (TABLE_WIDTH - 16) // (len(kinds) * (width + 1))  # groups side by side; the rest in blocks below
    blocks = math.ceil(len(groups) / fit)
    per_block = math.ceil(len(groups) / blocks)  # blocks as even as they can be: 4 groups as 2 + 2
    firsts = [per_rank[g[0]] for g in groups]
    for start in range(0, len(groups), per_block):
        cols = range(start, min(start + per_block, len(groups)))
        lines += [""] * (start > 0)
        lines.append(" ".join(["category".ljust(16)] + [f"{labels[i]} {k}".rjust(width) for i in cols for k in kinds]))
        lines += [row(cat, [(s["current"][cat], s["peak"][cat]) for s in firsts], cols) for cat in CATEGORIES]
        lines.append(row("peak total", [(None, s["peak_total"]) for s in firsts], cols))
        if process_peaks is not None:
            lines.append(row("process peak*", [(None, max(process_peaks[r] for r in g)) for g in groups], cols))
    if process_peaks is not None:
        several = "; a column of several ranks shows the largest of theirs" if any(len(g) > 1 for g in groups) else ""
        lines += wrap("* " + PROCESS_PEAK_SOURCES[process_peak_source] + several)
    if any(sum(s["peak"].values()) > s["peak_total"] for s in firsts):
        lines += wrap("(peak total: the most bytes alive at one moment; each category peaks at its own moment, "
                      "so their peaks add up to more)")
    if every > 4:
        ordered = [_rank_label(g) for g in sorted(groups, key=lambda g: -per_rank[g[0]]["peak_total"])]
        shown = (f"{ordered[0]}, the largest peak total, and {ordered[-1]}, the smallest" if len(ordered) > 1 else
                 f"{ordered[0]}: every peak total is equal")
        lines += wrap(f"(the {len(per_rank)} ranks' ledgers differ ({every} kinds): shown are {shown}; summary.json "
                      "has every rank's peaks)")
    elif len(groups) < len(per_rank):
        shared = next(lab for lab, g in zip(labels, groups) if len(g) > 1)
        lines += wrap(f"(ranks in one column, e.g. {shared}, end with equal current and peak bytes in every category; "
                      "memory.png groups its rows the same way)")
    for note in notes or []:
        lines += wrap(note)
    return "\n".join(lines)


#: a figure's pieces that a line break must not part: a rank label, its number and its unit ("r4-7 16.09 MiB")
_UNBREAKABLE = re.compile(r"(?:\br[0-9][0-9,-]* )?[0-9][0-9.,]* (?:B|KiB|MiB|GiB|TiB|kB|MB|GB|TB|tokens/s|s|ms)\b")


def wrap(line: str, width: int = 100, hang: int = 2) -> list[str]:
    """A prose line cut at ``width`` columns, the continuation lines indented ``hang`` more than the first; a
    figure (``r4-7 16.09 MiB``) stays on one line."""
    indent = line[:len(line) - len(line.lstrip())]
    glued = _UNBREAKABLE.sub(lambda m: m.group(0).replace(" ", "\0"), line.lstrip())
    return [part.replace("\0", " ") for part in textwrap.wrap(
        glued, width, initial_indent=indent, subsequent_indent=indent + " " * hang, break_on_hyphens=False,
        break_long_words=False)] or [line]


def equal_ranks(per_rank: list[dict]) -> list[list[int]]:
    """Ranks grouped by equal ledger snapshots (every category's current and peak, and the peak total), in order
    of their first rank: ``[[0, 1, 2, 3]]`` when four data-parallel replicas agree (the table's columns, memory.png's
    rows)."""
    groups: dict[tuple, list[int]] = {}
    for r, s in enumerate(per_rank):
        key = (tuple(s["current"][c] for c in CATEGORIES), tuple(s["peak"][c] for c in CATEGORIES), s["peak_total"])
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def rank_runs(ranks: list[int], sep: str = ",") -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``: runs of consecutive ranks joined, the runs by ``sep``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return sep.join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def _rank_label(ranks: list[int]) -> str:
    """``[0]`` -> ``r0``; ``[0, 1, 2, 3, 5]`` -> ``r0-3,5``."""
    return "r" + rank_runs(ranks)


def per_rank_text(texts: list[str]) -> str:
    """Per-rank values as one line, ranks with equal text sharing a label: ``["1 B", "2 B", "1 B"]`` ->
    ``"r0,2 1 B, r1 2 B"``; eight equal values -> ``"r0-7 1 B"`` (ordered by each group's first rank)."""
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    return ", ".join(f"{_rank_label(ranks)} {t}" for t, ranks in groups.items())


def array_bytes(arrays) -> int:
    """Sum of ``nbytes`` over an iterable of arrays (for tests and formulas)."""
    return int(sum(a.nbytes for a in arrays))
