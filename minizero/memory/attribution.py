"""Which layers hold the bytes: per-module attribution of the ledger, and the check against the formula.

Forward pre- and post-hooks push and pop each module's name on the ledger's scope stack; arguments and outputs
are untouched. Mirrors: PyTorch's memory snapshot (``torch.cuda.memory._snapshot``), by module.
"""
from __future__ import annotations

import re
import textwrap

from minizero.ledger import OUTSIDE, SCORES, format_bytes, get_ledger, rank_runs
from minizero.memory.estimator import PRECISIONS, saved_per_layer

#: the module (relative to a block ``transformer.h.i``) whose forward saves each row of
#: ``saved_per_layer(..., accounting="minizero")``; ``""`` is the block itself
ROW_MODULE = {
    "ln_1 input (the layer input)": "ln_1",
    "ln_1 mean and rstd": "ln_1",
    "QKV matmul input (ln_1 output)": "attn.c_attn",
    "Q, K, V": "attn",
    "softmax output": "attn" + SCORES,
    "attention dropout mask": "attn.attn_dropout" + SCORES,
    "attention dropout output": "attn" + SCORES,
    "attention projection input": "attn.c_proj",
    "attention output dropout mask": "attn.resid_dropout",
    "ln_2 input": "ln_2",
    "ln_2 mean and rstd": "ln_2",
    "MLP input (ln_2 output)": "mlp.c_fc",
    "GeLU input": "mlp",
    "GeLU output (second linear input)": "mlp.c_proj",
    "MLP dropout mask": "mlp.dropout",
}


def _base_row(name: str) -> str:
    """The fp32 row a bf16/fp8 Linear's row stands for: "X (bf16)", "X: its weight (fp8)", "X: scales" -> "X"."""
    for tail in (" (bf16)", " (fp8)"):
        name = name.removesuffix(tail)
    return name.removesuffix(": its weight").removesuffix(": scales")


def attach(model) -> callable:
    """Charge every array tracked during ``model``'s forward to the innermost module running (this rank's ledger).

    Returns a function that removes every hook it installed.
    """
    removers = []
    for name, module in model.named_modules():
        if name.endswith(".core"):  # an attention core's arrays are its attention's (the ``:scores`` split)
            name = name[: -len(".core")]

        def push(_m, _args, _name=name):
            get_ledger().push_scope(_name)

        def pop(_m, _args, _out):
            get_ledger().pop_scope()

        removers.append(module.register_forward_pre_hook(push))
        removers.append(module.register_forward_hook(pop))

    def detach():
        for r in removers:
            r()
    return detach


def after_forward_hook(store: dict, category: str = "activations"):
    """A root forward hook copying the per-module current bytes into ``store`` (``{"self", "inclusive"}``)."""
    def hook(_m, _args, _out):
        led = get_ledger()
        store["self"] = {n: c for n, (c, _p) in led.modules(category).items()}
        store["inclusive"] = {n: c for n, (c, _p) in led.modules(category, inclusive=True).items()}
    return hook


def attention_split(by_module: dict, attn: str) -> tuple[int, int]:
    """(score/probability bytes, the rest) of attention module ``attn`` from a ``{name: bytes}`` dict."""
    scores = rest = 0
    for name, nbytes in by_module.items():
        if name == attn or name.startswith(attn + ".") or name.startswith(attn + ":"):
            if name.endswith(SCORES):
                scores += nbytes
            else:
                rest += nbytes
    return scores, rest


def layer_terms(cfg, seq_len: int, micro_batch: int, recompute: str = "none", tp: int = 1,
                precision: str | None = None) -> dict[str, list[tuple[str, int]]]:
    """The formula for one block by module: ``{module suffix: [(term, bytes on one rank)]}``, per recompute mode.

    ``precision``: the estimator's name (:data:`PRECISIONS`); None: from ``cfg.dtype`` (float64, float32, else
    mixed), so bf16 and fp8, whose models hold float32, must be named. Raises ValueError: unknown recompute mode
    or precision, or a row the mapping does not know.
    """
    if recompute not in ("none", "full", "selective"):
        raise ValueError(f"recompute {recompute!r} is not one of none, full, selective")
    precision = precision or {"float64": "fp64", "float32": "fp32"}.get(cfg.dtype, "mixed")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    rows = saved_per_layer(cfg, seq_len, micro_batch, "minizero", precision)
    out: dict[str, list[tuple[str, int]]] = {}
    for r in rows:
        base = _base_row(r.name)
        if base not in ROW_MODULE:
            raise ValueError(f"no module known for the formula's row {r.name!r}")
        if recompute == "full" and r is not rows[0]:
            continue
        if recompute == "selective" and r.part == "core":
            continue
        module = "" if recompute == "full" else ROW_MODULE[base]
        out.setdefault(module, []).append((r.name, round(r.per_rank(tp, False))))
    return out


def compare_layer(measured: dict, layer: str, terms: dict) -> list[tuple[str, str, int, int]]:
    """Rows (module, formula terms, formula bytes, ledger bytes) for block ``layer``; unknown modules at formula 0."""
    rows = []
    for suffix, ts in terms.items():
        name = f"{layer}.{suffix}" if suffix and not suffix.startswith(":") else layer + suffix
        rows.append((name, " + ".join(t for t, _ in ts), sum(b for _, b in ts), measured.get(name, 0)))
    named = {r[0] for r in rows}
    for name, nbytes in sorted(measured.items()):
        inside = name == layer or name.startswith(layer + ".") or name.startswith(layer + ":")
        if inside and name not in named and nbytes:
            rows.append((name, "(no formula row)", 0, nbytes))
    return rows


