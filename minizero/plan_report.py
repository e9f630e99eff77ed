"""What ``python -m minizero.plan`` prints and draws: the strategy in words, the table, "why", the plot, JSON.

Every memory figure is divided by one ``scale`` with its ``unit`` (GB = 10^9 bytes or
GiB = 2^30 bytes), so a table never mixes unit families.
"""
from __future__ import annotations

import dataclasses
import os

from minizero.files import atomic_write
from minizero.overwrite import check_output, refuse_slash_or_dangling
from minizero.memory.estimator import DEVICE_CATEGORIES, Strategy, element_bytes
from minizero.numerals import column, counted, significant
from minizero.plan_search import Candidate, Hardware, train_runs
from minizero.pngs import MARK
from minizero.streams import stream_fd

def describe(st: Strategy) -> str:
    """``dp=8 tp=8 pp=1 zero=1 sp recompute=selective offload=none`` -- the strategy in one phrase (``ep=4``
    after dp when expert parallel; ``cp=4 cp_attention=ring|ulysses`` when context parallel)."""
    parts = [f"dp={st.dp}"] + ([f"ep={st.ep}"] if st.ep > 1 else []) \
        + ([f"cp={st.cp}", f"cp_attention={st.cp_attention}"] if st.cp > 1 else []) \
        + [f"tp={st.tp}", f"pp={st.pp}", f"zero={st.zero}"] + ([f"shard={st.dp_shard}"] if st.dp_shard else [])
    parts += (["sp"] if st.sequence_parallel else []) + [f"recompute={st.recompute}"] \
        + ([f"offload={st.offload}"] if st.offload != "none" else []) \
        + (["offload=activations"] if st.offload_activations else []) \
        + ([f"attention={st.attention}"] if st.attention != "dense" else [])
    return " ".join(parts)


_WHY = {"compute": "compute", "bubble": "pipeline bubble", "tp": "tensor-parallel traffic",
        "cp": "context-parallel traffic", "ep": "expert all-to-all traffic", "pp": "pipeline traffic",
        "dp": "exposed data-parallel traffic", "offload": "exposed offload"}
#: the step-time parts that move bytes, and their key in ``Candidate.comm`` (the table's net sums all but pcie)
_SENT = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp", "offload": "pcie"}
#: the step-time model overlaps dp traffic and offload with compute in part (their seconds are the exposed rest, as
#: the legend says), the other traffic not at all; the bytes are all sent, hidden or not
_HIDDEN = {"dp": "", "offload": "", **{k: ", all exposed" for k in ("tp", "cp", "ep", "pp")}}


def _amounts(xs: list[float], scale: float, unit: str) -> str:
    """Byte counts in the table's unit (``5808.70 vs 2225.10 GB``), or the unit of its family they reach."""
    if max(xs) / scale < 0.01:  # 0.00 vs 0.00 GB says nothing
        scale, unit = unit_for(max(xs), "GiB" if unit.endswith("iB") else "GB")
    return " vs ".join(f"{x / scale:.2f}" for x in xs) + f" {unit}"


def _part(k: str, cands: list[Candidate], scale: float, unit: str) -> str:
    """One step-time part of ``cands`` (one or two rows), every figure named: ``exposed data-parallel traffic (0.12
    vs 0.17 s; 5808.70 vs 2225.10 GB sent per GPU)``. The seconds are what the step time counts, the bytes all a GPU
    sends (or copies over PCIe), overlapped with compute or not."""
    secs = " vs ".join(significant(c.time.get(k, 0)) for c in cands) + " s"
    if k == "compute":
        extra = ", recompute's extra FLOPs included" if any(c.strategy.recompute != "none" for c in cands) else ""
        return f"compute ({secs}{extra})"
    if k == "bubble":
        return f"pipeline bubble ({secs} idle)"
    sent = _amounts([c.comm.get(_SENT[k], 0) for c in cands], scale, unit)
    where = "copied over PCIe" if k == "offload" else "sent"
    return f"{_WHY[k]} ({secs}{_HIDDEN[k]}; {sent} {where} per GPU)"


