"""The flight recorder: each rank's last N operations, kept by its traffic ledger, dumped when the job fails.

Each ``traffic.op(label, buf)`` block and overlapped ring collective is one :class:`Entry`; ``seq`` counts one
group's collectives on this rank (rank r's #k and rank s's #k must be the same call), None for blocks without
an array. States: ``posted``, ``started``, ``completed``, ``failed``. A record names its job's ``run``
(:func:`run_id`, rank 0's, shared at start-up), so that records of two jobs in one folder are never merged.
Mirrors PyTorch's NCCL flight recorder and ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""
from __future__ import annotations

import collections
import json
import os
import re
import socket
import stat
import time

import numpy as np

DEFAULT_CAPACITY = 2000  #: entries kept per rank (the TORCH_NCCL_TRACE_BUFFER_SIZE PyTorch's tutorial sets)
_CHECK_TAG = 1400  #: tag of the descriptor exchange of ``check_collectives`` (apart from every other tag in minizero)
_LABEL_BYTES, _MAX_DIMS = 48, 6
RECORD_NAME = re.compile(r"rank_(\d+)\.json(\.tmp)?")  #: a rank's record, or its write cut short
_HEAD = re.compile(rb'\{"rank": (\d+), "world_size": (\d+)(?:, "run": ("(?:[^"\\]|\\.)*"|null))?')  # dump's start


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called different collectives (op, sequence number, shape, dtype or root) at one point."""


class Described:
    """What an entry reads of an array (shape, dtype, nbytes), for a collective whose result is not allocated yet."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize


class Entry:
    """One operation of one group on this rank (see the module docstring for the fields)."""
    __slots__ = ("group", "seq", "op", "within", "shape", "dtype", "nbytes", "state", "posted_us", "ended_us",
                 "error", "root")

    def __init__(self, group, seq, op, buf, state, within, root=None):  # kept as given: text only in as_dict
        self.group, self.seq, self.op, self.state, self.within, self.root = group, seq, op, state, within, root
        self.shape, self.dtype, self.nbytes = (None, None, None) if buf is None else (buf.shape, buf.dtype, buf.nbytes)
        self.posted_us, self.ended_us, self.error = time.time_ns() // 1000, None, None

    def as_dict(self) -> dict:
        shape = None if self.shape is None else tuple(int(d) for d in self.shape)
        return {"group": self.group.name, "seq": self.seq, "op": self.op, "within": self.within, "shape": shape,
                "dtype": None if self.dtype is None else str(self.dtype),
                "bytes": None if self.nbytes is None else int(self.nbytes), "state": self.state,
                "posted_us": self.posted_us, "ended_us": self.ended_us, "error": self.error, "root": self.root}


class _Group:
    """A communicator's ledger as the recorder sees it: a name and member world ranks (once named), a counter."""

    def __init__(self, ledger, index: int):
        self.ledger, self.seq, self.comm = ledger, 0, None  # the ledger is kept so that its id() stays unique
        self.name = "world" if ledger.parent is None else f"unnamed{index}"
        self.members = None