def format_compare(rows) -> str:
    """A Markdown table of :func:`compare_layer` rows, with the total (bytes)."""
    lines = ["| module | formula terms (Korthikanti et al. 2022, minizero accounting) | formula | ledger |",
             "|---|---|---:|---:|"]
    for name, terms, f, m in rows:
        lines.append(f"| {name} | {terms} | {f:,} | {m:,} |")
    lines.append(f"| **layer total** | | **{sum(r[2] for r in rows):,}** | **{sum(r[3] for r in rows):,}** |")
    return "\n".join(lines)


def top_modules(peaks: dict) -> list[tuple[str, int]]:
    """The modules (not ``OUTSIDE``) with peak bytes, largest first, from ``{name: peak bytes}``."""
    items = [(k, v) for k, v in peaks.items() if k != OUTSIDE and v > 0]
    return sorted(items, key=lambda kv: (-kv[1], kv[0]))


def _compact(names: list[str]) -> str:
    """Module names with their first block index folded: ``h.0.mlp, h.1.mlp, h.0.attn`` -> ``h.{0-1}.mlp, h.0.attn``."""
    folded: dict[str, list[int]] = {}
    for name in names:
        m = re.search(r"\.(\d+)(?=[.:]|$)", name)
        key = name if m is None else name[:m.start(1)] + "{}" + name[m.end(1):]
        folded.setdefault(key, []).append(-1 if m is None else int(m.group(1)))
    out = []
    for key, idx in folded.items():
        if idx == [-1]:
            out.append(key)
            continue
        runs: list[list[int]] = []
        for i in sorted(idx):
            runs.append([i]) if not runs or i != runs[-1][-1] + 1 else runs[-1].append(i)
        text = ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
        out.append(key.replace("{}", f"{{{text}}}" if len(idx) > 1 else text))
    return ", ".join(out)


def format_top_modules(per_rank: list[dict], n: int = 8) -> str:
    """Text: per rank, the top ``n`` modules by peak activation bytes (self), attention scores as their own entries;
    modules that tie are said once ("12 modules at 512.00 KiB each: h.{0-3}.mlp, ..."), those that tie with the
    last one shown included."""
    lines = ["activation hotspots (ledger: peak bytes each module saved for backward itself; ':scores': (b,a,s,s))"]

    def line_of(peaks):
        everything = top_modules(peaks)
        shown = everything[:n]
        shown += [(name, b) for name, b in everything[n:] if shown and b == shown[-1][1]]
        groups: dict[int, list[str]] = {}
        for name, b in shown:  # largest first: equal bytes are neighbours
            groups.setdefault(b, []).append(name or "(top level: the root module's own forward)")
        parts = [f"{names[0]} {format_bytes(b)}" if len(names) == 1 else
                 f"{len(names)} modules at {format_bytes(b)} each: {_compact(names)}" for b, names in groups.items()]
        if not parts:  # e.g. --offload-activations: what forward saved is counted as offloaded
            return "none (no saved array stayed in the activations category)"
        return ("; " if len(groups) < len(shown) else ", ").join(parts)  # "; ": a part holds commas itself
    rows = [line_of(peaks) for peaks in per_rank]
    kinds = list(dict.fromkeys(rows))
    if len(kinds) > 4:  # e.g. MoE, whose routing differs on every rank: the ranks saving the most and the least
        saved = [sum(peaks.values()) for peaks in per_rank]
        ends = [saved.index(max(saved)), saved.index(min(saved))]
        shown = (f"r{ends[0]}, which saved the most bytes, and r{ends[1]}, the least" if ends[0] != ends[1] else
                 f"r{ends[0]}: every rank saved as many bytes")
        lines += textwrap.wrap(f"({len(rows)} ranks, {len(kinds)} kinds: shown {shown}; summary.json has every "
                               "rank's)", 100, initial_indent="  ", subsequent_indent="    ")
        kinds = list(dict.fromkeys(rows[r] for r in ends))
    for row in kinds:  # ranks with the same hotspots share one line (data parallelism: all of them)
        ranks = [r for r, other in enumerate(rows) if other == row]
        who = "every rank" if len(ranks) == len(rows) > 1 else "r" + rank_runs(ranks)  # r4-7, as the memory table
        lines += textwrap.wrap(f"{who}: {row}", 100, initial_indent="  ", subsequent_indent="    ",
                               break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)


def saved_by_module(model, *inputs) -> dict[str, int]:
    """Run ``model(*inputs)`` once with attribution on; ``{module: bytes it saved for backward}`` (self),
    hooks removed."""
    store: dict = {}
    detach = attach(model)
    remove = model.register_forward_hook(after_forward_hook(store))
    try:
        model(*inputs)
    finally:
        detach()
        remove()
    return store["self"]


def layer_bytes(by_module: dict, layer: str) -> int:
    """Bytes charged to block ``layer`` and everything under it, from a ``{module: bytes}`` dict."""
    return sum(b for n, b in by_module.items() if n == layer or n.startswith(layer + ".") or n.startswith(layer + ":"))
