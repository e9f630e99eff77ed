"""Which JSON files are minizero's own: every summary (``--json``) it writes holds the top-level key :data:`KEY`, every
trace (``--trace``) holds it in ``otherData`` (the Trace Event Format's metadata: Perfetto skips it, chrome://tracing
lists it; Perfetto drops what follows a top-level key it does not know). A run replaces only a file so marked; any
other JSON is the user's and refused before any work, one a minizero older than the mark wrote included (as
:mod:`minizero.pngs`: delete that one, or choose another path)."""
from __future__ import annotations

KEY = "minizero"  #: the key pngs.KEY names too
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
