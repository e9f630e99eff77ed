"""Layouts the command line refuses, in the flags' words (called by :func:`minizero.args.resolve_parallel_args`).

:func:`resolve_sizes` derives the --dp/--tp/--pp left out from the world size.

Each check reads a :class:`~minizero.config.TrainConfig` whose dp/tp/pp are resolved and the preset's
GPTConfig ``cfg``; it raises ValueError naming the flags (the techniques' own errors name no flag).
"""
from __future__ import annotations

import numpy as np

from minizero.flags import LATE_DEFAULTS, UsageError
from minizero.parallel.expert_parallel import MAX_EXPERTS
from minizero.parallel.lora_tp import nf4_shard_refusal, nf4_tensor_parallel_sizes


# ---- the planner's rules: ZeRO with pp, sp's split (every model's), train's (plan_search.train_refusal: presets') ----
#: the pipeline schedules a mixture of experts runs (check_moe)
MOE_SCHEDULES = ("1f1b", "gpipe")


def zero_fits_pipeline(zero: int, pp: int) -> bool:
    """Whether ZeRO-``zero`` runs with ``pp`` stages: not 2-3, which reduce in every backward (one per micro-batch)."""
    return zero < 2 or pp == 1


def sequence_parallel_fits(tp: int, seq_len: int) -> bool:
    """Whether sequence parallelism splits a sequence of ``seq_len`` tokens over ``tp`` tensor ranks."""
    return tp > 1 and seq_len % tp == 0


def flash_fits(attention: str, cp: int, cp_attention: str | None) -> bool:
    """Whether the attention core runs at this cp: flash not with ring attention (None: ring, not given)."""
    return not (attention == "flash" and cp > 1 and cp_attention != "ulysses")


def precision_fits(precision: str, tp: int) -> bool:
    """Whether ``precision`` runs at ``tp``: bf16 and fp8 convert plain Linear layers only (tp 1)."""
    return precision not in ("bf16", "fp8") or tp == 1


def offloads_optimizer(optimizer: str) -> bool:
    """Whether optimizer offload takes ``optimizer``'s state (8-bit Adam's stays on the device)."""
    return optimizer != "adam8bit"


# a mixture of experts (check_moe says why each is refused)
def moe_allows_cp(cp: int) -> bool:
    return cp == 1  # a rank would route its sequence chunks, not the micro-batch


def moe_allows_sequence_parallel(sequence_parallel: bool) -> bool:
    return not sequence_parallel  # the MoE layer routes whole sequences


def moe_allows_precision(precision: str) -> bool:
    return precision != "fp8"  # FP8's amax history is per tensor, not per expert


def moe_allows_schedule(schedule: str) -> bool:
    return schedule in MOE_SCHEDULES


# expert parallelism, ep > 1 (the planner's AdamW is "adam", train's "adamw")
def ep_allows_optimizer(optimizer: str) -> bool:
    return optimizer in ("adamw", "adam")


def ep_allows_offload(offload: str) -> bool:
    return offload == "none"  # expert parallelism keeps AdamW on the device


def launch(ranks: int, prog: str, exact: bool = False) -> str:
    """The launch to name where a size does not fit the ranks (one process: the user left out mpirun)."""
    return (f"; launch {'' if exact else 'a multiple of '}{ranks} ranks, e.g. "
            f"mpirun -n {ranks} python -m minizero.{prog} ...")


def check_zero(args) -> None:
    """``--zero`` with the pipeline, and ``--dp-shard`` (zero/hybrid.py; None becomes dp): a divisor of dp, given
    only with ZeRO, a multiple of ep in data ranks (with --cp a shard group is N data ranks' cp ranks)."""
    zero = args.zero
    if not zero_fits_pipeline(zero, args.pp):
        raise ValueError(f"--zero {zero} with --pp {args.pp} is not supported: ZeRO-{zero} reduces gradients"
                         f"{' and gathers parameters' if zero == 3 else ''} in every backward, and a pipeline runs "
                         "one backward per micro-batch (DeepSpeed refuses this combination too); use --zero 1")
    given, args.dp_shard = args.dp_shard is not None, args.dp if args.dp_shard is None else args.dp_shard
    n, dp = args.dp_shard, args.dp  # None became dp: plain ZeRO shards over the whole data group
    if not 1 <= n <= dp or dp % n:
        raise ValueError(f"--dp-shard {n} must divide the data-parallel size {dp}; allowed: "
                         f"{', '.join(str(k) for k in range(1, dp + 1) if dp % k == 0)}"
                         + (launch(n * args.tp * args.pp * args.cp, "train") if n > dp else ""))
    if given and zero < 1:  # N = dp too: it was accepted and ran plain data parallelism
        raise ValueError(f"--dp-shard {n} shards ZeRO's states over groups of {n} data rank{'s' * (n > 1)}: it needs "
                         f"--zero 1, 2 or 3 (got --zero {zero}; plain data parallelism shards nothing)")
    if n < dp and (n * args.cp) % args.ep and args.moe_experts and dp % args.ep == 0:  # else check_moe's refusal
        ok = [k for k in range(1, dp + 1) if dp % k == 0 and (k * args.cp) % args.ep == 0]
        raise ValueError(f"--dp-shard {n} with --ep {args.ep}: a shard group's {n * args.cp} data rank(s) must hold "
                         f"whole expert groups of {args.ep}; allowed: {', '.join(map(str, ok))}")


