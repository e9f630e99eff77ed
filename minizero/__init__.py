"""minizero: distributed and memory-efficient training, written by hand on NumPy and MPI.

See README.md for the two commands, ARCHITECTURE.md for the seams, and lessons/ for one chapter per technique.
"""
__version__ = "0.1.0"
import os as _os
import signal as _signal
import sys as _sys


def _launched_as_tool() -> bool:
    """True while ``python -m minizero.X`` imports this package (runpy's ``sys.argv[0]`` is "-m" until X runs)."""
    for i, arg in enumerate(_sys.orig_argv):
        if arg.startswith("-m"):
            name = arg[2:] or (_sys.orig_argv[i + 1] if i + 1 < len(_sys.orig_argv) else "")
            return _sys.argv[:1] == ["-m"] and name.startswith("minizero.")
    return False


_DEPENDENCIES = {"numpy", "mpi4py", "tqdm", "threadpoolctl", "safetensors", "matplotlib"}  #: pyproject's, importable


def _missing_dependency_hook(kind, error, tb, _default=_sys.excepthook):
    """A tool run by a Python without minizero's dependencies (a new shell, the environment not activated) says so
    in one line instead of a traceback ending in "No module named ...", and exits with status 1."""
    if not (isinstance(error, ModuleNotFoundError) and error.name in _DEPENDENCIES):  # missing, not broken
        return _default(kind, error, tb)
    from minizero.numerals import error_lines  # the standard library only: importable without the dependencies

    tool = next((a.removeprefix("-m") for a in _sys.orig_argv if a.removeprefix("-m").startswith("minizero.")), "")
    print(error_lines(f"python -m {tool}", f"no module named {error.name!r} in {_sys.executable}: activate the "
                      "environment minizero was installed in (. .venv/bin/activate), or install minizero into this "
                      "Python (pip install .)"), file=_sys.stderr)
    _sys.exit(1)


def _end_as_sigterm(signum, frame):
    """SIGINT while one of several MPICH ranks starts: end the process as SIGTERM's default action does. MPICH's
    launcher ORs its ranks' wait statuses: SIGINT's 2 with the SIGKILL (9) it sends the others read "Segmentation
    fault (signal 11)"; SIGTERM's 15 absorbs both, so the job reads "Terminated (signal 15)"."""
    _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
    _os.kill(_os.getpid(), _signal.SIGTERM)


# ``python -m minizero.X`` imports this package, then X's imports take seconds: Ctrl-C meanwhile printed a
# KeyboardInterrupt traceback per rank (and inside MPI_Init a Python handler never runs). Until a program installs
# its own handlers (minizero.interrupts) the signal's default action ends the process: no traceback, no hang; one of
# several ranks under MPICH's launcher (PMI_SIZE; other PMI launchers set it too, and SIGTERM's default action
# ends a rank as plainly there) ends as by SIGTERM (inside MPI_Init: once MPI_Init returns).
if _launched_as_tool():
    _size = _os.environ.get("PMI_SIZE", "")
    _signal.signal(_signal.SIGINT, _end_as_sigterm if _size.isascii() and _size.isdigit() and int(_size) > 1
                   else _signal.SIG_DFL)
    _sys.excepthook = _missing_dependency_hook
