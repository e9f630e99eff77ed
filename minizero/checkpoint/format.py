"""A checkpoint on disk: one folder, one safetensors file per rank, one JSON manifest, a pointer.

``SAVE_DIR/step_NNNNNNNN/`` holds ``manifest.json`` (bytes + sha256 per file) and ``rankNNNNN.safetensors``;
``latest`` names the newest. Written in ``.tmp-step_N``, fsynced, renamed, then ``latest`` moved: a crash
leaves the previous checkpoint valid. safetensors through its NumPy API (no pickle).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat

import numpy as np
from safetensors import SafetensorError, safe_open

from minizero.checkpoint.fields import manifest_problems, rank_file  # noqa: F401 (rank_file: save's)
from minizero.checkpoint.model_fields import clipped
from minizero.data import describe_non_file
from minizero.numerals import is_count
from minizero.files import FolderLock
from minizero.overwrite import MANIFEST, checkpoint_holding  # noqa: F401 (re-exported: minizero.checkpoint's API)

FORMAT = "minizero-checkpoint"
VERSION = 1  #: the manifest version this code writes and the newest it reads
LATEST = "latest"
PREFIX, TMP, TRASH = "step_", ".tmp-", ".trash-"
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and the problem (one line)."""


def folder_name(step: int) -> str:
    """``step_00000006``: the folder of the checkpoint taken after ``step`` loop steps."""
    return f"{PREFIX}{step:08d}"


def fsync_path(path: str) -> None:
    """Flush a file's (or a directory's entries') data to the device (``os.fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: str, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces (memory O(chunk))."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def step_of(name: str) -> int | None:
    """The step in a folder name ``step_N``, or None for any other name."""
    if name.startswith(PREFIX) and is_count(name[len(PREFIX):]):  # not "step_²" (isdigit, which int() refuses)
        return int(name[len(PREFIX):])
    return None


def is_step_folder(name: str) -> bool:
    """Whether ``name`` is one a save writes: :func:`folder_name`'s ``step_00000006``, not ``step_6``."""
    step = step_of(name)
    return step is not None and name == folder_name(step)


def complete(save_dir: str) -> list[str]:
    """Complete checkpoint folders in ``save_dir`` (with a manifest), oldest step first."""
    if not os.path.isdir(save_dir):
        return []
    found = [(step_of(n), n) for n in os.listdir(save_dir) if step_of(n) is not None
             and os.path.isfile(os.path.join(save_dir, n, MANIFEST))]
    return [os.path.join(save_dir, n) for _, n in sorted(found)]


def clean_partial(save_dir: str) -> list[str]:
    """Remove the ``.tmp-`` and ``.trash-`` folders a killed save left (a ``.trash-`` whose replacement never
    landed is renamed back: a save stopped between its two renames); returns the removed names."""
    gone = []
    if os.path.isdir(save_dir):
        for n in os.listdir(save_dir):
            here, back = os.path.join(save_dir, n), os.path.join(save_dir, n[len(TRASH):])
            if not any(n.startswith(p) and is_step_folder(n[len(p):]) for p in (TMP, TRASH)):
                continue  # not a save's (.tmp-step_00000002): the user's, in a --save-dir that is any folder
            if n.startswith(TRASH) and not os.path.lexists(back) and os.path.isfile(os.path.join(here, MANIFEST)):
                with contextlib.suppress(OSError):  # a read-only --save-dir: left as it is, as rmtree leaves it
                    os.replace(here, back)
            else:
                shutil.rmtree(os.path.join(save_dir, n), ignore_errors=True)
                gone.append(n)
    return gone


