"""The planner's ``--strategy``: one strategy the user names, read and checked by the search's rules
(:mod:`minizero.plan_search`), for minizero's presets also minizero.train's (:func:`plan_search.train_refusal`)."""
from __future__ import annotations

import re

from minizero.layout_checks import (MOE_SCHEDULES, moe_allows_precision, moe_allows_schedule, sequence_parallel_fits,
                                    zero_fits_pipeline)
from minizero.memory.estimator import ATTENTIONS, CP_ATTENTIONS, PRECISIONS, RECOMPUTE, ModelShape, Strategy
from minizero.plan_search import (_divisors, context_parallel_sizes, micro_batches, pipeline_schedule, tp_divides,
                                  train_refusal, train_runs, ulysses_fits)

STRATEGY_FORMS = ("dpN cpN tpN ppN epN zeroN (or zN; '=' allowed: dp=2), shardN (ZeRO over groups of N data ranks, "
                  "replicated across: hybrid sharding), sp, recompute=none|selective|full, "
                  "offload=none|optimizer|params|activations (joined with '+'), attention=dense|flash, "
                  "cp_attention=ring|ulysses")


def _either(names) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def search_refusal(model: ModelShape, precision: str, schedule: str) -> str | None:
    """Why minizero.train runs no layout of ``model``, a preset with experts, at ``precision`` and ``schedule``, or
    None (a real model: always None)."""
    if not (train_runs(model) and model.experts):
        return None
    if not moe_allows_precision(precision):
        return (f"--precision {precision} with {model.name}, a mixture of experts: FP8's amax history is kept per "
                "tensor, not per expert (minizero.train refuses it); allowed: --precision "
                + _either([p for p in sorted(PRECISIONS) if moe_allows_precision(p)]))
    if not moe_allows_schedule(schedule):
        return (f"--schedule {schedule} with {model.name}, a mixture of experts: minizero.train runs the expert "
                f"all-to-alls with {_either(MOE_SCHEDULES)} only; allowed: --schedule {_either(MOE_SCHEDULES)}")
    return None


def _settings(word: str, size) -> list[str]:
    """What a lower-case ``--strategy`` word sets (``size``: its match as dpN, zN, ...), each to be given once:
    ``cp`` for cp2, ``zero`` for z1, ``sp``, ``recompute``, ``offload=params`` and ``offload=activations`` for
    offload=params+activations (several offload words add up, each kind once)."""
    key, _, value = word.partition("=")
    if size:
        return [{"z": "zero"}.get(size.group(1), size.group(1))]
    if key == "offload":
        return [f"offload={v}" for v in value.split("+")]
    return [key] if key in ("recompute", "attention", "cp_attention") else ["sp"] if word in (
        "sp", "sequence-parallel") else []


