"""Memory monitoring: per-module attribution against the formula, the live timeline, the sweep."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, get_ledger, set_ledger
from minizero.memory.attribution import (attention_split, compare_layer, layer_bytes, layer_terms,
                                         saved_by_module)
from minizero.memory.estimator import layer_activation_bytes
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT, get_config
from minizero.parallel.tensor_parallel import tensor_parallelize
from tests.conftest import mpi_env


def _measure(cfg, b, mode="none", comm=None):
    set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    if comm is not None:
        tensor_parallelize(model, comm)
    apply_recompute(model, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    return saved_by_module(model, x, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_default_model_per_module_equals_the_formula_terms(mode, dropout):
    """Default model, micro-batch 4: scores = b*a*s^2*4 bytes per saved copy; every module = its terms."""
    cfg = get_config("default", dropout=dropout)
    b, s, a = 4, cfg.block_size, cfg.n_head
    got = _measure(cfg, b, mode)
    terms = layer_terms(cfg, s, b, mode)
    copies = 0 if mode != "none" else (2 if dropout else 1)  # softmax output (+ dropout output)
    for i in range(cfg.n_layer):
        layer = f"transformer.h.{i}"
        assert got.get(f"{layer}.attn:scores", 0) == copies * b * a * s * s * 4
        mask = b * a * s * s if dropout and mode == "none" else 0  # the attention dropout mask, 1 byte
        assert attention_split(got, f"{layer}.attn")[0] == copies * b * a * s * s * 4 + mask
        for name, _terms, formula, ledger in compare_layer(got, layer, terms):
            assert ledger == formula, name
        total = sum(t for rows in terms.values() for _, t in rows)
        assert layer_bytes(got, layer) == total == layer_activation_bytes(
            cfg, s, b, recompute=mode, accounting="minizero", precision="fp32")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_tensor_parallel_per_module_equals_the_formula_terms(tp, mode):
    """Under tp the 'tp' rows shrink by 1/t (scores: b*(a/t)*s^2*4) and each module still equals its terms."""
    cfg = get_config("small", dtype="float64", dropout=0.1)
    b, s = 2, cfg.block_size
    terms = layer_terms(cfg, s, b, mode, tp=tp, precision="fp64")
    for got in run_in_threads(tp, lambda comm: _measure(cfg, b, mode, comm)):
        for i in range(cfg.n_layer):
            layer = f"transformer.h.{i}"
            if mode == "none":
                assert got[f"{layer}.attn:scores"] == 2 * b * (cfg.n_head // tp) * s * s * 8
            rows = compare_layer(got, layer, terms)
            assert [r[3] for r in rows] == [r[2] for r in rows], rows


@pytest.mark.timeout(120)
def test_sweep_grows_as_a_s_squared_and_matches_the_formula():
    """Per-layer bytes f(s) = alpha*s + beta*s^2: f(2s) - 2f(s) = 2*beta*s^2, beta = 4ab (none), 0 (recompute)."""
    b = 2
    for mode, beta in [("none", 4 * 2 * b), ("selective", 0), ("full", 0)]:
        f = {}
        for s in (8, 16, 32):
            cfg = get_config("tiny", block_size=s)  # a = 2 heads, h = 16, float32, no dropout
            got = _measure(cfg, b, mode)
            f[s] = layer_bytes(got, "transformer.h.0")
            assert f[s] == layer_activation_bytes(cfg, s, b, recompute=mode, accounting="minizero", precision="fp32")
        for s in (8, 16):
            assert f[2 * s] - 2 * f[s] == 2 * beta * s * s, (mode, f)


def test_ledger_charges_arrays_outside_a_forward_to_no_module():
    led = set_ledger(MemoryLedger())
    p = np.zeros(10)
    led.track(p, "parameters")
    led.push_scope("a.b")
    x = np.zeros((1, 2, 3, 3))
    led.track(x, "activations")
    led.pop_scope()
    assert led.modules("parameters") == {"(outside forward)": (80, 80)}
    assert led.modules("activations") == {"a.b:scores": (144, 144)}
    assert led.modules("activations", inclusive=True) == {"a.b:scores": (144, 144), "a.b": (144, 144),
                                                         "a": (144, 144), "": (144, 144)}
    del x
    assert led.modules("activations")["a.b:scores"] == (0, 144)
    assert get_ledger() is led


@pytest.mark.parametrize("category, shape", [("comm_scratch", (7,)), ("activations", (1, 2, 3, 3)), ("gathered", (0,))])
def test_track_temporary_leaves_the_figures_of_an_array_tracked_then_freed(category, shape):
    """A collective's scratch (issue 33): counted at once instead of until freed, byte-identical figures."""
    def figures(count):
        led = MemoryLedger()
        held = np.zeros(5)
        led.track(held, "comm_buffers")
        led.push_scope("a.b")
        count(led, np.zeros(shape))
        led.track(np.zeros(3), category)  # after it: a later, smaller array of the same category
        led.pop_scope()
        return (led.snapshot(), led.window_peak, led.window_at_peak, led.modules(category),
                led.modules(category, inclusive=True))

    def track_and_free(led, a):
        led.track(a, category)
        del a  # the caller's reference goes when count returns

    tracked = figures(track_and_free)
    assert tracked == figures(lambda led, a: led.track_temporary(a, category))
    assert tracked[0]["peak"][category] == max(np.zeros(shape).nbytes, 24) and tracked[0]["current"][category] == 0


