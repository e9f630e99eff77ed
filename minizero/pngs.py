"""Which PNGs are minizero's own: every plot it saves carries the tEXt chunk :data:`MARK` (``savefig(...,
metadata=MARK)``); a run replaces only a PNG holding it. Any other PNG at an output's path is the user's and refused
before any work, a plot of a minizero older than the mark included (delete that one, or choose another path)."""
from __future__ import annotations

import struct

KEY = "minizero"
MARK = {KEY: "a plot minizero wrote; its next run at this path replaces it"}
SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHUNKS = 64  #: chunks read before the mark is given up on (matplotlib: IHDR, tEXt, tEXt, pHYs, IDAT)
MARKED = f"marked by the text key {KEY!r} (an older minizero's plot has none: delete it)"
WHAT = f"a plot minizero wrote, {MARKED}"


def is_marked(path: str) -> bool:
    """Whether ``path`` is a PNG whose text chunks before the image data hold :data:`KEY` (matplotlib writes them
    there). Reads the chunk headers, seeking past the rest; no matplotlib. Raises OSError: unreadable."""
    with open(path, "rb") as f:
        if f.read(8) != SIGNATURE:
            return False
        for _ in range(CHUNKS):  # a file of millions of empty chunks is judged as fast as a plot
            if len(head := f.read(8)) < 8:
                return False
            size, kind = struct.unpack(">I4s", head)
            if kind in (b"IDAT", b"IEND"):
                return False
            key = f.read(min(size, len(KEY) + 1)) if kind == b"tEXt" else b""  # its keyword, then a NUL
            if key == KEY.encode() + b"\0":
                return True
            f.seek(size - len(key) + 4, 1)  # the rest of the chunk, and its CRC
    return False
