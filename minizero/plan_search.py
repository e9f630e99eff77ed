"""The planner's search: every strategy for a model on N GPUs, its memory, traffic and step time, ranked.

Used by ``python -m minizero.plan`` (:mod:`minizero.plan`; the step-time model and placement rules: :func:`step_time`)
and printed by :mod:`minizero.plan_report`. Memory and traffic come from :mod:`minizero.memory.estimator` (the papers'
accounting); here they are combined with a simple hardware model (:class:`Hardware`) into step times.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from minizero.layout_checks import (ep_allows_offload, ep_allows_optimizer, flash_fits, moe_allows_cp,
                                    moe_allows_precision, moe_allows_schedule, moe_allows_sequence_parallel,
                                    offloads_optimizer, precision_fits, sequence_parallel_fits, zero_fits_pipeline)
from minizero.memory.estimator import (
    CP_ATTENTIONS, OFFLOAD, RECOMPUTE, ModelShape, Strategy, element_bytes, comm_bytes_per_step, estimate_stages,
    model_flops_per_step, replica_bytes, stage_expert_parameters, stage_kinds, stage_parameters, stage_shard)
from minizero.memory.estimator.messages import message_steps
from minizero.numerals import NotANumber, real
from minizero.parallel.schedule import bubble_over_ideal

LATENCY_DESTS = ("latency_us", "inter_node_latency_us")  #: the two latency flags' argparse names
MAX_LATENCY_US = 1e6  #: ``--latency-us`` at most a second a step (more is a typo, not a network)
LATENCY_HELP = ("alpha within a node: microseconds per message step of a collective (a ring step, a recursive-doubling "
                "exchange, a pipeline send), step time = steps x alpha + bytes / bandwidth (Hockney 1994); 5: between "
                "NCCL's ring per-step latencies over NVLink, 3.4, and PCIe, 5.7 (its tuning model, "
                "src/graph/tuning.cc hwLat, the same in v2.12.10-1 to v2.30.7-1)")
INTER_NODE_LATENCY_HELP = ("alpha across nodes: microseconds per message step that crosses nodes (a ring spanning "
                           "nodes: 2(nodes-1) of an all-reduce's steps, nodes-1 of a reduce-scatter's, as NCCL "
                           "counts them from v2.23.4-1, src/graph/tuning.cc nInterSteps; the rest take the alpha "
                           "within a node); 14: NCCL's ring per-step latency over the network (Simple protocol, "
                           "src/graph/tuning.cc hwLat from v2.18.1-1, the same to v2.30.7-1; 9.6 before)")
RANKING_RULE = ("fastest estimated step first (tokens/s); equal step times go to less device memory per GPU, "
                "then to fewer techniques")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Bytes, bytes per second, FLOP/s.

    Defaults: an A100-80GB SXM node (312 TFLOP/s dense 16-bit, NVLink 3 300 GB/s per direction, one 200 Gb/s HDR
    InfiniBand NIC per GPU = 25 GB/s, PCIe 4.0 x16 ~25 GB/s, 8 GPUs a node, ``host_memory`` per GPU: 128 GB, ~1 TB a
    node). ``efficiency``: fraction of peak the matmuls reach. ``cpu_adam``: parameters per second one GPU's share
    of CPU cores updates (ZeRO-Offload's CPU-Adam, Ren et al. 2021; an assumption). ``latency``,
    ``inter_node_latency``: alpha, seconds per message step within a node and across
    (:mod:`~minizero.memory.estimator.messages`; assumptions, :data:`LATENCY_HELP` says from where).
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
    latency: float = 5e-6
    inter_node_latency: float = 14e-6


def latency_us(text) -> float:
    """``--latency-us``'s value: microseconds in [0, :data:`MAX_LATENCY_US`]. Raises NotANumber naming the text."""
    value = real(text)
    if not 0 <= value <= MAX_LATENCY_US:
        raise NotANumber(f"{text!r} is out of range; allowed: microseconds in [0, {MAX_LATENCY_US:g}]")
    return value