def test_track_temporary_counts_nothing_for_a_buffer_counted_already():
    led = MemoryLedger()
    a = np.zeros(4)
    led.track(a, "gradients")
    led.track_temporary(a[1:], "comm_scratch")
    assert led.peak["comm_scratch"] == 0 and led.current["gradients"] == 32


@pytest.mark.timeout(180)
def test_main_job_writes_module_peaks_and_memory_png(mpiexec, tmp_path):
    out = tmp_path / "out"
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "minizero.train", "--steps", "4", "--log-every", "2",
           "--eval-batches", "1", "--sample-tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, env=dict(mpi_env(), MINIZERO_PLOTS="1"), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    mem = [i for i, line in enumerate(lines) if "  mem " in line]
    assert len(mem) == 2 and lines[mem[0] + 1].strip() == "(mem and peak: max over ranks)"  # said once, below
    assert proc.stdout.count("max over ranks") == 1 and all(len(lines[i]) <= 120 for i in mem)
    summary = json.loads((out / "summary.json").read_text())
    peaks = summary["activation_peaks_by_module"]
    assert len(peaks) == 2
    cfg = get_config("default")
    b, s, a = 2, cfg.block_size, cfg.n_head  # batch 4 over 2 data ranks
    for r in range(2):
        for i in range(cfg.n_layer):
            assert peaks[r][f"transformer.h.{i}.attn:scores"] == b * a * s * s * 4
    assert len(summary["memory_timeline_peak_bytes"][0]) == 4
    assert max(summary["memory_timeline_peak_bytes"][0]) == summary["ledger_peak_total_bytes"][0]
    for png in ("memory.png", "loss.png"):  # matplotlib is a dependency of pip install .: both are always drawn
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert f"wrote {out / 'memory.png'}" in proc.stdout and f"wrote {out / 'loss.png'}" in proc.stdout


# --------------------------------------------------------------------------- device memory (issue #15)
class _Pool:
    """CuPy's memory pool as the monitor reads it: used and held bytes."""

    def __init__(self):
        self.used, self.total = 0, 0

    def used_bytes(self):
        return self.used

    def total_bytes(self):
        return self.total


class _NumpyWithPool:
    """NumPy plus CuPy's ``get_default_memory_pool``: the array module as the monitor sees it on a GPU."""

    def __init__(self, pool):
        self.pool = pool

    def get_default_memory_pool(self):
        return self.pool

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.timeout(60)
def test_pool_high_water_is_kept_at_step_ends_beside_the_ledger(monkeypatch):
    from minizero import backend
    from minizero.memory.monitor import MemoryMonitor, device_pool_bytes
    assert device_pool_bytes() is None  # NumPy: no pool, nothing reported
    pool = _Pool()
    monkeypatch.setattr(backend, "xp", _NumpyWithPool(pool))

    def steps(comm):
        mon = MemoryMonitor(GPT(get_config("tiny"), seed=0), every=1, total=3)
        texts = []
        for step, (used, total) in enumerate([(512, 1024), (2048, 4096), (1024, 4096)]):
            mon.begin_step()
            pool.used, pool.total = used, total
            texts.append(mon.end_step(comm, step))
        mon.close()
        return mon.device_pool_peak, texts

    peak, texts = run_in_threads(1, steps)[0]
    assert peak == {"used": 2048, "total": 4096}  # the largest at any step end, not the last
    assert "CuPy pool high-water 4.00 KiB" in texts[-1]


def test_ledger_counts_a_cupy_array_by_its_allocation():
    from minizero.ledger import allocation_bytes

    class FakeCupyArray:  # what the ledger reads of a cupy.ndarray: nbytes, base, data.mem.size
        __module__ = "cupy._core.core"
        nbytes, base, shape = 100, None, (25,)
        data = type("Ptr", (), {"mem": type("Mem", (), {"size": 512})()})()

    assert allocation_bytes(FakeCupyArray()) == 512  # the pool's 512-byte block
    assert allocation_bytes(np.zeros(25, dtype=np.float32)) == 100
    led = MemoryLedger()
    arr = FakeCupyArray()
    led.track(arr, "activations")
    assert led.current["activations"] == 512


