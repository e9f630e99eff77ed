"""Ctrl-C (SIGINT) and SIGTERM in every command-line tool: one line naming the tool, the signal and what happened
to its files, exit status 128 + the signal, no traceback (:func:`interruptible`; the main job: minizero.train)."""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from minizero.launcher import (launched_by_mpiexec, launched_rank, launched_ranks, launcher_connected, pmix_names,
                               refuse_stale_launcher)
from minizero.numerals import error_lines, significant, wrapped

#: what a tool says of its files when interrupted
WHOLE = "files already written are left as they were (each is written whole or not at all)"
NOTHING = "nothing was written"


class Terminated(BaseException):
    """SIGTERM arrived (as KeyboardInterrupt is SIGINT): unwind, clean up, exit 128 + 15."""


class Interrupts:
    """Signal handlers that remember what they raised. A KeyboardInterrupt or Terminated raised inside a weakref
    callback (the ledger's release of a freed array) is printed as "Exception ignored" and lost; :meth:`quiet_hook`
    (``sys.unraisablehook``) keeps those off stderr and ``raised`` lets the caller raise it again."""

    raised: list = []  # the exception classes the handlers raised, first first

    @classmethod
    def handler(cls, error):
        """A signal handler raising ``error`` (an exception class) and remembering it."""
        def raise_it(signum, frame):
            cls.raised.append(error)
            raise error()
        return raise_it

    @classmethod
    def quiet_hook(cls, unraisable):
        if unraisable.exc_type not in cls.raised:
            sys.__unraisablehook__(unraisable)

    @classmethod
    def install(cls) -> None:
        """SIGINT raises KeyboardInterrupt, SIGTERM Terminated (main thread only); dropped ones stay quiet."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, cls.handler(KeyboardInterrupt))
            signal.signal(signal.SIGTERM, cls.handler(Terminated))
            sys.unraisablehook = cls.quiet_hook

    @classmethod
    def check(cls) -> None:
        """Raise again a signal's exception that Python dropped in a weakref callback."""
        if cls.raised:
            raise cls.raised[0]()


