"""Message steps per step: the latency half of the alpha-beta (Hockney) cost, t = steps x alpha + bytes / beta.

A step is one exchange a rank waits on before the next (one ``sendrecv`` of a ring or of recursive doubling), so
the latency a collective adds is its steps x alpha, whatever its size (Hockney, Parallel Computing 20, 1994;
collective costs as Thakur, Rabenseifner & Gropp, IJHPCA 2005). Steps follow minizero's algorithms
(``comm/collectives.py``, ``comm/recursive_doubling.py``, ``comm/all_to_all.py``) and per step its calls: a DP bucket,
a ZeRO unit (``zero_overlap.zero_units``), a micro-batch, a layer. Only the calls that carry the bytes of
:func:`~minizero.memory.estimator.traffic.comm_bytes_per_step` are counted (not the used-parameter mask, the norm).
"""
from __future__ import annotations

import collections

from minizero.comm.recursive_doubling import all_reduce_algorithm
from minizero.memory.estimator.model import as_shape
from minizero.memory.estimator.scratch import DEFAULT_BUCKET_BYTES
from minizero.memory.estimator.states import stage_layers, stage_parameters
from minizero.memory.estimator.strategy import Strategy, element_bytes
from minizero.memory.estimator.traffic import pipeline_sends, tensor_parallel_calls
from minizero.memory.estimator.zero_overlap import zero_units

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send")


