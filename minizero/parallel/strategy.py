"""A parallel strategy: what the one training loop asks of a layout (dp x tp x pp, ZeRO or not).

The loop's seven calls: ``forward_backward``, ``reduce_gradients``, ``grad_norm_sq``, ``step`` or ``skip_step``,
``zero_grad``, ``evaluate`` (ARCHITECTURE.md, "The loop and the strategy"). :func:`build_strategy` composes a
:class:`Topology`, a :class:`PipelineStage`, a :class:`PipelineEngine`, a :class:`Synchroniser` (DataParallel,
ZeRO, MoE's two-part ones) and an optimizer. Sources: Narayanan et al. 2021 (arXiv:2104.04473), sections 2-3;
Megatron-LM's ``finalize_model_grads`` and ``clip_grad_norm_fp32``.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Protocol

import numpy as np

from minizero import backend, trace
from minizero.autograd import manual_seed
from minizero.autograd.functional import IGNORE_INDEX
from minizero.comm.collectives import all_reduce
from minizero.comm.hierarchical import HierarchicalAllReduce
from minizero.comm.quantized import quantized_all_reduce
from minizero.data import micro_batch_rows
from minizero.memory.bf16 import use_bf16
from minizero.memory.fp8 import AmaxReduction, use_fp8
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT
from minizero.nn.flash_attention import use_flash_attention
from minizero.optim import AdamW
from minizero.optim.adam8bit import Adam8bit, ShardedAdam8bit
from minizero.parallel.context_parallel import chunk_ids, context_group, context_parallelize
from minizero.parallel.data_parallel import DataParallel, check_steps
from minizero.parallel.expert_parallel import (ExpertDataParallel, ExpertLoad, ExpertZero, aux_loss_seeder,
                                              expert_groups, gather_experts, use_moe, whole_experts)
from minizero.parallel.overlap import OverlappedReducer, can_overlap
from minizero.parallel.pipeline import PipelineEngine, PipelineStage, allreduce_tied_embedding_grads
from minizero.parallel.schedule import V_SHAPED
from minizero.parallel.sequence_parallel import SequenceParallelGrads
from minizero.parallel.three_d import (build_stage, gather_full_model, gather_routing_biases, grad_norm_sq,
                                       scratch_ledger, traffic_by_group)
from minizero.parallel.topology import Topology
from minizero.zero import shards_parameters, zero_optimizer
from minizero.zero.hybrid import hybrid_groups
from minizero.zero.stage1 import SETUP_GATHER


#: traffic labels (``comm.traffic.op``) of the data group, by purpose
GRADIENT_REDUCTIONS = ("all_reduce", "reduce_scatter", "quantized_reduce_scatter", "quantized_all_reduce")
PARAMETER_GATHERS = ("all_gather", "quantized_all_gather", "broadcast", "broadcast_params", SETUP_GATHER)
TRAFFIC_KINDS = ("gradient_reduction", "parameter_gathers", "pipeline_activations", "tensor_parallel_activations",
                 "context_parallel_attention", "expert_all_to_all", "validation", "other")
VALIDATION = "validation"  #: the traffic label of :meth:`Strategy.evaluate`: every byte its forward passes send


class Synchroniser(Protocol):
    """The gradient synchroniser a :class:`Strategy` holds; ``tests/test_readable.py`` checks every one built."""

    def reduce_gradients(self) -> None:
        """Collective, once a step after backward: this rank's gradients (or owned shards) become the group's mean."""

    def local_grads(self) -> list:
        """The gradient arrays this rank holds after :meth:`reduce_gradients` (the FP16 overflow check reads them)."""

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective: the squared global norm (float64) of the gradients of the parameters ``counts(p)`` accepts."""

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """Collective context in which every parameter's ``.data`` is whole (ZeRO-3 gathers)."""

    def bytes_per_step(self, steps: int) -> float:
        """Bytes this rank sent per optimizer step for gradient reduction (and ZeRO's parameter gathers)."""

    def held_grad_pieces(self, params) -> list | None:
        """None where ``params``' gradients stay whole until :meth:`reduce_gradients`; else (reduced inside backward,
        ZeRO 2-3) ``(p, lo, hi, view)`` for each owned piece ``[lo, hi)`` (flat) of them, in shard order."""


