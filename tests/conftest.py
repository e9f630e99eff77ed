"""Shared test helpers: finding ``mpiexec`` and the environment for launched ranks."""
import os

import pytest

from minizero.files import mpiexec_path  # noqa: F401  (re-exported for tests)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ZeRO's per-collective order check (off in the main job) runs in every test, here and in launched ranks
os.environ.setdefault("MINIZERO_DEBUG_COLLECTIVES", "1")
# The main job's two pictures (importing matplotlib and drawing: much of a short run) only where a test looks at
# them: it sets MINIZERO_PLOTS=1 (tests/test_memory_monitor.py, test_sample.py, test_progress.py)
os.environ.setdefault("MINIZERO_PLOTS", "0")


def mpi_env():
    """Environment for ranks: one BLAS thread each, and this checkout importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO_ROOT, env.get("PYTHONPATH")] if p)
    return env


def require_mpiexec():
    """Path to ``mpiexec``; skips the test when there is none, fails it under CI (which installs the mpich wheel)."""
    path = mpiexec_path()
    if path is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("mpiexec not found (pip install mpich, or a system MPI)")
    return path


@pytest.fixture
def mpiexec():
    return require_mpiexec()


@pytest.fixture
def ring_all_reduce(monkeypatch):
    """All-reduce by the ring at every size (no recursive doubling for small buffers), in this
    process and in launched ranks: for the tests of the ring's own order, bytes and messages."""
    from minizero.comm import recursive_doubling

    monkeypatch.setattr(recursive_doubling, "SMALL_ALLREDUCE_MAX_BYTES", -1)
    monkeypatch.setenv("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "-1")


@pytest.fixture
def strict_backend():
    """``backend.xp`` is the strict array module (host leaks raise) for the test; NumPy again after,
    whatever the test did (it may switch back and forth itself)."""
    from minizero import backend

    backend.set_backend("strict")
    try:
        yield backend
    finally:
        backend.set_backend("numpy")


def one_refusal(err: str) -> str:
    """A program's refusal read whole: one ``prog: error: ...`` whose lines (numerals.wrapped cuts it at 120 columns,
    each further line indented) are joined with one space. Asserts there is exactly one and no line is wider."""
    whole = " ".join(err.split())
    assert whole.count(": error: ") == 1 and all(len(line) <= 120 for line in err.splitlines()), err
    return whole


def earlier_json(flag: str = "--json", **data) -> str:
    """An earlier output: a summary (``--json``, of ``data``) or a trace (``--trace``) as minizero marks them."""
    import json

    from minizero import jsons

    return json.dumps(jsons.summary(data) if flag == "--json" else jsons.trace([]))


def png_bytes(marked: bool = True) -> bytes:
    """A 1x1 PNG: with the mark minizero writes into its plots (``pngs.MARK``), or without (a user's own, or a plot
    of a minizero older than the mark), built by hand (no matplotlib)."""
    import struct
    import zlib

    from minizero.pngs import MARK

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    texts = [(b"Software", b"a drawing program")] + [(k.encode(), v.encode()) for k, v in MARK.items() if marked]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + b"".join(chunk(b"tEXt", k + b"\0" + v) for k, v in texts)
            + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b""))
