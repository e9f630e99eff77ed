"""``python -m minizero.plan``: will this model fit on these GPUs, with which settings, and how fast?
Enumerates every layout dp x cp x tp x pp = GPUs with ZeRO 0-3 (2-3 without pipelining; for minizero's presets only what
minizero.train runs: plan_search.train_refusal), recompute, sequence and context parallelism (ring attention or
DeepSpeed-Ulysses), expert parallelism (ep dividing dp and the experts, for a mixture of experts; its all-to-alls
charged in full, on NVLink while tp x cp x ep GPUs fit a node) and offload; estimates each one's per-GPU bytes by
category (:mod:`minizero.memory.estimator`), bytes sent per step and step time (:func:`minizero.plan_search.step_time`);
prints those that fit, fastest first (equal step times: less memory, then fewer techniques: ``plan_search.rank``).
``--strategy`` evaluates one. Sizes need a unit (``80GB``, ``80GiB``, ``8e10B``); bad input: exit 2, a line saying why.
Search: :mod:`minizero.plan_search`; --strategy: :mod:`minizero.plan_strategy`; table: :mod:`minizero.plan_report`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import sys

from minizero.memory.estimator import (PRECISIONS, Strategy, adapted_splits, element_bytes, lora_activation_bytes,
                                       lora_state_bytes)
from minizero.models import MODELS, get_model
from minizero.nf4 import tensor_parallel_sizes
from minizero.nn import PRESETS
from minizero.numerals import (DefaultsOnce, OneLineParser, description, did_you_mean, integer,
                               negative_values_reach_checks, real)
from minizero.plan_report import (  # noqa: F401 (the public API: tests and notebooks import these from here)
    POWERS, candidate_json, count, describe, format_table, header, left_out_line, plot, plot_path, size, table_unit,
    unit_for, step_line, why_lines)
from minizero.plan_search import (  # noqa: F401 (likewise)
    LATENCY_DESTS, RANKING_RULE, Hardware, _divisors, add_latency_flags, enumerate_strategies, evaluate, plan,
    step_time)
from minizero.plan_strategy import STRATEGY_FORMS, parse_strategy, search_refusal
from minizero.interrupts import WHOLE, interruptible, refuse_several_ranks
from minizero.ledger import wrap

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_FORMS = ("a number with a unit, e.g. 80GB (80 x 10^9 bytes), 80GiB (80 x 2^30 bytes), 8e10B (bytes); units B, KB, "
          "MB, GB, TB (powers of 10), KiB, MiB, GiB, TiB (powers of 2)")
#: the most GPUs ``--gpus`` accepts (2**20 = 1,048,576), so enumeration stays interactive
MAX_GPUS = 2 ** 20
#: the largest --seq-len (2**24 tokens, past every published context), --micro-batch, --global-batch (2**24
#: sequences, thousands of times any published batch) and --gpus-per-node: larger is a typo, not a plan
MAX_SIZES = {"seq_len": 2 ** 24, "micro_batch": 2 ** 24, "global_batch": 2 ** 24, "gpus_per_node": 2 ** 24}
FINETUNE_UNREAD = ("top", "cp_attention", "schedule", "global_batch", "gpus_per_node", "gpu_flops", "efficiency",
                   "intra_node_bw", "inter_node_bw", "pcie_bw", "bucket", "host_memory", *LATENCY_DESTS)  #: unread
MIN_GPU_FLOPS, MAX_GPU_FLOPS, MIN_EFFICIENCY = 1e9, 1e18, 1e-3  #: beyond them a step took 1e300 s or nan
#: minizero's presets by the trainer's names (``--model gpt2`` there) -> the planner's ``minizero-gpt2``
ALIASES = {name: f"minizero-{name}" for name in PRESETS if name not in MODELS}


def parse_bytes(text: str, what: str = "value", unit_required: bool = False) -> int:
    """``"80GB"`` -> 80 * 10**9, ``"80GiB"`` -> 80 * 2**30, ``"8e10"`` -> 8 * 10**10 bytes (``/s`` allowed).

    Decimal units KB, MB, GB, TB are powers of 10; binary KiB, MiB, GiB, TiB powers of 2;
    B is bytes. ``unit_required``: a bare number is refused (the command line's rule).
    Raises:
        ValueError: not a positive finite number with one of those units, or no unit when one is
            required (the text is quoted and the accepted forms named).
    """
    s = str(text).strip()
    mt = re.fullmatch(r"([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)(?:/s)?", s)
    unit = mt.group(2).lower() if mt else None
    if mt is None or unit not in _UNITS:
        hint = " (ambiguous: write GB for 10^9 bytes or GiB for 2^30)" if unit in ("g", "m", "k", "t") else ""
        raise ValueError(f"{what} {text!r} is not a byte size{hint}; allowed: " + (_FORMS if unit_required else
                         "a number with an optional unit B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB "
                         "(powers of 2), e.g. 80GB, 80GiB, 8e10"))
    value = float(mt.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is infinite (too large for a float); allowed: a finite byte size, "
                         f"e.g. 80GB")
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive; allowed: a byte size of at least 1 byte, e.g. 80GB")
    if not value >= 1:
        raise ValueError(f"{what} {text!r} must be at least 1 byte")
    if unit_required and unit == "":
        raise ValueError(f"{what} {text!r} has no unit; allowed: {_FORMS}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.plan`` (every option has help; defaults shown once)."""
    p = negative_values_reach_checks(OneLineParser(prog="python -m minizero.plan", description=description(__doc__),
                                                   formatter_class=DefaultsOnce))
    p.add_argument("--model", required=True, metavar="NAME",
                   help=f"one of: {', '.join(sorted(MODELS))}; minizero's presets also by the trainer's names "
                        f"({', '.join(sorted(ALIASES))})")
    p.add_argument("--gpus", type=integer, required=True, help="number of GPUs (= dp x cp x tp x pp)")
    hw = p.add_argument_group("hardware", "the defaults are an A100-80GB SXM node's, as the plan's output says")
    hw.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, with a unit: 80GB = 80 x 10^9 bytes, "
                                                          "80GiB = 80 x 2^30 bytes")
    p.add_argument("--host-memory", default="128GB", help="host memory available to each GPU for offload")
    p.add_argument("--seq-len", type=integer, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--micro-batch", type=integer, default=1, help="sequences per micro-batch per GPU (b)")
    p.add_argument("--global-batch", type=integer, default=None,
                   help="sequences per optimizer step (default: about 4M tokens, 2^22 / seq-len)")
    p.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS),
                   help="mixed: 16-bit weights, gradients and activations + fp32 master weights and Adam")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adam8bit"],
                   help="Adam's state: 8 bytes per parameter (adam) or 2 (adam8bit)")
    p.add_argument("--attention", default="dense", choices=["dense", "flash"],
                   help="attention core of every strategy: dense keeps the (s, s) probabilities, flash "
                        "(FlashAttention) the output and row log-sum-exp instead")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"], help="pipeline schedule")
    p.add_argument("--virtual-stages", type=integer, default=None,
                   help="model chunks per GPU with --schedule interleaved (default: 2)")
    hw.add_argument("--gpus-per-node", type=integer, default=8, help="GPUs per node (tensor parallelism stays in one)")
    hw.add_argument("--gpu-flops", type=real, default=312e12,
                    help="peak dense 16-bit FLOP/s per GPU (H100: 989e12) (default: 312e12)")
    p.add_argument("--efficiency", type=real, default=0.6, help="fraction of peak the matmuls reach")
    hw.add_argument("--intra-node-bw", default="300GB", help="NVLink bytes/s per GPU per direction")
    hw.add_argument("--inter-node-bw", default="25GB", help="network bytes/s per GPU (200 Gb/s = 25GB)")
    hw.add_argument("--pcie-bw", default="25GB", help="host <-> device bytes/s per GPU")
    add_latency_flags(hw)
    p.add_argument("--bucket", default="25MiB", help="gradient reduce bucket, as PyTorch DDP's (default: 25MiB)")
    p.add_argument("--strategy", default=None, metavar="TEXT",
                   help=f"evaluate this one strategy instead of searching, e.g. \"dp2 tp4 pp1 zero3 "
                        f"recompute=selective\"; words: {STRATEGY_FORMS}")
    p.add_argument("--finetune", default="none", choices=["none", "lora", "qlora"],
                   help="plan fine-tuning instead: adapters of --lora-rank on every projection over a frozen base "
                        "(qlora: NF4), data parallel over --gpus with ZeRO 0-3 over the adapters")
    p.add_argument("--lora-rank", type=integer, default=None,
                   help="adapter rank r with --finetune (default 64, QLoRA's paper's, or the model's width if less)")
    p.add_argument("--tp", type=integer, default=1, help="with --finetune: tensor-parallel GPUs that split each "
                   "block and its adapters (minizero.finetune --tp); --gpus / tp of them data parallel")
    p.add_argument("--cp-attention", default="both", choices=["both", "ring", "ulysses"],
                   help="how layouts with cp > 1 attend: ring attention, DeepSpeed-Ulysses (where cp divides the "
                        "heads and KV heads of a tensor rank), or both kinds searched")
    p.add_argument("--ep", type=integer, default=None, metavar="N",
                   help="expert parallelism: only layouts with this ep (default: every ep that divides dp and the "
                        "model's experts); with --strategy, the ep when its text names none")
    p.add_argument("--top", type=integer, default=10, help="how many strategies to show (0: all that fit)")
    p.add_argument("--units", default="GB", choices=["GB", "GiB"],
                   help="unit of every size printed: GB = 10^9 bytes, GiB = 2^30 bytes")
    p.add_argument("--json", action="store_true", help="print JSON (all sizes in bytes) instead of the table")
    p.add_argument("--plot", metavar="PATH", default=None, help="also write a stacked-bar PNG of the shown strategies")
    return p