def check_sequence_parallel(args, cfg) -> None:
    """``--sequence-parallel`` needs tp > 1 and a context length T divisible by tp."""
    if not args.sequence_parallel:
        return
    if args.tp == 1:
        raise ValueError("--sequence-parallel splits the sequence over the tensor group: it needs --tp > 1")
    t = args.block_size or cfg.block_size
    if not sequence_parallel_fits(args.tp, t):
        raise ValueError(f"--sequence-parallel needs the context length {t} divisible by --tp {args.tp}")


def cp_flag(args) -> str:
    """The context-parallel size as the command line gave it, for the errors that name it: ``--ulysses N`` (which
    sets cp; "--cp 4 must divide the world size" answered "--ulysses 4" before) or ``--cp N``."""
    return f"--cp {args.cp}" if args.ulysses is None else f"--ulysses {args.ulysses}"


def check_cp_world(args, cfg, world_size: int) -> None:
    """``--cp`` dividing the world size, after the model's rules (so a suggested launch runs), tp as given."""
    cp = args.cp
    if cp > 1:
        check_model_sizes(args.tp, args.pp, n_head=cfg.n_head, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                          vocab_size=cfg.vocab_size)
        check_context_parallel(args, cfg)
    if cp < 1 or world_size % cp:
        raise ValueError(f"{cp_flag(args)} must be >= {1 if args.ulysses is None else 2} and divide the world size "
                         f"{world_size}" + (launch(cp, "train") if cp > 1 else ""))


