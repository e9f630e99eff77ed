"""Live memory monitoring while training runs: per-step timeline, progress text, per-module peaks.

Mirrors: PyTorch's memory snapshot (``torch.cuda.memory._record_memory_history``).
"""
from __future__ import annotations

import json
import os

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_gather
from minizero.ledger import CATEGORIES, format_bytes, get_ledger
from minizero.memory.attribution import after_forward_hook, attach, format_top_modules
from minizero.memory.plots import INSTALL_HINT, have_matplotlib, plot_timeline


def device_pool_bytes() -> dict | None:
    """``{"used": bytes, "total": bytes}`` of CuPy's default memory pool now; None when not on CuPy.

    Mirrors ``torch.cuda.memory_allocated`` / ``memory_reserved`` (cupy.get_default_memory_pool()).
    """
    pool_of = getattr(backend.xp, "get_default_memory_pool", None)
    if pool_of is None:
        return None
    pool = pool_of()
    return {"used": int(pool.used_bytes()), "total": int(pool.total_bytes())}


class MemoryMonitor:
    """Per-rank memory timeline and per-module attribution of one training run.

    ``every``: live figures every ``every`` steps (and the last); ``total``: optimizer steps.
    Attributes: timeline (per step, bytes per category at the step's peak); after_forward (bytes per module);
    device_pool_peak (``{"used", "total"}`` of CuPy's pool, or None).
    """

    def __init__(self, model, every: int, total: int):
        self.every, self.total = max(1, int(every)), total
        self.timeline: list[list[int]] = []
        self.after_forward: dict = {}
        self.device_pool_peak = device_pool_bytes()
        self.said_max = False  # the first live text says its figures are the max over ranks
        self._detach = attach(model)
        self._remove = model.register_forward_hook(after_forward_hook(self.after_forward))

    def close(self) -> None:
        """Remove the hooks (the ledger keeps its per-module figures)."""
        self._detach()
        self._remove()

    def begin_step(self) -> None:
        """Start this step's window: its peak and what was alive at it."""
        get_ledger().start_window()

    def end_step(self, comm, step: int) -> str:
        """Record this step; every ``every``-th (and the last) step return the live text, else "".

        Collective on those steps: an all-gather of (current, peak) bytes, 16 bytes per rank.
        """
        led = get_ledger()
        self.timeline.append([int(led.window_at_peak[c]) for c in CATEGORIES])
        pool = device_pool_bytes()
        if pool is not None:
            self.device_pool_peak = {k: max(v, self.device_pool_peak[k]) for k, v in pool.items()}
        if (step + 1) % self.every and step + 1 != self.total:
            return ""
        mine = np.array([sum(led.current.values()), led.peak_total], dtype=np.float64)
        with comm.traffic.op("metrics"):
            both = backend.to_host(all_gather(comm, backend.to_device(mine))).reshape(comm.world_size, 2)
        cur, peak = both.max(axis=0)
        pool_text = ("" if pool is None
                     else f"; CuPy pool high-water {format_bytes(self.device_pool_peak['total'])} here")
        first, self.said_max = not self.said_max, True  # "max over ranks" once, below: the log lines stay short
        text = f"mem {format_bytes(cur)}, peak {format_bytes(peak)}"
        return text + (f"\n(mem and peak: max over ranks{pool_text})" if first
                       else f" ({pool_text[2:]})" if pool_text else "")


def gather_timeline(comm, timeline: list[list[int]]) -> np.ndarray:
    """Collective: every rank's timeline, (world_size, steps, len(CATEGORIES)) int64 bytes.

    Every rank must have recorded the same number of steps. One hand-written all-gather.
    """
    mine = np.ascontiguousarray(np.asarray(timeline, dtype=np.int64).reshape(-1, len(CATEGORIES)))
    with comm.traffic.op("metrics"):
        allv = backend.to_host(all_gather(comm, backend.to_device(mine.reshape(-1))))
    return allv.reshape(comm.world_size, -1, len(CATEGORIES))


def module_peaks(category: str = "activations") -> dict[str, int]:
    """This rank's ``{module name: peak bytes}`` of ``category``, self attribution (see the ledger)."""
    return {name: peak for name, (_cur, peak) in get_ledger().modules(category).items()}


def gather_module_peaks(comm, category: str = "activations") -> list[dict[str, int]]:
    """Collective: every rank's :func:`module_peaks` by rank (two all-gathers: lengths, then padded JSON)."""
    text = json.dumps(module_peaks(category), sort_keys=True).encode()
    with comm.traffic.op("metrics"):
        lengths = backend.to_host(all_gather(comm, backend.to_device(np.array([len(text)], dtype=np.int64))))
        width = int(lengths.max())
        buf = np.zeros(width, dtype=np.uint8)
        buf[:len(text)] = np.frombuffer(text, dtype=np.uint8)
        allv = backend.to_host(all_gather(comm, backend.to_device(buf))).reshape(comm.world_size, width)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(allv, lengths)]


def report_memory(timeline, peaks_by_rank: list[dict], top: int = 6) -> tuple[list[str], dict]:
    """Rank 0, at the end: the hotspot lines and the summary entries (``memory_plot`` None until
    :func:`draw_memory` has drawn it).

    Returns (lines, ``{"activation_peaks_by_module", "memory_timeline_peak_bytes", "memory_plot"}``).
    """
    t = np.asarray(timeline)
    return [format_top_modules(peaks_by_rank, top)], {"activation_peaks_by_module": peaks_by_rank,
                                                      "memory_timeline_peak_bytes": t.sum(axis=2).astype(int).tolist(),
                                                      "memory_plot": None}


def draw_memory(out_dir: str, timeline, ledgers: list[dict] | None = None, first_step: int = 0,
                title: str = "") -> tuple[str, str | None]:
    """Rank 0: ``OUT/memory.png`` when matplotlib is installed (``title``: the run's words above the plots;
    ``ledgers``: each rank's ledger snapshot, grouped as in the memory table). Returns (the line, its path or None)."""
    if not have_matplotlib():
        return INSTALL_HINT, None
    path = os.path.join(out_dir, "memory.png")
    plot_timeline(path, timeline, title, ledgers=ledgers, first_step=first_step)
    return f"wrote {path} (ledger memory over the steps by category, and each category's peak)", path