def collective_steps(op: str, nbytes: int, n: int) -> int:
    """Steps of minizero's ``op`` on ``nbytes`` over ``n`` ranks: all_reduce ring 2(n-1), recursive doubling (up to
    its size threshold) log2 p, +2 where n is not a power of two p (the fold); reduce_scatter, all_gather and the
    pairwise all_to_all n-1; binomial broadcast ceil(log2 n); send 1. 0 on one rank."""
    if op not in OPS:
        raise ValueError(f"op={op!r}; allowed: {', '.join(OPS)}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"n={n}, nbytes={nbytes}; allowed: n >= 1 ranks, nbytes >= 0")
    if n == 1:
        return 0
    if p := _doubling_size(op, nbytes, n):
        return p.bit_length() - 1 + (2 if p != n else 0)
    return {"all_reduce": 2 * (n - 1), "broadcast": (n - 1).bit_length(), "send": 1}.get(op, n - 1)


def _doubling_size(op: str, nbytes: int, n: int) -> int | None:  # the power of two p <= n recursive doubling runs on
    if op == "all_reduce" and all_reduce_algorithm(nbytes, n) == "recursive_doubling":
        return 1 << (n.bit_length() - 1)
    return None


def buckets(sizes, itemsize: int, bucket_bytes: int) -> list[int]:
    """Bytes of each DataParallel bucket: ``sizes`` (tensor elements, model order) filled in reverse, a new bucket
    where the next tensor would pass ``bucket_bytes`` (``parallel/data_parallel.py``)."""
    out, current = [], 0
    for n in reversed(sizes):
        if current and (current + n) * itemsize > bucket_bytes:
            out, current = out + [current * itemsize], 0
        current += n
    return out + [current * itemsize] if current else out


def inter_node_steps(op: str, nbytes: int, n: int, stride: int = 1, gpus_per_node: int | None = None) -> int:
    """Of :func:`collective_steps`' steps, those crossing nodes: members at GPUs 0, stride, 2 stride, .. packed node by
    node (None: one node). A ring's as NCCL's tuning model (src/graph/tuning.cc nInterSteps, v2.23.4-1 on): all_reduce
    2(nodes-1), reduce_scatter and all_gather nodes-1; recursive doubling's and broadcast's exchanges with a partner on
    another node; every pairwise all_to_all step (each rank has a partner off its node); a send."""
    steps = collective_steps(op, nbytes, n)
    if gpus_per_node is None or not steps:
        return 0
    per = gpus_per_node
    if stride >= per:  # each member on a node of its own: every step crosses
        return steps
    nodes = (n - 1) * stride // per + 1  # the last member's node, + 1 (counted, not listed: the planner's hot path)
    if nodes == 1:
        return 0
    if p := _doubling_size(op, nbytes, n):
        rem = n - p  # ranks 2i, 2i+1 < 2 rem fold; virtual rank v is 2v+1 below rem, else v + rem
        cuts = [-(-(k * per) // stride) for k in range(1, nodes)]  # node k begins at member ceil(k per / stride)
        virtual = [b // 2 if b < 2 * rem else b - rem for b in cuts]
        fold = 2 * any(b % 2 and b < 2 * rem for b in cuts)  # exchange j pairs within blocks of 2^(j+1)
        return fold + sum(any(v % (2 << j) for v in virtual) for j in range(p.bit_length() - 1))
    if op == "broadcast":  # the binomial tree's exchange at distance 2^j crosses once 2^(j+1) passes the first cut
        return steps - ((-(-per // stride)).bit_length() - 1)  # the first cut: member ceil(per / stride)
    return {"all_reduce": 2 * (nodes - 1), "reduce_scatter": nodes - 1, "all_gather": nodes - 1}.get(op, steps)


def comm_messages_per_step(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0) -> dict:
    """:func:`message_steps`' steps of every group, on one node or many."""
    return message_steps(model, strategy, seq_len, stage)[0]


def message_steps(model, strategy: Strategy, seq_len: int | None = None, stage: int = 0,
                  gpus_per_node: int | None = None) -> tuple[dict, dict]:
    """Message steps one rank of ``stage`` waits on per optimizer step, by group: {"dp", "dp_after", "dp_across",
    "tp", "pp", "cp", "ep"} ("dp_after": ZeRO 1-2's all-gather after the step; "dp_across": hybrid sharding's
    replica all-reduce; "dp" the rest). Per :func:`collective_steps`, m micro-batches, u ZeRO units: ZeRO 0 one
    all-reduce per gradient bucket (``bucket_bytes``) a step; ZeRO 1 u reduce-scatters, ZeRO 2 m u, ZeRO 3 m u plus 2 m
    u all-gathers; ZeRO 1-2 u all-gathers after the step. tp: the all-reduces of ``comm_bytes_per_step``'s count (SP:
    an all-gather and a reduce-scatter each). pp: ``traffic.pipeline_sends`` sends a micro-batch. cp: per layer and
    micro-batch, ring attention's c-1 passes forward and 2c-1 backward, Ulysses' 4 all-to-alls each way. ep: per MoE
    block and micro-batch 5 all-to-alls forward (counts, then dispatch and combine with their counts), 4 backward.
    Second dict: of them, those crossing nodes (:func:`inter_node_steps`; layout tp-cp-dp-pp, tp innermost)."""
    m, st = as_shape(model), strategy.validate(as_shape(model))
    s, mb, t, c = seq_len or m.seq_len, st.micro_batches, st.tp, st.cp
    _, gb, e, _ = element_bytes(st)
    n, layers = st.shard_ranks, m.n_layer // st.pp
    out = dict.fromkeys(("dp", "dp_after", "dp_across", "tp", "pp", "cp", "ep"), 0)
    blocks = sum(m.is_moe_layer(i) for i in stage_layers(m, st, stage))  # this stage's MoE blocks
    inter = dict(out)

    def add(group, op, nbytes, ranks, stride, times=1):  # ranks: the group's size, stride: GPUs between members
        out[group] += times * collective_steps(op, nbytes, ranks)
        inter[group] += times * inter_node_steps(op, nbytes, ranks, stride, gpus_per_node)

    if st.data_ranks > 1 and st.zero == 0:  # the trainer's buckets (None: its 1 MiB), the stage's whole under tp, pp
        bucket = st.bucket_bytes or DEFAULT_BUCKET_BYTES
        full, rest = divmod(gb * stage_parameters(m, st, stage), bucket)  # a bound where tensors are split
        each = buckets(m.tensor_sizes(), gb, bucket) if t == st.pp == 1 else [bucket] * full + [rest] * (rest > 0)
        for b, times in collections.Counter(each).items():  # equal buckets priced once (thousands at 1 MiB)
            add("dp", "all_reduce", b, st.data_ranks, t, times)
    elif st.data_ranks > 1:
        tied, chain = zero_units(m, st, stage)
        expert_units = [1] * blocks if st.ep > 1 else []  # under ep, each MoE block's experts are one unit more
        units = [u for u in [tied, *chain] if u] + expert_units  # elements of each unit (the experts' taken as 1)
        add("dp", "reduce_scatter", 0, n, t, {1: 1, 2: mb, 3: 3 * mb}[st.zero] * len(units))
        add("dp_after", "all_gather", 0, n, t, len(units) if st.zero < 3 else 0)
        for u in units:
            add("dp_across", "all_reduce", gb * u // n, st.replicas, t * n, 1 if st.zero == 1 else mb)
    x = e * (s // c) * st.micro_batch * m.hidden  # one activation, as comm_bytes_per_step's
    if t > 1:
        calls = tensor_parallel_calls(m, st, stage)  # SP: an all-gather and a reduce-scatter each
        for op in ("all_gather", "reduce_scatter") if st.sequence_parallel else ("all_reduce",):
            add("tp", op, x, t, 1, calls)
    if st.pp > 1:  # the next stage: tp x cp x dp GPUs on
        ends, gap = stage in (0, st.pp - 1), st.world_size // st.pp
        add("pp", "send", 0, st.pp, gap, mb * pipeline_sends(st, stage))
        if m.tied_embeddings and ends:
            add("pp", "all_reduce", gb * m.vocab_shard(t), 2, gap * (st.pp - 1))
    passes = 2 if st.recompute != "none" else 1  # forward again under recompute, as the bytes
    if c > 1 and st.cp_attention == "ulysses":
        add("cp", "all_to_all", 0, c, t, mb * layers * 4 * (passes + 1))
    elif c > 1:  # K, V around the ring (c-1 steps, an all-gather's), dK, dV back to their owner (c steps: + 1)
        add("cp", "all_gather", 0, c, t, mb * layers * (passes + 2))
        add("cp", "send", 0, c, t, mb * layers)
    if st.ep > 1 and blocks:
        add("ep", "all_to_all", 0, st.ep, t * c, mb * blocks * (5 * (2 if st.recompute == "full" else 1) + 4))
    return out, inter
