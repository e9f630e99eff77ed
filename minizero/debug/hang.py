"""``python -m minizero.debug hang OUT/flight``: what the ranks' flight records say went wrong.

Matches every ``rank_R.json`` by group and sequence number (PyTorch's ``fr_trace`` analyzer does the same) and prints
one line per finding: ``missing`` (a rank wrote no file), ``mismatch`` (ranks in different operations at one sequence
number), ``hang`` (who waits in what, who never posted it), ``last`` (the last operation every rank completed).
Records of another job (run id or world size) than the newest record's are set aside, each named, not refused: the
newest job is the one asked about, and an older file beside it says nothing of that job. A rank whose only file is
``rank_R.json.tmp`` was cut short while writing it.
"""
from __future__ import annotations

import os
import time

from minizero.comm.flight import RECORD_NAME, describe, peek
from minizero.files import read_json
from minizero.numerals import counted, shortened, wrapped


def load(folder: str) -> dict[int, dict]:
    """``{rank: snapshot}`` of every ``rank_R.json`` in ``folder``.

    Raises:
        FileNotFoundError: ``folder`` is missing or holds no ``rank_*.json``; ValueError: ``folder`` is a file, or
        one is not JSON or lacks a field the analysis reads (the file and the field named).
    """
    if os.path.isfile(folder):  # one rank's record: the analysis compares them all
        raise ValueError(f"{folder!r} is a file; give the folder of every rank's rank_R.json, here "
                         f"{os.path.dirname(folder) or '.'!r}")
    if not os.path.isdir(folder):  # a FIFO or a device: not "no such folder"
        raise FileNotFoundError(f"{folder!r}: {'not a' if os.path.exists(folder) else 'no such'} folder (a failing job "
                                "writes OUT/flight)")
    names = sorted(n for n in os.listdir(folder) if RECORD_NAME.fullmatch(n))  # not rank_x.json
    paths = [os.path.join(folder, n) for n in names if not n.endswith(".tmp")]
    if not paths:
        cut = [n for n in names if n.endswith(".tmp")]
        raise FileNotFoundError(f"{folder!r} holds no rank_R.json flight files (a failing job writes OUT/flight)"
                                + (f"; {cut[0]} was cut short while being written" if cut else ""))
    out = {}
    for p in paths:
        snap = read_json(p)
        missing = _missing(snap)
        if missing:
            raise ValueError(f"{p} is not a flight record: it lacks {missing}")
        world, odd = snap["world_size"], [(name, m) for name, g in snap["groups"].items()
                                          for m in g["members"] or () if not 0 <= m < snap["world_size"]]
        if odd:  # the analysis would name a rank that does not exist
            raise ValueError(f"{p} is a damaged flight record: groups[{odd[0][0]!r}] names member {odd[0][1]}, "
                             f"outside the world of {world} (ranks 0..{world - 1})")
        named = int(os.path.basename(p)[5:-5])
        if snap["rank"] != named:  # a copy or a rename would be read as another rank's record
            raise ValueError(f"{p} holds rank {snap['rank']}'s flight record, expected rank {named} (its name)")
        if named in out:  # rank_1.json and rank_01.json
            raise ValueError(f"{p} is a second flight record of rank {named}; keep one file per rank")
        out[named] = snap
    return out


def _job(snap: dict) -> tuple:
    return snap.get("run"), snap["world_size"]


def newest_job(snaps: dict[int, dict]) -> tuple[dict[int, dict], list[str]]:
    """The records of the job (run id, world size) that wrote the newest record, and a line per other record."""
    last = max(snaps.values(), key=lambda s: s.get("time_us") or 0)
    kept = {r: s for r, s in snaps.items() if _job(s) == _job(last)}
    return kept, [f"set aside: rank_{r}.json is another job's record ({_said(s)}; analysed: {_said(last)})"
                  for r, s in sorted(snaps.items()) if r not in kept]


def _said(snap: dict) -> str:
    when = snap.get("time_us")
    written = "" if when is None else time.strftime(", written %Y-%m-%d %H:%M:%S UTC", time.gmtime(when / 1e6))
    return f"run {_shown(snap.get('run') or '(not recorded)')}, world size {snap['world_size']}{written}"


