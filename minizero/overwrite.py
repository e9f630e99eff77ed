"""Before an output is written: what it would overwrite. An earlier output of its kind is replaced; the user's
files (notes, data, an input, a file programs read back, a checkpoint) are refused in one line naming the flag."""
from __future__ import annotations

import contextlib
import os
import stat

from minizero.files import check_writable_file, read_json
from minizero.jsons import BIG, PEEK, WHAT as JSON_WHAT, ends_marked, is_marked as json_marked
from minizero.pngs import WHAT as PNG_WHAT, is_marked as png_marked
from minizero.streams import check_stream, stream_fd
from minizero.temporaries import unwritable


@contextlib.contextmanager
def refusing_unreadable(path: str, flag: str):
    """An OSError while the block reads the existing output ``path`` (chmod 000) becomes the one ValueError (naming
    ``flag``) that says so, the same for every kind of output, not a traceback."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{flag}: {path!r} is there and cannot be read ({e.strerror}); make it readable or move it "
                         "away") from None


MANIFEST = "manifest.json"  #: the file that makes a folder a checkpoint (minizero.checkpoint writes it last)


def checkpoint_holding(path: str) -> str | None:
    """The checkpoint folder (one with a ``manifest.json``) that ``path`` lies inside, or None (also for ``path``
    itself being one): no output may land inside a checkpoint (a shard or the manifest overwritten is it lost)."""
    a = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.isfile(os.path.join(a, MANIFEST)):
            return a
        if os.path.dirname(a) == a:
            return None
        a = os.path.dirname(a)


def refuse_inputs(flag: str, given: str, path: str, inputs: dict, instead: str = "give another file") -> None:
    """Raise ValueError when output ``path`` (``flag given``) is one of ``inputs`` ({flag: path}), links followed."""
    real = os.path.realpath(path)
    for other_flag, other in inputs.items():
        if other and real == os.path.realpath(other):
            raise ValueError(f"{flag} {given!r} would overwrite {other_flag} {other!r}; {instead}")


#: files minizero's programs read back (weights, config, a run's summary, a manifest): :func:`check_output` keeps them
READ_BACK = ("model.npz", "model.json", "summary.json", "manifest.json")


def refuse_read_back(path: str, flag: str) -> None:
    """Raise ValueError when writing ``path`` would lose a file minizero's programs read back: an existing
    :data:`READ_BACK` name or ``.npz`` (a ``summary.json`` only beside a run's ``model.npz`` or ``model.json``), or
    a save dir's ``latest`` (beside a ``step_N`` checkpoint)."""
    real = os.path.realpath(path)
    name, folder = os.path.basename(real), os.path.dirname(real)
    if name == "summary.json" and not any(os.path.exists(os.path.join(folder, f)) for f in ("model.npz", "model.json")):
        return  # a summary written on its own: nothing reads it with weights
    if not os.path.isfile(real):
        return  # nothing there to lose
    pointer = name == "latest" and any(os.path.isfile(os.path.join(folder, n, MANIFEST)) for n in os.listdir(folder)
                                       if n.startswith("step_"))
    if name in READ_BACK or real.endswith(".npz") or pointer:
        raise ValueError(f"{flag} {path!r} would overwrite {name}, which minizero's programs read back (weights, "
                         "config, a run's summary, a checkpoint manifest or a save dir's latest); give another file")


def refuse_blocking(path: str, flag: str) -> None:
    """Raise ValueError when ``path`` is a named pipe (FIFO), whose open would wait for a reader after all the
    work, or a socket, which cannot be opened. A device such as /dev/null is written into."""
    mode = os.stat(path).st_mode if os.path.exists(path) else 0
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        what = "a named pipe (FIFO): writing it would wait for a reader" if stat.S_ISFIFO(mode) else "a socket"
        raise ValueError(f"{flag} {path!r} is {what}; give a regular file (or /dev/null)")


def refuse_foreign(path: str, flag: str) -> None:
    """Raise ValueError when ``path`` is a non-empty regular file unlike what ``flag`` writes (:data:`JSON_WHAT`, else
    a PNG minizero marked, :mod:`minizero.pngs`): an output replaces an earlier output, never the user's files."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with refusing_unreadable(path, flag):
        with open(path, "rb") as f:
            head, big = f.read(PEEK), os.fstat(f.fileno()).st_size > BIG
            f.seek(max(f.tell(), os.fstat(f.fileno()).st_size - PEEK))
            tail = f.read()
        try:  # a small file, a brace first: parse it (a big one is judged by its ends, a text file is not read)
            data = read_json(path) if flag in JSON_WHAT and not big and head.lstrip()[:1] == b"{" else None
        except ValueError:
            data = None
    if flag not in JSON_WHAT:
        marked = png_marked(path)
    else:
        marked = ends_marked(head, tail, flag) if big else json_marked(data, flag)
    if not marked:
        what = JSON_WHAT.get(flag, PNG_WHAT)
        raise ValueError(f"{flag} {path!r} exists and does not hold {what}: {flag} replaces only such a file (an "
                         f"earlier output); give another {'folder' if flag == '--out' else 'file'}, or move that one "
                         "away")


def refuse_slash_or_dangling(path: str, flag: str) -> None:
    """Raise ValueError when ``path`` ends in '/', '/.' or '/..' (abspath drops it: another file was written) or is a
    link whose target's folder does not exist (the write made it, a folder given directly is refused)."""
    if (tail := os.path.basename(path)) in ("", ".", ".."):  # as given: 'x.json/.' wrote x.json or failed late
        what = "is a folder" if path == tail else f"ends in {'/' + tail!r}"
        raise ValueError(f"{flag} {path!r} {what}: give a file path")
    real = os.path.realpath(path)
    if os.path.islink(path) and not os.path.isdir(os.path.dirname(real)):
        raise ValueError(f"{flag} {path!r}: folder {os.path.dirname(real)!r} of the link's target {real!r} does not "
                         "exist; create that folder or give another path")


def check_output(path: str, flag: str = "--json", inputs: dict | None = None) -> None:
    """Raise ValueError unless ``path`` can be written (not a directory; its folder exists and takes a file) without
    losing what the user has: not '', not one of ``inputs`` ({flag: path} read), a file programs read back
    (:func:`refuse_read_back`), a FIFO (:func:`refuse_blocking`), another kind's (:func:`refuse_foreign`), nor
    inside a checkpoint folder."""
    if not path:
        raise ValueError(f"{flag} '': expected a file path")
    if stream_fd(path) is not None:  # written into, nothing replaced (minizero.streams)
        return check_stream(path, flag)
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path")
    refuse_slash_or_dangling(path, flag)
    refuse_inputs(flag, path, path, inputs or {})
    refuse_read_back(path, flag)
    refuse_blocking(path, flag)
    refuse_foreign(path, flag)
    if folder := checkpoint_holding(os.path.realpath(path)):
        raise ValueError(f"{flag} {path!r} is inside the checkpoint folder {folder!r}; give a path outside it")
    if not os.path.isdir(d := os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"{flag} {path!r}: folder {d!r} does not exist")
    try:
        check_writable_file(path)
    except OSError as e:
        raise ValueError(unwritable(flag, path, e)) from None
