"""Where ``python -m minizero.train`` writes: OUT, --json, --trace, checked before any work
(UsageError naming the flag)."""
from __future__ import annotations

import os

from minizero.checkpoint import checkpoint_holding, resolve
from minizero.checkpoint.format import LATEST, refuse_pipes
from minizero.checkpoint.format import MANIFEST, complete as complete_checkpoints, is_step_folder, step_of
from minizero.comm.flight import RECORD_NAME, clear, records
from minizero.files import PRUNED_MID_READ, check_writable_file, live_job_holding
from minizero.overwrite import refuse_blocking, refuse_slash_or_dangling, refuse_foreign, refuse_read_back
from minizero.temporaries import check_writable_folder, unwritable
from minizero.data import describe_non_file
from minizero.flags import UsageError
from minizero.memory.plots import plots_on
from minizero.saved_model import refuse_replacing
from minizero.streams import check_stream, stream_fd


def check_outputs(args) -> None:
    """OUT must be (or become) a writable directory and JSON a writable file path that clobbers nothing."""
    out = args.out
    if not out:
        raise UsageError("--out must name a directory, got ''")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} exists and is not a directory")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):  # the nearest existing ancestor is where makedirs will start
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--out {out!r} cannot be created or written ({parent!r} is not a writable directory)")
    if args.json == "":
        raise UsageError("--json '': expected a file path for the JSON summary")
    if stream_fd(args.json) is not None:  # /dev/stdout: written into where it stands, nothing replaced
        _usage(check_stream, args.json, "--json")
    else:
        check_json_file(args)
    files = [p for p, w in run_files(args).items() if w.startswith("the ")]  # OUT's files (not its folders, --data)
    for path in files:
        _usage(refuse_blocking, path, "--out")
    weights = os.path.join(out, "model.npz")
    outside_checkpoints("--out", weights, out)
    if os.path.isdir(weights):
        raise UsageError(f"--out {out!r}: {weights!r} is a directory; the weights could not be written there")
    for name in ("model.npz", "model.json"):  # the user's own file of that name: kept (check_outputs: not --no-save)
        _usage(refuse_replacing, os.path.join(out, name), "--out")
    for name in ("loss.png", "memory.png") if plots_on() else ():  # the user's own plots too (minizero's: marked);
        _usage(refuse_foreign, os.path.join(out, name), "--out")  # MINIZERO_PLOTS=0 draws none: nothing is lost
    flight = not_a_folder(os.path.join(out, "flight")) if args.flight_records else None
    if flight:  # found after the failure, the flight records would be lost
        raise UsageError(f"--out {out!r}: {flight}; the flight records of a failed job go there")
    probe(out, "--out")
    probe(args.json, "--json", check_writable_file)


def check_json_file(args) -> None:
    """:func:`check_outputs` for a ``--json`` file: one that overwrites none of the run's files nor the user's."""
    out, js = args.out, os.path.abspath(args.json)
    if os.path.isdir(args.json):  # as given: abspath('x.json/..') is a directory, 'x.json/..' is refused below
        raise UsageError(f"--json {args.json!r} is a directory; give a file path")
    _usage(refuse_slash_or_dangling, args.json, "--json")  # abspath drops the '/': NotADirectoryError after the run
    own = run_files(args)
    if os.path.realpath(js) in own:  # a link to --data too
        raise UsageError(f"--json {args.json!r} would overwrite {own[os.path.realpath(js)]}; give another file")
    not_a_flight_record(args, "--json", args.json)
    jparent = os.path.dirname(js)
    if os.path.abspath(jparent) != os.path.abspath(out):  # OUT is made before anything is written
        existing_folder("--json", args.json, jparent)
    outside_checkpoints("--json", js, args.json)
    if os.path.realpath(js) != os.path.realpath(os.path.join(out, "summary.json")):  # OUT's own: this run's
        _usage(refuse_read_back, args.json, "--json")
    _usage(refuse_foreign, args.json, "--json")  # the user's notes (OUT/summary.json too), not an earlier summary
    _usage(refuse_blocking, args.json, "--json")


def clear_flight(args) -> str | None:
    """Rank 0, holding OUT's lock (no other job writes there now): the refusal when OUT/flight holds a
    ``rank_R.json`` minizero did not write (a failed job's dump would replace it), else None, the previous run's
    flight records removed (this run's replace them); one read of the folder."""
    folder = os.path.join(args.out, "flight")
    ours, foreign = records(folder)
    if foreign and args.flight_records:
        return (f"--out {args.out!r}: {foreign[0]!r} exists and is no flight record; a failed job's record "
                "replaces only an earlier one (an earlier output): move that file away")
    if not os.path.islink(folder):  # a link may lead to kept records (an archive): none removed through it; the
        clear(folder, ours)  # analyzer sets other runs' records aside
    return None