def refuse_several_ranks(parser) -> None:
    """A one-process program launched on several ranks exits 2 before any work, one line from rank 0 (each rank
    would write the same files: two checkpoint consolidates raced on one model.npz)."""
    if launched_ranks() > 1:
        if not launcher_connected():  # PMI_SIZE=2 PMI_RANK=1 left in a shell: "rank 1" exited 2 silently before
            names = [k for k in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                 *pmix_names(("SLURM_STEP_NUM_TASKS", "PMIX_RANK"))) if k in os.environ]
            stale = names + [k for k in ("PMI_FD", "PMI_PORT") if k in os.environ]  # what train would trip on next
            parser.error(f"{' '.join(f'{k}={os.environ[k]}' for k in names)} {'is' if len(names) == 1 else 'are'} set, "
                         f"but no MPI launcher started this process: unset {' '.join(stale)} (this program runs in "
                         "one process, without mpiexec)")
        parser.quiet = launched_rank() != 0
        parser.error(f"runs in one process; mpiexec started {launched_ranks()} ranks: run it without mpirun (or with "
                     "-n 1)")


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process within about ``poll_s`` seconds once its parent (the launcher's proxy) is gone.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (what ``torchrun`` and Open MPI's ``--enable-recovery`` rely on);
    everywhere: a daemon thread that calls ``os._exit(129)`` when ``os.getppid()`` changes (the orphan was
    re-parented). Raises nothing.
    """
    ppid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == ppid:
            time.sleep(poll_s)
        os._exit(129)

    threading.Thread(target=watch, name="minizero-parent-watch", daemon=True).start()


def set_up_timeout(argv, default_s: float, minimum_s: float) -> float:
    """--comm-timeout as given in ``argv`` (read before MPI starts; the last one, as argparse), else ``default_s``;
    set-up waits at most this. Only that flag is read here (a value that is no ASCII number or lies outside
    [minimum_s, 1000 x default_s) falls back to the default; the program's own checks refuse it later)."""
    words, given = [str(w) for w in (sys.argv[1:] if argv is None else argv)], None
    for i, word in enumerate(words):
        if word == "--comm-timeout" and i + 1 < len(words):
            given = words[i + 1]
        elif word.startswith("--comm-timeout="):
            given = word.split("=", 1)[1]
    try:
        t = float(given) if given and given.isascii() and "_" not in given else default_s
    except ValueError:
        return default_s
    return t if minimum_s <= t < default_s * 1000 else default_s


def guard_set_up(argv, default_s: float, minimum_s: float, tool: str) -> None:
    """Bound an MPI program's set-up (MPI's start, the ranks' first exchanges, its locks); call it first in main.

    Under mpiexec this rank ends with its launcher (:func:`exit_with_parent`). A rank stalled before set-up ends
    (stopped while importing: its peers wait in MPI_Init or a blocking exchange, where no Python code runs) must
    still end the job: faulthandler's own thread prints where this rank waited and exits 1 after --comm-timeout s
    (:func:`set_up_timeout`; ``default_s``, ``minimum_s``: the program's), and mpiexec then ends every rank.
    Until :func:`end_set_up` Ctrl-C and SIGTERM keep their default action (``minizero/__init__.py`` sets SIGINT's
    before a ``python -m minizero.X`` program's imports; a Python handler would never run inside MPI_Init): the rank
    ends, mpiexec's status, no traceback, no hang (SIGINT to one of several MPICH ranks: as SIGTERM, see there).
    """
    refuse_stale_launcher(f"python -m {tool}")  # MPI_Init: MPICH's abort and error stack before
    if launched_by_mpiexec():
        exit_with_parent()
    faulthandler.dump_traceback_later(set_up_timeout(argv, default_s, minimum_s), exit=True, file=2)  # stderr (fd)


#: ends this process with ``argv[3]`` on stderr unless its stdin (a pipe from it) closes in ``argv[1]`` s
_WATCH = ("import os, select, signal, sys\nif not select.select([0], [], [], float(sys.argv[1]))[0]:\n"
          "    os.write(2, sys.argv[3].encode() + b'\\n'); os.kill(int(sys.argv[2]), signal.SIGTERM)")


@contextlib.contextmanager
def mpi_start_guarded(prog: str | None = None, argv=None, default_s: float = 600.0, timeout_s: float | None = None):
    """Start MPI (import mpi4py's MPI, ``world()``) inside this: what :func:`guard_set_up` does for an MPI program
    without a set-up to bound (the hardware tool, bench scripts). A stale launcher is named in one line; SIGTERM
    and SIGINT (unless ignored) take their default action, as no Python handler runs inside MPI_Init; a watchdog
    process ends a MPI_Init stalled ``timeout_s`` (else ``argv``'s --comm-timeout) s, one line."""
    prog = prog or os.path.basename(sys.argv[0])
    refuse_stale_launcher(prog)
    if launched_by_mpiexec():
        exit_with_parent()
    kept = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            if (s == signal.SIGTERM and signal.getsignal(s) is not None) or callable(signal.getsignal(s)):
                kept[s] = signal.signal(s, signal.SIG_DFL)  # any Python handler (not SIG_IGN: nohup; not C's: None)
    seconds = set_up_timeout(argv, default_s, 1.0) if timeout_s is None else timeout_s  # parsed: as given
    names = [f"{k}={os.environ[k]}" for k in ("PMI_FD", "PMI_PORT") if k in os.environ]
    line = error_lines(prog, f"MPI_Init waited {significant(seconds)} s for its launcher"
                       + (f" ({' '.join(names)}) and was ended: unset {' '.join(n.split('=')[0] for n in names)} "
                          "if no mpiexec started this" if names else " and was ended"))
    watch = None
    try:
        watch = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCH, str(seconds), str(os.getpid()), line],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        yield
    finally:
        try:  # the pipe's end of file ends it only for a parent that died: a child forked in the block keeps its end
            if watch is not None:
                watch.kill()
                watch.wait()  # before the handlers: a SIGTERM it sent as the block ended kills (default action) here
                watch.stdin.close()
        finally:
            for s, handler in kept.items():
                signal.signal(s, handler)


def start_mpi(prog: str | None = None):
    """mpi4py's MPI, imported (MPI_Init) inside :func:`mpi_start_guarded`."""
    with mpi_start_guarded(prog):
        from mpi4py import MPI  # noqa: PLC0415
    return MPI