def refuse_pipes(path: str, flag: str = "--resume") -> None:
    """Raise CheckpointError when ``path``'s ``latest`` or the ``.lock`` in it or above it is not a regular file: a
    FIFO's open waits for a writer (no error, no timeout), so the job would hang before any work."""
    folder = os.path.abspath(path)
    for f in (os.path.join(folder, LATEST), os.path.join(folder, FolderLock.NAME),
              os.path.join(os.path.dirname(folder), FolderLock.NAME)):
        why = describe_non_file(f) if os.path.exists(f) else None  # absent, or a dangling link: nothing to open
        if why:
            raise CheckpointError(f"{flag} {path}: {f}{why}; remove it (a save dir's {LATEST} and {FolderLock.NAME} "
                                  "are files minizero writes)")


def resolve(path: str) -> str:
    """The checkpoint folder ``path`` names: itself, or a save dir's ``latest`` unless a complete step is newer.

    Raises CheckpointError: no such path, or no complete checkpoint in it (partial ones named).
    """
    name = os.path.basename(os.path.normpath(path))
    if name.startswith((TMP, TRASH)):  # never trusted: written by a save that did not finish, or being replaced
        done = [os.path.basename(p) for p in complete(os.path.dirname(os.path.abspath(path)))]
        what = "an unfinished save (never renamed to step_N)" if name.startswith(TMP) else "a replaced checkpoint"
        raise CheckpointError(f"--resume {path}: {what}, never resumed; " + (
            f"complete ones beside it: {', '.join(done[-3:])}" if done else "no complete checkpoint beside it"))
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: is a file, not a checkpoint folder or save dir (give the folder "
                              "that holds manifest.json, or the save dir above it)")
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such checkpoint folder or save dir")
    refuse_pipes(path)
    found = complete(path)
    newest = step_of(os.path.basename(found[-1])) if found else None
    pointer = os.path.join(path, LATEST)
    try:  # a pointer that is unreadable, names no checkpoint here or lags a newer complete step (a save killed
        with open(pointer, encoding="utf-8") as f:  # between its rename and the pointer's move) is passed over
            name = f.read(256).strip()
        step = step_of(name)
        if (name == os.path.basename(name) and os.path.isfile(os.path.join(path, name, MANIFEST))
                and (newest is None or step is None or step >= newest)):
            return os.path.join(path, name)
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    if not found:
        partial = sorted(n for n in os.listdir(path) if n.startswith(TMP))
        raise CheckpointError(f"--resume {path}: no complete checkpoint (no {PREFIX}N/{MANIFEST})"
                              + (f"; only unfinished saves: {', '.join(partial)}" if partial else ""))
    return found[-1]


def checkpoint_digest(path: str) -> dict:
    """``{"--resume PATH": "step_00000002, manifest SHA-256 0123456789ab"}``: the checkpoint :func:`resolve` finds
    under ``path``, for the ranks to compare (:func:`minizero.flags.inputs_refusal`; node-local disks may hold
    different ones under one name); the manifest lists every shard's SHA-256, so its digest covers the shards.
    Raises CheckpointError (as :func:`resolve`; an unreadable manifest)."""
    folder = resolve(path)
    try:
        digest = sha256(os.path.join(folder, MANIFEST))[:12]
    except OSError as e:
        raise CheckpointError(f"{os.path.join(folder, MANIFEST)}: cannot be read ({clipped(e, 90)})") from None
    return {f"--resume {path!r}": f"{os.path.basename(os.path.normpath(folder))}, manifest SHA-256 {digest}"}


def read_manifest(folder: str) -> dict:
    """The parsed ``manifest.json`` of ``folder``, its format and version checked.

    Raises:
        CheckpointError: unreadable or invalid JSON, another format, or a newer version.
    """
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested deeper than any manifest
        raise CheckpointError(f"{path}: cannot be read as JSON ({clipped(e, 90)})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a minizero checkpoint manifest (format {man.get('format')!r})"
                              if isinstance(man, dict) else f"{path}: not a minizero checkpoint manifest")
    v = man.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"{path}: format version {v!r:.40}, expected an integer in 1..{VERSION} (the "
                              "versions this minizero reads)")
    if v > VERSION:
        raise CheckpointError(f"{path}: format version {man.get('version')!r} is newer than this minizero reads "
                              f"(up to {VERSION}); update minizero")
    found = manifest_problems(man)
    if found:
        raise CheckpointError("\n".join(f"{path}: {p}; the manifest is damaged" for p in found))
    return man


