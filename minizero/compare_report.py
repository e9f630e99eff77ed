"""The report of ``python -m minizero.compare``: its Markdown table (``OUT/compare.md``, every column), the
terminal's table (the essentials in 120 columns, :func:`terminal`) and its figure.

Units: MiB = 2**20 bytes in the table and the figure; the runs hold bytes.
"""
from __future__ import annotations

from minizero.files import atomic_write
from minizero.ledger import wrap
from minizero.memory.estimator import DEVICE_CATEGORIES
from minizero.numerals import in_width, significant_column, wrapped
from minizero.pngs import MARK

#: categories shown per rank (the ledger's), and the unit of the table
SHOWN = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "comm_scratch", "gathered",
         "offloaded")
MIB = 2 ** 20
#: the line just above the table: why its process peak can be below its device total
NOT_SIMULTANEOUS = ("Device total = sum of per-category peaks, not one simultaneous peak: it may exceed the "
                    "process peak.")


def _mib(n) -> str:
    return f"{n / MIB:.2f}"


def _step(r: dict) -> tuple[str, str]:
    """The cells "measured / predicted" step seconds and their ratio ("-" without a prediction)."""
    if "predicted_step_s" not in r:
        return f"{r['step_s']:.3g} / -" if "step_s" in r else "-", "-"
    return f"{r['step_s']:.3g} / {r['predicted_step_s']:.3g}", f"{r['step_s'] / r['predicted_step_s']:.1f}x"