def check_context_parallel(args, cfg) -> None:
    """``--cp`` needs T divisible by 2 cp (two chunks per rank) and, with --sequence-parallel, T / cp divisible by
    tp."""
    cp = args.cp
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if cp == 1:  # --cp-attention given here: refused by minizero.flags.refuse_idle_flags
        return
    t, tp, ulysses = args.block_size or cfg.block_size, args.tp or 1, args.cp_attention == "ulysses"
    heads = cfg.n_head // tp  # tp None: not derived yet (check_cp_world)
    ok = ", ".join(str(k) for k in range(2, t // 2 + 1) if t % (2 * k) == 0 and (heads % k == 0 or not ulysses))
    if t % (2 * cp):
        fits = t - t % (2 * cp) or 2 * cp  # the nearest length at or below t that splits (t < 2 cp: 2 cp itself)
        raise ValueError(f"{cp_flag(args)} needs the context length {t} divisible by 2 x cp = {2 * cp} (two chunks "
                         f"per rank); allowed: " + (f"{ok} (or change --block-size)" if ok else
                                                    f"no cp at length {t}: give --block-size {fits}, say"))
    ok = ok or "none"
    if ulysses and heads % cp:
        said = cp_flag(args) + (" --cp-attention ulysses" if args.ulysses is None else "")
        raise ValueError(f"{said} needs the {heads} attention heads per tensor rank (n_head {cfg.n_head} / --tp "
                         f"{tp}) divisible by cp = {cp}: the all-to-all splits heads; allowed: {ok}")
    if args.sequence_parallel and args.tp and (t // cp) % args.tp:
        raise ValueError(f"{cp_flag(args)} with --sequence-parallel --tp {args.tp} needs the local length T / cp = "
                         f"{t // cp} divisible by --tp {args.tp} (sequence parallelism splits each rank's chunks)")


def check_attention(args) -> None:
    """``--attention-block`` must be a positive integer; ``--attention flash`` does not combine with ring attention."""
    if args.attention_block < 1:
        raise ValueError(f"--attention-block must be a positive integer (rows per query and key/value block), "
                         f"got {args.attention_block}")
    if not flash_fits(args.attention, args.cp, args.cp_attention):
        raise ValueError(f"--attention flash with --cp {args.cp} is not supported: ring attention already runs the "
                         "flash recurrence across ranks, one (T/cp)-row block each (the same block kernel), and does "
                         "not tile that block further; use --attention dense with --cp (or --cp-attention ulysses)")


def check_bf16(args) -> None:
    """``--precision bf16 / fp8`` (memory/bf16.py, fp8.py) keep float32 weights and convert plain Linear layers:
    they need --dtype float32 and --tp 1; fp8's delayed scaling also refuses --recompute (a recomputed forward
    would cast again and move the amax history)."""
    p = args.precision
    if p not in ("bf16", "fp8"):
        return
    if args.dtype != "float32":
        raise ValueError(f"--precision {p} keeps float32 weights and Adam state; --dtype must be float32, "
                         f"got {args.dtype}")
    if not precision_fits(p, args.tp):
        raise ValueError(f"--precision {p} with --tp {args.tp} is not supported: it rounds the products of plain "
                         "Linear layers, and tensor-parallel layers are not converted; use --tp 1")
    if p == "fp8" and args.fp8_scaling == "delayed" and args.recompute != "none":
        raise ValueError(f"--precision fp8 --fp8-scaling delayed with --recompute {args.recompute} is not supported: "
                         "the recomputed forward would cast again and advance the amax history; use "
                         "--fp8-scaling current")


def check_zero_bubble(args, cfg) -> None:
    """Refuse ``--schedule zb-h1 / zb-v`` where they do not run (parallel/schedule.py, autograd/split_backward.py)."""
    if args.schedule not in ("zb-h1", "zb-v"):
        return
    if args.pp < 2:
        raise UsageError(f"--schedule {args.schedule} needs --pp >= 2, got --pp {args.pp}")
    if args.schedule == "zb-v" and 2 * args.pp > cfg.n_layer:
        raise UsageError(f"--schedule zb-v needs 2 x --pp {args.pp} = {2 * args.pp} virtual stages of at least one "
                         f"layer each, but the model has {cfg.n_layer} layers")
    why = {"--sequence-parallel": (args.sequence_parallel,
                                    "its gathered linear all-gathers and reduce-scatters in one backward, which a "
                                    "split backward would run twice"),
           f"--cp {args.cp}": (args.cp > 1, "ring attention with a split backward is not tested"),
           f"--offload-activations {args.offload_activations}": (
               args.offload_activations != "none", "a split backward unpacks saved arrays twice (B and W), "
               "which offload's hooks are not tested for")}
    for flag, (bad, reason) in why.items():
        if bad:
            raise UsageError(f"--schedule {args.schedule} with {flag} is not supported: {reason}; "
                             "use --schedule 1f1b (its backward not split" +
                             (")" if args.schedule == "zb-h1" else "; one chunk per stage, not zb-v's two)"))


def resolve_sizes(world_size: int, dp=None, tp=None, pp=None, *, n_head=None, n_embd=None,
                  n_layer=None, vocab_size=None, ranks=None, cp=1) -> tuple[int, int, int]:
    """Fill in the sizes left out and check them against the world and the model; returns (dp, tp, pp).

    Args:
        world_size: number of ranks.
        dp, tp, pp: sizes or None. Exactly one None is derived as world / (product of the others). With two or three
            left out, a missing ``tp`` or ``pp`` is 1 and ``dp`` (if missing) is derived.
        n_head, n_embd, n_layer, vocab_size: model shape to check against (skipped when None).
        ranks: how messages name ``world_size`` (None or False: "world size N"; --cp: "world size W / cp c = N").
        cp: the context split, by which the ranks to launch are ``cp`` times the product.
    Raises:
        ValueError naming the numbers: a size < 1; a product that is not the world size (or a derivation that does not
        divide); ``tp`` not dividing ``n_head``, ``n_embd`` or ``vocab_size``; ``pp`` larger than ``n_layer``.
    """
    given = {"dp": dp, "tp": tp, "pp": pp}
    for name, v in given.items():
        if v is not None and (not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"--{name} must be an integer >= 1, got {v!r}")
    check_model_sizes(tp, pp, n_head=n_head, n_embd=n_embd, n_layer=n_layer, vocab_size=vocab_size)  # the given
    missing = [k for k, v in given.items() if v is None]
    if len(missing) >= 2:  # tp and pp default to 1; dp, if missing, is derived below
        given.update({k: 1 for k in ("tp", "pp") if given[k] is None})
        missing = [k for k, v in given.items() if v is None]
    if len(missing) == 1:
        k = missing[0]
        others = [(n, v) for n, v in given.items() if n != k]
        prod = others[0][1] * others[1][1]
        if world_size % prod:
            raise ValueError(
                f"cannot derive --{k}: {ranks or f'world size {world_size}'} is not divisible by "
                f"--{others[0][0]} {others[0][1]} x --{others[1][0]} {others[1][1]} = {prod}"
                + launch(prod * cp, "train"))
        given[k] = world_size // prod
    dp, tp, pp = given["dp"], given["tp"], given["pp"]
    if dp * tp * pp != world_size:
        raise ValueError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp}, but "
                         + (f"{ranks}; the product must equal that" if ranks else
                            f"the world has {world_size} rank(s); the product must equal the world size")
                         + launch(dp * tp * pp * cp, "train", exact=True))
    check_model_sizes(tp, pp, n_head=n_head, n_embd=n_embd, n_layer=n_layer, vocab_size=vocab_size)
    return int(dp), int(tp), int(pp)


def check_model_sizes(tp, pp, *, n_head=None, n_embd=None, n_layer=None, vocab_size=None) -> None:
    """:func:`resolve_sizes`'s model rules for ``tp`` and ``pp`` (None: not checked), before any world-size rule:
    "launch a multiple of 3 ranks" for --tp 3 led to n_head's refusal next."""
    sizes = {"n_head": (n_head, "the number of attention heads", " (tensor parallelism splits attention by heads)"),
             "n_embd": (n_embd, "the hidden size", ""),
             "vocab_size": (vocab_size, "the vocabulary size", " (the embedding and the LM head are split by tokens)")}
    known = {name: v for name, (v, _, _) in sizes.items() if v is not None}
    for name, (v, what, why) in sizes.items():
        if tp is not None and v is not None and v % tp:
            ok = [k for k in range(1, min(known.values()) + 1) if all(n % k == 0 for n in known.values())]
            raise ValueError(f"--tp {tp} does not divide {what} {name}={v}{why}; allowed: {', '.join(map(str, ok))} "
                             f"(the divisors of {', '.join(f'{n}={n_}' for n, n_ in known.items())})")
    if pp is not None and n_layer is not None and pp > n_layer:
        raise ValueError(f"--pp {pp} is larger than the number of layers n_layer={n_layer} "
                         f"(every pipeline stage needs at least one layer); allowed: 1 to {n_layer}")


def check_tensor_parallel(cfg, tp: int, world: int, method: str, targets) -> None:
    """Raise ValueError unless finetune's ``--tp`` splits ``cfg``'s GPT (loaded) on ``world`` ranks: its heads and
    width and, under QLoRA, whole NF4 blocks (:func:`nf4_shard_refusal`); each refusal names the --tp allowed there."""
    if cfg.n_head % tp or cfg.n_embd % tp:
        ok = [t for t in range(1, world + 1) if world % t == cfg.n_head % t == cfg.n_embd % t == 0]
        raise ValueError(f"--tp {tp} must divide the model's n_head={cfg.n_head} and n_embd={cfg.n_embd}; "
                         f"allowed on {world} ranks: --tp {' or '.join(map(str, ok))}")
    cut = tp > 1 and method == "qlora" and nf4_shard_refusal(cfg, tp, targets)
    if cut:  # the sizes that work here (--model tiny: none above 1)
        ok = " or ".join(str(t) for t in nf4_tensor_parallel_sizes(cfg, world, targets))
        raise ValueError(f"--{cut}; allowed on {world} ranks: --tp {ok} (or --method lora)")


def check_interleaved(args, cfg) -> None:
    """Refuse ``--schedule interleaved`` / ``--virtual-stages`` where they cannot run, at parse time.

    Raises:
        ValueError: --virtual-stages < 1, or > 1 without --schedule interleaved; interleaved with
        --pp 1 or --virtual-stages < 2; pp x v not dividing the layers (Megatron-LM's rule); the
        micro-batches per step (--micro-batches / --grad-accum) not a multiple of pp.
    """
    v = args.virtual_stages
    if v < 1:
        raise ValueError(f"--virtual-stages must be >= 1, got {v}")
    if args.schedule != "interleaved":
        if v > 1:
            raise ValueError(f"--virtual-stages {v} needs --schedule interleaved")
        return
    if args.pp < 2 or v < 2:
        raise ValueError(f"--schedule interleaved needs --pp >= 2 and --virtual-stages >= 2, got pp {args.pp}, v {v}")
    if cfg.n_layer % (args.pp * v):
        raise ValueError(f"--schedule interleaved: pp {args.pp} x {v} virtual stages must divide "
                         f"the {cfg.n_layer} layers")
    m = args.grad_accum
    if m is not None and m % args.pp:
        raise ValueError(f"--schedule interleaved needs the micro-batches per step ({m}) to be a multiple of "
                         f"--pp {args.pp} (each group of pp micro-batches goes through a chunk together)")


def check_moe(args) -> None:
    """``--moe-*`` / ``--ep`` in range and a layout MoE is tested with (dp/tp/pp resolved, before any work)."""
    e, ep = args.moe_experts, args.ep
    if not 0 <= e <= MAX_EXPERTS:
        raise ValueError(f"--moe-experts must be in 0..{MAX_EXPERTS} (0: dense MLPs), got {e}")
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    if not e:
        if ep > 1:
            raise ValueError(f"--ep {ep} splits experts: it needs --moe-experts > 0")
        return
    k = args.moe_top_k  # None: not given (LATE_DEFAULTS fills it after these checks)
    if k is None and e < LATE_DEFAULTS["moe_top_k"]:
        k = LATE_DEFAULTS["moe_top_k"]
        raise ValueError(f"--moe-experts {e} is fewer than the {k} experts each token is routed to (--moe-top-k "
                         f"{k}, the default); allowed: --moe-experts >= {k}, or give --moe-top-k {e}")
    if k is not None and not 1 <= k <= e:
        raise ValueError(f"--moe-top-k must be in 1..--moe-experts {e}, got {k}")
    if not (0 < args.moe_capacity_factor < float("inf")):
        raise ValueError(f"--moe-capacity-factor must be a finite number > 0, got {args.moe_capacity_factor}")
    for flag in ("moe_aux_loss", "moe_z_loss", "moe_bias_update"):
        v = vars(args)[flag]
        if not (0 <= v < float("inf")):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {v}")
    if e % ep:
        raise ValueError(f"--moe-experts {e} must be divisible by --ep {ep} (each expert-parallel rank holds E/ep); "
                         f"allowed: {', '.join(str(k) for k in range(1, e + 1) if e % k == 0)}")
    if args.dp % ep:
        raise ValueError(f"--ep {ep} must divide the data-parallel size {args.dp} (expert groups are ep data ranks)"
                         + (launch(ep * args.tp * args.pp * args.cp, "train") if ep > args.dp else ""))
    m = "--moe-experts with"
    cp_flag = f"--ulysses {args.cp}" if args.ulysses is not None else f"--cp {args.cp}"
    refused = [(not moe_allows_cp(args.cp), f"{m} {cp_flag}", "a rank would route its sequence chunks, not the "
                f"micro-batch; run without {cp_flag.split()[0]} (--dp, --ep, --tp and --pp compose with MoE)"),
               (not moe_allows_sequence_parallel(args.sequence_parallel), f"{m} --sequence-parallel",
                "the MoE layer routes whole sequences; leave --sequence-parallel off (--tp alone composes with MoE)"),
               (not moe_allows_precision(args.precision), f"{m} --precision fp8", "FP8Linear keeps an amax history "
                "per tensor, while the router and expert products (nn.Matmul children, which bf16 converts) would need "
                "one per expert, reduced over its expert-data group; use --precision bf16 or fp16"),
               (args.documents == "pad", f"{m} --pad", "the balancing losses are not weighed by real targets; "
                "use --pack"),
               (not moe_allows_schedule(args.schedule), f"{m} --schedule {args.schedule}",
                "split or interleaved backward is not tested with the expert all-to-alls; "
                "use --schedule 1f1b or gpipe")]
    if ep > 1:
        m, adamw = f"--ep {ep} with", "expert parallelism runs AdamW"
        ring = "the expert-data all-reduce is the plain ring"
        refused += [(broken, f"{m} {flag}", f"{why}; allowed: {fix}, or --ep 1") for broken, flag, why, fix in (
            (args.allreduce != "ring", f"--allreduce {args.allreduce}", ring, "--allreduce ring"),
            (args.quantized_comm, "--quantized-comm", ring, "drop --quantized-comm"),
            (args.native_comm, "--native-comm", ring, "drop --native-comm"),
            (not ep_allows_optimizer(args.optimizer), f"--optimizer {args.optimizer}", adamw, "--optimizer adamw"),
            (not ep_allows_offload(args.offload_optimizer), f"--offload-optimizer {args.offload_optimizer}",
             f"{adamw} on the device", "--offload-optimizer none"))]
    for broken, what, why in refused:
        if broken:
            raise ValueError(f"{what} is not supported: {why}")