def test_memory_summary_puts_ranks_with_equal_ledgers_in_one_column():
    """Eight data-parallel replicas would print eight equal columns; equal ledgers share one (r0-2),
    a rank that differs keeps its own, and the shared column's process peak is the largest of its ranks."""
    from minizero.ledger import memory_summary

    def snap(extra):
        led = MemoryLedger()
        keep = [np.zeros(1000 + extra, dtype=np.uint8)]
        led.track(keep[0], "parameters")
        return led.snapshot()

    text = memory_summary([snap(0), snap(0), snap(0), snap(24)], [10 << 20, 30 << 20, 20 << 20, 5 << 20],
                          process_peak_source="rss")
    head = text.splitlines()[1].split()
    assert head == ["category", "r0-2", "current", "r0-2", "peak", "r3", "current", "r3", "peak"]
    peak_row = next(line for line in text.splitlines() if line.startswith("process peak"))
    assert peak_row.split()[-4:] == ["30.00", "MiB", "5.00", "MiB"]
    assert "(ranks in one column, e.g. r0-2, end with equal current and peak bytes" in text  # the run's own column, not a fixed one
    one = memory_summary([snap(0)])
    assert one.splitlines()[1].split() == ["category", "r0", "current", "r0", "peak"] and "equal ledgers" not in one