def cut_short(folder: str, snaps: dict[int, dict]) -> dict[int, str]:
    """``{rank: "rank_R.json.tmp"}`` for the ranks of ``snaps``' job whose only file in ``folder`` is a write cut
    short (not another job's, when its start names that job)."""
    run, world = _job(next(iter(snaps.values())))
    out = {}
    for name in sorted(os.listdir(folder)):
        m = RECORD_NAME.fullmatch(name)
        if m and m[2] and int(m[1]) < world and int(m[1]) not in snaps:
            head = peek(os.path.join(folder, name))
            if head is None or head["run"] is None or (head["run"], head["world_size"]) == (run, world):
                out[int(m[1])] = name
    return out


SNAPSHOT_FIELDS = ("rank", "world_size", "reason", "groups", "entries")  #: what the analysis reads of a record ...
GROUP_FIELDS = ("members", "last_seq")  #: ... of each group ...
ENTRY_FIELDS = ("group", "seq", "op", "shape", "dtype", "bytes", "state", "posted_us")  #: ... and of each entry


def _missing(snap) -> str | None:
    """The first field :data:`SNAPSHOT_FIELDS` (and the group and entry fields) that ``snap`` lacks, or None."""
    if not isinstance(snap, dict):
        return "a JSON object"
    for f in SNAPSHOT_FIELDS:
        if f not in snap:
            return repr(f)
    if not isinstance(snap["groups"], dict) or not isinstance(snap["entries"], list):
        return "'groups' as an object and 'entries' as a list"
    world = snap["world_size"]
    if not (_whole(world) and 1 <= world <= MAX_WORLD and _whole(snap["rank"]) and 0 <= snap["rank"] < world):
        return f"a 'world_size' in [1, {MAX_WORLD:,}] and a 'rank' below it"
    for name, g in snap["groups"].items():
        if not isinstance(g, dict) or any(f not in g for f in GROUP_FIELDS):
            return f"groups[{name!r}].{next(f for f in GROUP_FIELDS if not isinstance(g, dict) or f not in g)}"
        if not (_whole(g["last_seq"]) and (g["members"] is None or isinstance(g["members"], list)
                                          and all(_whole(m) for m in g["members"]))):
            return f"groups[{name!r}] with a whole 'last_seq' and 'members' a list of ranks (or null)"
        if g["last_seq"] < 0:  # a group's collectives counted from 1: 0 before its first
            return f"groups[{name!r}].last_seq >= 0 (got {g['last_seq']})"
    for i, e in enumerate(snap["entries"]):
        if not isinstance(e, dict) or any(f not in e for f in ENTRY_FIELDS):
            return f"entries[{i}].{next(f for f in ENTRY_FIELDS if not isinstance(e, dict) or f not in e)}"
        if not (e["seq"] is None or _whole(e["seq"])) or not (e["shape"] is None or isinstance(e["shape"], list)
                                                             and all(_whole(d) for d in e["shape"])):
            return f"entries[{i}] with a whole 'seq' (or null) and 'shape' a list of whole numbers (or null)"
        lows = [("seq", e["seq"], 1), ("bytes", e["bytes"], 0), ("posted_us", e["posted_us"], 0),
                *(("shape", d, 0) for d in e["shape"] or ())]  # seq counts a group's collectives from 1
        below = [(f, v, low) for f, v, low in lows if _whole(v) and v < low]
        if below:
            return f"entries[{i}].{below[0][0]} >= {below[0][2]} (got {below[0][1]})"
        texts = [f for f in ("group", "op", "state", "dtype", "within", "error")
                 if not (isinstance(e.get(f), str) or f not in ("group", "op", "state") and e.get(f) is None)]
        if texts or not (_whole(e["posted_us"]) and (e["bytes"] is None or _whole(e["bytes"]))):
            return (f"entries[{i}].{texts[0]} as text" if texts else
                    f"entries[{i}] with a whole 'posted_us' and 'bytes' (or null)")
    if not (snap.get("run") is None or isinstance(snap["run"], str)) or not (
            snap.get("time_us") is None or _whole(snap["time_us"]) and 0 <= snap["time_us"] <= 1 << 53):
        return "'run' as text and 'time_us' microseconds in [0, 2**53] (or null)"
    cap = snap.get("capacity")  # the entries a rank kept (FlightRecorder's capacity)
    if not (cap is None or _whole(cap) and cap >= 1):
        return f"'capacity' as a whole number >= 1 (or null; got {shortened(repr(cap), 40)})"
    return None if isinstance(snap["reason"], str) else "'reason' as text"