#: what a checkpoint written before a layout field existed means by its absence
LAYOUT_DEFAULTS = {"moe_experts": 0}


def verify(path: str, model: dict | None = None, layout: dict | None = None, checksums: bool = True) -> str:
    """Check a checkpoint before any training; returns its folder.

    ``model``: this run's config (:data:`SHAPE_FIELDS` must match); ``layout``: its fields (train's
    :func:`~minizero.checkpoint.run_layout`) must match; ``checksums``: SHA-256 every file and refuse NaN/inf in its
    arrays, in one read of each file (:func:`check_contents`). Raises CheckpointError naming the file and the
    problem: a symbolic link, a damaged manifest, a missing or truncated rank file, one whose header names another
    rank, a checksum, a non-finite value, another model.
    """
    folder = resolve(path)
    if os.path.islink(os.path.normpath(folder)):  # as a rank file: a link may lead anywhere, name the real folder
        raise CheckpointError(f"{folder}: a symbolic link (to {os.path.realpath(folder)}), expected the checkpoint "
                              "folder itself; give that path")
    man = read_manifest(folder)
    mpath = os.path.join(folder, MANIFEST)
    for key in SHAPE_FIELDS:
        if model is not None and man["model"].get(key) != model.get(key):
            raise CheckpointError(f"{mpath}: the checkpoint's model has {key}={man['model'].get(key)}, this run "
                                  f"{model.get(key)} (another model shape; pass the same --model/--block-size)")
    for key, value in (layout or {}).items():
        saved = man["layout"].get(key, LAYOUT_DEFAULTS.get(key))
        if saved != value:
            raise CheckpointError(f"{mpath}: the checkpoint was trained with {key} {saved!r}, this "
                                  f"run asks for {value!r}; resume with the same --{key.replace('_', '-')}")
    for entry in man["files"]:
        f = os.path.join(folder, entry["file"])
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            raise CheckpointError(f"{f}: missing (rank {entry['rank']}'s file of this checkpoint)") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{f}: {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a regular file'}, "
                                  f"expected rank {entry['rank']}'s regular file inside the checkpoint folder")
        size = st.st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{f}: {size:,} bytes, the manifest says {entry['bytes']:,} (truncated or "
                                  f"overwritten)")
        check_header(f, entry["rank"], [pc for pc in man["pieces"] if pc["file"] == entry["file"]])
        if checksums:
            check_contents(f, entry["sha256"])
    return folder


def check_header(path: str, rank: int, pieces=()) -> None:
    """Refuse a rank file whose safetensors header (save writes ``{"rank"}`` there) names another rank
    than its files entry (rank files swapped, or copied in from elsewhere), or lacks one of its ``pieces`` as the
    manifest gives it (a flat array of hi - lo elements of its dtype; 8-bit: uint8 codes). Reads the header only."""
    try:
        with safe_open(path, framework="numpy") as st:
            meta = st.metadata() or {}
            held = {k: (sl.get_dtype(), sl.get_shape()) for k, sl in ((k, st.get_slice(k)) for k in st.keys())}
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the checkpoint is damaged") from None
    if meta.get("rank") != str(rank):
        said = f"rank {meta['rank'][:20]}" if isinstance(meta.get("rank"), str) else "no rank"
        raise CheckpointError(f"{path}: its header names {said}, expected rank {rank} (its files entry's rank); the "
                              "rank files are swapped or from another checkpoint")
    for pc in pieces:
        key, want = (pc["key"], CODES[pc["dtype"]]) if pc["format"] == "dense" else (pc["key"] + "/codes", "U8")
        if held.get(key) != (want, [pc["hi"] - pc["lo"]]):
            said = "no such array" if key not in held else f"{held[key][0]} of shape {held[key][1]}"
            raise CheckpointError(f"{path}: array {key!r}: {said}, the manifest says {want} of shape "
                                  f"[{pc['hi'] - pc['lo']}]; the checkpoint is damaged (resume from an earlier one)")