def _fine_tune_tps(model, args) -> list[int]:
    """The --tp a fine-tune of ``model`` takes on --gpus (:func:`minizero.nf4.tensor_parallel_sizes`): dividing the
    GPUs, heads and widths (qlora: whole NF4 blocks per shard, as finetune's refusal lists them)."""
    nf4 = adapted_splits(model) if args.finetune == "qlora" else ()
    return tensor_parallel_sizes(args.gpus, (model.n_head, model.hidden, model.ffn_hidden), nf4)


def _check(parser, args):
    """Every value, before any planning; returns (model, sizes in bytes). Bad values end in ``parser.error``."""
    try:
        model = get_model(ALIASES.get(args.model, args.model))
    except ValueError as e:  # and the closest of both lists' names
        parser.error(f"--model: {e} (or minizero's presets by the trainer's names: {', '.join(sorted(ALIASES))})"
                     + did_you_mean(args.model, [*MODELS, *ALIASES]))
    for name in ("gpus", "seq_len", "micro_batch", "global_batch", "virtual_stages", "gpus_per_node", "ep"):
        value = vars(args)[name]
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.ep is not None:
        if args.ep > 1 and not model.experts:
            parser.error(f"--ep {args.ep}: {model.name} is a dense model (no experts to split); allowed: 1, or a "
                         f"mixture of experts (mixtral-8x7b, deepseek-v3)")
        if model.experts and model.experts % args.ep:
            parser.error(f"--ep {args.ep} must divide {model.name}'s {model.experts} experts per MoE block; allowed: "
                         f"{', '.join(str(e) for e in _divisors(model.experts))}")
        if args.gpus % args.ep:
            parser.error(f"--ep {args.ep} must divide --gpus {args.gpus} (an expert group is ep data-parallel GPUs)")
        if args.finetune != "none" and args.ep > 1:
            parser.error(f"--ep {args.ep} does not apply to --finetune (leave it out)")
    for name, cap in MAX_SIZES.items():
        if vars(args)[name] is not None and vars(args)[name] > cap:
            parser.error(f"--{name.replace('_', '-')} {vars(args)[name]:,} is too large; allowed: 1..{cap:,} (2^24)")
    if args.gpus > MAX_GPUS:
        parser.error(f"--gpus {args.gpus} is too many; allowed: 1..{MAX_GPUS:,} (2^20)")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:  # the network model: whole nodes
        parser.error(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}; "
                     f"allowed: --gpus up to {args.gpus_per_node}, or a multiple of it")
    if args.virtual_stages is not None and args.schedule != "interleaved":
        parser.error(f"--virtual-stages {args.virtual_stages} only applies with --schedule interleaved; got "
                     f"--schedule {args.schedule} (leave it out, or add --schedule interleaved)")
    args.virtual_stages = args.virtual_stages or 2  # None: the default (0 was refused above)
    if args.finetune == "none" and (why := search_refusal(model, args.precision, args.schedule)):  # the trainer's
        parser.error(why)
    ok_v = [d for d in _divisors(model.n_layer) if d >= 2 and model.n_layer // d >= 2]  # train's rule: v >= 2
    if args.schedule == "interleaved" and args.virtual_stages not in ok_v:
        parser.error(f"--virtual-stages {args.virtual_stages}: with --schedule interleaved, pp x virtual stages (2 or "
                     f"more) must divide {model.name}'s {model.n_layer} layers with pp >= 2; allowed: "
                     f"{', '.join(map(str, ok_v)) or 'none (use --schedule 1f1b)'}")
    if args.strategy is not None and not args.strategy.replace(",", " ").strip():  # no words: "" or ",,,"
        parser.error(f"--strategy {args.strategy!r}: give the strategy's words, e.g. \"dp2 tp4 pp1 zero3\"")
    if args.plot is not None:
        try:
            args.plot = plot_path(args.plot)
        except ValueError as e:
            parser.error(str(e))
        if importlib.util.find_spec("matplotlib") is None:  # optional: checked before any work
            parser.error("--plot needs matplotlib (pip install matplotlib, or pip install -e '.[test]')")
    if args.top < 0 or (args.strategy is not None and args.top != parser.get_default("top")):  # was ignored
        parser.error(f"--top must be >= 0, got {args.top}" if args.top < 0 else f"--top {args.top} chooses how many "
                     "searched strategies to show; --strategy plans one (leave it out)")
    if args.lora_rank is not None and args.finetune == "none":
        parser.error(f"--lora-rank {args.lora_rank} sizes fine-tuning adapters: give --finetune lora or qlora too")
    args.lora_rank = min(64, model.hidden) if args.lora_rank is None else args.lora_rank  # tiny: 16, not refused
    if args.finetune != "none" and not 1 <= args.lora_rank <= model.hidden:
        parser.error(f"--lora-rank must be in 1..{model.hidden} ({model.name}'s width: an adapter of higher rank "
                     f"than its matrix adds nothing), got {args.lora_rank}")
    if args.tp != 1 and args.finetune == "none":
        parser.error(f"--tp {args.tp} splits a fine-tune's blocks: give --finetune lora or qlora too (training "
                     "layouts: --strategy, e.g. \"dp2 tp4 pp1 zero3\")")
    ok_tp = ", ".join(map(str, _fine_tune_tps(model, args))) if args.finetune != "none" else ""
    if args.finetune != "none" and (args.tp < 1 or args.gpus % args.tp or model.n_head % args.tp
                                    or model.hidden % args.tp or model.ffn_hidden % args.tp):
        parser.error(f"--tp {args.tp} must divide --gpus {args.gpus} and {model.name}'s {model.n_head} heads, "
                     f"width {model.hidden} and MLP width {model.ffn_hidden}; allowed: --tp {ok_tp}")
    if args.finetune == "qlora" and args.tp > 1:
        try:
            lora_state_bytes(model, args.lora_rank, base="nf4", tp=args.tp)
        except ValueError as e:
            parser.error(f"--tp {args.tp}: {model.name}: {e}; allowed on {args.gpus} GPUs: --tp {ok_tp} "
                         "(or --finetune lora)")
    if args.finetune != "none" and args.strategy is not None:
        parser.error(f"--finetune {args.finetune} plans data parallelism with ZeRO 0-3 over the adapters; "
                     "--strategy does not apply to it (leave it out)")
    if args.strategy is not None and args.cp_attention != "both":  # parse_strategy never read it: ring, unsaid
        parser.error(f"--cp-attention {args.cp_attention} chooses among the searched strategies; with --strategy "
                     f"name it in its words: cp_attention={args.cp_attention}")
    unread = [f"--{k.replace('_', '-')}" for k in FINETUNE_UNREAD if vars(args)[k] != parser.get_default(k)]
    if args.finetune != "none" and unread:  # its table (memory per ZeRO stage): said, not ignored
        parser.error(f"{', '.join(unread)} do(es) not apply to --finetune {args.finetune} (it tabulates memory per "
                     "ZeRO stage: no search, no step time); leave it out")
    if args.plot is not None and (args.finetune != "none" or args.strategy is not None):  # drew nothing, said nothing
        parser.error(f"--plot draws the searched strategies' memory; it does not apply to "
                     f"{'--strategy' if args.strategy else '--finetune ' + args.finetune} (leave it out)")
    if not MIN_GPU_FLOPS <= args.gpu_flops <= MAX_GPU_FLOPS:
        parser.error(f"--gpu-flops must be in [{MIN_GPU_FLOPS:g}, {MAX_GPU_FLOPS:g}] FLOP/s per GPU, got "
                     f"{args.gpu_flops}")
    if not MIN_EFFICIENCY <= args.efficiency <= 1:
        parser.error(f"--efficiency must be in [{MIN_EFFICIENCY:g}, 1] (a fraction of peak), got {args.efficiency}")
    try:
        sizes = {k: parse_bytes(vars(args)[k], "--" + k.replace("_", "-"), unit_required=True)
                 for k in ("gpu_memory", "host_memory", "intra_node_bw", "inter_node_bw", "pcie_bw", "bucket")}
    except ValueError as e:
        parser.error(str(e))
    seq = args.seq_len or model.seq_len
    if model.learned_pos and seq > model.seq_len:
        parser.error(f"--seq-len {seq} exceeds {model.name}'s learned position table of {model.seq_len}; "
                     f"allowed: 1..{model.seq_len}")
    return model, sizes


def _one_strategy(args, parser, model, hw, seq, gbatch, sizes, scale, unit) -> list[str]:
    """The text for ``--strategy``: header, its row, whether it fits, its step time by component."""
    kw = dict(micro_batch=args.micro_batch, global_batch=gbatch, precision=args.precision, optimizer=args.optimizer,
              schedule=args.schedule, virtual_stages=args.virtual_stages, gpus_per_node=args.gpus_per_node,
              bucket_bytes=sizes["bucket"], seq_len=seq, attention=args.attention, ep=args.ep)
    try:
        st = parse_strategy(args.strategy, model, args.gpus, **kw)
    except ValueError as e:
        parser.error(str(e))
    c, args.attention = evaluate(model, st, hw, seq), st.attention  # the header names the attention evaluated
    if args.json:
        return [json.dumps({"model": dataclasses.asdict(model), "gpus": args.gpus, "seq_len": seq, "units": "bytes",
                            "hardware": dataclasses.asdict(hw), "fits": c.memory.total <= hw.gpu_memory
                            and c.host <= hw.host_memory, "candidates": [candidate_json(c, 1)]}, indent=1)]
    fit_dev, fit_host = c.memory.total <= hw.gpu_memory, c.host <= hw.host_memory
    ts, tu = table_unit([c], unit)  # the table's unit: MB or KB for a tiny model (0.00 GB before)
    fullest = f" (pipeline stage {c.memory.stage}, the fullest)" if st.pp > 1 else ""  # "stage 0" read as ZeRO's
    verdict = ("fits" if fit_dev and fit_host else "does NOT fit") + (
        f": device {c.memory.total / ts:.2f} {tu} of {size(hw.gpu_memory, unit)} per GPU{fullest}, "
        f"host {c.host / ts:.2f} {tu} of {size(hw.host_memory, unit)}")
    return (_prose(header(args, model, hw, seq, gbatch, scale, unit, [c], [c])
                   + [f"strategy: {describe(st)} (m = {st.micro_batches:,} micro-batches per step)"]) + [""]
            + format_table([c], ts) + ["", verdict] + wrap(step_line(c, ts, tu)))


def _search(args, parser, model, hw, seq, gbatch, sizes, scale, unit) -> list[str]:
    """The text (or JSON) of the search: the strategies that fit, best first, and why."""
    fits, count, smallest = plan(model, args.gpus, hw, seq, micro_batch=args.micro_batch, global_batch=gbatch,
                                 precision=args.precision, optimizer=args.optimizer, schedule=args.schedule,
                                 virtual_stages=args.virtual_stages, bucket_bytes=sizes["bucket"],
                                 attention=args.attention, ep=args.ep, left_out=(left := {}),
                                 cp_attention=None if args.cp_attention == "both" else args.cp_attention)
    if count == 0:
        with_ep = f" and ep {args.ep} dividing dp" if args.ep else ""
        parser.error(f"--gpus {args.gpus}: no layout dp x tp x pp splits {model.name} ({model.n_layer} layers, "
                     f"{model.n_head} heads) over {args.gpus} GPUs with tp <= {args.gpus_per_node}{with_ep}")
    if not fits:
        st, device, host = smallest
        if device > hw.gpu_memory:
            parser.error(f"--gpu-memory {args.gpu_memory} ({size(hw.gpu_memory, unit)}) is below the smallest "
                         f"per-GPU footprint of any of the {count:,} strategies for {model.name} on {args.gpus} GPUs: "
                         f"{size(device, unit)} ({describe(st)}). Allowed: --gpu-memory of at least "
                         f"{size(device, unit)}, or more GPUs, or a shorter --seq-len"
                         + (f", or a smaller --micro-batch than {args.micro_batch}" if args.micro_batch > 1 else ""))
        parser.error(f"--host-memory {args.host_memory} ({size(hw.host_memory, unit)}) is too small: every "
                     f"strategy that fits {size(hw.gpu_memory, unit)} per GPU offloads more than that; the "
                     f"smallest device footprint, {size(device, unit)} ({describe(st)}), offloads "
                     f"{size(host, unit)}. Allowed: more --host-memory or --gpu-memory, or more GPUs")
    shown = fits if args.top == 0 else fits[:args.top]
    args.shown = shown
    if args.json:
        return [json.dumps({"model": dataclasses.asdict(model), "parameters": model.num_parameters(),
                            "active_parameters": model.active_parameters(),
                            "gpus": args.gpus, "seq_len": seq, "global_batch_requested": gbatch,
                            "hardware": dataclasses.asdict(hw), "units": "bytes", "ranking_rule": RANKING_RULE,
                            "enumerated": count, "fit": len(fits),
                            "candidates": [candidate_json(c, i) for i, c in enumerate(shown, 1)]}, indent=1)]
    more = f"; the best {len(shown)} shown (--top 0: all)" if len(shown) < len(fits) else ""
    return (_prose(header(args, model, hw, seq, gbatch, scale, unit, shown, fits)
                   + [f"{count:,} strategies enumerated, {len(fits):,} fit{more}; ranking: {RANKING_RULE}",
                      "(a first-order model: step times within about 1% of each other are within its accuracy; such "
                      "rows stay in tok/s order; the why lines below compare the first few and say when one needs "
                      "less memory)"] + left_out_line(left)) + [""]
            + format_table(shown, table_unit(shown, unit)[0]) + ["", "why: (each line compares rows shown above)"]
            + [w for line in why_lines(shown, *table_unit(shown, unit), fit_count=len(fits))
               for w in wrap("  " + line, hang=4)])


def _finetune(args, model, hw, seq, unit) -> list[str]:
    """``--finetune lora|qlora``: per-GPU bytes of a fine-tune (:func:`lora_state_bytes`, the activations of
    :func:`lora_activation_bytes`) at ZeRO 0-3 over the adapters, data parallel over --gpus / --tp; no offload.
    Under --tp: the tensor rank with the most bytes (the NF4 shards' constants differ by a few bytes)."""
    element = PRECISIONS[args.precision][0]
    k = element_bytes(Strategy(precision=args.precision, optimizer=args.optimizer))[3]
    acts = lora_activation_bytes(model, args.lora_rank, seq, args.micro_batch, precision=args.precision,
                                 attention=args.attention, tp=args.tp)
    rows = []
    for zero in range(4):
        b = max((lora_state_bytes(model, args.lora_rank, base="nf4" if args.finetune == "qlora" else "float",
                                  element=element, dp=args.gpus // args.tp, zero=zero, optimizer_bytes=k, tp=args.tp,
                                  tp_rank=t) for t in range(args.tp)), key=lambda b: b["frozen"])
        b.update(zero=zero, activations=acts, total=b["parameters"] + b["gradients"] + b["optimizer_state"] + acts)
        rows.append(b | {"fits": b["total"] <= hw.gpu_memory})
    if args.json:
        return [json.dumps({"model": dataclasses.asdict(model), "finetune": args.finetune, "lora_rank": args.lora_rank,
                            "gpus": args.gpus, "tp": args.tp, "seq_len": seq, "micro_batch": args.micro_batch,
                            "units": "bytes", "rows": rows}, indent=1)]
    psi, (scale, table) = model.num_parameters(), unit_for(max(r["total"] for r in rows), unit)
    lines = [f"minizero.plan --finetune {args.finetune}: {model.name} ({count(psi)} parameters, frozen"
             f"{' as NF4' if args.finetune == 'qlora' else ''}), adapters of rank {args.lora_rank} on every "
             "projection; "
             f"{args.gpus:,} GPU(s) x {size(hw.gpu_memory, unit)}, "
             f"{f'tp {args.tp} x ' if args.tp > 1 else ''}data parallel; sequence {seq:,}, micro-batch "
             f"{args.micro_batch:,}; {args.precision} precision, {args.optimizer} (K = {k:g} bytes per adapter "
             "parameter)",
             f"every size in {table} ({POWERS[table]} bytes) per GPU; Z = ZeRO stage over the adapters (the frozen "
             f"base is {f'split over the {args.tp} tensor GPUs' if args.tp > 1 else 'whole on every GPU'}); "
             "bytes/param = model states (all but acts) / parameters"]
    lines = _prose(lines) + [f"{'Z':>2} {'frozen':>9} {'adapters':>9} {'grads':>9} {'optim':>9} {'acts':>9} "
                             f"{'total':>9}  {'bytes/param':>11}  fits"]
    for r in rows:
        lines.append(f"{r['zero']:>2} " + " ".join(f"{r[c] / scale:>9.2f}" for c in (
            "frozen", "adapters", "gradients", "optimizer_state", "activations", "total"))
            + f"  {r['bytes_per_parameter']:>11.3f}  {'yes' if r['fits'] else 'no'}")
    return lines


def _prose(lines: list[str]) -> list[str]:
    """The explanatory lines above a table, wrapped at 100 columns as the why lines below it are."""
    return [w for line in lines for w in wrap(line)]


def main(argv=None) -> int:
    """Run the planner; returns 0 (bad input exits 2 with one line on stderr, no usage block)."""
    parser = build_parser()
    refuse_several_ranks(parser)
    args = parser.parse_args(argv)
    model, sizes = _check(parser, args)
    seq = args.seq_len or model.seq_len
    gbatch = args.global_batch or max(1, math.ceil(2 ** 22 / seq))
    hw = Hardware(gpu_memory=sizes["gpu_memory"], host_memory=sizes["host_memory"], flops=args.gpu_flops,
                  efficiency=args.efficiency, intra_node_bw=sizes["intra_node_bw"],
                  inter_node_bw=sizes["inter_node_bw"], pcie_bw=sizes["pcie_bw"], gpus_per_node=args.gpus_per_node,
                  latency=args.latency_us / 1e6, inter_node_latency=args.inter_node_latency_us / 1e6)
    scale, unit = (1e9, "GB") if args.units == "GB" else (2 ** 30, "GiB")
    args.shown = None
    if args.finetune != "none":
        lines = _finetune(args, model, hw, seq, unit)
    elif args.strategy is not None:
        lines = _one_strategy(args, parser, model, hw, seq, gbatch, sizes, scale, unit)
    else:
        lines = _search(args, parser, model, hw, seq, gbatch, sizes, scale, unit)
    print("\n".join(lines), flush=True)
    if args.plot and args.shown:
        try:
            plot(args.shown, args.plot, hw.gpu_memory, *table_unit(args.shown, unit),
                 f"{model.name} on {args.gpus:,} GPUs, seq {seq:,}: per-GPU memory of the best {len(args.shown)}")
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib, or pip install -e '.[test]')")
        except OSError as e:
            parser.error(f"--plot {args.plot!r}: cannot write the PNG: {e.strerror or e}")
        if not args.json:
            print(f"wrote {args.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(interruptible("minizero.plan", WHOLE, main))