def parse_strategy(text: str, model: ModelShape, gpus: int, *, micro_batch: int = 1, global_batch: int = 1,
                   precision: str = "mixed", optimizer: str = "adam", schedule: str = "1f1b",
                   virtual_stages: int = 2, gpus_per_node: int = 8, bucket_bytes: int | None = None,
                   seq_len: int | None = None, attention: str = "dense", ep: int | None = None) -> Strategy:
    """The :class:`Strategy` ``text`` names, e.g. ``"dp2 tp4 pp1 zero3 recompute=selective"``.

    Accepts :data:`STRATEGY_FORMS`, separated by spaces or commas, and what :func:`describe` prints
    (``dp=8 tp=8 pp=1 zero=1 sp recompute=selective``), so a row can be pasted back. Left out: cp = tp = pp = 1,
    dp = gpus / (cp x tp x pp), ep = ``ep`` or 1, ring attention, ZeRO 0, no recompute, no offload. The micro-batches
    per step follow from ``global_batch`` as in :func:`enumerate_strategies`.
    Raises:
        ValueError: an unknown word (sizes in ASCII digits), a setting given twice, dp x cp x tp x pp != gpus,
            or a rule of :func:`enumerate_strategies` broken (the rule named).
    """
    sizes, zero, sp, recompute, offloads, said, cp_attention = {}, 0, False, "none", set(), {}, "ring"
    flag_attention = attention  # --attention (default dense)
    for i, word in enumerate(text.replace(",", " ").split()):
        w = word.lower()
        m = re.fullmatch(r"(dp|cp|tp|pp|ep|zero|z|shard)=?([0-9]+)", w)  # ASCII digits: \d (and int) read '٣' as 3
        key, _, value = w.partition("=")
        if m:
            if m.group(1) in ("zero", "z"):
                zero = int(m.group(2))
            else:
                sizes[m.group(1)] = int(m.group(2))
        elif w in ("sp", "sequence-parallel"):
            sp = True
        elif key == "recompute" and value in RECOMPUTE:
            recompute = value
        elif key == "attention" and value in ATTENTIONS:
            if flag_attention != "dense" and value != flag_attention:  # ran dense while the header said flash
                raise ValueError(f"--strategy {text!r}: attention={value} disagrees with --attention {flag_attention}; "
                                 "give attention once")
            attention = value
        elif key == "cp_attention" and value in CP_ATTENTIONS:
            cp_attention = value
        elif key == "offload" and value and set(value.split("+")) <= {"none", "optimizer", "params", "activations"}:
            offloads |= set(value.split("+")) - {"none"}  # several offload= words add up
        else:
            raise ValueError(f"--strategy {text!r}: cannot read {word!r}; allowed words: {STRATEGY_FORMS}")
        for name in _settings(w, m):  # "cp2 cp4": one would be dropped without a word; "sp sp": said twice
            if name in said:
                where = f"in {word!r}" if said[name][0] == i else f"({said[name][1]!r} and {word!r})"
                raise ValueError(f"--strategy {text!r}: {name} is given twice {where}; give it once")
            said[name] = (i, word)
    act, kinds = "activations" in offloads, offloads - {"activations"}
    if len(kinds) > 1:
        raise ValueError(f"--strategy {text!r}: offload names both optimizer and params (offloading the parameters "
                         "includes the optimizer state); give one")
    offload = kinds.pop() if kinds else "none"
    tp, pp, cp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("cp", 1)
    if ep is not None and sizes.get("ep", ep) != ep:  # "ep4" with ep=2 ran ep 4 silently
        raise ValueError(f"--strategy {text!r}: ep {sizes['ep']} disagrees with --ep {ep}; give ep once")
    ep = sizes.get("ep", ep or 1)
    if low := [f"{k} {v}" for k, v in {**sizes, "ep": ep}.items() if v < 1]:  # the word named, not only the rule
        raise ValueError(f"--strategy {text!r}: {low[0]}: dp, cp, tp, pp, ep and shard must be >= 1")
    dp = sizes.get("dp", gpus // (cp * tp * pp) if gpus % (cp * tp * pp) == 0 else 0)
    if dp * cp * tp * pp != gpus:
        names, values = ("dp x cp x tp x pp", f"{cp} x ") if cp > 1 else ("dp x tp x pp", "")
        raise ValueError(f"--strategy {text!r}: {names} = {sizes.get('dp', '?')} x {values}{tp} x {pp} must equal "
                         f"--gpus {gpus}")
    shard = sizes.pop("shard", None)  # hybrid sharding (zero/hybrid.py); None: ZeRO over all data ranks
    sp_tps = [t for t in _divisors(gpus) if 1 < t <= gpus_per_node and tp_divides(model, t) and seq_len
              and sequence_parallel_fits(t, seq_len)]
    rules = [(zero in (0, 1, 2, 3), f"zero {zero}: allowed 0, 1, 2, 3"),
             (shard is None or dp % shard == 0,
              f"shard {shard} must divide dp {dp}; allowed: {', '.join(map(str, _divisors(dp)))}"),
             (shard is None or dp % shard or shard == dp or zero > 0,
              f"shard {shard} below dp {dp} needs zero 1-3 (got zero {zero})"),
             (tp <= gpus_per_node, f"tp {tp} exceeds the {gpus_per_node} GPUs of a node (--gpus-per-node)"),
             (tp_divides(model, tp),
              f"tp {tp} must divide {model.name}'s {model.n_head} heads, {model.n_kv_head} KV heads and FFN "
              f"{model.ffn_hidden}" + (f" and expert FFN {model.expert_hidden}" if model.experts else "")),
             (ep == 1 or model.experts, f"ep {ep}: {model.name} is a dense model (no experts to split); use ep 1"),
             (not model.experts or model.experts % ep == 0,
              f"ep {ep} must divide {model.name}'s {model.experts} experts per MoE block; allowed: "
              f"{', '.join(str(e) for e in _divisors(model.experts or 1))}"),
             (dp % ep == 0, f"ep {ep} must divide dp {dp} (an expert group is ep data-parallel ranks)"),
             (shard is None or dp % shard or shard == dp or shard * cp % ep == 0,  # after ep's own rules
              f"shard {shard} x cp {cp} must be a multiple of ep {ep} (whole expert groups in a shard group); allowed: "
              f"{', '.join(str(k) for k in _divisors(dp) if k * cp % ep == 0)}"),
             (cp_attention == "ring" or cp > 1, "cp_attention=ulysses needs cp > 1 (it splits the sequence)"),
             (cp_attention == "ring" or ulysses_fits(model, cp, tp),
              f"cp_attention=ulysses with cp {cp} needs cp to divide the {model.n_head // tp} heads and "
              f"{model.n_kv_head // tp} KV heads of each of the tp {tp} ranks"),
             (not sp or tp > 1, "sp (sequence parallelism) needs tp > 1 (as in training)"),
             (not sp or seq_len is None or sequence_parallel_fits(tp, seq_len),
              f"sp needs the sequence {seq_len} divisible by tp {tp} (Megatron-LM splits it over the tp ranks); "
              f"allowed tp: {', '.join(map(str, sp_tps)) or 'none'}, or leave sp off"),
             (zero_fits_pipeline(zero, pp), f"zero {zero} with pp {pp} > 1: ZeRO-2/3 reduce gradients every "
              "micro-batch (neither DeepSpeed nor Megatron-LM combines them); use zero 1"),
             (offload != "optimizer" or zero >= 2, "offload=optimizer needs zero 2 or 3 (ZeRO-Offload)"),
             (offload != "params" or zero == 3, "offload=params needs zero 3 (ZeRO-Infinity)"),
             (not (dp * cp == 1 and zero > 0 and offload == "none"),
              f"zero {zero} over dp 1 shards nothing; use zero 0"),
             (cp == 1 or seq_len is None or cp in context_parallel_sizes(cp, seq_len, tp),
              f"cp {cp} needs the sequence {seq_len} in 2 x cp = {2 * cp} equal chunks, each rank's two of a "
              f"length divisible by tp {tp}")]
    sched, v = pipeline_schedule(schedule, virtual_stages, pp)
    rules.append((model.n_layer % (pp * v) == 0, f"pp {pp}{f' x {v} virtual stages' if v > 1 else ''} must divide "
                                                 f"{model.name}'s {model.n_layer} layers"))
    for ok, why in rules:
        if not ok:
            raise ValueError(f"--strategy {text!r}: {why}")
    st = Strategy(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp, recompute=recompute,
                  precision=precision, optimizer=optimizer, offload=offload, offload_activations=act,
                  micro_batch=micro_batch, micro_batches=micro_batches(global_batch, dp, micro_batch, sched, pp),
                  schedule=sched, virtual_stages=v, bucket_bytes=bucket_bytes, attention=attention, ep=ep,
                  cp_attention=cp_attention, dp_shard=shard if shard is not None and shard < dp else None)
    if train_runs(model) and (why := train_refusal(model, st, seq_len)):
        raise ValueError(f"--strategy {text!r}: {why[1]} (a rule of minizero.train, which runs {model.name})")
    return st