class FlightRecorder:
    """This rank's ring buffer (``entries``, oldest first) of the last ``capacity`` operations over all its groups.

    Raises ValueError: ``capacity`` not an int >= 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, run: str | None = None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:  # True: a flag, not 1
            raise ValueError(f"capacity={capacity!r}; allowed: an int >= 1")
        self.run = run  # the job's run id (:func:`run_id`), the same on every rank
        self.entries: collections.deque = collections.deque(maxlen=capacity)
        self.groups: dict[int, _Group] = {}
        self.check_collectives = False

    def _group(self, ledger) -> _Group:
        g = self.groups.get(id(ledger))
        if g is None:
            g = self.groups[id(ledger)] = _Group(ledger, len(self.groups))
        return g

    def name_group(self, comm, name: str, members) -> None:
        """Name ``comm``'s group (``"dp"``, ...) and give its member world ranks, in group-rank order; the
        descriptor check needs the communicator. Every rank of the group must name it alike."""
        g = self._group(comm.traffic)
        g.name, g.members, g.comm = name, [int(m) for m in members], comm

    # -- recording (called by TrafficLedger.op / count_call and the overlapped ring) -----------------------------
    def post(self, ledger, op: str, buf=None, state: str = "started", root=None) -> Entry:
        """Record the start of ``op`` on ``ledger``'s group (``buf``: its array or None; a rooted op's ``root``)."""
        g = self._group(ledger)
        if buf is not None:
            g.seq += 1
        entry = Entry(g, g.seq if buf is not None else None, op, buf, state, ledger.current_label(), root)
        self.entries.append(entry)
        # an overlapped ring's "posted" entry is not checked: a blocking descriptor exchange at post time would wait
        # inside backward and undo the overlap; its buckets are laid out once at build time, alike on every rank
        checked = self.check_collectives and state == "started" and buf is not None and g.comm is not None
        if checked and g.comm.world_size > 1:
            agree(g, entry)
        return entry

    @staticmethod
    def end(entry: Entry, error: BaseException | None = None) -> None:
        """Mark ``entry`` completed, or failed with ``error``'s type and message."""
        entry.ended_us = time.time_ns() // 1000
        if error is None:
            entry.state = "completed"
        else:
            entry.state, entry.error = "failed", f"{type(error).__name__}: {error}"[:500]

    # -- output ------------------------------------------------------------------------------------------------
    def snapshot(self, rank: int, world_size: int, reason: str = "on demand") -> dict:
        """This rank's record as a JSON-able dict: rank, world_size, run, reason, groups, entries (oldest first)."""
        groups = {}
        for g in self.groups.values():
            members = g.members if g.members is not None else (list(range(world_size)) if g.name == "world" else None)
            groups[g.name] = {"members": members, "last_seq": g.seq}
        return {"rank": int(rank), "world_size": int(world_size), "run": self.run, "reason": reason,  # dump's start:
                "time_us": time.time_ns() // 1000, "capacity": self.entries.maxlen, "groups": groups,  # see _HEAD
                "entries": [e.as_dict() for e in self.entries]}

    def dump(self, folder: str, rank: int, world_size: int, reason: str = "on demand") -> str:
        """Write :meth:`snapshot` to ``folder/rank_R.json`` (atomically, by rename); returns the path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank_{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.snapshot(rank, world_size, reason), f)
        os.replace(path + ".tmp", path)
        return path


def run_id() -> str:
    """``2026-12-06T20:00:27.123456Z host pid 4321``: when and where a job started (rank 0 makes it, every rank
    records it)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return f"{stamp} {socket.gethostname()} pid {os.getpid()}"


def peek(path: str) -> dict | None:
    """``{"rank", "world_size", "run"}`` from the start of a record :meth:`FlightRecorder.dump` wrote, whole or cut
    short (``.tmp``; run None: not recorded, or cut off); None for a file that does not start like a record."""
    try:
        m = _HEAD.match(_head(path))
    except OSError:
        return None
    return m and {"rank": int(m[1]), "world_size": int(m[2]), "run": m[3] and json.loads(m[3])}


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096)


def records(folder: str) -> tuple[list[str], list[str]]:
    """The ``rank_R.json`` and ``rank_R.json.tmp`` files in ``folder``: (minizero's records, whole or cut short, and
    empty ones; the others: files a dump would replace that minizero did not write)."""
    try:
        names = sorted(n for n in os.listdir(folder) if RECORD_NAME.fullmatch(n))
    except OSError:
        return [], []
    ours, others = [], []
    for path in (os.path.join(folder, n) for n in names):
        try:  # a regular file (a FIFO's open would block), empty or starting like a record
            st = os.stat(path)
            mine = stat.S_ISREG(st.st_mode) and (st.st_size == 0 or _HEAD.match(_head(path)) is not None)
        except FileNotFoundError:  # renamed or removed while looked at (a dump's .tmp): not there
            continue
        except OSError:
            mine = False
        (ours if mine else others).append(path)
    return ours, others


def clear(folder: str, ours: list[str] | None = None) -> list[str]:
    """Remove the flight records of an earlier job from ``folder`` (:func:`records`, or ``ours`` when given, never
    another file), and the folder if that empties it; returns the paths removed (one that cannot be removed stays)."""
    removed = []
    for p in records(folder)[0] if ours is None else ours:
        try:
            os.remove(p)
            removed.append(p)
        except OSError:
            continue
    if removed:
        try:
            os.rmdir(folder)  # OSError unless empty
        except OSError:
            pass
    return removed