def step_line(c: Candidate, scale: float, unit: str) -> str:
    """``--strategy``'s step time by part, seconds and bytes named (:func:`_part`): dp traffic wholly overlapped with
    compute shows as 0 s exposed of its bytes, not as nothing."""
    parts = ", ".join(_part(k, [c], scale, unit) for k, v in c.time.items()
                      if k != "step" and (v > 0 or c.comm.get(_SENT.get(k), 0) > 0))
    where = f" (pipeline stage {c.stage}, the slowest of {c.strategy.pp})" if c.strategy.pp > 1 else ""
    return f"step {significant(c.step_s)} s{where} = {parts or '0'}"


#: each --units family, largest unit first: GB and the smaller powers of 10, GiB and the smaller powers of 2
UNITS = {"GB": {"GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1.0},
         "GiB": {"GiB": 2.0 ** 30, "MiB": 2.0 ** 20, "KiB": 2.0 ** 10, "B": 1.0}}
POWERS = {"GB": "10^9", "MB": "10^6", "KB": "10^3", "GiB": "2^30", "MiB": "2^20", "KiB": "2^10", "B": "1"}


def unit_for(largest: float, unit: str) -> tuple[float, str]:
    """(scale, unit): ``unit`` or the first smaller unit of its family that ``largest`` bytes reach."""
    for name, scale in UNITS[unit].items():
        if largest >= scale:
            break
    return scale, name


def size(n: float, unit: str) -> str:
    """``n`` bytes in the unit of ``unit``'s family it reaches (:func:`unit_for`): ``1.00 MB``, not ``0.00 GB``."""
    scale, name = unit_for(n, unit)
    return f"{n / scale:.2f} {name}"


def table_unit(cands: list[Candidate], unit: str) -> tuple[float, str]:
    """:func:`unit_for` the largest device or host size of ``cands``: the unit of their table, why lines, plot."""
    return unit_for(max(max(c.memory.total, c.host) for c in cands), unit)


ACCURACY = 0.01  #: step times this close (relative) are within the first-order model's accuracy: a tie


_SETTING = {"cp_attention": "cp attention", "dp_shard": "shard", "sequence_parallel": "sp",
            "offload_activations": "activation offload", "micro_batches": "micro-batches"}  #: as the table's key


def explain(a: Candidate, b: Candidate, ia: int, ib: int, scale: float, unit: str) -> str:
    """One line: why candidate ``a`` (rank ia) ranks above ``b`` (rank ib) -- the step-time components
    that differ most, and the settings that differ."""
    def said(v):  # a switch as on/off, dp_shard's None (no hybrid sharding) as none
        return "none" if v is None else {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    fields = [f"{_SETTING.get(f, f)} {said(getattr(a.strategy, f))} vs {said(getattr(b.strategy, f))}"
              for f in ("dp", "ep", "cp", "cp_attention", "tp", "pp", "zero", "dp_shard", "sequence_parallel",
                        "recompute", "offload", "offload_activations", "micro_batches")
              if getattr(a.strategy, f) != getattr(b.strategy, f)]
    diff = "settings: " + "; ".join(fields) if fields else "same settings"  # apart from the figures' parentheses
    gain, more = a.tokens_per_s / b.tokens_per_s - 1, a.tokens_per_s * a.step_s / (b.tokens_per_s * b.step_s)
    if gain > 1e-9:
        delta = {k: a.time.get(k, 0) - b.time.get(k, 0) for k in _WHY}  # negative: a is quicker there
        big = max(abs(d) for d in delta.values())
        wins = sorted((k for k in delta if delta[k] < -0.01 * big), key=delta.get)[:3]
        costs = sorted((k for k in delta if delta[k] > 0.01 * big), key=lambda k: -delta[k])[:2]
        why = " and ".join(f"{significant(-delta[k])} s less {_part(k, [a, b], scale, unit)}" for k in wins)
        if costs:
            why += (" outweigh " if len(wins) > 1 else " outweighs ") + " and ".join(
                f"{significant(delta[k])} s more {_part(k, [a, b], scale, unit)}" for k in costs)
        by = f"by {100 * gain:.2g}% tokens/s ({significant(b.step_s - a.step_s)} s per step)"
        if abs(more - 1) > 1e-9:  # m = ceil(B / (dp x b)): the seconds per step compare unequal work
            why, by = (f"it trains {more:.3g}x #{ib}'s tokens per step (m rounds the global batch up) in "
                       f"{significant(a.step_s)} vs {significant(b.step_s)} s"), f"by {100 * gain:.2g}% tokens/s"
        lead = f"#{ia} beats #{ib} {by}"  # a lead the first-order model can resolve
        if gain < ACCURACY:  # kept in tok/s order (plan_search.rank); the user may trade it for memory
            less = (b.memory.total - a.memory.total) / scale  # > 0: a needs less
            mem = f", #{ia if less > 0 else ib} needing {abs(less):.2f} {unit} less per GPU" if round(less, 2) else ""
            lead = f"#{ia} is ranked above #{ib} {by}, a tie within the model's accuracy of about 1%{mem}"
            lead += f"; #{ia}" if mem and less < 0 else ""  # the reasons are #ia's, not the smaller row's
        return f"{lead}: {why} ({diff})"
    saved = (b.memory.total - a.memory.total) / scale
    return f"#{ia} ties #{ib} on step time and needs {saved:.2f} {unit} less per GPU ({diff})"


def why_lines(fits: list[Candidate], scale: float, unit: str, groups: int = 3,
              fit_count: int | None = None) -> list[str]:
    """One line for each of the first ``groups`` distinct step times: why its best strategy beats the
    best of the next slower group, and which strategies tie with it (same step time, more memory).

    ``fits``: the rows shown (ranked); a line compares only these, so every ``#N`` it names is
    in the table. ``fit_count``: how many fit in all (default ``len(fits)``).
    """
    firsts = [i for i, c in enumerate(fits) if i == 0 or abs(c.tokens_per_s / fits[i - 1].tokens_per_s - 1) > 1e-9]
    if len(fits) == 1:
        return ["only one strategy fits" if (fit_count or 1) == 1 else "one row shown: nothing to compare (--top)"]
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
            lines.append(f"#{i + 1} is the slowest shown{tie}")
    return lines


#: the table's short names: recompute ("rc") and offload ("off") values, so a row fits 120 columns
RECOMPUTE_SHORT = {"none": "none", "selective": "sel", "full": "full"}
OFFLOAD_SHORT = {"none": "", "optimizer": "opt", "params": "par"}
#: the table's size columns and their widths, each widened by a larger size
SIZE_WIDTHS = {"dp": 4, "ep": 3, "cp": 3, "tp": 2, "pp": 3}


def format_table(cands: list[Candidate], scale: float) -> list[str]:
    """The fixed-width table of ``cands`` (memory columns divided by ``scale``), 120 columns wide where the sizes fit
    (a size wider than its column widens it, as m of 10,000 or more: 131072 ranks took 6 of dp's 4 columns before):
    settings | device memory by category, host, net; step time, tokens/s, MFU (the legend: :func:`header`)."""
    marked = [{"cp": f"{c.strategy.cp}{'u' if c.strategy.cp > 1 and c.strategy.cp_attention == 'ulysses' else ''}",
               "tp": f"{c.strategy.tp}{'s' if c.strategy.sequence_parallel else ''}"} for c in cands]  # 128 before
    need = {k: max([len(k)] + [len(m.get(k, str(getattr(c.strategy, k)))) for c, m in zip(cands, marked)])
            for k in SIZE_WIDTHS}
    w = {k: max(d, need[k]) for k, d in SIZE_WIDTHS.items()}
    wn = max(3, len(str(len(cands))))  # --top 0: row 1000
    w["m"] = max([5] + [len(f"{c.strategy.micro_batches:,}") for c in cands])  # 16384 beside 4,096 before
    nets = [sum(c.comm.get(k, 0) for k in ("dp", "tp", "pp", "cp", "ep")) / scale for c in cands]
    w["net"] = max([7] + [len(f" {n:.0f}") for n in nets])  # tiny's 1434463 KB: 8 columns
    for k in ("dp", "ep", "cp", "pp"):  # a wide m or net takes the room these do not use (tiny: 122)
        w[k] -= min(w[k] - need[k], max(0, len(_head(wn, w)) - 120))
    w["net"] -= min(w["net"] - 7, max(0, len(_head(wn, w)) - 120))  # what still does not fit: _cell's 1.4e6
    tokens = column([c.tokens_per_s for c in cands], 8)  # one form: 3504572 beside 25,642 (another table) before
    head = _head(wn, w)
    lines = [head, "-" * len(head)]
    for i, (c, m) in enumerate(zip(cands, marked), 1):
        st, mem = c.strategy, c.memory
        off = "+".join(o for o in (OFFLOAD_SHORT[st.offload], "act" if st.offload_activations else "") if o)
        bufs = mem.comm_buffers + mem.gathered
        step = (f"{c.step_s:7.3f}" if 1e-3 <= c.step_s < 1e3 else f"{c.step_s:7.1f}" if 1e3 <= c.step_s < 1e5
                else f"{c.step_s:7.1e}")  # a tiny model's read 0.000, 1020.216 s took 8 of 7 columns
        zero = f"{st.zero}{'h' if st.dp_shard else ''}"  # h: hybrid sharding
        lines.append(
            f"{i:>{wn}} {st.dp:>{w['dp']}} {st.ep:>{w['ep']}} {m['cp']:>{w['cp']}} {m['tp']:>{w['tp']}} "
            f"{st.pp:>{w['pp']}} {zero:>2} {RECOMPUTE_SHORT[st.recompute]:>4} {off or 'none':>7} "
            f"{st.micro_batches:>{w['m']},} |"
            + "".join(_cell(x / scale, 6) for x in (mem.parameters, mem.gradients, mem.optimizer_state,
                                                   mem.activations, bufs))
            + f"{_cell(mem.total / scale, 7)}{_cell(c.host / scale, 6, 1)}{_cell(nets[i - 1], w['net'], 1)}"
            f" {step} {tokens[i - 1]} {c.mfu:5.1%}")
    return lines


def _head(wn: int, w: dict) -> str:
    return (f"{'#':>{wn}} {'dp':>{w['dp']}} {'ep':>{w['ep']}} {'cp':>{w['cp']}} {'tp':>{w['tp']}} "
            f"{'pp':>{w['pp']}} {'Z':>2} {'rc':>4} {'off':>7} {'m':>{w['m']}} |"
            f"{'param':>6}{'grad':>6}{'optim':>6}{'acts':>6}{'bufs':>6}{'total':>7}{'host':>6}{'net':>{w['net']}}"
            f"{'step s':>8}{'tok/s':>9}{'MFU':>6}")


def _cell(x: float, width: int, digits: int = 2) -> str:
    """``x`` right-aligned in ``width`` columns, a space before it always: fewer decimals where they do not fit
    (before: 96.36 GB of optimizer state and 1147.87 of activations printed as 96.361147.87)."""
    text = f"{x:.{digits}f}"
    text = text if len(text) < width else f"{x:.0f}"
    for d in range(width, -1, -1):  # 1.1e6 where even that does not fit (--gpu-memory 1000000TB: 123 columns)
        if len(text) < width:
            break
        mantissa, power = f"{x:.{d}e}".split("e")
        text = f"{mantissa}e{int(power)}"
    return " " + text.rjust(width - 1)


def count(n: int) -> str:
    """A parameter count: ``1.23 B``, ``4.56 M`` or ``10,944`` (a tiny model's read 0.00 B before)."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def fp8_note(args, model) -> str:
    """What a preset's fp8 rows need in minizero.train: its default delayed scaling refuses recompute."""
    if args.precision != "fp8" or not train_runs(model):
        return ""
    return " (a row with recompute, rc, runs in minizero.train with --fp8-scaling current: delayed scaling refuses it)"


def header(args, model, hw, seq, gbatch, scale, unit, shown, fits) -> list[str]:
    """The lines above the table: model, GPUs and the assumed hardware, units, the columns' legend."""
    p0, tunit = element_bytes(shown[0].strategy), table_unit(shown, unit)[1]
    if args.schedule == "interleaved":
        piped = sum(c.strategy.pp > 1 for c in fits)
        sched = (f"interleaved pipeline schedule ({args.virtual_stages} virtual stages per GPU; pp = 1 layouts "
                 f"have no pipeline" + ("; no layout with pp > 1 fits" if not piped else "") + ")")
    else:
        sched = f"{args.schedule} pipeline schedule"
    n_psi = model.num_parameters()
    hybrid = (", or groups of shard=N of them (x cp; hybrid sharding, Z 1h-3h: replicated across the groups; the "
              "search tries one node's data ranks)") if any(c.strategy.dp_shard for c in shown) else ""
    binary = args.gpu_memory.strip().lower().endswith("ib")  # the flag's unit family, shown in the table's
    given = f" = {hw.gpu_memory:,} bytes" if binary != (unit == "GiB") else ""
    moe = ""
    if model.experts:
        moe = (f", {count(model.active_parameters())} active; {model.experts} experts top-{model.top_k}"
               + (f" + {model.shared_experts} shared" if model.shared_experts else "")
               + f" of FFN {model.expert_hidden:,} in {len(model.moe_layers())} of {model.n_layer} layers")
    return [f"minizero.plan: {model.name} ({count(n_psi)} parameters{moe}; {model.n_layer} layers, hidden "
            f"{model.hidden:,}, {model.n_head} heads / {model.n_kv_head} KV, FFN {model.ffn_hidden:,}, vocab "
            f"{model.vocab_size:,})",
            f"{args.gpus:,} GPUs x {size(hw.gpu_memory, unit)} (--gpu-memory {args.gpu_memory}{given}; "
            f"{args.gpus_per_node} per node), host "
            f"{size(hw.host_memory, unit)} per GPU; sequence {seq:,}, micro-batch {args.micro_batch:,}, global "
            f"batch {gbatch:,} sequences requested; {args.precision} precision{fp8_note(args, model)}, "
            f"{args.attention} attention, "
            f"{args.optimizer} (K = {p0[3]:g} "
            f"bytes/parameter), {sched}",
            f"every size in the table in {tunit} ({POWERS[tunit]} bytes): memory per GPU; host = offloaded; "
            "net = all bytes each GPU sends per step (dp + tp + pp + cp + ep), overlapped with compute or not, while "
            "step s counts only the exposed traffic (not overlapped with compute), so a row with more net can be "
            "quicker (the why lines name both); net and step s are the slowest pipeline stage's (it sets the step), "
            "memory the fullest stage's; bufs = comm buffers + ZeRO-3 gathered layer",
            assumed(hw, scale, unit),
            "columns: ep = expert parallelism; cp = context parallelism (4u: DeepSpeed-Ulysses, 4: ring attention); "
            "tp = tensor parallelism (2s: with sequence parallelism); "
            f"Z = ZeRO stage, sharding over the dp x cp data ranks{hybrid} (1: optimizer state, 2: + gradients, 3: + "
            "parameters); rc = activation recompute (sel: selective); off = "
            "offloaded to the host (opt: optimizer state and gradients, par: + parameters, as ZeRO-Infinity: not in "
            "minizero.train; act: activations); m = "
            "micro-batches per step per data rank; acts = activations",
            "MFU = model FLOPs / (step time x GPUs x peak) = --efficiency x the share of the step spent computing "
            "(not in bubble, exposed communication or offload) x model FLOPs / FLOPs done (recompute's extra): it "
            "follows from the assumptions above, not a measurement"
            ] + rounded_batch(gbatch, shown, bool(args.global_batch))


def rounded_batch(gbatch, shown, given: bool = True) -> list[str]:
    """The line saying which shown rows train another global batch than asked: m = ceil(B / (dp x b)) rounds up."""
    got = [c.strategy.dp * c.strategy.micro_batch * c.strategy.micro_batches for c in shown]
    off = [f"#{i} {g:,}" for i, g in enumerate(got, 1) if g != gbatch]
    asked = (f"--global-batch {gbatch}" if given else
             f"the default global batch ({gbatch:,}: 2^22 tokens / seq-len, rounded up)")
    return [f"{asked} is not a multiple of dp x micro-batch in every row: m = ceil(B / (dp x b)) "
            f"rounds up, so these rows train more sequences per step: {', '.join(off)}"] if off else []


def left_out_line(left: dict) -> list[str]:
    """The line naming what the search of a minizero preset left out (``left``: strategies by the rule of
    :func:`plan_search.train_refusal` they break) because minizero.train runs none of it; [] when it left out none."""
    if not left:
        return []
    rules = sorted(left.items(), key=lambda r: -r[1])  # one rule: its count is the total, said once
    runs = "; ".join(f"no {what}" + (f" ({counted(n, 'strategy', 'strategies')})" if len(rules) > 1 else "")
                     for what, n in rules)
    total = counted(sum(left.values()), "strategy", "strategies")
    return [f"left out {total} minizero.train does not run: it runs {runs}"]


def assumed(hw: Hardware, scale: float, unit: str) -> str:
    """The GPU, links and efficiency the step times assume, bandwidths in ``unit``/s (the defaults: an A100's)."""
    flags = {"flops": "--gpu-flops", "efficiency": "--efficiency", "intra_node_bw": "--intra-node-bw",
             "inter_node_bw": "--inter-node-bw", "pcie_bw": "--pcie-bw", "gpu_memory": "--gpu-memory",
             "latency": "--latency-us", "inter_node_latency": "--inter-node-latency-us"}
    given = [flag for field, flag in flags.items() if getattr(hw, field) != getattr(Hardware, field)]
    who = "an A100-80GB SXM's, the defaults" + (f", but {', '.join(given)} as given" if given else "")
    return (f"assumed ({who}; --gpu-flops, --efficiency, --intra-node-bw, --inter-node-bw, --pcie-bw, --latency-us, "
            f"--inter-node-latency-us): {hw.flops / 1e12:g} TFLOP/s peak dense 16-bit per GPU, matmuls at "
            f"{hw.efficiency:.0%} of it; NVLink {hw.intra_node_bw / scale:.2f} {unit}/s per direction, network "
            f"{hw.inter_node_bw / scale:.2f} {unit}/s and PCIe {hw.pcie_bw / scale:.2f} {unit}/s per GPU; "
            f"{hw.latency * 1e6:g} us per message step within a node, {hw.inter_node_latency * 1e6:g} across nodes")


def _short(st: Strategy) -> str:
    """A compact multi-line label: ``dp4 tp2 pp1 / Z3 sp / sel rc / off:params``."""
    lines = [f"dp{st.dp}" + (f" ep{st.ep}" if st.ep > 1 else "") + (f" cp{st.cp}" if st.cp > 1 else "")
             + (" ulys" if st.cp > 1 and st.cp_attention == "ulysses" else "") + f" tp{st.tp} pp{st.pp}",
             f"Z{st.zero}" + (" sp" if st.sequence_parallel else ""),
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
    ax.set_ylabel(f"memory per GPU ({unit}, {POWERS[unit]} bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, metadata=MARK))
    finally:
        plt.close(fig)


def candidate_json(c: Candidate, rank: int) -> dict:
    """One candidate as JSON-ready data (every size in bytes), with its rank."""
    return {"rank": rank, "strategy": dataclasses.asdict(c.strategy), "memory_bytes": c.memory.as_dict(),
            "device_total_bytes": c.memory.total, "stage": c.memory.stage, "host_bytes_max": c.host,
            "comm_bytes_per_step": c.comm, "slowest_stage": c.stage,
            "step_time_s": c.time, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu}


def plot_path(path: str) -> str:
    """The PNG path ``--plot PATH`` writes: PATH, with ``.png`` added when it has no extension; a device (/dev/null) is
    written into. Raises ValueError: another extension, a directory, a folder that does not exist or takes no file."""
    if not path.strip() or path == "-":  # '-' is no standard output: it wrote ./-.png
        raise ValueError(f"--plot {path!r}: give a file name for the PNG" + (
            " (it is not written to standard output; ./- writes ./-.png)" if path == "-" else ""))
    if os.path.isdir(path):  # '.', '..' and 'pl/' too: a directory says so first
        raise ValueError(f"--plot {path!r}: cannot write the PNG: {path!r} is a directory; give a file name")
    refuse_slash_or_dangling(path, "--plot")  # 'pl/' was refused naming 'pl/.png', 'pl/.' wrote 'pl/..png'
    ext = os.path.splitext(path)[1].lower()
    if ext not in ("", ".png"):
        raise ValueError(f"--plot {path!r}: cannot write the PNG there: the name must end in .png (or have no "
                         f"extension, and .png is added)")
    into = os.path.exists(path) and not os.path.isfile(path) and stream_fd(path) is None  # as --json /dev/null
    real = path if ext or into else path + ".png"
    if not ext and not into and os.path.exists(path):  # notes -> notes.png: not asked for
        raise ValueError(f"--plot {path!r} names an existing file, and the PNG would go to {real!r} beside it; give "
                         "a name ending in .png")
    try:  # an earlier plot (minizero's mark) is replaced, never another file the user named .png (refuse_foreign)
        check_output(real, "--plot")
    except ValueError as e:
        raise ValueError(f"cannot write the PNG: {e}") from None
    return real