MAX_WORLD = 1 << 20  #: the largest world a flight record may name (the planner's --gpus bound)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _signature(e: dict) -> tuple:
    return e["op"], None if e["shape"] is None else tuple(e["shape"]), e["dtype"]


def _sentence(text) -> str:  # each word of a record's sentence as _shown: the sentence wraps, a long word would not
    return " ".join(_shown(word) for word in str(text).split(" "))


def _shown(text) -> str:  # a record's text past 60 characters (a 300-character op made a 302-column line)
    return shortened(str(text), 60)


def _describe(e: dict) -> str:
    return describe({**e, **{k: _shown(e[k]) for k in ("op", "within", "dtype") if isinstance(e.get(k), str)}})


def _what(e: dict) -> str:
    return _describe(e).replace(f" #{e['seq']}", "")


def _groups(snaps: dict[int, dict]) -> dict[tuple, dict[int, dict]]:
    """``{(name, members): {rank: {"last": last seq posted, "by_seq": {seq: entry}}}}`` for named groups."""
    groups: dict[tuple, dict[int, dict]] = {}
    for rank, snap in snaps.items():
        for name, info in snap["groups"].items():
            if info["members"]:
                groups.setdefault((name, tuple(info["members"])), {})[rank] = {"last": info["last_seq"], "by_seq": {}}
        for e in snap["entries"]:
            if e["seq"] is None:  # a labelled exchange, not a whole-group collective: not matched
                continue
            for key, per in groups.items():
                if key[0] == e["group"] and rank in per and rank in key[1]:
                    per[rank]["by_seq"][e["seq"]] = e
    return groups


def _first_mismatch(name, members, per) -> str | None:
    seqs = sorted(set().union(*(set(p["by_seq"]) for p in per.values())))
    for seq in seqs:
        here = {r: p["by_seq"][seq] for r, p in per.items() if seq in p["by_seq"]}
        kinds: dict[tuple, list[int]] = {}
        for r, e in sorted(here.items()):
            kinds.setdefault(_signature(e), []).append(r)
        if len(kinds) > 1:
            (odd, odd_ranks), *rest = sorted(kinds.items(), key=lambda kv: len(kv[1]))
            others = "; ".join(f"rank(s) {rs} are in {_what(here[rs[0]])}" for _, rs in rest)
            return (f"mismatch: group {_shown(name)} {list(members)} #{seq}: rank(s) {odd_ranks} are in "
                    f"{_what(here[odd_ranks[0]])} while {others}")
    return None


def _pending(p: dict) -> int | None:
    waiting = [s for s, e in p["by_seq"].items() if e["state"] != "completed"]
    return min(waiting) if waiting else None