def check_collectives(comm, on: bool = True) -> FlightRecorder:
    """Turn the descriptor check (``--debug-collectives``) on or off for every group of ``comm``'s rank;
    ``comm`` (the world) is named ``"world"``. Returns the recorder. Raises: ValueError if it has none."""
    recorder = comm.traffic.active_recorder()
    if recorder is None:
        raise ValueError(f"{comm!r} has no flight recorder (its root ledger's recorder was set to None)")
    if comm.traffic.parent is None:
        recorder.name_group(comm, "world", range(comm.world_size))
    recorder.check_collectives = on
    return recorder


def name_split(parent, group, name: str, ranks) -> None:
    """Name ``group``, split from ``parent`` with ``parent``'s ``ranks`` (in group-rank order), in the flight recorder
    if it has one (:meth:`FlightRecorder.name_group`: members as world ranks, so --debug-collectives checks it)."""
    recorder = parent.traffic.active_recorder()
    if recorder is not None:
        recorder.name_group(group, name, [parent.world_rank(k) for k in ranks])


def describe(d: dict, root: bool = False) -> str:
    """``all_reduce #5 (shape (4,), float64, 32 bytes) in metrics`` for a descriptor or an entry's dict."""
    text = f"{d['op']} #{d['seq']}"
    if d.get("shape") is not None:
        root = f", root {d['root']}" if root and d.get("root") is not None else ""
        text += f" (shape {tuple(d['shape'])}, {d['dtype']}, {d['bytes']} bytes{root})"
    return text + (f" in {d['within']}" if d.get("within") and d["within"] != d["op"] else "")


# -- the descriptor check (--debug-collectives) ---------------------------------------------------------------
def _encode(entry: Entry) -> np.ndarray:
    label = entry.op.encode()[:_LABEL_BYTES].ljust(_LABEL_BYTES, b"\0")
    dims = list(entry.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(entry.shape), _MAX_DIMS))
    root = -1 if entry.root is None else entry.root
    head = np.array([entry.seq, len(entry.shape), entry.nbytes, root] + dims, dtype=np.int64)
    dtype = np.frombuffer(str(entry.dtype).encode()[:8].ljust(8, b"\0"), dtype=np.int64)
    return np.concatenate([head, dtype, np.frombuffer(label, dtype=np.int64)])


def _decode(row: np.ndarray) -> dict:
    seq, ndim, nbytes, root = (int(v) for v in row[:4])
    shape = [int(v) for v in row[4:4 + min(ndim, _MAX_DIMS)]]
    text = row[4 + _MAX_DIMS:].tobytes()
    return {"seq": seq, "shape": shape, "bytes": nbytes, "root": None if root < 0 else root,
            "dtype": text[:8].rstrip(b"\0").decode(),
            "op": text[8:].rstrip(b"\0").decode()}


def agree(group: _Group, entry: Entry) -> None:
    """Collective: all-gather ``entry``'s descriptor over ``group`` (sendrecv ring, tag 1400, ``debug_collectives``).

    Raises CollectiveMismatchError on every rank, naming this side and the first rank that differs.
    """
    from minizero import backend  # noqa: PLC0415  (comm imports no array policy at module level)
    comm, n = group.comm, group.comm.world_size
    rows = np.empty((n, 1 + 4 + _MAX_DIMS + _LABEL_BYTES // 8), dtype=np.int64)
    rows[comm.rank] = _encode(entry)
    right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
    with comm.traffic.labelled("debug_collectives"):
        for s in range(n - 1):
            send, recv = (comm.rank - s) % n, (comm.rank - s - 1) % n
            got = comm.sendrecv(backend.to_device(rows[send].copy()), right,
                                backend.to_device(np.empty_like(rows[recv])), left, tag=_CHECK_TAG)
            rows[recv] = backend.to_host(got)
    mine = _decode(rows[comm.rank])
    for r in range(n):
        other = _decode(rows[r])
        if other != mine:
            roots = other["op"] == mine["op"] and other["root"] != mine["root"]  # show roots where they differ
            who = group.members or list(range(n))
            raise CollectiveMismatchError(
                f"group {group.name} {who}: rank {who[comm.rank]} calls {describe(mine, roots)} but rank {who[r]} "
                f"calls {describe(other, roots)} (the descriptor check before each collective)")