def markdown(runs: list[dict], header: str, descriptions: dict, hardware: str | None = None) -> str:
    """The comparison as a Markdown table: rank 0's measured / estimated MiB per category, and the rest.

    ``runs``: the records of :func:`minizero.compare.main` (bytes, seconds); ``descriptions``: strategy
    name -> what it adds; ``hardware``: the profile's line (:func:`hardware_line`), if any.
    """
    lines = [header, "",
             "Cells: measured / estimated, MiB (2^20 bytes), rank 0; measured = the ledger's peak during the training "
             "steps; estimated = `estimate_memory(..., accounting=\"minizero\")`. Device total = the sum of the "
             "per-category peaks except `offloaded`. Worst = the largest |estimated - measured| / measured over "
             "ranks and categories. Process peak = tracemalloc (every NumPy allocation). Tokens/s = rank 0's over "
             "these few steps, the first included: rough. Step s = measured / predicted seconds per step: rank 0's "
             "training-loop time (first step included, `--no-overlap`) / the planner's `step_time` on the hardware "
             "profile below; ratio = measured divided by predicted: how many times slower this machine ran than the "
             "planner's first-order model (matmul FLOPs, collective bytes, offload copies) says: it leaves out the "
             "elementwise kernels, the optimizer step, Python's overhead and FP16 emulated on NumPy; it charges "
             "data-parallel traffic in full, none hidden behind compute, as `--no-overlap` runs it (lesson 08).",
             *(["", hardware] if hardware else []), "",
             NOT_SIMULTANEOUS, "",
             "| ranks | strategy | parameters | gradients | optimizer state | activations | "
             "comm + scratch + gathered | offloaded | files | device total | worst | process peak | "
             "tokens/s | step s | ratio |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if not r["ok"]:
            lines.append(f"| {r['ranks']} | {r['strategy']} | failed: {r['error'].replace('|', '/')} "
                         "|  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        m, e = r["measured"]["per_rank"][0], r["estimate"]

        def cell(*cats):
            return f"{_mib(sum(m[c] for c in cats))} / {_mib(sum(e[c] for c in cats))}"

        dev_total = sum(m[c] for c in DEVICE_CATEGORIES)
        worst = max(r["deviation"].values())
        files = r["measured"]["optimizer_disk_bytes"][0]
        lines.append(
            f"| {r['ranks']} | {r['strategy']} | {cell('parameters')} | {cell('gradients')} | "
            f"{cell('optimizer_state')} | {cell('activations')} | {cell('comm_buffers', 'comm_scratch', 'gathered')} | "
            f"{cell('offloaded')} | {_mib(files)} / {_mib(e['nvme_optimizer'])} | {_mib(dev_total)} / "
            f"{_mib(e['total'])} | {worst:.1%} | {_mib(r['measured']['process_peak_bytes'][0])} | "
            f"{r['measured']['tokens_per_s']:,.0f} | {' | '.join(_step(r))} |")
    lines += totals_by_world_size(runs)
    lines += ["", "files = optimizer state in NVMe files (the job's `optimizer_disk_bytes`; activation files are not "
                  "counted by the job). Strategies: " + "; ".join(
                      f"`{n}` {descriptions[n]}" for n in dict.fromkeys(r["strategy"] for r in runs))]
    return "\n".join(lines) + "\n"


#: the terminal table's columns, (header, width), each separated by two spaces; 103 columns in all
COLUMNS = (("ranks", 5), ("strategy", 12), ("device MiB", 10), ("estimate", 8), ("worst", 6), ("process MiB", 11),
           ("tokens/s", 8), ("step s", 8), ("predicted", 9), ("ratio", 8))
KEY = ("Columns (rank 0; MiB = 2^20 bytes):",
       "  device       the ledger's peaks summed over the categories except offloaded (not one simultaneous peak)",
       "  estimate     the same total as estimate_memory(..., accounting=\"minizero\") predicts it",
       "  worst        the largest |estimate - measured| / measured over categories and ranks: 0.0% when the",
       "               estimator, counting as minizero allocates, predicts every ledger category exactly",
       "  process      tracemalloc's peak: every NumPy allocation of the process",
       "  tokens/s     over these few steps, the first included: rough; each run is its own process, so the",
       "               order does not favour a row, but another job on the cores does: rerun before ranking rows",
       "  step s       seconds per step, the first included; predicted: the planner's, on the hardware profile above",
       "  ratio        step s / predicted (lesson 08: what the planner leaves out)")


def terminal(runs: list[dict]) -> str:
    """The comparison as the terminal shows it: one fixed-width row per run (:data:`COLUMNS`), a blank line between
    world sizes, then :data:`KEY`; every line <= 120 columns.

    The columns are the memory/speed trade-off a reader weighs: rank 0's device total measured beside the estimate
    and the worst per-category gap (does the memory model hold?), the process peak (what the machine holds: on NumPy
    cpu offload does not lower it, nvme does), tokens/s, and seconds per step measured beside the planner's
    prediction, with their ratio. Why a total moved (the per-category cells), NVMe files, the device totals by world
    size and the caption are in :func:`markdown`'s table, which compare writes to ``OUT/compare.md``: its 15 columns
    take 170-190, and a Markdown row cut in two is no row.
    """
    def row(*cells):
        return "  ".join(c.ljust(w) if h == "strategy" else c.rjust(w) for c, (h, w) in zip(cells, COLUMNS)).rstrip()

    lines = [row(*(h for h, _ in COLUMNS))]
    for i, r in enumerate(runs):
        if i and r["ranks"] != runs[i - 1]["ranks"]:
            lines.append("")
        if not r["ok"]:
            lines.append(wrapped(f"{r['ranks']:>5}  {r['strategy']:<12}  failed: {r['error']}"))
            continue
        m = r["measured"]
        device = sum(m["per_rank"][0][c] for c in DEVICE_CATEGORIES)
        pred = r.get("predicted_step_s")
        lines.append(row(str(r["ranks"]), r["strategy"], in_width(device / MIB, 10, 2),
                         in_width(r["estimate"]["total"] / MIB, 8, 2),
                         in_width(worst := 100 * max(r["deviation"].values()), 5, int(worst < 1000)) + "%",
                         in_width(m["process_peak_bytes"][0] / MIB, 11, 2), in_width(m["tokens_per_s"], 8),
                         significant_column(r["step_s"], 8), "-" if pred is None else significant_column(pred, 9),
                         "-" if pred is None else in_width(r["step_s"] / pred, 7, 1) + "x"))
    return "\n".join(lines + ["", *KEY])


def progress(k: int, of: int, run: dict) -> str:
    """The line compare prints as run ``k`` of ``of`` starts (``run`` without "ok": ``[ 3/18] zero3 on 2 ranks:
    starting``) and as it ends: ``... ok, 12.3 s``, or ``failed:`` and its cause (:func:`wrapped`: whole, lines of
    <= 120 columns). Its numbers are in :func:`terminal`'s table."""
    head = f"[{k:>{len(str(of))}}/{of}] {run['strategy']} on {run['ranks']} rank{'s' * (run['ranks'] > 1)}"
    if "ok" not in run:
        return f"{head}: starting"
    return (f"{head}: ok, {significant_column(run['wall_s'], 0)} s" if run["ok"] else
            wrapped(f"{head}: failed: {run['error']}"))


def totals_by_world_size(runs: list[dict]) -> list[str]:
    """Rank 0's measured device total (MiB) per strategy, one column per world size; [] for one world size."""
    sizes = list(dict.fromkeys(r["ranks"] for r in runs))
    if len(sizes) < 2:
        return []
    total = {(r["strategy"], r["ranks"]): _mib(sum(r["measured"]["per_rank"][0][c] for c in DEVICE_CATEGORIES))
             if r["ok"] else "failed" for r in runs}
    lines = ["", "Device total, measured, MiB, rank 0:", "",
             "| strategy | " + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for name in dict.fromkeys(r["strategy"] for r in runs):
        lines.append(f"| {name} | " + " | ".join(total.get((name, n), "-") for n in sizes) + " |")
    return lines


def plot(runs: list[dict], path: str, title: str) -> bool:
    """Stacked bars of rank 0's measured peaks by category, the estimate as a marker; tokens/s below.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in runs if r["ok"]]
    world_sizes = sorted({r["ranks"] for r in ok})
    fig, axes = plt.subplots(2, max(1, len(world_sizes)), figsize=(2 + 4.5 * len(world_sizes), 7.5),
                             squeeze=False, gridspec_kw={"height_ratios": [3, 1]})
    colors = dict(zip(SHOWN, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for j, n in enumerate(world_sizes):
        rs = [r for r in ok if r["ranks"] == n]
        xs = range(len(rs))
        ax = axes[0][j]
        bottom = [0.0] * len(rs)
        for c in SHOWN:
            vals = [r["measured"]["per_rank"][0][c] / MIB for r in rs]
            ax.bar(xs, vals, bottom=bottom, color=colors[c], label=c, hatch="//" if c == "offloaded" else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        estimates = [r["estimate"]["total"] / MIB for r in rs]
        ax.scatter(xs, estimates, marker="D", color="black", zorder=3, label="estimate: device total")
        ax.set_ylim(0, 1.12 * max(bottom + estimates) or 1)  # headroom: the tallest bar and marker inside the axes
        ax.set_title(f"{n} rank(s): peak memory per rank (rank 0)")
        ax.set_ylabel("MiB")
        ax.set_xticks(list(xs), [r["strategy"] for r in rs], rotation=30, ha="right")
        axt = axes[1][j]
        axt.bar(xs, [r["measured"]["tokens_per_s"] for r in rs], color="gray")
        axt.set_ylabel("tokens/s")
        axt.set_xticks(list(xs), [r["strategy"] for r in rs], rotation=30, ha="right")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, metadata=MARK))
    plt.close(fig)
    return True


def deviations(measured: list[dict], est: dict) -> dict:
    """Per category, the largest |estimate - measured| / measured over ranks (0 when both are 0; inf if only one)."""
    out = {}
    for c in SHOWN:
        worst = 0.0
        for peaks in measured:
            m, e = peaks.get(c, 0), est[c]
            worst = max(worst, abs(e - m) / m if m else (0.0 if e == 0 else float("inf")))
        out[c] = worst
    return out


def hardware_line(profile) -> str:
    """One line of a :class:`minizero.hardware.Profile`: sgemm GFLOP/s per BLAS threads, copy GB/s, busbw GB/s,
    AdamW."""
    flops = ", ".join(f"{v / 1e9:.1f} GFLOP/s ({t} thread{'s' * (t > 1)})"
                      for t, v in sorted(profile.sgemm_flops.items()))
    bw = ", ".join(f"{v / 1e9:.2f} GB/s and {profile.latency.get(n, 0) * 1e6:.1f} us a message step ({n} ranks)"
                   for n, v in sorted(profile.allreduce_busbw.items()) if n > 1)
    return (f"hardware profile (minizero.hardware): sgemm at the model's shapes {flops}; copy "
            f"{profile.copy_bw / 1e9:.1f} GB/s; all-reduce busbw at the {profile.gradient_bytes / 2**20:.2f} MiB "
            f"gradient {bw or '- (1 rank)'}; AdamW {profile.adam_params_per_s / 1e6:.0f} M params/s")


def hardware_lines(profile) -> str:
    """:func:`hardware_line` as the live output shows it: indented, wrapped at 100 columns."""
    return "\n".join(wrap("  " + hardware_line(profile)))