def add_latency_flags(group) -> None:
    """``--latency-us`` (within a node) and ``--inter-node-latency-us`` on argparse ``group``."""
    group.add_argument("--latency-us", type=latency_us, default=5.0, help=LATENCY_HELP)
    group.add_argument("--inter-node-latency-us", type=latency_us, default=14.0, help=INTER_NODE_LATENCY_HELP)


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
    stage: int = 0  # the pipeline stage whose bytes ``comm`` and ``time`` are: the slowest (:func:`evaluate`)

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


#: The search tries cp > 1 only where each rank keeps at least this many tokens of the sequence. The
#: step-time model counts FLOPs and bytes, not how attention kernels slow down on short blocks nor the
#: ring's exposed latency, so below this it would trade dp for cp over differences far under its own
#: accuracy (~1%). Context parallelism is a long-context technique: Llama 3 (Dubey et al. 2024,
#: section 3.3.2) used cp 16 only for its 131,072-token stage, 8,192 tokens per rank. A planner
#: decision, not a rule of the trainer (``--strategy cpN`` and ``--cp`` still take any size that splits).
MIN_CP_TOKENS_PER_RANK = 4096


def context_parallel_sizes(ranks: int, seq_len: int | None, tp: int = 1) -> list[int]:
    """The context-parallel sizes c the search tries on ``ranks`` = GPUs / (tp x pp): divisors of ``ranks``
    with the sequence in 2c equal chunks (two per rank; ``parallel/context_parallel.py``), and, for c > 1,
    s/c divisible by tp (sequence parallelism splits each rank's chunks). Only c = 1 when ``seq_len`` is None."""
    if not seq_len:
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or (seq_len % (2 * c) == 0 and (seq_len // c) % tp == 0)]


def expert_parallel_sizes(model: ModelShape, dp: int) -> list[int]:
    """The ep sizes the search tries: divisors of ``dp`` that divide the experts (1 for a dense model)."""
    return [e for e in _divisors(dp) if e == 1 or (model.experts and model.experts % e == 0)]


def ulysses_fits(model: ModelShape, cp: int, tp: int) -> bool:
    """Whether Ulysses splits over ``cp``: cp divides a tensor rank's heads and KV heads."""
    return (model.n_head // tp) % cp == 0 and (model.n_kv_head // tp) % cp == 0


def tp_divides(model: ModelShape, tp: int) -> bool:
    """Whether tensor parallelism of ``tp`` splits the heads, the KV heads, the FFN and an expert's FFN."""
    return not (model.n_head % tp or model.n_kv_head % tp or model.ffn_hidden % tp or model.expert_hidden % tp)


def train_runs(model: ModelShape) -> bool:
    """Whether ``model`` is one of minizero's presets (``minizero-<preset>``), which minizero.train runs: the search
    and ``--strategy`` keep to train's rules (:func:`train_refusal`) only there; a real model is planned as
    Megatron-LM and DeepSpeed run it, not by the limits of minizero's emulation."""
    return model.name.startswith("minizero-")


def train_refusal(model: ModelShape, st: Strategy, seq_len: int | None) -> tuple[str, str] | None:
    """The first of minizero.train's rules (:mod:`minizero.layout_checks`) ``st`` breaks, as (what train runs none
    of and why, the header's words; this strategy's and the fix, --strategy's), or None: train runs it."""
    moe, ep, p, opt = model.experts, st.ep > 1, st.precision, st.optimizer
    broken = [not precision_fits(p, st.tp),
              not flash_fits(st.attention, st.cp, st.cp_attention),
              st.offload != "none" and not offloads_optimizer(opt),
              moe and not moe_allows_cp(st.cp), moe and not moe_allows_sequence_parallel(st.sequence_parallel),
              moe and not moe_allows_precision(p), moe and not moe_allows_schedule(st.schedule),
              ep and not ep_allows_optimizer(opt), ep and not ep_allows_offload(st.offload)]
    if not any(broken):
        return None
    experts, adamw = f"{model.name}'s experts", "expert parallelism runs AdamW"
    return [(f"tp > 1 with --precision {p}, which converts plain Linear layers only",
             f"tp {st.tp} with --precision {p}: it converts plain Linear layers, not tensor-parallel ones; use tp 1"),
            ("attention=flash with ring attention, which already runs the flash recurrence",
             f"attention=flash with cp {st.cp} by ring attention: the ring already runs the flash recurrence; use "
             "cp_attention=ulysses or attention=dense"),
            (f"offload with --optimizer {opt}, whose state stays on the device",
             f"offload={st.offload} with --optimizer {opt}: 8-bit Adam's state stays on the device; use offload=none"),
            ("cp > 1 with a mixture of experts, whose ranks would route sequence chunks",
             f"cp {st.cp} with {experts}: a rank would route its sequence chunks, not the micro-batch; use cp 1"),
            ("sequence parallelism with a mixture of experts, which routes whole sequences",
             f"sp with {experts}: the MoE layer routes whole sequences; leave sp off"),
            ("fp8 with a mixture of experts", f"--precision fp8 with {experts}: FP8's amax history is kept per "
                                              "tensor, not per expert"),
            (f"--schedule {st.schedule} with a mixture of experts",
             f"--schedule {st.schedule} with {experts}: the expert all-to-alls run with 1f1b or gpipe only"),
            (f"ep > 1 with --optimizer {opt}, as {adamw}", f"ep {st.ep} with --optimizer {opt}: {adamw}; use ep 1 "
                                                           "or --optimizer adam"),
            (f"ep > 1 with offload, as {adamw} on the device",
             f"ep {st.ep} with offload={st.offload}: {adamw} on the device; use ep 1 or offload=none")
            ][broken.index(True)]


def pipeline_schedule(schedule: str, virtual_stages: int, pp: int) -> tuple[str, int]:
    """(schedule, virtual stages) at ``pp`` stages: interleaved at pp 1 has nothing to interleave, so 1F1B, v = 1."""
    if schedule == "interleaved":
        return ("interleaved", virtual_stages) if pp > 1 else ("1f1b", 1)
    return schedule, 1


def micro_batches(global_batch: int, dp: int, micro_batch: int, schedule: str, pp: int) -> int:
    """Micro-batches per step per data rank: ceil(B / (dp x b)), up to a multiple of pp for the interleaved schedule
    (Megatron-LM's needs m divisible by p)."""
    m = math.ceil(global_batch / (dp * micro_batch))
    return math.ceil(m / pp) * pp if schedule == "interleaved" else m


def enumerate_strategies(model: ModelShape, gpus: int, *, micro_batch: int = 1, global_batch: int = 1,
                         precision: str = "mixed", optimizer: str = "adam", schedule: str = "1f1b",
                         virtual_stages: int = 2, gpus_per_node: int = 8, bucket_bytes: int | None = None,
                         seq_len: int | None = None, attention: str = "dense", ep: int | None = None,
                         cp_attention: str | None = None, left_out: dict | None = None):
    """Every valid :class:`Strategy` for ``model`` on exactly ``gpus`` = dp x cp x tp x pp GPUs (a generator).

    tp divides the heads, KV heads and FFN sizes and fits in a node; pp x virtual stages divides the layers; ZeRO > 0
    on one data rank only with offload; ZeRO 2-3 not with pp > 1 (:func:`zero_fits_pipeline`); sequence parallelism
    needs tp > 1 dividing the sequence (:func:`sequence_parallel_fits`); cp as :func:`context_parallel_sizes` allows,
    with at least :data:`MIN_CP_TOKENS_PER_RANK` tokens per rank, by ring attention and, where :func:`ulysses_fits`, by
    DeepSpeed-Ulysses (``cp_attention``: only that one); ep as :func:`expert_parallel_sizes` allows (``ep``: only it).
    For minizero's presets (:func:`train_runs`) only what minizero.train runs; ``left_out`` counts the rest by rule.
    """
    train = train_runs(model)
    for tp in _divisors(gpus):
        if tp > gpus_per_node or not tp_divides(model, tp):
            continue
        for pp in _divisors(gpus // tp):
            sched, v = pipeline_schedule(schedule, virtual_stages, pp)
            if model.n_layer % (pp * v):
                continue
            for cp in context_parallel_sizes(gpus // (tp * pp), seq_len, tp):
                if cp > 1 and seq_len // cp < MIN_CP_TOKENS_PER_RANK:
                    continue
                dp = gpus // (tp * pp * cp)
                kinds = [k for k in CP_ATTENTIONS if (k == "ring" or ulysses_fits(model, cp, tp))
                         and cp_attention in (None, k)] if cp > 1 else ["ring"]
                for e in expert_parallel_sizes(model, dp):
                    if ep is not None and e != ep:
                        continue
                    for kind in kinds:
                        for st in _layouts(tp, pp, cp, dp, sched, v, micro_batch, global_batch, precision, optimizer,
                                           bucket_bytes, attention, e, kind, hybrid_shard(dp, tp * cp, gpus_per_node),
                                           seq_len is None or sequence_parallel_fits(tp, seq_len)):
                            why = train_refusal(model, st, seq_len) if train else None
                            if why is None:
                                yield st
                            elif left_out is not None:
                                left_out[why[0]] = left_out.get(why[0], 0) + 1


def hybrid_shard(dp: int, gpus: int, gpus_per_node: int) -> int | None:
    """The shard group size N the search tries for hybrid sharding (zero/hybrid.py), or None: the most of ``dp``
    data ranks whose ``gpus`` GPUs each (tp x cp) fill a node evenly, where ZeRO over all of them would cross nodes:
    gather and reduce-scatter on NVLink, only a 1/N shard's all-reduce between nodes (FSDP's HYBRID_SHARD)."""
    if dp * gpus <= gpus_per_node:
        return None
    n = max((d for d in _divisors(dp) if gpus_per_node % (d * gpus) == 0), default=1)  # 6 of 8: ranks 6-11 span 2
    return n if n > 1 else None


def _layouts(tp, pp, cp, dp, sched, v, micro_batch, global_batch, precision, optimizer, bucket_bytes, attention,
             ep=1, cp_attention="ring", shard=None, sp_fits=True):
    """Every ZeRO / offload / recompute / sequence-parallel / activation-offload choice on one dp x cp x tp x pp
    mesh, ZeRO also over groups of ``shard`` data ranks (hybrid sharding) where they hold whole expert groups; sp only
    where ``sp_fits`` (tp divides the sequence)."""
    m = micro_batches(global_batch, dp, micro_batch, sched, pp)
    for zero in (0, 1, 2, 3):
        for offload in OFFLOAD:
            if (offload == "optimizer" and zero < 2) or (offload == "params" and zero != 3):
                continue
            if (dp * cp == 1 and zero > 0 and offload == "none") or not zero_fits_pipeline(zero, pp):
                continue
            shards = (None, shard) if zero > 0 and shard and shard * cp % ep == 0 else (None,)
            for recompute, sp, act_off, dp_shard in itertools.product(
                    RECOMPUTE, (False, True) if tp > 1 and sp_fits else (False,), (False, True), shards):
                yield Strategy(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp, dp_shard=dp_shard,
                               recompute=recompute, precision=precision, optimizer=optimizer, offload=offload,
                               offload_activations=act_off, micro_batch=micro_batch, micro_batches=m, schedule=sched,
                               virtual_stages=v, bucket_bytes=bucket_bytes, attention=attention, ep=ep,
                               cp_attention=cp_attention)


def _state_shard(model: ModelShape, st: Strategy, stage: int = 0) -> float:
    """Elements of ``stage`` on one rank after ZeRO's split over N shard ranks: dense / N + experts / (N / ep)."""
    return stage_shard(model, st, stage)  # N: all dp x cp data ranks, or hybrid sharding's group


def _gather_after_step(model: ModelShape, st: Strategy, stage: int = 0) -> float:
    """Bytes a rank of ``stage`` sends in ZeRO 1-2's all-gather after the step (0 otherwise): the dense part over the
    N shard ranks, the experts over their N/ep holders (hybrid sharding: those of the shard group)."""
    if st.zero not in (1, 2):
        return 0.0
    experts, ns, ne = stage_expert_parameters(model, st, stage), st.shard_ranks, st.expert_shard_ranks
    psi = stage_parameters(model, st, stage)
    return element_bytes(st)[0] * ((ns - 1) / ns * (psi - experts) + (ne - 1) / ne * experts)


def step_time(model: ModelShape, st: Strategy, hw: Hardware, seq_len: int, comm: dict | None = None,
              stage: int = 0, overlap: bool = True) -> dict:
    """Seconds per step by part on pipeline stage ``stage`` (``comm``: its bytes, by default computed); "step" sums
    them. Compute: the model's FLOPs / GPUs, stages balanced (Narayanan et al. 2021; the head's extra unmodelled).
    Traffic: alpha-beta, message steps x ``hw.latency`` (``hw.inter_node_latency`` for those crossing nodes) + bytes /
    bandwidth (``memory/estimator/messages.py``).
    ``overlap=False``: train's ``--no-overlap``, no DP traffic hidden behind compute."""
    comm = comm or comm_bytes_per_step(model, st, seq_len, stage=stage)
    n, batch = st.world_size, st.dp * st.micro_batch * st.micro_batches
    compute = model_flops_per_step(model, batch, seq_len, st.recompute) / n / (hw.flops * hw.efficiency)
    bubble = compute * bubble_over_ideal(st.pp, st.micro_batches, st.virtual_stages)  # the simulator's formula
    node, d, ns = hw.gpus_per_node, st.data_ranks, st.shard_ranks  # gradients are averaged over dp x cp ranks
    dp_bw = hw.intra_node_bw if d * st.tp <= node else hw.inter_node_bw
    shard_bw = hw.intra_node_bw if ns * st.tp <= node else hw.inter_node_bw  # ZeRO's group (hybrid: N data ranks)
    pp_bw = hw.intra_node_bw if n <= node else hw.inter_node_bw
    cp_bw = hw.intra_node_bw if st.cp * st.tp <= node else hw.inter_node_bw  # order tp-cp-dp-pp: cp next to tp
    steps, inter = message_steps(model, st, seq_len, stage, node)  # alpha-beta: intra- and inter-node steps
    latency = {k: (v - inter[k]) * hw.latency + inter[k] * hw.inter_node_latency for k, v in steps.items()}
    tp = comm["tp"] / hw.intra_node_bw + latency["tp"]
    pp = comm["pp"] / pp_bw + latency["pp"]
    cp = comm["cp"] / cp_bw + latency["cp"]  # the ring's K, V blocks and their gradients, charged in full (see plan.py)
    # an expert group is ep consecutive data ranks: tp x cp x ep GPUs; its all-to-alls wait for nothing to overlap
    ep_bw = hw.intra_node_bw if st.tp * st.cp * st.ep <= node else hw.inter_node_bw
    ep = comm.get("ep", 0) / ep_bw + latency["ep"]
    dp = 0.0
    if d > 1:
        gather_after_step = _gather_after_step(model, st, stage)
        across = replica_bytes(model, st, stage)  # hybrid sharding's all-reduce over the replicas (0 without)
        overlappable = comm["dp"] - gather_after_step - across
        if not overlap:  # blocking: every bucket waits on its collective
            window = 0.0
        elif st.zero < 2:
            window = 2 / 3 * compute / st.micro_batches
        elif st.zero == 2:
            window = 2 / 3 * compute
        else:
            window = compute
        exposed = overlappable / shard_bw + latency["dp"] + across / dp_bw + latency["dp_across"] - window
        dp = max(0.0, exposed) + gather_after_step / shard_bw + latency["dp_after"]
    offload, shard = 0.0, _state_shard(model, st, stage)
    pb, gbytes = element_bytes(st)[:2]
    if st.offload != "none":
        offload += (gbytes + pb) * shard / hw.pcie_bw + shard / hw.cpu_adam
        overlapped = comm["pcie"] - (gbytes + pb) * shard
        offload += max(0.0, overlapped / hw.pcie_bw - compute)
    elif st.offload_activations:
        offload += max(0.0, comm["pcie"] / hw.pcie_bw - compute)
    parts = dict(compute=compute, bubble=bubble, tp=tp, cp=cp, ep=ep, pp=pp, dp=dp, offload=offload)
    parts["step"] = sum(parts.values())
    return parts


def evaluate(model: ModelShape, st: Strategy, hw: Hardware, seq_len: int, stages: list | None = None) -> Candidate:
    """Memory (the fullest stage's; ``stages``: :func:`estimate_stages`'), traffic and step time (the slowest stage's:
    all stages run the same schedule, so the step lasts as long as the one with the most exposed traffic; Narayanan
    et al. 2021) over :func:`stage_kinds` (ends, MoE blocks: their bytes differ), throughput, MFU."""
    stages = stages or estimate_stages(model, st, seq_len)
    mem = max(stages, key=lambda e: e.total)
    t, comm, slowest = max(((step_time(model, st, hw, seq_len, c, i), c, i) for i in stage_kinds(model, st)
                            for c in [comm_bytes_per_step(model, st, seq_len, stage=i)]), key=lambda r: r[0]["step"])
    tokens = st.dp * st.micro_batch * st.micro_batches * seq_len
    mfu = model_flops_per_step(model, tokens // seq_len, seq_len) / (t["step"] * st.world_size * hw.flops)
    techniques = (st.zero > 0) + (st.tp > 1) + (st.pp > 1) + (st.cp > 1) + (st.ep > 1) + st.sequence_parallel \
        + (st.recompute != "none") + (st.offload != "none") + st.offload_activations
    return Candidate(st, mem, comm, t, tokens / t["step"], mfu, techniques, max(e.offloaded for e in stages), slowest)


def plan(model: ModelShape, gpus: int, hw: Hardware, seq_len: int, **kw) -> tuple[list[Candidate], int, tuple]:
    """(strategies that fit, ranked by :data:`RANKING_RULE`; how many were enumerated; the smallest
    footprint as (strategy, device bytes, host bytes), or None when nothing was enumerated).

    A strategy fits when every pipeline stage's device total is at most ``hw.gpu_memory`` and what it offloads at most
    ``hw.host_memory`` (:func:`stage_kinds` bound the stages; the middle ones, for speed, only where the ends fit or
    may be the smallest footprint: the ends alone missed MoE stages). ``kw`` goes to :func:`enumerate_strategies`.
    """
    fits, count, smallest = [], 0, None
    for st in enumerate_strategies(model, gpus, gpus_per_node=hw.gpus_per_node, seq_len=seq_len, **kw):
        count += 1
        stages = estimate_stages(model, st, seq_len, within=max(hw.gpu_memory, smallest[1]) if smallest else None)
        device, host = max(e.total for e in stages), max(e.offloaded for e in stages)
        if smallest is None or (device, host) < smallest[1:]:
            smallest = (st, device, host)
        if device <= hw.gpu_memory and host <= hw.host_memory:
            fits.append(evaluate(model, st, hw, seq_len, stages))
    return rank(fits), count, smallest


def rank(cands: list[Candidate]) -> list[Candidate]:
    """``cands`` by :data:`RANKING_RULE`: tokens/s (to 10^-6) descending, then device bytes, then techniques.

    A lead within the model's accuracy (~1%) is kept, not traded for memory: the tok/s column stays
    monotonic, and a 1% band is not transitive (A ~ B ~ C with A, C 2% apart), so a band's order
    would hang on where it starts. ``plan_report.explain`` marks such near-ties and their memory.
    """
    return sorted(cands, key=lambda c: (-round(c.tokens_per_s, 6), c.memory.total, c.techniques))
