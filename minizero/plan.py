"""``python -m minizero.plan``: will this model fit on these GPUs, with which settings, and how fast?

::

    python -m minizero.plan --model llama3-70b --gpus 64 --gpu-memory 80GB --seq-len 4096

Enumerates every layout dp x tp x pp = GPUs, ZeRO stage 0-3 (2-3 only without
pipelining), recompute (none/selective/full), sequence parallelism (when tp > 1),
offload (none, optimizer, parameters; and activations), estimates each one's per-GPU
memory by category on its first and last pipeline stage (:mod:`minizero.memory.estimator`,
the papers' accounting), the bytes each GPU sends per step, and the step time on a
simple hardware model; prints the strategies that fit, best first, and for each of the
three best step times one line saying why its strategy beats the next slower one.

Ranking rule: highest estimated training throughput (tokens per second) first; ties
(strategies whose step time is the same, e.g. with and without sequence
parallelism) go to less device memory per GPU, then to fewer techniques switched on.

Step-time model (first order, stated so it can be argued with)::

    compute  = hardware FLOPs of the step (model FLOPs + recompute) / GPUs / (peak x efficiency)
    bubble   = compute x (p - 1) / (v m)            pipeline flush (Narayanan et al. 2021, 2.2)
    tp       = tensor-parallel bytes / NVLink bandwidth, on the critical path (not overlapped)
    pp       = pipeline send/recv bytes / link bandwidth
    dp       = data-parallel bytes / link bandwidth, minus what hides behind backward:
               ZeRO 0-1 behind the last micro-batch's backward, ZeRO 2 behind every
               backward, ZeRO 3 behind all compute; ZeRO 1-2's parameter all-gather after
               the optimizer step is exposed
    offload  = optimizer: PCIe (gradients down, parameters up) + CPU Adam, exposed;
               parameters and activations: PCIe traffic beyond the compute time
    step     = compute + bubble + tp + pp + dp + offload

Placement: tensor-parallel groups inside a node; the data-parallel group uses
intra-node links when dp x tp fits in a node, the pipeline when the whole job does;
otherwise inter-node links. The number of micro-batches m per step is the global
batch / (dp x micro-batch), rounded up (the effective batch is printed).

Units: memory in GB = 10**9 bytes unless ``--units GiB`` (2**30 bytes); the header
says which. Memory arguments accept ``80GB`` (8e10 bytes), ``80GiB`` (85,899,345,920
bytes), or a plain number of bytes (``8e10``); an "80 GB" A100/H100 has 80 GiB.
Bad input exits with status 2 and one line naming the value and what is allowed.
``--gpus`` is at most 2**20 (1,048,576); ``--plot PATH`` writes a PNG to PATH (``.png`` added
when PATH has no extension) through a temporary name, and the path is checked before planning.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile

from minizero.files import atomic_write
from minizero.memory.estimator import (
    DEVICE_CATEGORIES, PRECISIONS, RECOMPUTE, ModelShape, Strategy, _bytes, comm_bytes_per_step,
    estimate_stages, model_flops_per_step, stage_parameters)
from minizero.models import MODELS, get_model

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
#: the most GPUs ``--gpus`` accepts (2**20 = 1,048,576), so enumeration stays interactive
MAX_GPUS = 2 ** 20
RANKING_RULE = ("fastest estimated step first (tokens/s); ties go to less device memory per GPU, "
                "then to fewer techniques")


def parse_bytes(text: str, what: str = "value") -> int:
    """``"80GB"`` -> 80 * 10**9, ``"80GiB"`` -> 80 * 2**30, ``"8e10"`` -> 8 * 10**10 bytes (``/s`` allowed).

    Decimal units KB, MB, GB, TB are powers of 10; binary KiB, MiB, GiB, TiB powers of 2.
    Raises:
        ValueError: not a positive finite number with one of those units (the text is quoted).
    """
    s = str(text).strip()
    mt = re.fullmatch(r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)(?:/s)?", s)
    unit = mt.group(2).lower() if mt else None
    if mt is None or unit not in _UNITS:
        hint = " (ambiguous: write GB for 10^9 bytes or GiB for 2^30)" if unit in ("g", "m", "k", "t") else ""
        raise ValueError(f"{what} {text!r} is not a byte size{hint}; allowed: a number with an optional unit "
                         f"B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), "
                         f"e.g. 80GB, 80GiB, 8e10")
    value = float(mt.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is infinite (too large for a float); allowed: a finite byte size, "
                         f"e.g. 80GB")
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive; allowed: a byte size of at least 1 byte, e.g. 80GB")
    if not value >= 1:
        raise ValueError(f"{what} {text!r} must be at least 1 byte")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Bytes, bytes per second, FLOP/s.

    Defaults: an A100-80GB SXM node (312 TFLOP/s dense 16-bit, NVLink 3 300 GB/s per
    direction, one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s, PCIe 4.0 x16 ~25 GB/s,
    8 GPUs and 1 TB of host memory per node). ``efficiency``: fraction of peak the
    matmuls reach. ``cpu_adam``: parameters per second one GPU's share of CPU cores
    updates (ZeRO-Offload's CPU-Adam, Ren et al. 2021, section 4.2; an assumption).
    """

    gpu_memory: int = 80 * 2 ** 30
    host_memory: int = 128 * 10 ** 9
    flops: float = 312e12
    efficiency: float = 0.6
    intra_node_bw: float = 300e9
    inter_node_bw: float = 25e9
    pcie_bw: float = 25e9
    gpus_per_node: int = 8
    cpu_adam: float = 1e9


