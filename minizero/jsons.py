"""Which JSON files are minizero's own: every summary (``--json``) it writes holds the top-level key :data:`KEY`, every
trace (``--trace``) holds it in ``otherData`` (the Trace Event Format's metadata: Perfetto skips it, chrome://tracing
lists it; Perfetto drops what follows a top-level key it does not know). A run replaces only a file so marked; any
other JSON is the user's and refused before any work, one a minizero older than the mark wrote included (as
:mod:`minizero.pngs`: delete that one, or choose another path)."""
from __future__ import annotations

import json
import re

from minizero.pngs import KEY  # one mark for every output minizero replaces

BIG, PEEK = 1 << 24, 4096  #: a file over 16 MiB is judged by the mark in its first or last PEEK bytes, not parsed
MARKS = {"--json": "a summary minizero wrote; its next run at this path replaces it",
         "--trace": "a trace minizero wrote; its next run at this path replaces it"}
WHAT = {"--json": f"a summary minizero wrote, marked by its top-level key {KEY!r} (an older minizero's has none: "
                  "delete it)",
        "--trace": f"a trace minizero wrote, marked by the key {KEY!r} in its otherData (an older minizero's has "
                   "none: delete it)"}


def summary(data: dict) -> dict:
    """``data`` with the mark first: what every program's ``--json`` writes."""
    return {KEY: MARKS["--json"], **data}


def trace(events: list) -> dict:
    """The Chrome trace-event JSON object of ``events``, marked."""
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {KEY: MARKS["--trace"]}}


def is_marked(data, flag: str) -> bool:
    """Whether ``data`` (parsed JSON) is what ``flag`` (``--json`` or ``--trace``) wrote: its mark in its place."""
    if flag == "--trace":
        data = data.get("otherData") if isinstance(data, dict) else None
    return isinstance(data, dict) and data.get(KEY) == MARKS[flag]


def ends_marked(head: bytes, tail: bytes, flag: str) -> bool:
    """Whether a big file's ``head`` (a summary's first key) or ``tail`` (a trace's last: otherData) holds the mark."""
    mark = re.escape(json.dumps(KEY).encode()) + rb'\s*:\s*' + re.escape(json.dumps(MARKS[flag]).encode())
    if flag == "--json":
        return re.match(rb'\s*\{\s*' + mark + rb'\s*[,}]', head) is not None
    return re.search(rb'"otherData"\s*:\s*\{\s*' + mark + rb'\s*\}\s*\}\s*\Z', tail) is not None