def _hang(name, members, per, no_file, mismatch) -> list[str]:
    pend = {r: _pending(p) for r, p in per.items()}
    waiting = [s for s in pend.values() if s is not None]
    if not waiting:
        return []
    k = min(waiting)
    waiters = sorted(r for r, s in pend.items() if s == k)
    e = per[waiters[0]]["by_seq"][k]
    state = _shown(e["state"]) + (f": {_sentence(e['error'])}" if e.get("error") else "")
    line = f"hang: group {_shown(name)} {list(members)}: rank(s) {waiters} wait in {_describe(e)} [{state}]"
    never = [r for r in members if r in per and per[r]["last"] < k]
    absent = [r for r in members if r not in per]
    for r in never:
        last = per[r]["by_seq"].get(per[r]["last"])
        line += (f"; rank {r} never posted #{k} (its last: "
                 f"{_describe(last) + ', ' + _shown(last['state']) if last else 'nothing recorded'})")
    for r in absent:
        why = ("never used this group" if r not in no_file else
               "flight file cut short" if no_file[r] else "no flight file")
        line += f"; rank {r} left no record ({why})"
    if not never and not absent and mismatch:
        line += f"; every rank posted #{k}: see the mismatch"
    elif not never and not absent:
        line += f"; every rank posted #{k}: look for the rank that waits elsewhere (another group's line)"
    done = min((s - 1 if s is not None else per[r]["last"]) for r, s in pend.items())
    last = next((p["by_seq"][done] for p in per.values() if done in p["by_seq"]), None)
    out = [line]
    if last is not None:
        out.append(f"last: group {_shown(name)} {list(members)}: the last operation every rank completed is "
                   f"{_describe(last)}")
    return out


def _spans(ranks: list[int]) -> str:
    """Ascending ranks as runs: [0, 2, 3, 4, 7] -> '0, 2-4, 7'."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def analyze(snaps: dict[int, dict], cut: dict[int, str] | None = None, aside=()) -> list[str]:
    """The findings, one readable line each (``missing``, ``mismatch``, ``hang``, ``last``); hangs ordered
    by when their operation was posted (the earliest is the likely cause); ``["ok: ..."]`` if none.
    ``cut``: :func:`cut_short`'s ``{rank: file}``; ``aside``: ranks whose file is another job's."""
    world = max(s["world_size"] for s in snaps.values())
    no_file = {r: (cut or {}).get(r) for r in range(world) if r not in snaps}
    # every file here dumped on SIGUSR1: a rank dumps only when it is signalled itself (kill -USR1 one PID)
    why = "not sent SIGUSR1? each rank dumps its own record: kill -USR1 every rank's PID" \
        if all(s.get("reason") == "SIGUSR1" for s in snaps.values()) else "stopped or killed before it could"
    lines = [f"missing: rank {r}: its flight file was cut short while being written ({tmp})" if tmp else
             f"missing: rank {r}: its rank_{r}.json is another job's record (set aside above)"
             for r, tmp in no_file.items() if tmp or r in aside]
    none = [r for r, tmp in no_file.items() if not tmp and r not in aside]  # one line: one per rank repeated the why
    if none:
        lines.append(f"missing: rank{'s' * (len(none) > 1)} {_spans(none)} wrote no flight file ({why})")
    hangs = []
    for (name, members), per in sorted(_groups(snaps).items()):
        mismatch = _first_mismatch(name, members, per)
        if mismatch:
            lines.append(mismatch)
        found = _hang(name, members, per, no_file, mismatch)
        if found:
            k = min(_pending(p) for p in per.values() if _pending(p) is not None)
            posted = min(p["by_seq"][k]["posted_us"] for p in per.values() if k in p["by_seq"])
            hangs.append((posted, found))
    for _, found in sorted(hangs, key=lambda h: h[0]):
        lines.extend(found)
    if len(lines) == 0:
        n = counted(sum(len(s["entries"]) for s in snaps.values()), "operation")
        lines.append(f"ok: {len(snaps)} rank(s), {n}, every one completed and alike on every rank")
    return lines


def main(folder: str) -> int:
    """Print the records set aside, the reasons of the dumps and the findings; exit status 0 (nothing found) or 1."""
    every = load(folder)
    snaps, aside = newest_job(every)
    for line in aside:
        print(wrapped(line))
    for r, s in sorted(snaps.items()):
        ops = counted(len(s["entries"]), "operation")
        print(wrapped(f"rank {r}: dumped on {_sentence(s['reason'])}, {ops} recorded"))
    lines = analyze(snaps, cut_short(folder, snaps), aside=set(every) - set(snaps))
    for line in lines:  # one line per finding, a long one over indented lines
        print(wrapped(line))
    return 0 if lines[0].startswith("ok:") else 1