@dataclasses.dataclass
class Candidate:
    """One strategy with its estimates: memory (the MemoryEstimate of its fullest stage), comm bytes per
    step, step time breakdown (s), tokens/s, MFU, number of techniques on, host bytes."""

    strategy: Strategy
    memory: object
    comm: dict
    time: dict
    tokens_per_s: float
    mfu: float
    techniques: int
    host: int  # the most any stage offloads (bytes)

    @property
    def step_s(self) -> float:
        """Estimated seconds per optimizer step."""
        return self.time["step"]


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (trial division up to sqrt(n))."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def enumerate_strategies(model: ModelShape, gpus: int, *, micro_batch: int = 1, global_batch: int = 1,
                         precision: str = "mixed", optimizer: str = "adam", schedule: str = "1f1b",
                         virtual_stages: int = 2, gpus_per_node: int = 8, bucket_bytes: int | None = None):
    """Every valid :class:`Strategy` for ``model`` on exactly ``gpus`` GPUs (a generator).

    tp divides the heads, the KV heads and the FFN size and fits in a node; pp x
    virtual stages divides the layers; ZeRO > 0 on one data-parallel rank only with
    offload (ZeRO-Offload on one GPU); ZeRO 2-3 not with pipelining (they reduce
    gradients every micro-batch; neither DeepSpeed nor Megatron-LM combines them with
    pp > 1, while ZeRO-1 -- Megatron's distributed optimizer -- is); sequence
    parallelism only with tp > 1.
    """
    for tp in _divisors(gpus):
        if tp > gpus_per_node or model.n_head % tp or model.n_kv_head % tp or model.ffn_hidden % tp:
            continue
        for pp in _divisors(gpus // tp):
            sched, v = (schedule, virtual_stages) if schedule == "interleaved" and pp > 1 else (
                "1f1b" if schedule == "interleaved" else schedule, 1)
            if model.n_layer % (pp * v):
                continue
            dp = gpus // (tp * pp)
            m = math.ceil(global_batch / (dp * micro_batch))
            if sched == "interleaved":
                m = math.ceil(m / pp) * pp  # Megatron-LM's interleaved schedule needs m divisible by p
            for zero in (0, 1, 2, 3):
                for offload in ("none", "optimizer", "params"):
                    if (offload == "optimizer" and zero < 2) or (offload == "params" and zero != 3):
                        continue
                    if (dp == 1 and zero > 0 and offload == "none") or (zero >= 2 and pp > 1):
                        continue
                    for recompute in RECOMPUTE:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for act_off in (False, True):
                                yield Strategy(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp,
                                               recompute=recompute, precision=precision, optimizer=optimizer,
                                               offload=offload, offload_activations=act_off,
                                               micro_batch=micro_batch, micro_batches=m, schedule=sched,
                                               virtual_stages=v, bucket_bytes=bucket_bytes)


def step_time(model: ModelShape, st: Strategy, hw: Hardware, seq_len: int, comm: dict | None = None) -> dict:
    """Seconds per optimizer step by component (see the module docstring); key "step" is the sum."""
    comm = comm or comm_bytes_per_step(model, st, seq_len)
    n = st.world_size
    batch = st.dp * st.micro_batch * st.micro_batches
    compute = model_flops_per_step(model, batch, seq_len, st.recompute) / n / (hw.flops * hw.efficiency)
    bubble = compute * (st.pp - 1) / (st.virtual_stages * st.micro_batches)
    node = hw.gpus_per_node
    dp_bw = hw.intra_node_bw if st.dp * st.tp <= node else hw.inter_node_bw
    pp_bw = hw.intra_node_bw if n <= node else hw.inter_node_bw
    tp = comm["tp"] / hw.intra_node_bw
    pp = comm["pp"] / pp_bw
    dp = 0.0
    if st.dp > 1:
        pb = _bytes(st)[0]
        gather_after_step = (st.dp - 1) / st.dp * pb * stage_parameters(model, st, 0) if st.zero in (1, 2) else 0.0
        overlappable = comm["dp"] - gather_after_step
        window = {0: 2 / 3 * compute / st.micro_batches, 1: 2 / 3 * compute / st.micro_batches,
                  2: 2 / 3 * compute, 3: compute}[st.zero]
        dp = max(0.0, overlappable / dp_bw - window) + gather_after_step / dp_bw
    offload = 0.0
    shard = math.ceil(stage_parameters(model, st, 0) / st.dp)
    pb, gbytes = _bytes(st)[:2]
    if st.offload != "none":
        offload += (gbytes + pb) * shard / hw.pcie_bw + shard / hw.cpu_adam
        overlapped = comm["pcie"] - (gbytes + pb) * shard
        offload += max(0.0, overlapped / hw.pcie_bw - compute)
    elif st.offload_activations:
        offload += max(0.0, comm["pcie"] / hw.pcie_bw - compute)
    parts = dict(compute=compute, bubble=bubble, tp=tp, pp=pp, dp=dp, offload=offload)
    parts["step"] = sum(parts.values())
    return parts


def evaluate(model: ModelShape, st: Strategy, hw: Hardware, seq_len: int) -> Candidate:
    """Memory (the stage with the most device bytes), communication, step time, throughput and MFU."""
    stages = estimate_stages(model, st, seq_len)
    mem = max(stages, key=lambda e: e.total)
    comm = comm_bytes_per_step(model, st, seq_len, stage=mem.stage)
    t = step_time(model, st, hw, seq_len, comm_bytes_per_step(model, st, seq_len))
    tokens = st.dp * st.micro_batch * st.micro_batches * seq_len
    mfu = model_flops_per_step(model, tokens // seq_len, seq_len) / (t["step"] * st.world_size * hw.flops)
    techniques = (st.zero > 0) + (st.tp > 1) + (st.pp > 1) + st.sequence_parallel + (st.recompute != "none") \
        + (st.offload != "none") + st.offload_activations
    return Candidate(st, mem, comm, t, tokens / t["step"], mfu, techniques, max(e.offloaded for e in stages))


def plan(model: ModelShape, gpus: int, hw: Hardware, seq_len: int, **kw) -> tuple[list[Candidate], int, tuple]:
    """(strategies that fit, ranked by :data:`RANKING_RULE`; how many were enumerated; the smallest
    footprint as (strategy, device bytes, host bytes), or None when nothing was enumerated).

    A strategy fits when, on its first and its last pipeline stage (which bound every
    stage), the device total is at most ``hw.gpu_memory`` and what it offloads at most
    ``hw.host_memory``. ``kw`` goes to :func:`enumerate_strategies`.
    """
    fits, count, smallest = [], 0, None
    for st in enumerate_strategies(model, gpus, gpus_per_node=hw.gpus_per_node, **kw):
        count += 1
        stages = estimate_stages(model, st, seq_len)
        device, host = max(e.total for e in stages), max(e.offloaded for e in stages)
        if smallest is None or (device, host) < smallest[1:]:
            smallest = (st, device, host)
        if device <= hw.gpu_memory and host <= hw.host_memory:
            fits.append(evaluate(model, st, hw, seq_len))
    fits.sort(key=lambda c: (-round(c.tokens_per_s, 6), c.memory.total, c.techniques))
    return fits, count, smallest


# ---- text -------------------------------------------------------------------------------------
def describe(st: Strategy) -> str:
    """``dp=8 tp=8 pp=1 zero=1 sp recompute=selective offload=none`` -- the strategy in one phrase."""
    parts = [f"dp={st.dp}", f"tp={st.tp}", f"pp={st.pp}", f"zero={st.zero}"]
    if st.sequence_parallel:
        parts.append("sp")
    parts.append(f"recompute={st.recompute}")
    if st.offload != "none":
        parts.append(f"offload={st.offload}")
    if st.offload_activations:
        parts.append("offload=activations")
    return " ".join(parts)


_WHY = {"compute": "compute (recompute FLOPs)", "bubble": "pipeline bubble", "tp": "tensor-parallel traffic",
        "pp": "pipeline traffic", "dp": "exposed data-parallel traffic", "offload": "offload (PCIe, CPU Adam)"}


def explain(a: Candidate, b: Candidate, ia: int, ib: int, scale: float, unit: str) -> str:
    """One line: why candidate ``a`` (rank ia) ranks above ``b`` (rank ib) -- the step-time components
    that differ most, and the settings that differ."""
    fields = [f"{f} {getattr(a.strategy, f)} vs {getattr(b.strategy, f)}"
              for f in ("dp", "tp", "pp", "zero", "sequence_parallel", "recompute", "offload",
                        "offload_activations", "micro_batches") if getattr(a.strategy, f) != getattr(b.strategy, f)]
    diff = "; ".join(fields) or "same settings"
    gain = a.tokens_per_s / b.tokens_per_s - 1
    if gain > 1e-9:
        delta = {k: a.time[k] - b.time[k] for k in _WHY}  # negative: a is quicker there
        big = max(abs(d) for d in delta.values())
        wins = sorted((k for k in delta if delta[k] < -0.01 * big), key=delta.get)[:3]
        costs = sorted((k for k in delta if delta[k] > 0.01 * big), key=lambda k: -delta[k])[:2]
        why = " and ".join(f"{-delta[k]:.3g} s less {_WHY[k]}" for k in wins)
        if costs:
            why += (" outweigh " if len(wins) > 1 else " outweighs ") + " and ".join(
                f"{delta[k]:.3g} s more {_WHY[k]}" for k in costs)
        return (f"#{ia} beats #{ib} by {100 * gain:.2g}% tokens/s ({b.step_s - a.step_s:.3g} s per step): "
                f"{why} ({diff})")
    saved = (b.memory.total - a.memory.total) / scale
    return f"#{ia} ties #{ib} on step time and needs {saved:.2f} {unit} less per GPU ({diff})"


def why_lines(fits: list[Candidate], scale: float, unit: str, groups: int = 3) -> list[str]:
    """One line for each of the first ``groups`` distinct step times: why its best strategy beats the
    best of the next slower group, and which strategies tie with it (same step time, more memory)."""
    firsts = [i for i, c in enumerate(fits) if i == 0 or abs(c.tokens_per_s / fits[i - 1].tokens_per_s - 1) > 1e-9]
    if len(fits) == 1:
        return ["only one strategy fits"]
    lines = []
    for k, i in enumerate(firsts[:groups]):
        end = firsts[k + 1] if k + 1 < len(firsts) else len(fits)
        tie = ""
        if end - i > 1:
            more = max(fits[j].memory.total for j in range(i + 1, end)) - fits[i].memory.total
            tie = (f" [#{i + 2}{' ties' if end - i == 2 else f'-#{end} tie'} with #{i + 1} on step time, needing up to "
                   f"{more / scale:.2f} {unit} more per GPU]")
        if end < len(fits):
            lines.append(explain(fits[i], fits[end], i + 1, end + 1, scale, unit) + tie)
        elif tie:
            lines.append(f"#{i + 1} is the slowest that fits{tie}")
    return lines


def format_table(cands: list[Candidate], scale: float) -> list[str]:
    """The fixed-width table of ``cands`` (memory columns divided by ``scale``)."""
    head = (f"{'#':>3} {'dp':>4} {'tp':>2} {'pp':>3} {'Z':>1} {'SP':>2} {'recomp':>9} {'offload':>13} {'m':>5} |"
            f"{'param':>7}{'grad':>7}{'optim':>7}{'acts':>7}{'bufs':>7}{'total':>8} |{'host':>7} |"
            f"{'net/step':>9} | {'step s':>7} {'tok/s':>9} {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        st, mem = c.strategy, c.memory
        off = st.offload if st.offload != "none" else ""
        if st.offload_activations:
            off = (off + "+act") if off else "act"
        bufs = mem.comm_buffers + mem.gathered
        net = c.comm["dp"] + c.comm["tp"] + c.comm["pp"]
        lines.append(
            f"{i:>3} {st.dp:>4} {st.tp:>2} {st.pp:>3} {st.zero:>1} {'y' if st.sequence_parallel else '':>2} "
            f"{st.recompute:>9} {off or 'none':>13} {st.micro_batches:>5} |"
            f"{mem.parameters / scale:7.2f}{mem.gradients / scale:7.2f}{mem.optimizer_state / scale:7.2f}"
            f"{mem.activations / scale:7.2f}{bufs / scale:7.2f}{mem.total / scale:8.2f} |{c.host / scale:7.1f} |"
            f"{net / scale:9.2f} | {c.step_s:7.3f} {c.tokens_per_s:9,.0f} {c.mfu:5.1%}")
    return lines


def _short(st: Strategy) -> str:
    """A compact multi-line label: ``dp4 tp2 pp1 / Z3 sp / sel / off:params``."""
    lines = [f"dp{st.dp} tp{st.tp} pp{st.pp}", f"Z{st.zero}" + (" sp" if st.sequence_parallel else ""),
             {"none": "no rc", "selective": "sel rc", "full": "full rc"}[st.recompute]]
    off = [o for o in (st.offload if st.offload != "none" else "", "act" if st.offload_activations else "") if o]
    if off:
        lines.append("off:" + "+".join(off))
    return "\n".join(lines)


def plot(cands: list[Candidate], path: str, gpu_memory: int, scale: float, unit: str, title: str) -> None:
    """Stacked bars of each candidate's device memory by category, and the GPU's capacity, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(cands) + 3), 4.8))
    xs = list(range(len(cands)))
    bottom = [0.0] * len(cands)
    for cat in DEVICE_CATEGORIES:
        vals = [getattr(c.memory, cat) / scale for c in cands]
        ax.bar(xs, vals, bottom=bottom, label=cat.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(gpu_memory / scale, color="k", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"#{i + 1}\n{_short(c.strategy)}" for i, c in enumerate(cands)], fontsize=7)
    ax.set_ylabel(f"memory per GPU ({unit}, {'10^9' if unit == 'GB' else '2^30'} bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def _candidate_json(c: Candidate, rank: int) -> dict:
    return {"rank": rank, "strategy": dataclasses.asdict(c.strategy), "memory_bytes": c.memory.as_dict(),
            "device_total_bytes": c.memory.total, "stage": c.memory.stage, "host_bytes_max": c.host,
            "comm_bytes_per_step": c.comm,
            "step_time_s": c.time, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu}


# ---- the command ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.plan``."""
    p = argparse.ArgumentParser(prog="python -m minizero.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="NAME", help=f"one of: {', '.join(sorted(MODELS))}")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (= dp x tp x pp)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU: 80GB = 8e10 bytes, 80GiB = 2^30 x 80")
    p.add_argument("--host-memory", default="128GB", help="host memory available to each GPU for offload")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per GPU (b)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: about 4M tokens, 2^22 / seq-len)")
    p.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS), help="mixed: 16-bit + fp32 master")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adam8bit"])
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"], help="pipeline schedule")
    p.add_argument("--virtual-stages", type=int, default=2, help="model chunks per GPU with --schedule interleaved")
    p.add_argument("--gpus-per-node", type=int, default=8, help="tensor parallelism stays inside a node")
    p.add_argument("--gpu-flops", type=float, default=312e12, help="peak dense 16-bit FLOP/s per GPU (H100: 989e12)")
    p.add_argument("--efficiency", type=float, default=0.6, help="fraction of peak the matmuls reach")
    p.add_argument("--intra-node-bw", default="300GB", help="NVLink bytes/s per GPU per direction")
    p.add_argument("--inter-node-bw", default="25GB", help="network bytes/s per GPU (200 Gb/s = 25GB)")
    p.add_argument("--pcie-bw", default="25GB", help="host <-> device bytes/s per GPU")
    p.add_argument("--bucket", default="25MiB", help="gradient reduce bucket (PyTorch DDP: 25MiB)")
    p.add_argument("--top", type=int, default=10, help="how many strategies to show (0: all that fit)")
    p.add_argument("--units", default="GB", choices=["GB", "GiB"], help="GB = 10^9 bytes, GiB = 2^30 bytes")
    p.add_argument("--json", action="store_true", help="print JSON (all sizes in bytes) instead of the table")
    p.add_argument("--plot", metavar="PATH", default=None, help="also write a stacked-bar PNG of the shown strategies")
    return p