def not_a_flight_record(args, flag: str, given: str) -> None:
    """Refuse an output named like a flight record (``rank_R.json``) in OUT/flight: a failed job's dump would
    replace it, and the next run with this OUT refuses it as a record minizero did not write (:func:`clear_flight`)."""
    if args.no_save or not args.flight_records or not RECORD_NAME.fullmatch(os.path.basename(given)):
        return
    if os.path.realpath(os.path.dirname(os.path.abspath(given))) == os.path.realpath(os.path.join(args.out, "flight")):
        raise UsageError(f"{flag} {given!r} is named like a flight record in OUT/flight, where a failed job's records "
                         "go; give another file")


def not_a_folder(path: str) -> str | None:
    """``"PATH is a named pipe (FIFO), not a folder"`` when ``path`` is there and no folder (a file, a link to
    nothing: makedirs fails), else None."""
    if not os.path.lexists(path) or os.path.isdir(path):
        return None
    what = (describe_non_file(path) or " is a file").split(", not")[0] if os.path.exists(path) else " is a broken link"
    return f"{path}{what}, not a folder"


def run_files(args) -> dict:
    """The files a run reads or writes besides --json and --trace, and the folders it makes (OUT, OUT/flight, the
    save dir), {absolute path: what it is}: another output given one of these paths would overwrite it or be
    overwritten by it (the weights' config unreadable), or fail after the work (a file where the run made its folder);
    links followed. Raises UsageError for a save dir at one of OUT's own paths (OUT itself is allowed)."""
    files = {os.path.realpath(os.path.join(args.out, name)): what for name, what in (
        ("model.npz", "the weights (OUT/model.npz)"), ("model.json", "the weights' config (OUT/model.json)"),
        ("loss.png", "the loss plot (OUT/loss.png)"), ("memory.png", "the memory plot (OUT/memory.png)"))}
    if not args.no_save:  # a file where OUT goes: refused before the work, not after it
        files[os.path.realpath(args.out)] = "--out, the folder the run writes into"
        if args.flight_records:  # a file there: the next run with this OUT is refused (check_outputs)
            flight = os.path.realpath(os.path.join(args.out, "flight"))
            files[flight] = "OUT/flight, the folder of a failed job's flight records"
    if args.save_every:
        save = args.save_dir if args.save_dir is not None else os.path.join(args.out, "checkpoints")
        clash = files.get(os.path.realpath(save)) if os.path.realpath(save) != os.path.realpath(args.out) else None
        if clash and not args.no_save:  # the save dir made first, the run's own file could not be written after it
            raise UsageError(f"--save-dir {save!r} would take the place of {clash}; give another folder")
        files[os.path.realpath(save)] = "--save-dir, the folder the checkpoints go to"
    if args.data:
        files[os.path.realpath(args.data)] = "--data"
    return files