#: safetensors' codes of the floating dtypes save writes (little-endian); other arrays are only hashed
FLOAT_CODES = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}
CODES = {"float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8"}  #: a piece's dtype, as its header says


def _array_problem(path: str, key: str, a) -> str | None:
    """The message for a floating array that holds NaN/inf, or an Adam v (``v/...``) that holds a negative value."""
    if key.startswith("v/") and (a < 0).any():  # Adam's v: an average of squares
        return (f"{path}: array {key!r} holds negative values, expected Adam's second moment >= 0; the checkpoint "
                "is damaged (resume from an earlier one)")
    if not np.isfinite(a).all():
        bad = int(a.size - np.isfinite(a).sum())
        return (f"{path}: array {key!r} holds {bad:,} non-finite value(s) (NaN or inf) of {a.size:,}, expected finite "
                "numbers; the checkpoint is damaged (resume from an earlier one)")
    return None


def _arrays_in_file_order(header: bytes) -> list[tuple[int, int, str, str]] | None:
    """``(begin, end, key, dtype code)`` of a safetensors JSON header's arrays, by offset (data section bytes);
    None for a header that does not parse."""
    try:
        entries = json.loads(header)
        return sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1]), k, str(e["dtype"]))
                      for k, e in entries.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None


def check_contents(path: str, expected_sha256: str, chunk: int = 1 << 20) -> None:
    """Read a rank file once, front to back: its SHA-256 against the manifest's, and its floating arrays
    (parameters, m, v, masters, 8-bit absmax) finite, Adam's v >= 0, each array decoded from the bytes as they
    pass (one array in memory at a time; the rest in ``chunk``-byte pieces). The checksum is judged first (a corrupt
    file is named corrupt, whatever its bytes decode to), then a header that does not parse (its arrays cannot be
    checked), then the first bad array in key order. Raises CheckpointError naming the file (and the array, the
    count)."""
    h, problems, unparsed = hashlib.sha256(), {}, None
    with open(path, "rb") as f:
        def take(n: int) -> bytes:
            data = f.read(n)
            h.update(data)
            return data

        def skip(n: int) -> None:
            while n > 0 and (data := take(min(n, chunk))):
                n -= len(data)

        head = take(8)
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        fits = len(head) == 8 and n <= size - 8
        arrays = _arrays_in_file_order(take(n)) if fits else None
        if arrays is None:
            unparsed = "not JSON naming each array's dtype and data_offsets" if fits else \
                f"a header of {n:,} bytes in a file of {size:,}"
            arrays = []
        at = 0  # offset in the data section
        for begin, end, key, code in arrays:
            if begin < at or end < begin:  # overlapping or reversed: a damaged header
                unparsed = f"array {key!r} at bytes {begin}..{end} overlaps the one before or is reversed"
                continue
            skip(begin - at)
            at = end
            if code not in FLOAT_CODES:
                skip(end - begin)
                continue
            data, dtype = take(end - begin), np.dtype(FLOAT_CODES[code])
            if len(data) == end - begin and len(data) % dtype.itemsize == 0:
                problem = _array_problem(path, key, np.frombuffer(data, dtype=dtype))
                if problem is not None:
                    problems[key] = problem
        while take(chunk):  # whatever follows the last array, to the end
            pass
    if h.hexdigest() != expected_sha256:
        raise CheckpointError(f"{path}: checksum mismatch (SHA-256 differs from the manifest's; the file is corrupt)")
    if unparsed:
        raise CheckpointError(f"{path}: its SHA-256 matches the manifest's, but its safetensors header does not parse "
                              f"({unparsed}), so its arrays cannot be checked; the checkpoint is damaged")
    if problems:
        raise CheckpointError(problems[min(problems)])