def plot_path(path: str) -> str:
    """The PNG path ``--plot PATH`` writes: PATH, with ``.png`` added when it has no extension.

    Raises:
        ValueError: another extension, a directory, or a folder that does not exist or takes no file.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in ("", ".png"):
        raise ValueError(f"--plot {path!r}: cannot write the PNG there: the name must end in .png (or have no "
                         f"extension, and .png is added)")
    real = path if ext else path + ".png"
    if os.path.isdir(real) or os.path.isdir(path) and not ext:
        raise ValueError(f"--plot {path!r}: cannot write the PNG: {path!r} is a directory; give a file name")
    d = os.path.dirname(os.path.abspath(real))
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(real)}.", suffix=".tmp")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(f"--plot {path!r}: cannot write the PNG in {d!r}: {e.strerror or e}") from None
    return real


def _positive(parser, name, value):
    if value is not None and value < 1:
        parser.error(f"--{name} must be a positive integer, got {value}")


def main(argv=None) -> int:
    """Run the planner; returns 0 (bad input exits 2 through argparse, with one message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = get_model(args.model)
    except ValueError as e:
        parser.error(f"--model: {e}")
    for name in ("gpus", "seq_len", "micro_batch", "global_batch", "virtual_stages", "gpus_per_node"):
        _positive(parser, name.replace("_", "-"), getattr(args, name))
    if args.gpus > MAX_GPUS:
        parser.error(f"--gpus {args.gpus} is too many; allowed: 1..{MAX_GPUS:,} (2^20)")
    if args.schedule == "interleaved":
        v = args.virtual_stages
        ok_v = [d for d in _divisors(model.n_layer) if model.n_layer // d >= 2]
        if v not in ok_v:
            parser.error(f"--virtual-stages {v}: with --schedule interleaved, pp x virtual stages must divide "
                         f"{model.name}'s {model.n_layer} layers with pp >= 2; allowed: "
                         f"{', '.join(map(str, ok_v)) or 'none (use --schedule 1f1b)'}")
    if args.plot:
        try:
            args.plot = plot_path(args.plot)
        except ValueError as e:
            parser.error(str(e))
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib, or pip install -e '.[test]')")
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    if not (args.gpu_flops > 0 and math.isfinite(args.gpu_flops)):
        parser.error(f"--gpu-flops must be a positive number, got {args.gpu_flops}")
    if not 0 < args.efficiency <= 1:
        parser.error(f"--efficiency must be in (0, 1], got {args.efficiency}")
    try:
        sizes = {k: parse_bytes(getattr(args, k), "--" + k.replace("_", "-"))
                 for k in ("gpu_memory", "host_memory", "intra_node_bw", "inter_node_bw", "pcie_bw", "bucket")}
    except ValueError as e:
        parser.error(str(e))
    seq = args.seq_len or model.seq_len
    if model.learned_pos and seq > model.seq_len:
        parser.error(f"--seq-len {seq} exceeds {model.name}'s learned position table of {model.seq_len}; "
                     f"allowed: 1..{model.seq_len}")
    gbatch = args.global_batch or max(1, math.ceil(2 ** 22 / seq))
    hw = Hardware(gpu_memory=sizes["gpu_memory"], host_memory=sizes["host_memory"], flops=args.gpu_flops,
                  efficiency=args.efficiency, intra_node_bw=sizes["intra_node_bw"],
                  inter_node_bw=sizes["inter_node_bw"], pcie_bw=sizes["pcie_bw"], gpus_per_node=args.gpus_per_node)
    scale, unit = (1e9, "GB") if args.units == "GB" else (2 ** 30, "GiB")
    fits, count, smallest = plan(model, args.gpus, hw, seq, micro_batch=args.micro_batch, global_batch=gbatch,
                                 precision=args.precision, optimizer=args.optimizer, schedule=args.schedule,
                                 virtual_stages=args.virtual_stages, bucket_bytes=sizes["bucket"])
    if count == 0:
        parser.error(f"--gpus {args.gpus}: no layout dp x tp x pp splits {model.name} ({model.n_layer} layers, "
                     f"{model.n_head} heads) over {args.gpus} GPUs with tp <= {args.gpus_per_node}")
    if not fits:
        st, device, host = smallest
        if device > hw.gpu_memory:
            parser.error(f"--gpu-memory {args.gpu_memory} ({hw.gpu_memory / scale:.2f} {unit}) is below the smallest "
                         f"per-GPU footprint of any of the {count:,} strategies for {model.name} on {args.gpus} GPUs: "
                         f"{device / scale:.2f} {unit} ({describe(st)}). Allowed: --gpu-memory of at least "
                         f"{device / scale:.2f} {unit}, or more GPUs, or a shorter --seq-len")
        parser.error(f"--host-memory {args.host_memory} ({hw.host_memory / scale:.2f} {unit}) is too small: every "
                     f"strategy that fits {hw.gpu_memory / scale:.2f} {unit} per GPU offloads more than that; the "
                     f"smallest device footprint, {device / scale:.2f} {unit} ({describe(st)}), offloads "
                     f"{host / scale:.2f} {unit}. Allowed: more --host-memory or --gpu-memory, or more GPUs")
    shown = fits if args.top == 0 else fits[:args.top]
    n_psi = model.num_parameters()
    if args.json:
        out = {"model": dataclasses.asdict(model), "parameters": n_psi, "gpus": args.gpus, "seq_len": seq,
               "global_batch_requested": gbatch, "hardware": dataclasses.asdict(hw), "units": "bytes",
               "ranking_rule": RANKING_RULE, "enumerated": count, "fit": len(fits),
               "candidates": [_candidate_json(c, i) for i, c in enumerate(shown, 1)]}
        print(json.dumps(out, indent=1))
    else:
        p0 = _bytes(shown[0].strategy)
        if args.schedule == "interleaved":
            piped = sum(c.strategy.pp > 1 for c in fits)
            sched = (f"interleaved pipeline schedule ({args.virtual_stages} virtual stages per GPU; pp = 1 layouts "
                     f"have no pipeline" + ("; no layout with pp > 1 fits" if not piped else "") + ")")
        else:
            sched = f"{args.schedule} pipeline schedule"
        count_text = (f"{n_psi / 1e9:.2f} B" if n_psi >= 1e9 else f"{n_psi / 1e6:.2f} M" if n_psi >= 1e6
                      else f"{n_psi:,}")
        print(f"minizero.plan: {model.name} ({count_text} parameters; {model.n_layer} layers, hidden "
              f"{model.hidden}, {model.n_head} heads / {model.n_kv_head} KV, FFN {model.ffn_hidden}, vocab "
              f"{model.vocab_size})")
        print(f"{args.gpus} GPUs x {hw.gpu_memory / scale:.2f} {unit} ({args.gpus_per_node} per node); sequence {seq}, "
              f"micro-batch {args.micro_batch}, global batch {gbatch} sequences requested; {args.precision} "
              f"precision, {args.optimizer} (K = {p0[3]:g} bytes/parameter), {sched}")
        print(f"memory per GPU in {unit} ({'10^9' if unit == 'GB' else '2^30'} bytes); host = offloaded; "
              f"net/step = bytes each GPU sends per step ({unit}); bufs = comm buffers + ZeRO-3 gathered layer")
        print(f"{count:,} strategies enumerated, {len(fits):,} fit; ranking: {RANKING_RULE}")
        print("(a first-order model: step times within about 1% of each other are within its accuracy)")
        print()
        for line in format_table(shown, scale):
            print(line)
        print()
        print("why:")
        for line in why_lines(fits, scale, unit):
            print("  " + line)
    if args.plot:
        try:
            plot(shown, args.plot, hw.gpu_memory, scale, unit,
                 f"{model.name} on {args.gpus} GPUs, seq {seq}: per-GPU memory of the best {len(shown)}")
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib, or pip install -e '.[test]')")
        except OSError as e:
            parser.error(f"--plot {args.plot!r}: cannot write the PNG: {e.strerror or e}")
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
