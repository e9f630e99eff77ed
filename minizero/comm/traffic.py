"""The ledger of the bytes each rank sends, by operation label
(one per Communicator; Thakur et al. 2005's cost model)."""
from __future__ import annotations

import contextlib

from minizero import trace
from minizero.comm.flight import FlightRecorder


class TrafficLedger:
    """Bytes this rank sent (``bytes_sent``), by label (``by_op``) and calls per label (``calls``); one thread,
    no locks.

    ``record(nbytes)`` adds to the outermost open ``op(label)`` block, else ``"p2p"``, and to the ``parent`` ledger.
    """

    def __init__(self, parent: TrafficLedger | None = None):
        self.parent = parent
        self.tracer = None  #: this rank's :class:`~minizero.trace.Tracer`, registered by whoever traces, or None
        #: this rank's :class:`~minizero.comm.flight.FlightRecorder` (a root ledger's own; groups use the root's)
        self.recorder = FlightRecorder() if parent is None else None
        self._labels: list[str] = []
        self.reset()

    def reset(self) -> None:
        """Zero this ledger (not its parent)."""
        self.bytes_sent = 0
        self.by_op: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def current_label(self) -> str | None:
        """The outermost active label of the parent ledger, else of this one, else None."""
        outer = self.parent.current_label() if self.parent is not None else None
        if outer is not None:
            return outer
        return self._labels[0] if self._labels else None

    def active_tracer(self):
        """The tracer registered here, else on the parent ledger (a group's events join the rank's timeline),
        else the thread's (:func:`minizero.trace.set_tracer`); None: tracing off, nothing recorded."""
        if self.tracer is not None:
            return self.tracer
        return self.parent.active_tracer() if self.parent is not None else trace.get_tracer()

    def span(self, name: str, cat: str = "comm", tid: int = trace.COMM, **args):
        """A timeline span of the ``with`` block (yields ``args``), or a no-op context when tracing is off."""
        tracer = self.active_tracer()
        return contextlib.nullcontext(args) if tracer is None else tracer.span(name, cat, tid, **args)

    def active_recorder(self):
        """The flight recorder of the root ledger (:mod:`minizero.comm.flight`), or None if it was removed."""
        return self.recorder if self.parent is None else self.parent.active_recorder()

    def op(self, label: str, buf=None, root=None) -> _OpBlock:
        """A ``with`` block: bytes recorded inside it go to ``label`` (unless an outer block is open).

        The block is a trace span and one flight-recorder entry; ``buf`` (a whole-group collective's array) gives its
        shape; ``root`` a rooted collective's root (the descriptor check compares it).
        """
        return _OpBlock(self, label, buf, root)

    def record(self, nbytes: int) -> None:
        """Record one message of ``nbytes`` bytes sent by this rank. Raises ValueError: negative ``nbytes``."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        label = self.current_label()
        if label is None:
            self._add("p2p", nbytes, calls=1)
        else:
            self._add(label, nbytes, calls=0)

    def count_call(self, label: str, buf=None):
        """Count one call of ``label`` (no bytes): an overlapped collective, whose messages follow later
        inside :meth:`labelled` blocks. Returns its flight-recorder entry ``posted`` (or None)."""
        self._add(label, nbytes=0, calls=1)
        recorder = self.active_recorder()
        return recorder.post(self, label, buf, state="posted") if recorder is not None else None

    @contextlib.contextmanager
    def labelled(self, label: str):
        """Attribute bytes recorded inside the block to ``label`` like :meth:`op`, without counting a
        call or drawing a span (the messages of an overlapped collective, posted a few at a time)."""
        self._labels.append(label)
        try:
            yield self
        finally:
            self._labels.pop()

    def _add(self, label: str, nbytes: int, calls: int) -> None:
        self.bytes_sent += nbytes
        self.by_op[label] = self.by_op.get(label, 0) + nbytes
        self.calls[label] = self.calls.get(label, 0) + calls
        if self.parent is not None:
            self.parent._add(label, nbytes, calls)

    def snapshot(self) -> dict:
        """A JSON-able copy: ``{"bytes_sent": int, "by_op": {...}, "calls": {...}}``."""
        return {"bytes_sent": self.bytes_sent, "by_op": dict(self.by_op), "calls": dict(self.calls)}

    def __repr__(self) -> str:
        return f"TrafficLedger(bytes_sent={self.bytes_sent}, by_op={self.by_op})"


class _OpBlock:
    """:meth:`TrafficLedger.op`'s block (a class, not a generator: it opens around every collective call)."""

    __slots__ = ("ledger", "label", "buf", "root", "recorder", "entry", "before", "span", "args")

    def __init__(self, ledger: TrafficLedger, label: str, buf, root=None):
        self.ledger, self.label, self.buf, self.root = ledger, label, buf, root

    def __enter__(self) -> TrafficLedger:
        ledger, label = self.ledger, self.label
        ledger._add(label, nbytes=0, calls=1)
        self.recorder = ledger.active_recorder()
        self.entry = self.recorder.post(ledger, label, self.buf, root=self.root) if self.recorder is not None else None
        ledger._labels.append(label)
        self.before = ledger.bytes_sent
        tracer = ledger.active_tracer()
        self.span = None
        if tracer is not None:
            try:
                span = tracer.span(label, "comm", trace.COMM)
                self.args = span.__enter__()
            except BaseException as e:
                ledger._labels.pop()
                if self.entry is not None:
                    self.recorder.end(self.entry, e)
                raise
            self.span = span
        return ledger

    def __exit__(self, error_type, error, tb) -> bool:
        try:
            if self.span is not None:
                if error_type is None:
                    self.args["bytes"] = self.ledger.bytes_sent - self.before
                self.span.__exit__(error_type, error, tb)
        finally:
            self.ledger._labels.pop()
            if self.entry is not None:
                self.recorder.end(self.entry, error)
        return False
