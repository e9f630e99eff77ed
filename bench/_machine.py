"""The line every benchmark prints first: when and on what it ran (date, CPU, BLAS, kernel, threads).

Speed depends on the BLAS kernel as much as on the CPU (OpenBLAS's Haswell kernel runs float32
matmuls at about half its SkylakeX kernel's speed on the same AVX-512 machine), so a figure
without its kernel cannot be compared. ``threadpoolctl`` reports what NumPy's BLAS actually runs.
"""
import datetime
import os
import platform


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas(threads: str | None = None) -> str:
    """``openblas 0.3.27 (kernel SkylakeX, 2 threads)`` for NumPy's BLAS, as threadpoolctl sees it; ``threads``
    replaces the thread count (where the timed work runs in other processes, which set their own)."""
    from minizero.backend import blas_info  # noqa: PLC0415  (the scripts put the checkout on sys.path first)

    i = blas_info()
    if not i:
        return "BLAS unknown"
    return (f"{i.get('internal_api', '?')} {i.get('version', '?')} "
            f"(kernel {i.get('architecture', '?')}, {threads or count(i.get('num_threads', '?'), 'thread')})")


def count(n, noun: str) -> str:
    """``1 thread``, ``2 threads``, ``? threads``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def source() -> str:
    """``minizero 54ffb13`` (the checkout's commit), ``+ changes`` when tracked files differ from it;
    ``minizero (no git)`` outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "minizero (no git)"
    return f"minizero {sha}" + (" + changes" if dirty else "")


def cores() -> int:
    """The cores this process may run on (``backend.usable_cores``: taskset, cpusets, mpiexec's binding)."""
    from minizero.backend import usable_cores  # noqa: PLC0415  (the scripts put the checkout on sys.path first)

    return usable_cores()


RANK_THREADS = "threads per rank: cores / ranks on the node, as the main job sets them"  #: train.py's rule


def header(threads: str | None = None) -> str:
    """One line: date (UTC), CPU and core count, NumPy's version (its casts and ufunc loops change between
    releases), BLAS library/kernel/threads, OPENBLAS_CORETYPE, the source.
    ``threads``: what to print for the BLAS threads instead of this process's (e.g. :data:`RANK_THREADS`)."""
    import numpy as np

    forced = os.environ.get("OPENBLAS_CORETYPE")
    usable = cores()
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu_model()}, "
            f"{os.cpu_count()} cores{'' if usable == os.cpu_count() else f' ({usable} usable)'} | "
            f"numpy {np.__version__} | {blas(threads)} | "
            f"OPENBLAS_CORETYPE={'unset' if forced is None else forced} | {source()}")


def set_malloc(default: bool) -> str:
    """Keep freed memory for reuse in this process, as the main job does (``backend.keep_freed_memory``), unless
    ``default``; returns how the process allocates, for the table's header (every side of an in-process
    comparison, PyTorch's too, allocates under the same setting)."""
    from minizero import backend

    if default:
        return "malloc: glibc's default (--default-malloc)"
    if backend.keep_freed_memory():
        return (f"malloc: freed memory kept for reuse, every side (mallopt M_MMAP_THRESHOLD "
                f"{backend.MALLOC_MMAP_THRESHOLD // 2 ** 20} MiB, M_TRIM_THRESHOLD "
                f"{backend.MALLOC_TRIM_THRESHOLD // 2 ** 20} MiB, as the main job)")
    return "malloc: not kept (no glibc mallopt here, or it refused the settings)"
