"""A per-rank event timeline in Chrome's trace-event format (what PyTorch's profiler exports).

One :class:`Tracer` per rank (thread-local) records complete events (``"ph": "X"``; ``ts``, ``dur`` in
microseconds from ``time.time_ns()``; ``pid`` the rank; ``tid`` a lane: COMPUTE 0, COMM 1 (blocking,
exposed), IN_FLIGHT 2 (overlapped collectives)). Without ``set_tracer``, :func:`span` is a ``nullcontext``.
Merging ranks' events: :mod:`minizero.parallel.tracing`.
"""
from __future__ import annotations

import contextlib
import threading
import time

COMPUTE, COMM, IN_FLIGHT = 0, 1, 2  #: lanes (``tid``) of a rank's row
LANE_NAMES = {COMPUTE: "compute", COMM: "communication (blocking)", IN_FLIGHT: "communication (in flight)"}

class _Local(threading.local):
    tracer = None  # a class default: reading it costs no AttributeError where no tracer was set (every collective)


_local = _Local()


def now_us() -> int:
    """Wall-clock microseconds (``time.time_ns() // 1000``): comparable across the processes of one machine."""
    return time.time_ns() // 1000


class Tracer:
    """The events of one rank.

    Attributes:
        rank: the ``pid`` of every event.
        events: list of event dicts (``ph`` "X"), in the order they ended.
    """

    def __init__(self, rank: int):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r}; allowed: an int >= 0")
        self.rank = rank
        self.events: list[dict] = []

    def complete(self, name: str, cat: str, start_us: int, end_us: int, tid: int = COMPUTE, **args) -> dict:
        """Record an event that ran from ``start_us`` to ``end_us`` (microseconds); returns it.

        Raises:
            ValueError: ``end_us < start_us`` or an unknown lane ``tid``.
        """
        if end_us < start_us:
            raise ValueError(f"event {name!r} ends at {end_us} us, before its start {start_us} us")
        if tid not in LANE_NAMES:
            raise ValueError(f"tid={tid!r}; allowed: {sorted(LANE_NAMES)}")
        ev = {"name": name, "cat": cat, "ph": "X", "ts": int(start_us), "dur": int(end_us - start_us),
              "pid": self.rank, "tid": tid, "args": args}
        self.events.append(ev)
        return ev

    @contextlib.contextmanager
    def span(self, name: str, cat: str, tid: int = COMPUTE, **args):
        """Record the time spent in the ``with`` block; yields the ``args`` dict (fill it in the block)."""
        start = now_us()
        try:
            yield args
        finally:
            self.complete(name, cat, start, now_us(), tid, **args)


def set_tracer(tracer: Tracer | None) -> None:
    """Install ``tracer`` for this thread (this rank); None turns tracing off."""
    _local.tracer = tracer


def get_tracer() -> Tracer | None:
    """This thread's tracer, or None when tracing is off."""
    return _local.tracer


def span(name: str, cat: str, tid: int = COMPUTE, **args):
    """``get_tracer().span(...)`` when tracing, else a no-op context (yielding ``args``)."""
    tracer = get_tracer()
    if tracer is None:
        return contextlib.nullcontext(args)
    return tracer.span(name, cat, tid, **args)


def metadata_events(ranks) -> list[dict]:
    """``"ph": "M"`` events naming each rank's row and lanes (Perfetto shows the names)."""
    out = []
    for r in ranks:
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.extend({"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": n}}
                   for t, n in LANE_NAMES.items())
    return out


def intervals(events, pid: int, pred) -> list[tuple[int, int]]:
    """``[(start_us, end_us)]`` of the ``"X"`` events of rank ``pid`` for which ``pred(event)`` holds, merged."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e["pid"] == pid and pred(e))
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def covered_us(spans, within) -> int:
    """Microseconds of the merged ``within`` intervals that the merged ``spans`` cover."""
    total = 0
    for a, b in within:
        for c, d in spans:
            total += max(0, min(b, d) - max(a, c))
    return total


def summarize(events, pid: int) -> dict:
    """Microsecond figures of rank ``pid``'s timeline (``"X"`` events of a training run).

    ``steps``: optimizer-step spans; ``step_us``: mean wall time per step (first forward start to last optimizer-step
    end, over ``steps``); ``backward_us``: union of backward spans; ``in_flight_during_backward_us``: the part of it
    during which an overlapped collective was in flight; ``overlap_fraction``: their ratio (0 when no backward);
    ``exposed_comm_us``: union of the blocking-communication lane (time the rank waited on messages), per step.
    """
    mine = [e for e in events if e.get("ph") == "X" and e["pid"] == pid]
    steps = sum(1 for e in mine if e["cat"] == "optimizer")
    first = min((e["ts"] for e in mine if e["cat"] == "forward"), default=0)
    last = max((e["ts"] + e["dur"] for e in mine if e["cat"] == "optimizer"), default=first)
    bwd = intervals(mine, pid, lambda e: e["cat"] == "backward")
    flight = intervals(mine, pid, lambda e: e["tid"] == IN_FLIGHT)
    backward_us = sum(b - a for a, b in bwd)
    covered = covered_us(flight, bwd)
    exposed = sum(b - a for a, b in intervals(mine, pid, lambda e: e["tid"] == COMM))
    per = max(steps, 1)
    return {"steps": steps, "step_us": (last - first) / per, "backward_us": backward_us / per,
            "in_flight_during_backward_us": covered / per,
            "overlap_fraction": covered / backward_us if backward_us else 0.0, "exposed_comm_us": exposed / per}