def test_memory_summary_of_four_rank_groups_fits_120_columns_in_blocks():
    """Before: tp 2 x pp 4 (columns r0-1, r2-3, r4-5, r6-7) printed 128 columns; now two blocks of two groups,
    and rank labels too long for any column (64 ranks, 4 stages) become letters named above the table."""
    from minizero.ledger import CATEGORIES, memory_summary

    def snap(r):  # stage r's ledger, a GiB-ish figure in every cell
        cells = {c: (1000 << 20) + (r << 10) for c in CATEGORIES}
        return {"current": dict(cells), "peak": dict(cells), "peak_total": 8 * cells["parameters"]}

    text = memory_summary([snap(r // 2) for r in range(8)], [1000 << 20] * 8, process_peak_source="rss")
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and lines.count("") == 1
    heads = [line.split() for line in lines if line.startswith("category")]
    assert heads == [["category", "r0-1", "current", "r0-1", "peak", "r2-3", "current", "r2-3", "peak"],
                     ["category", "r4-5", "current", "r4-5", "peak", "r6-7", "current", "r6-7", "peak"]]
    assert [line.split()[-2:] for line in lines if line.startswith("parameters")] == [["1000.00", "MiB"]] * 2
    wide = memory_summary([snap(r % 4) for r in range(64)], [1 << 20] * 64)
    assert max(map(len, wide.splitlines())) <= 120 and "A = ranks 0, 4, 8," in wide
    assert [line.split()[1::2] for line in wide.splitlines() if line.startswith("category")] == [list("AABBCCDD")]


def test_memory_summary_of_many_differing_ranks_shows_the_largest_and_the_smallest():
    """Before: 8 MoE ranks gave 8 peak columns, a table 125 columns wide."""
    from minizero.ledger import memory_summary

    def snap(extra):
        led = MemoryLedger()
        keep = [np.zeros(1000 + extra, dtype=np.uint8)]
        led.track(keep[0], "activations")
        return led.snapshot()

    extras = [5, 1, 7, 3, 0, 6, 2, 4]  # r2 the largest, r4 the smallest
    text = memory_summary([snap(e) for e in extras], [1 << 20] * 8, process_peak_source="rss")
    assert text.splitlines()[1].split() == ["category", "r2", "peak", "r4", "peak"]
    assert "shown are r2, the largest peak total, and r4, the smallest" in " ".join(text.split())
    assert "largest of theirs" not in text and max(map(len, text.splitlines())) <= 100
    same_total = [MemoryLedger() for _ in range(6)]  # equal peak totals, six kinds of split: one column, no crash
    keep = []
    for r, led in enumerate(same_total):
        keep += [np.zeros(100 + r, dtype=np.uint8), np.zeros(100 - r, dtype=np.uint8)]
        led.track(keep[-2], "activations")
        led.track(keep[-1], "gradients")
    text = memory_summary([led.snapshot() for led in same_total])
    assert text.splitlines()[1].split() == ["category", "r0", "peak"]
    assert "shown are r0: every peak total is equal" in " ".join(text.split())


def test_per_rank_values_share_a_label_when_equal():
    from minizero.ledger import per_rank_text

    assert per_rank_text(["1 B"] * 8) == "r0-7 1 B"
    assert per_rank_text(["9 B", "0 B", "3 B", "0 B", "6 B", "0 B", "3 B", "0 B"]) == "r0 9 B, r1,3,5,7 0 B, r2,6 3 B, r4 6 B"
    assert per_rank_text(["1 B", "2 B"]) == "r0 1 B, r1 2 B"


def test_wrap_keeps_a_rank_its_number_and_its_unit_on_one_line():
    """Before: the 3D job's report read "r4-7 16.09" at a line's end and "MiB" alone on the next, and
    "r2-3,6-7" apart from its "0 B"."""
    from minizero.ledger import wrap

    line = ("  validation (the forward passes of the held-out batches, every group): r0-3 24.00 MiB, r4-7 16.09 MiB"
            "; parameter gathers: r0 905.50 KiB, r1 1.70 MiB, r2-3,6-7 0 B, r4-5 1,234 B")
    for width in range(40, 110):
        lines = wrap(line, width)
        assert " ".join(" ".join(lines).split()) == " ".join(line.split()), width
        for figure in ("r4-7 16.09 MiB", "r2-3,6-7 0 B", "r0 905.50 KiB", "r4-5 1,234 B"):
            assert any(figure in part for part in lines), (width, figure, lines)
        assert all(len(part) <= width for part in lines), (width, lines)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_linears_per_module_equal_the_formula_terms(precision):
    """bf16 and fp8 Linears save their input's and weight's codes (fp8: and two scales): each module its terms."""
    from minizero.memory.bf16 import use_bf16
    from minizero.memory.fp8 import use_fp8

    cfg, b = get_config("small"), 2
    set_ledger(MemoryLedger())
    model = GPT(cfg, seed=0)
    (use_bf16 if precision == "bf16" else use_fp8)(model)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    got = saved_by_module(model, x, x)
    terms = layer_terms(cfg, cfg.block_size, b, precision=precision)
    assert any(precision in t for rows in terms.values() for t, _ in rows)  # the low-precision rows, not fp32's
    for i in range(cfg.n_layer):
        rows = compare_layer(got, f"transformer.h.{i}", terms)
        assert [r[3] for r in rows] == [r[2] for r in rows], rows
    with pytest.raises(ValueError, match="precision 'fp13' is not one of"):
        layer_terms(cfg, cfg.block_size, b, precision="fp13")


def test_a_freed_array_leaves_every_enclosing_scope_and_a_later_one_peaks_alone():
    """Free then allocate: the inclusive rows of "a.b"'s enclosing scopes fall back to 0 on the free, so a later
    80-byte array under "a.c" leaves "a" at its 144-byte peak, not 224 bytes alive at once."""
    led = MemoryLedger()
    led.push_scope("a.b")
    x = np.zeros(18)
    led.track(x, "activations")
    led.pop_scope()
    del x
    led.push_scope("a.c")
    y = np.zeros(10)
    led.track(y, "activations")
    led.pop_scope()
    assert led.modules("activations", inclusive=True) == {"a.b": (0, 144), "a": (80, 144), "": (80, 144),
                                                         "a.c": (80, 80)}
    assert (led.current["activations"], led.peak["activations"], led.peak_total) == (80, 144, 144)


def test_the_live_text_gives_the_max_over_ranks_of_current_and_of_peak_each():
    """Rank 1 holds more now (2 KiB against 1 KiB), rank 0 peaked higher (8 KiB): each figure is its own rank's."""
    from minizero.memory.monitor import MemoryMonitor
    from minizero.nn.module import Linear

    def fn(comm):
        monitor = MemoryMonitor(Linear(2, 2), every=1, total=1)
        led = set_ledger(MemoryLedger())
        held = np.zeros(128 * (1 + comm.rank))
        led.track(held, "activations")
        if comm.rank == 0:
            led.track_temporary(np.zeros(896), "activations")
        monitor.begin_step()
        text = monitor.end_step(comm, 0)
        monitor.close()
        return text

    assert run_in_threads(2, fn)[0].splitlines()[0] == "mem 2.00 KiB, peak 8.00 KiB"


def test_reset_peaks_starts_every_module_row_at_what_is_alive_now():
    led = MemoryLedger()
    led.push_scope("a.b")
    x, y = np.zeros(18), np.zeros(4)
    led.track(x, "activations")
    led.track(y, "activations")
    led.pop_scope()
    del x
    led.reset_peaks()
    assert led.modules("activations") == {"a.b": (32, 32)}
    assert led.modules("activations", inclusive=True) == {"a.b": (32, 32), "a": (32, 32), "": (32, 32)}
    assert (led.peak["activations"], led.peak_total, led.window_peak) == (32, 32, 32)