def end_set_up(install: bool = True) -> None:
    """Set-up is over: :func:`guard_set_up`'s timer cancelled (the communicator's timeouts take over) and, with
    ``install``, SIGINT and SIGTERM unwind from here (:meth:`Interrupts.install`, this run's signals only)."""
    faulthandler.cancel_dump_traceback_later()
    if install:
        Interrupts.raised.clear()
        Interrupts.install()


class WatchedStdout:
    """``sys.stdout`` (:func:`watch_stdout`) that keeps the OSError its write or flush raised (a full disk)."""
    failed = None

    def __init__(self, inner):
        self.inner = inner

    def write(self, text):
        return self._do(self.inner.write, text)

    def flush(self):
        return self._do(self.inner.flush)

    def _do(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            WatchedStdout.failed = e
            raise

    def __getattr__(self, name):
        return getattr(self.inner, name)


def watch_stdout(tool: str = "minizero") -> None:
    """Wrap ``sys.stdout`` in :class:`WatchedStdout` (a program's ``__main__`` only), each line one write (under
    ``PYTHONUNBUFFERED`` print wrote text and newline apart, and MPICH's launcher put other ranks' lines between),
    any text printable (``PYTHONIOENCODING=ascii``: a sample's U+FFFD shows as ``\\ufffd``, UTF-8 unchanged).
    Stdout closed (``>&-``, ``sys.stdout`` None): one line on stderr, exit 2 before any work (a file opened later
    would get descriptor 1, and whatever writes to stdout would write into it)."""
    if sys.stdout is None:
        print(error_lines(tool if tool.endswith(".py") else f"python -m {tool}", "standard output is closed (>&-); "
                          "send it to a file or to /dev/null (> /dev/null)"), file=sys.stderr)
        raise SystemExit(2)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is getattr(sys, f"__{name}__") and getattr(stream, "write_through", False):  # not a test's capture
            stream.reconfigure(write_through=False, line_buffering=True)
    if sys.stdout is sys.__stdout__ and hasattr(sys.stdout, "reconfigure"):  # stderr's default already is this
        sys.stdout.reconfigure(errors="backslashreplace")
    if not isinstance(sys.stdout, WatchedStdout):
        sys.stdout = WatchedStdout(sys.stdout)


def stdout_unwritable(e: BaseException) -> bool:
    """True when ``e`` is what writing standard output raised (> /dev/full, a full disk): not a bug. Not for its
    reader gone (:func:`stdout_reader_gone`), which ends a program quietly."""
    return e is WatchedStdout.failed and not isinstance(e, BrokenPipeError)


def stdout_reader_gone(e: BaseException) -> bool:
    """True when ``e`` is the BrokenPipeError writing standard output raised: its reader went away (``| head``)."""
    return e is WatchedStdout.failed and isinstance(e, BrokenPipeError)


def run_script(main) -> int:
    """``main()`` of a script (bench/, lessons/build.py) with :func:`watch_stdout`, as the tools run: ``| head -1``
    ends it quietly (0), stdout on a full disk with one line (1), closed (``>&-``) before any work (2); Ctrl-C or
    SIGTERM with one line, 130 / 143."""
    name = os.path.basename(sys.argv[0])
    watch_stdout(name)
    if not (launched_by_mpiexec() and launcher_connected()):  # a rank keeps the default action (a Python handler
        Interrupts.install()  # never runs inside MPI_Init); a stale PMI_RANK in the shell does not count
    try:
        code = main()
        Interrupts.check()
        sys.stdout.flush()  # what print left in the buffer fails here, not in the exit's flush
        return code
    except (KeyboardInterrupt, Terminated) as e:  # a traceback (Ctrl-C), or mpiexec left running (SIGTERM) before
        return _interrupted(e, name)
    except subprocess.CalledProcessError as e:  # a run it launched failed: before, a traceback without the run's error
        tail = "\n".join((e.stderr or "").strip().splitlines()[-20:])  # run_group's capture, else printed already
        cmd = e.cmd if isinstance(e.cmd, str) else " ".join(map(str, e.cmd))
        print((tail + "\n" if tail else "") + error_lines(name, f"a run exited {e.returncode}: {cmd}"), file=sys.stderr)
        return 1
    except OSError as e:  # before: BrokenPipeError's traceback, and "Exception ignored ... BrokenPipeError" at exit
        if not (stdout_reader_gone(e) or stdout_unwritable(e)):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if stdout_unwritable(e):
            print(error_lines(name, f"cannot write standard output ({e.strerror or e})"), file=sys.stderr)
        return int(stdout_unwritable(e))


def interruptible(tool: str, files: str, main, argv=None, guarded: bool = False) -> int:
    """``main(argv)`` with :meth:`Interrupts.install`; Ctrl-C / SIGTERM: one line on stderr (rank 0 only under
    mpiexec, which signals every rank), ``"python -m {tool}: interrupted (SIGINT); {files}"``, then 130 / 143.
    Stdout closed by its reader (``| head -1``): the rest of the output dropped, no traceback, 0; stdout full: 1.
    ``guarded``: ``main`` installs the handlers itself when its set-up ends (:func:`guard_set_up`)."""
    if not guarded:
        Interrupts.install()
    watch_stdout(tool)
    try:
        code = main(argv)
        Interrupts.check()  # an interrupt dropped in a weakref callback is still an interrupt
        return code
    except BrokenPipeError:  # Python docs, "Note on SIGPIPE": stdout to /dev/null, so the exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # stdout on a full disk (> /dev/full): one line, not print's traceback
        if not stdout_unwritable(e):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(error_lines(f"python -m {tool}", f"cannot write standard output ({e.strerror or e}); {files}"),
              file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        return _interrupted(e, f"python -m {tool}", f"; {files}")


def _interrupted(e, prog: str, tail: str = "") -> int:
    """Ctrl-C / SIGTERM's one line, ``"{prog}: interrupted (SIGINT){tail}"`` (rank 0 only under a launcher, which
    signals every rank), and the exit status, 130 / 143."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the line
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code, name = (143, "SIGTERM") if isinstance(e, Terminated) else (130, "SIGINT")
    if launched_rank() == 0 or not launcher_connected():  # a stale PMI_RANK=1 (no launcher): quiet before
        print(wrapped(f"{prog}: interrupted ({name}){tail}"), file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def every_rank_ends(tool: str, files: str, world, grace_s: float = 0.5):
    """Under mpiexec (``world``: MPI.COMM_WORLD of several ranks) an exception or a signal on this rank ends every
    rank (``MPI_Abort``, then SystemExit: MPICH's returns), as the main job does: a peer left waiting in a
    collective would wait for ever. One line first: rank 0 speaks for an interrupted job (mpiexec signals every
    rank), any rank names its own error (a traceback for a bug: not a ValueError or OSError)."""
    try:
        yield
    except BaseException as e:
        if world is None or world.Get_size() < 2 or (isinstance(e, SystemExit) and not e.code):
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the line and the abort short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = world.Get_rank()
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            code, name = (143, "SIGTERM") if isinstance(e, Terminated) else (130, "SIGINT")
            if rank != 0:  # rank 0 speaks for the job when every rank got the signal
                time.sleep(2 * grace_s)
            who = "" if rank == 0 else f"[rank {rank}] "
            text = wrapped(f"{who}python -m {tool}: interrupted ({name}); {files}") + "\n"
        else:
            said = str(e).replace("the communicator's timeout", "--comm-timeout")  # a CommTimeoutError: the flag
            prog = f"[rank {rank}] python -m {tool}"
            code, text = 1, error_lines(prog, said) + "\n"
            if isinstance(e, MemoryError):
                text = error_lines(prog, f"out of memory ({said or 'MemoryError'})") + "\n"
            elif not isinstance(e, (ValueError, OSError)):  # a bug: its type and where
                text = error_lines(prog, f"{type(e).__name__}: {e}") + "\n" + "".join(
                    traceback.format_exception(type(e), e, e.__traceback__))
        sys.stderr.flush()
        os.write(2, text.encode("utf-8", "replace"))
        time.sleep(grace_s)  # a peer's own message lands too
        world.Abort(code)
        raise SystemExit(code)  # MPICH's MPI_Abort returns (the launcher then kills the job): never run on


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (started in its own session: mpiexec and every rank it started), reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def run_group(cmd: list[str], check: bool = False, capture_output: bool = True, timeout=None,
              **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, text=True, ...)`` in its own session; on any exception (Ctrl-C, SIGTERM's Terminated, the
    timeout) :func:`kill_group`, then raise again (subprocess.run kills the launcher alone: a wrapper script's
    mpiexec and its ranks ran on)."""
    pipe = subprocess.PIPE if capture_output else None
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