class Strategy:
    """One rank's part of a training layout, behind the seven calls the training loop makes.

    Attributes: topo; stage (the whole GPT when pp = 1); model (the whole GPT when tp = pp = 1, else None);
    engine; sync (the gradient synchroniser: ``reducer`` when overlapping); dp (the plain DataParallel the builder
    made, the given ``sync`` or what ``reducer`` reduces, else None); opt (the optimizer, which is ``sync`` under
    ZeRO); params (this rank's parameters); before_forward, after_backward, after_step (hook lists: a step's
    backward seed per micro-batch before its forwards; after the gradients are reduced; after ``opt.step``, and
    after a skipped step, with ``applied=False``).
    """

    def __init__(self, topo: Topology, stage: PipelineStage, model, engine: PipelineEngine, sync: Synchroniser, opt,
                 predivide: bool = False, overlap: bool = False, cp: int = 1, padded: bool = False,
                 expert_load=None, ep_comm=None, make_model=None, edp_comm=None, dp: DataParallel | None = None):
        self.topo, self.stage, self.model, self.engine, self.sync, self.opt = topo, stage, model, engine, sync, opt
        # MoE (expert_parallel.py): the per-step load and bias update, the expert group, the whole model's shape,
        # the expert-data group (the traffic table's edp row)
        self.expert_load, self.ep_comm, self.make_model, self.edp_comm = expert_load, ep_comm, make_model, edp_comm
        #: hook(seed) before the step's forward passes, ``seed`` one micro-batch's backward seed (MoE's aux losses)
        self.before_forward = []
        self.after_step = [] if expert_load is None else [expert_load.after_step]  #: collectives after opt.step
        self.dp = dp  # the overlapped reducer and the traffic table's ring-vs-hierarchical line read its buckets
        self.cp = cp  # --cp: the data group (topo.dp ranks) is dp x cp; the rows are the data rank's, dp_rank // cp
        # --pad: targets may be IGNORE_INDEX, so a step counts its real targets (one all-reduce); without it
        # every target is real, the count is B*T and each micro-batch's mean weighs 1/m as it always did
        self.padded = padded
        # FP16: every rank seeds backward with S / (k dp), so its local gradients are its share of the
        # global mean and never exceed what one process would hold; the data group then just sums
        # (DeepSpeed's prescale_gradients; PyTorch DDP instead divides each gradient as it copies it into its bucket)
        # (the synchroniser was built with predivided=True then: build_strategy)
        self.seed_divisor = topo.dp if predivide and topo.dp > 1 else 1
        self.params = stage.parameters()
        self.after_backward = []  #: what reduce_gradients runs last, every rank, once a step (FP8's amax reduction)
        self.sequence_parallel_grads = SequenceParallelGrads(self.params, topo.tp_comm)
        #: the overlapped bucket all-reduce (DDP's Reducer) and then ``sync``, or None: ``dp`` reduces after backward
        self.reducer = None
        if overlap and can_overlap(dp):
            tied = [stage.transformer["wte"].weight if stage.is_first else stage.lm_head.weight] \
                if stage.num_stages > 1 and (stage.is_first or stage.is_last) else []
            # the sequence-parallel norms' and biases' gradients are summed over the tensor group after backward too
            sliced = [p for p in self.params if getattr(p, "sequence_parallel", False)]
            self.sync = self.reducer = OverlappedReducer(dp, defer=tied + sliced)

    @property
    def holds_loss(self) -> bool:
        """True on the ranks whose :meth:`forward_backward` returns the loss (last stage, tensor rank 0)."""
        return self.stage.is_last and self.topo.tp_rank == 0

    def forward_backward(self, micro_batches, loss_scale: float = 1.0) -> float:
        """Forward and backward of the step's m micro-batches; gradients accumulate in ``.grad``. Each
        ``before_forward`` hook gets one micro-batch's backward seed first (S / :attr:`seed_divisor` / m).

        Args:
            micro_batches: m pairs (x, y) of (b, T) int64 ids and targets (``IGNORE_INDEX`` allowed if ``padded``).
            loss_scale: S; after :meth:`reduce_gradients` every gradient is S times that of the global mean loss.
        Returns the sum of the m micro-batch mean losses on :attr:`holds_loss` ranks, 0.0 elsewhere (``padded``:
        each weighted by m D n_i / N, N the global batch's real targets). Collective (``padded`` only): one float64
        all-reduce over the data group (``token_count``). Raises ValueError (that rank only): an ignored target
        without ``padded``.
        """
        counts = [self.real_targets(y) for _, y in micro_batches]
        if not self.padded and any(c != y.size // self.cp for c, (_, y) in zip(counts, micro_batches)):
            raise ValueError(f"targets equal to ignore_index {IGNORE_INDEX} in a step of a strategy that counts every "
                             "target: build it with padded=True so the loss is normalised by the global count")
        if self.reducer is not None:
            self.reducer.begin_step(len(micro_batches))
        shares = None
        if self.padded:
            with self.topo.dp_comm.traffic.op("token_count"):
                n = all_reduce(self.topo.dp_comm, backend.to_device(np.array([float(sum(counts))])))
            n = float(backend.to_host(n)[0])
            shares = [len(counts) * self.topo.dp * c / n for c in counts]
        seed = loss_scale / self.seed_divisor
        for hook in self.before_forward:  # per micro-batch, as the main loss is seeded (no --pad with MoE)
            hook(seed / len(micro_batches))
        data_rank, data_size, m = self.topo.dp_rank // self.cp, self.topo.dp // self.cp, len(micro_batches)
        rows = [micro_batch_rows(k, len(x), m, data_rank, data_size) for k, (x, _) in enumerate(micro_batches)]
        return self.engine.forward_backward(micro_batches, loss_scale=seed, shares=shares, rows=rows)

    def real_targets(self, y) -> int:
        """How many of the targets ``y`` (b, T) this rank's loss counts: not ``IGNORE_INDEX``, in its context chunks."""
        real = backend.to_host(y) != IGNORE_INDEX  # on the host, where the sampler made them
        if self.cp == 1:
            return int(real.sum())
        chunks = np.split(real, 2 * self.cp, axis=1)  # split_for_context_parallel's chunks, counted on the host
        return sum(int(chunks[c].sum()) for c in chunk_ids(self.topo.dp_rank % self.cp, self.cp))

    def reduce_gradients(self) -> None:
        """Collective: the tied embedding's two copies summed (pp > 1), the data-group average with the
        sequence-parallel norms' and biases' gradients summed over the tensor group (--sequence-parallel)."""
        allreduce_tied_embedding_grads(self.stage, self.topo.embed_comm)
        self.sequence_parallel_grads.reduce(self.sync)
        for hook in self.after_backward:  # after the gradient collectives: none of theirs is in flight
            hook()

    def local_grads(self) -> list:
        """The gradient arrays this rank holds (every ``.grad``, or a ZeRO rank's gradient shards)."""
        return list(self.sync.local_grads())

    def grad_norm_sq(self) -> float:
        """Collective: the squared global gradient norm (float64 sum, each model element once)."""
        return grad_norm_sq(self.topo, self.sync)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """The optimizer update at learning rate ``lr`` on gradients multiplied by ``grad_scale``."""
        self.opt.set_lr(lr)
        with trace.span("optimizer step", "optimizer"):
            self.opt.step(grad_scale=grad_scale)
        for hook in self.after_step:  # every rank, after each update (MoE: the step's expert load, the routing bias)
            hook(applied=True)

    def skip_step(self) -> None:
        """A step the loss scaler skipped: no update; the after-step collectives still run (MoE: the load counted,
        the routing bias kept), on every rank, as after an update."""
        for hook in self.after_step:
            hook(applied=False)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def full_parameters(self):
        """Context in which every parameter's ``.data`` is whole (ZeRO-3 gathers; otherwise nothing to do)."""
        return self.sync.full_parameters()

    def evaluate(self, batches) -> float:
        """Collective: mean validation loss over ``batches`` (rows ``dp_rank::dp``), independent of the layout.

        A data rank with no rows runs one uncounted row, so every rank joins every collective.
        """
        topo, stage = self.topo, self.stage
        was_training = stage.training
        stage.eval()
        total = np.zeros(2)  # [sum of per-sequence (per real target) mean losses, number of sequences (targets)]
        with topo.world.traffic.labelled(VALIDATION):  # in every group's ledger: kept out of the per-step figures
            for x, y in batches:
                rows = slice(topo.dp_rank // self.cp, None, topo.dp // self.cp)  # a context group shares its rows
                xs, ys = x[rows], y[rows]
                n = (self.real_targets(ys) if self.padded else len(xs)) if len(xs) else 0
                loss = self.engine.forward_only(*((xs, ys) if len(xs) else (x[:1], y[:1])))
                if self.holds_loss and n:
                    total += [loss * n, n]
            with topo.world.traffic.op("metrics"):
                total = backend.to_host(all_reduce(topo.world, backend.to_device(total)))  # host metrics, device coll.
        stage.train(was_training)
        return float(total[0] / total[1])

    def full_model(self):
        """Collective: the whole GPT — the local model itself when tp = pp = 1 (every rank), else
        gathered onto world rank 0 (None elsewhere; :func:`gather_full_model`)."""
        if self.model is not None:
            if self.ep_comm is None:
                return self.model
            with scratch_ledger():  # the gathered copy is the output, not the training's memory
                whole = self.make_model()
            with self.full_parameters():  # ZeRO-3: gathered first
                return gather_experts(self.model, whole, self.ep_comm)
        with self.full_parameters(), whole_experts(self.stage, self.ep_comm):
            whole = gather_full_model(self.stage, self.topo, self.stage.config, make_model=self.make_model)
        if self.expert_load is None:
            return whole
        load = self.expert_load  # the routing biases are no parameters: gathered on their own
        return gather_routing_biases(self.stage, whole, self.topo, load.all_layers, load.experts)

    def traffic(self) -> dict:
        """Bytes sent per group: ``{group: traffic snapshot}`` for tp, dp, pp, embed and world, and ``edp`` (MoE's
        expert-data group, whose bytes are in dp's too) under ``--ep``."""
        out = traffic_by_group(self.topo)
        if self.edp_comm is not None:
            out["edp"] = self.edp_comm.traffic.snapshot()
        return out

    def traffic_by_kind(self) -> dict:
        """Bytes this rank sent over the run, by purpose (:data:`TRAFFIC_KINDS`, from each group's traffic ledger;
        ``expert_all_to_all``: MoE's dispatch and combine)."""
        by = {name: c.traffic.snapshot()["by_op"] for name, c in self.topo.groups().items()}
        # MoE refuses --cp: the all-to-alls are its
        a2a, moe = by["dp"].get("all_to_all", 0), self.expert_load is not None
        kinds = {
            "gradient_reduction": sum(by["dp"].get(op, 0) for op in GRADIENT_REDUCTIONS) + sum(by["embed"].values()),
            "parameter_gathers": sum(by["dp"].get(op, 0) for op in PARAMETER_GATHERS)  # + the model's final gather:
            + self.topo.world.traffic.by_op.get("gather_model", 0),  # onto world rank 0, over the world
            # the embedding group is split from the pipeline group: its all-reduce is in both ledgers, counted once
            "pipeline_activations": sum(by["pp"].values()) - sum(by["embed"].values()) - by["pp"].get(VALIDATION, 0),
            "tensor_parallel_activations": sum(by["tp"].values()) - by["tp"].get(VALIDATION, 0),
            "context_parallel_attention": by["dp"].get("ring_attention", 0) + (0 if moe else a2a),
            "expert_all_to_all": a2a + by["dp"].get("all_to_all_counts", 0) if moe else 0,
            VALIDATION: self.topo.world.traffic.by_op.get(VALIDATION, 0),  # every group's, through its parent
        }
        kinds["other"] = self.topo.world.traffic.bytes_sent - sum(kinds.values())
        return kinds

    def model_state_bytes_per_step(self, steps: int) -> float:
        """Bytes this rank sent per optimizer step for gradient reduction and ZeRO's parameter gathers. Raises
        ValueError: ``steps`` not an integer >= 0 (:func:`~minizero.parallel.data_parallel.check_steps`; ZeRO's
        count, which reads no ``steps``, accepted any)."""
        return self.sync.bytes_per_step(check_steps(steps))


def build_strategy(args, comm, cfg, forward_context=None, store=None, log=print) -> Strategy:
    """Build this rank's :class:`Strategy` for ``args`` (from :func:`minizero.args.parse_args`).

    ``forward_context``: callable returning a context entered around every forward (activation offload);
    ``store``: the optimizer-state store (optimizer offload).
    """
    cp = args.cp
    topo = Topology(comm, args.dp * cp, args.tp, args.pp)  # --cp: the data group holds dp x cp ranks
    cp_comm = context_group(topo.dp_comm, cp)
    manual_seed(args.seed * 1000)  # one stream everywhere: masks are addressed by dropout site and global row
    meta = shards_parameters(args.zero)  # ZeRO-3 draws only the owned pieces of meta parameters (nn/init.py)
    if args.tp * args.pp * cp == 1:  # the whole model, built as one process builds it
        model = GPT(cfg, seed=args.seed, meta=meta)
        stage = PipelineStage(model, 0, 1)
    else:
        model, stage = None, build_stage(cfg, args.seed, topo, args.sequence_parallel,
                                         args.virtual_stages, keep_meta=meta, v_shape=args.schedule in V_SHAPED)
    if args.attention == "flash":  # before context parallelism and recompute replace or wrap the cores
        use_flash_attention(stage, args.attention_block)
    if cp > 1:
        # either order with recompute: selective recompute wraps the ring core
        context_parallelize(stage, cp_comm, args.cp_attention)
    moe, ep_comm, edp_comm, expert_load, make_model = args.moe_config(), None, None, None, None
    if moe is not None:  # before the precision converts the products and recompute wraps the blocks
        if args.ep > 1:
            ep_comm, edp_comm = expert_groups(topo.dp_comm, args.ep)
        layers = use_moe(stage, moe, args.seed, ep_comm)
        expert_load = ExpertLoad(layers, moe.layers(cfg.n_layer), moe.experts, comm, topo.tp_rank == 0,
                                 moe.bias_update)

        def make_model():  # the whole model's shape, to gather into (ep 1)
            model = GPT(cfg, seed=args.seed)
            use_moe(model, moe, args.seed)
            return model
    if args.precision == "bf16":  # before recompute wraps the blocks
        use_bf16(stage)
    elif args.precision == "fp8":
        use_fp8(stage, args.fp8_scaling, cp_comm)  # a sequence chunk's casts take the whole sequence's amax
    if model is not None:  # the one stage shares the model's blocks, not its head attribute: the GPT samples with it
        model.lm_head = stage.lm_head
    apply_recompute(stage, args.recompute, args.recompute_every)
    params = stage.parameters()
    fp16 = args.precision == "fp16"
    predivided = fp16 and topo.dp > 1  # the backward seed carries 1/dp (Strategy.seed_divisor): reduce by a sum
    dp = None  # a plain DataParallel (Strategy.dp): not under ZeRO, not MoE's two-part synchroniser
    if args.zero:
        # --dp-shard N < dp: ZeRO's group is N data ranks, the gradients summed across the replicas too (zero/hybrid.py)
        hybrid = args.hybrid_sharding()  # data group dp x cp: N x cp ranks a group
        shard_comm, replicas = hybrid_groups(topo.dp_comm, args.dp_shard * args.cp if hybrid else topo.dp)

        def adam8bit_state(shard_map):  # with --optimizer adam8bit the 8-bit state is what gets sharded
            return ShardedAdam8bit(shard_map, shard_comm, cfg.dtype, block_size=args.adam8bit_block_size)

        state = adam8bit_state if args.optimizer == "adam8bit" else None
        kw = dict(lr=args.lr, weight_decay=args.weight_decay, native=args.native_comm, sharded_state=state,
                  quantized_comm=args.quantized_comm, master_weights=fp16, store=store, prefetch=args.overlap,
                  overlap_reduce=args.overlap, predivided=predivided,
                  check_order=True if args.debug_collectives else None)  # None: the env switch
        if ep_comm is not None:  # experts sharded over their expert-data group (expert_parallel.py)
            sync = opt = ExpertZero(stage, shard_comm, edp_comm, args.ep, args.zero, replicas=replicas, **kw)
        else:
            sync = opt = zero_optimizer(stage, shard_comm, args.zero, replicas=replicas, **kw)
    elif ep_comm is not None:
        sync = ExpertDataParallel(params, topo.dp_comm, edp_comm, args.ep, bucket_bytes=int(args.bucket_mb * 2 ** 20),
                                  predivided=predivided)
        opt = AdamW(params, lr=args.lr, weight_decay=args.weight_decay, master_weights=fp16, store=store)
    else:
        hierarchical = args.allreduce == "hierarchical"
        allreduce = HierarchicalAllReduce(topo.dp_comm) if hierarchical else None
        if args.quantized_comm:  # INT8 on the wire (comm/quantized.py)
            allreduce = functools.partial(quantized_all_reduce, topo.dp_comm)
        sync = dp = DataParallel(params, topo.dp_comm, bucket_bytes=int(args.bucket_mb * 2 ** 20),
                                 native=args.native_comm, allreduce=allreduce, predivided=predivided)
        if args.optimizer == "adam8bit":
            opt = Adam8bit(params, lr=args.lr, weight_decay=args.weight_decay, block_size=args.adam8bit_block_size,
                           master_weights=fp16)
        else:
            opt = AdamW(params, lr=args.lr, weight_decay=args.weight_decay, master_weights=fp16, store=store)
    verbose = args.pp_verbose and topo.tp_rank == 0 and topo.dp_rank == 0  # one pipeline speaks
    log_line = lambda s: print(f"[rank {comm.rank}] {s}", flush=True)  # noqa: E731
    overlap = args.overlap
    engine = PipelineEngine(stage, topo.pp_comm, args.schedule, verbose=verbose, forward_context=forward_context,
                            log=log_line, overlap=overlap)
    strategy = Strategy(topo, stage, model, engine, sync, opt, predivide=fp16, overlap=overlap,
                        cp=cp, padded=args.documents == "pad",
                        expert_load=expert_load, ep_comm=ep_comm, make_model=make_model, edp_comm=edp_comm, dp=dp)
    if moe is not None:  # the Switch and z losses seeded as the main loss is
        strategy.before_forward.append(aux_loss_seeder(stage))
    if args.precision == "fp8" and args.fp8_scaling == "delayed":  # every replica's scales the group's max
        strategy.after_backward.append(AmaxReduction(stage, topo.dp_comm).reduce)
    return strategy


def describe_batch(args, cfg) -> str:
    """The batch arithmetic in one line: B = b x dp x k sequences of T tokens."""
    return (f"global batch {args.batch_size} sequences x {cfg.block_size} tokens "
            f"({args.batch_size * cfg.block_size:,} tokens per step) = micro-batch {args.micro_batch_size} "
            f"x {args.dp} data rank(s) x {args.grad_accum} micro-batch(es)")