def _usage(check, path: str, flag: str) -> None:
    """``check(path, flag)`` (a :mod:`minizero.overwrite` check raising ValueError) as a UsageError."""
    try:
        check(path, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None


def existing_folder(flag: str, given: str, folder: str) -> None:
    """Refuse an output whose ``folder`` does not exist or is not writable: a typo is not made into a folder. A
    stream or device (/dev/null) is written into, never renamed over: its folder need not be writable."""
    if stream_fd(given) is not None or os.path.exists(given) and not (os.path.isfile(given) or os.path.isdir(given)):
        return
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise UsageError(f"{flag} {given!r}: directory {folder!r} does not exist or is not writable")


def outside_checkpoints(flag: str, path: str, given: str) -> None:
    """Refuse an output ``path`` inside a checkpoint folder (it would overwrite or add to the checkpoint)."""
    folder = checkpoint_holding(path)
    if folder:
        raise UsageError(f"{flag} {given!r} is inside the checkpoint folder {folder!r} and would overwrite or add to "
                         "it; give a path outside every checkpoint")


def probe(path: str, flag: str, check=check_writable_folder) -> None:
    """``check(path)``: the temporary of a write created and removed where the write puts it, or in the nearest
    existing folder above (nothing is left behind: a run refused later finds no empty folder); the whole path and
    every name within the file system's limits; access() says yes for root on /proc. UsageError names ``flag``."""
    try:
        check(path)
    except OSError as e:
        raise UsageError(unwritable(flag, path, e, "folder" if check is check_writable_folder else "file")) from None


def check_trace(args) -> None:
    """``--trace PATH`` is written by rank 0 after the last step: check now that it can be (a file path whose
    folder exists, or is OUT, and takes a file), and that it overwrites none of the run's own files, so a
    finished run is never lost to it."""
    path = args.trace
    if path is None:
        return
    if not path:
        raise UsageError("--trace must name a file for the timeline, got ''")
    p = os.path.abspath(path)
    if os.path.isdir(path):
        raise UsageError(f"--trace {path!r} is a directory; give a file path, e.g. "
                         f"{os.path.join(path, 'trace.json')!r}")
    if stream_fd(path) is not None:  # /dev/stdout: written into where it stands, nothing replaced
        return _usage(check_stream, path, "--trace")
    _usage(refuse_slash_or_dangling, path, "--trace")
    own = dict(run_files(args), **{os.path.realpath(args.json): "the --json summary"})
    if os.path.realpath(p) in own:  # links followed
        raise UsageError(f"--trace {path!r} would overwrite {own[os.path.realpath(p)]}; give another file")
    outside_checkpoints("--trace", p, path)
    not_a_flight_record(args, "--trace", path)
    _usage(refuse_read_back, path, "--trace")
    _usage(refuse_blocking, path, "--trace")
    _usage(refuse_foreign, path, "--trace")  # the user's notes, not an earlier trace
    if args.no_save or os.path.dirname(p) != os.path.abspath(args.out):  # OUT made unless --no-save
        existing_folder("--trace", path, os.path.dirname(p))
    probe(path, "--trace", check_writable_file)


def check_save_dir(args) -> None:
    """A save dir that already holds checkpoints takes this run's only when it resumes one of them: a fresh run
    (or one resumed from elsewhere) would overwrite another run's steps and move its ``latest``."""
    if args.save_every:
        _usage(refuse_pipes, args.save_dir, "--save-dir")
        names = os.listdir(args.save_dir) if os.path.isdir(args.save_dir) else []
        resumed = step_of(os.path.basename(resolve(args.resume))) if args.resume else None
        start = resumed or 0  # saves come after it: a step folder below (a prune killed part way) is never replaced
        other = [n for n in sorted(names) if is_step_folder(n) and step_of(n) > start
                 and not os.path.isfile(os.path.join(args.save_dir, n, MANIFEST))]  # a save of step N replaces it
        if other:
            raise UsageError(f"--save-dir {args.save_dir!r} holds {other[0]!r}, which is not a checkpoint (no "
                             f"{MANIFEST} in it): a save of that step would replace it; move it away, or "
                             "give another --save-dir")
        latest = os.path.join(args.save_dir, LATEST)
        if os.path.isfile(latest) and not complete_checkpoints(args.save_dir):  # else a damaged pointer: rewritten
            try:
                with open(latest, "rb") as f:
                    said = f.read(64).decode("utf-8", "replace").strip()
            except OSError:  # unreadable: the rename of a save replaces it all the same
                said = ""
            if step_of(said) is None:
                raise UsageError(f"--save-dir {args.save_dir!r} holds a file {LATEST!r} that names no checkpoint "
                                 f"({said[:20]!r}), which every save would overwrite; move it away, or give another "
                                 "--save-dir")
    held = complete_checkpoints(args.save_dir) if args.save_every else []
    if not held:
        return
    if args.resume:
        resumed = os.path.realpath(resolve(args.resume))  # realpath: through links too
        if os.path.dirname(resumed) == os.path.realpath(args.save_dir):
            first = step_of(os.path.basename(resumed))
            later = [os.path.basename(p) for p in held if first is not None and step_of(os.path.basename(p)) > first]
            if first is not None and not later:
                return
            if first is not None:  # a rewind (or a stale ``latest``): this run's steps would land on the later ones
                raise UsageError(
                    f"--resume {args.resume!r} is {os.path.basename(resumed)}, but --save-dir {args.save_dir!r} "
                    f"also holds later steps of that run ({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}"
                    "): saving there would mix the two runs; to rewind, give this run another --save-dir; to "
                    f"continue, --resume {os.path.join(args.save_dir, later[-1])!r}")
    names = ", ".join(os.path.basename(p) for p in held[:3]) + (", ..." if len(held) > 3 else "")
    raise UsageError(f"--save-dir {args.save_dir!r} already holds the checkpoints of an earlier run ({names}); "
                     + ("continue that run with --resume " + repr(args.save_dir) if not args.resume else
                        f"--resume {args.resume!r} is not one of them")
                     + ", or give another --save-dir (or --out)")


def check_resume_source(args) -> None:
    """Refuse --resume from a folder a running minizero job locks (:class:`~minizero.files.FolderLock`): the path or
    the folder above it, its save dir (or OUT). That job's next save prunes old checkpoints (--keep) and moves
    ``latest`` while this job reads shards: refused in one line rather than a read that races the pruning."""
    _usage(refuse_pipes, args.resume, "--resume")
    held = live_job_holding(args.resume)
    if held:
        raise UsageError(f"--resume {args.resume!r}: {held[0]!r} is in use by a running minizero job ({held[1]}), "
                         + PRUNED_MID_READ)


def _result_files(args) -> list[str]:
    """The files a finished run leaves in OUT: the weights, their config, the plots, and --json when it is in OUT."""
    names = [os.path.join(args.out, n) for n in ("model.npz", "model.json", "loss.png", "memory.png")]
    in_out = args.json and os.path.dirname(os.path.realpath(args.json)) == os.path.realpath(args.out)
    return names + ([args.json] if in_out else [])


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def earlier_results(args) -> dict:
    """OUT's result files there now (an earlier run's), {path: (inode, mtime in ns)}; none under --no-save."""
    stamps = {} if args.no_save else {p: _stamp(p) for p in _result_files(args)}
    return {p: s for p, s in stamps.items() if s is not None}


def still_earlier(found: dict) -> list[str]:
    """The paths of :func:`earlier_results` this run has not replaced (same inode and mtime; a write replaces the
    file): what a failed run leaves of the run before it, which ``sample`` and ``quantize`` would take for its own."""
    return [p for p, stamp in found.items() if _stamp(p) == stamp]
