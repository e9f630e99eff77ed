"""``python -m minizero.debug trace OUT/trace.json``: per rank, where each step's time went, and the straggler.

From the ``--trace`` timeline (:mod:`minizero.trace` lanes), per rank and optimizer step in ms: ``compute`` (compute
lane), ``exposed`` (blocking lane, pipeline waits excluded), ``overlapped`` (in-flight lane under compute), ``bubble``
(pipeline ``recv``/``wait sends`` spans, with the stage waited for), ``other`` (the rest). Names the slowest rank (most
time not waiting on others) and the one that waits most. Mirrors Holistic Trace Analysis (HTA).
"""
from __future__ import annotations


from minizero.files import read_json
from minizero.numerals import ERROR_WIDTH, column, in_width, shortened, significant, wrapped
from minizero.trace import COMM, COMPUTE, IN_FLIGHT, covered_us, intervals

PIPELINE_WAITS = ("recv ", "wait sends", "pp_")  #: blocking-lane span names that are a pipeline stage waiting


def _length(spans) -> int:
    return sum(b - a for a, b in spans)


def _union(*span_lists):
    merged: list[list[int]] = []
    for a, b in sorted(s for spans in span_lists for s in spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def rank_figures(events, pid: int) -> dict:
    """Milliseconds per step of rank ``pid``: ``step``, ``compute``, ``exposed``, ``overlapped``, ``bubble``,
    ``other``; ``steps`` (optimizer spans); ``waited_on``: ``{stage: ms per step}`` of its pipeline waits (the
    spans' ``peer`` is a rank of the pipeline group, which is the stage number)."""
    mine = [e for e in events if e.get("ph") == "X" and e["pid"] == pid]
    steps = max(1, sum(1 for e in mine if e["cat"] == "optimizer"))
    first = min((e["ts"] for e in mine if e["cat"] == "forward"), default=0)
    last = max((e["ts"] + e["dur"] for e in mine if e["cat"] == "optimizer"), default=first)
    in_window = [e for e in mine if e["ts"] >= first and e["ts"] + e["dur"] <= last]
    is_wait = lambda e: e["tid"] == COMM and e["name"].startswith(PIPELINE_WAITS)  # noqa: E731
    compute = intervals(in_window, pid, lambda e: e["tid"] == COMPUTE)
    waits = intervals(in_window, pid, is_wait)
    exposed = intervals(in_window, pid, lambda e: e["tid"] == COMM and not is_wait(e))
    flight = intervals(in_window, pid, lambda e: e["tid"] == IN_FLIGHT)
    busy = _length(_union(compute, waits, exposed))
    waited: dict[int, float] = {}
    for e in in_window:
        if is_wait(e) and "peer" in e.get("args", {}):
            waited[e["args"]["peer"]] = waited.get(e["args"]["peer"], 0.0) + e["dur"] / 1e3 / steps
    per = 1e3 * steps
    return {"steps": steps, "step": (last - first) / per, "compute": _length(compute) / per,
            "exposed": _length(exposed) / per, "overlapped": covered_us(flight, compute) / per,
            "bubble": _length(waits) / per, "other": (last - first - busy) / per, "waited_on": waited,
            "waiting": _length(_union(waits, exposed)) / per}  # a collective over a pipeline wait counted once


def _ms(x: float) -> str:  # 6.00, 13,510,798,882,111.49: commas as every report's (a step of 2**54 us takes 21)
    return in_width(x, 24, 2).lstrip()


#: the slowest rank's working time over the fastest's from which the verdict names a straggler (below it: timing
#: noise, as 1.01x on a balanced pipeline)
STRAGGLER_RATIO = 1.1
COLUMNS = ("step", "compute", "exposed", "overlapped", "bubble", "other")  #: the table's times, ms per step
CELL = 13  #: a time's columns in a row that would pass 120 with commas: 99,999,999.99 fits, 1.8014399e+13 else


def report(events) -> list[str]:
    """The table (Markdown, one row per rank) and the verdict lines; every line at most 120 columns."""
    by_pid: dict[int, list] = {}
    for e in events:
        if e.get("ph") == "X":
            by_pid.setdefault(e["pid"], []).append(e)
    pids = sorted(by_pid)
    if not pids:
        return ["no events: was the job run with --trace?"]
    figs = {p: rank_figures(by_pid[p], p) for p in pids}  # each rank's own: all events per rank took 80 s at 40,000
    rows = [[_ms(figs[p][c]) for c in COLUMNS] for p in pids]
    if any(len(f"| {p} | " + " | ".join(r) + " |") > ERROR_WIDTH for p, r in zip(pids, rows)):  # huge times: each
        rows = list(zip(*([t.strip() for t in column([figs[p][c] for p in pids], CELL, 2)] for c in COLUMNS)))
    lines = ["| rank | " + " | ".join(f"{c} ms/step" for c in COLUMNS) + " |", "|---:" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(r) + " |" for p, r in zip(pids, rows)]  # column that has one: 1.8014399e+13
    return lines + [part for said in _verdicts(pids, figs) for part in wrapped(said).splitlines()]


def _verdicts(pids, figs) -> list[str]:  # the straggler and the waiter, each one line before wrapping
    working = {p: figs[p]["step"] - figs[p]["waiting"] for p in pids}  # not waiting on others
    defined = "working = step - exposed - bubble, their overlap counted once: a rank's step less its waits"
    return [defined] + _straggler(pids, figs, working)


def _straggler(pids, figs, working) -> list[str]:
    if len(pids) == 1:
        return [f"one rank: no straggler to name (working {_ms(working[pids[0]])} ms/step, compute "
                f"{_ms(figs[pids[0]]['compute'])} ms/step)"]
    slow, fast = max(pids, key=working.get), min(pids, key=working.get)
    if working[slow] <= 0:  # 'slowest rank: 0 (working 0.00 ms/step ...)' before; the waiter is still named
        lines = ["no rank has working time (a forward-to-optimizer window, less its waits): no straggler to name"]
    elif working[fast] > 0 and working[slow] < STRAGGLER_RATIO * working[fast]:  # noise, not a straggler
        lines = [f"no straggler: every rank works {_ms(working[fast])} to {_ms(working[slow])} ms/step (within "
                 f"{STRAGGLER_RATIO:g}x of each other)"]  # 'slowest rank: 2 (...; 1.01x rank 1's ...)' before
    else:
        vs = (f"{significant(working[slow] / working[fast])}x rank {fast}'s {_ms(working[fast])} ms/step"
              if working[fast] > 0 else f"no ratio: rank {fast} has no working time (no forward-to-optimizer window)")
        lines = [f"slowest rank: {slow} (working {_ms(working[slow])} ms/step, compute "
                 f"{_ms(figs[slow]['compute'])} ms/step; {vs})"]  # 'infx rank 7's' where no ratio before
    waiter = max(pids, key=lambda p: figs[p]["exposed"] + figs[p]["bubble"])
    f = figs[waiter]
    if f["exposed"] + f["bubble"] <= 0:
        return lines + ["most waiting: none (no rank spent time in collectives or pipeline waits)"]
    on = max(f["waited_on"], key=f["waited_on"].get) if f["waited_on"] else None
    return lines + [f"most waiting: rank {waiter} ({_ms(f['exposed'])} ms/step in collectives, {_ms(f['bubble'])} "
                    "ms/step in pipeline waits" + (f", most of it waiting for pipeline stage {on})" if on is not None
                                                   else ")")]


SPAN_FIELDS = ("name", "cat", "pid", "tid", "ts", "dur")  #: what :func:`report` reads of a complete ("X") event


def load(path: str) -> list:
    """The ``traceEvents`` of the timeline ``--trace`` wrote at ``path``.

    Raises OSError: unreadable; ValueError: not JSON (or not UTF-8), no ``traceEvents`` list, or a complete
    event without one of :data:`SPAN_FIELDS` or with one of another type (the file and the field named).
    """
    data = read_json(path)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path!r} has no traceEvents list")
    for i, e in enumerate(events):
        missing = [f for f in SPAN_FIELDS if f not in e] if isinstance(e, dict) and e.get("ph") == "X" else []
        if not isinstance(e, dict) or missing:
            raise ValueError(f"{path!r}: traceEvents[{i}] "
                             + (f"lacks {missing[0]!r}" if missing else "is not an object"))
        if e.get("ph") != "X":
            continue
        wrong = [(f, allowed) for f, ok, allowed in (
            ("ts", _number(e["ts"]), "a number of microseconds (at most 2**53 in size)"),
            ("dur", _number(e["dur"]) and e["dur"] >= 0, "a number of microseconds (0 to 2**53)"),
            ("pid", _rank(e["pid"]), f"a rank (a whole number 0 to {RANKS - 1:,})"),
            ("tid", _whole(e["tid"]), "a lane number"),
            ("name", isinstance(e["name"], str), "text"), ("cat", isinstance(e["cat"], str), "text"),
            ("args", isinstance(e.get("args", {}), dict) and _rank(e.get("args", {}).get("peer", 0)),
             f"an object whose 'peer' is a rank (0 to {RANKS - 1:,})")) if not ok]
        if wrong:
            f, allowed = wrong[0]
            raise ValueError(f"{path!r}: traceEvents[{i}].{f} is {shortened(repr(e[f]), 30, 40)}, not {allowed}")
    return events


def _number(v) -> bool:  # at most 2**53 (285 years of microseconds): sums of two stay finite and exact enough
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= 2 ** 53  # NaN, inf: False


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


RANKS = 2 ** 31  #: MPI's ranks are C ints: a pid or peer of 10**30 is no rank (printed as a pipeline stage before)


def _rank(v) -> bool:
    return _whole(v) and v < RANKS


def main(path: str) -> int:
    """Print :func:`report` for the trace file at ``path``; 0 (:func:`load` raises for a file of another kind)."""
    events = load(path)
    for line in report(events):
        print(line)
    return 0
