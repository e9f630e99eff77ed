"""Pipeline parallelism: the layers split into ``pp`` stages, micro-batches streamed through them.

Per op of a schedule (:mod:`minizero.parallel.schedule`): F(i) receives a (b, T, C) activation from the previous stage
and sends its output on; B(i) receives dL/dy (last stage: seeds S/m) and sends dL/dx back; W(i) computes B(i)'s weight
gradients. A blocking send and the next receive from the same neighbour are one ``sendrecv`` (no 1F1B deadlock); with
``overlap`` every send is an ``isend``. Sources: GPipe, arXiv:1811.06965; Narayanan et al., arXiv:2104.04473,
section 2.2; Megatron-LM ``core/pipeline_parallel/schedules.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import numpy as np

from minizero import backend, trace
from minizero.autograd import Tensor, backward, no_grad
from minizero.autograd.rng import batch_rows, reserve
from minizero.comm.collectives import all_reduce, shard_range
from minizero.comm.nonblocking import wait_all
from minizero.ledger import get_ledger
from minizero.nn.module import CrossEntropyLoss, Linear, Module, ModuleDict, ModuleList, Parameter
from minizero.nn.init import copy_or_meta
from minizero.autograd.split_backward import WeightGradients
from minizero.parallel.schedule import V_SHAPED, make_schedule, peak_in_flight, split_backwards

PP_TAG = 1100  #: tag of every pipeline message of one-chunk schedules (one direction per pair, in order)
ACT_TAG, GRAD_TAG = 1110, 1111  #: with chunks (v > 1): the tags of activations and of gradients


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """The block indices of ``stage``: contiguous, the first ``n_layer % pp`` stages one longer."""
    lo, n = shard_range(n_layer, pp, stage)
    return range(lo, lo + n)


class _Layers(ModuleList):
    """A stage's blocks as a ModuleList named by their index in the whole model (``"2"``, ``"3"``)."""

    def __init__(self, blocks: dict):
        Module.__init__(self)
        for name, block in blocks.items():
            setattr(self, name, block)


class PipelineStage(Module):
    """One pipeline stage of a GPT: blocks ``shard_range(n_layer, pp, stage)``, the same module objects as ``model``.

    First stage: embeddings; last: ln_f and the tied head's copy ``lm_head.weight``. ``forward(x, targets=None)``:
    x (b, T) ids on the first stage, else (b, T, C) -> (b, T, C), or on the last stage the mean loss with
    ``targets``, else logits (b, T, V) ((b, T, V/tp) vocab-parallel).
    Raises ValueError: num_stages outside [1, n_layer] or stage outside [0, num_stages).
    """

    def __init__(self, model, stage: int, num_stages: int):
        super().__init__()
        cfg = model.config
        if not 1 <= num_stages <= cfg.n_layer or not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} of {num_stages}: need 1 <= stages <= n_layer={cfg.n_layer}")
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.layers = stage_layers(cfg.n_layer, num_stages, stage)
        tr = model.transformer
        mods = {}
        if self.is_first:
            mods.update(wte=tr["wte"], wpe=tr["wpe"], drop=tr["drop"])
        mods["h"] = _Layers({str(i): tr["h"][i] for i in self.layers})
        if self.is_last:
            mods["ln_f"] = tr["ln_f"]
        self.transformer = ModuleDict(mods)
        self.sequence_splits = {}  # {technique: ways} each technique that splits the sequence declares
        self.v_shape = False  # an InterleavedStage's chunks may sit in a V (ZB-V); one stage is one chunk
        if self.is_last and self.is_first:
            self.lm_head = model.lm_head  # weight shared with wte: one Parameter
        elif self.is_last:
            w = Parameter(copy_or_meta(model.lm_head.weight.data))  # a meta weight stays 0 bytes
            w.shared_embedding_copy = True
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, weight=w)
        if self.is_last:  # a child: vocab_parallel.py puts its split loss in beside its split head
            self.loss = CrossEntropyLoss()
        #: the pipeline ranks of the previous and next stage (None past an end); interleave() sets them for chunks
        self.prev_rank = None if self.is_first else stage - 1
        self.next_rank = None if self.is_last else stage + 1

    @property
    def chunks(self) -> list:
        """``[self]``: one stage is its own one chunk (an ``InterleavedStage`` holds v, in chunk order)."""
        return [self]

    def rank_of_layer(self, layer: int) -> int:
        """The pipeline rank holding block ``layer`` (one stage per rank)."""
        return next(s for s in range(self.num_stages) if layer in stage_layers(self.config.n_layer, self.num_stages, s))

    def forward(self, x, targets=None):
        tr = self.transformer
        if self.is_first:
            idx = x.data if isinstance(x, Tensor) else x
            x = tr["drop"](tr["wte"](idx) + tr["wpe"](backend.xp.arange(idx.shape[1])))
        for block in tr["h"]:
            x = block(x)
        if not self.is_last:
            return x
        logits = self.lm_head(tr["ln_f"](x))
        if targets is None:
            return logits
        b, t, v = logits.shape
        return self.loss(logits.reshape(b * t, v), targets.reshape(b * t))

    def add_sequence_split(self, technique: str, ways: int) -> None:
        """``technique`` (sequence_parallel.py: t, context_parallel.py: c) splits the sequence ``ways`` ways."""
        self.sequence_splits[technique] = ways

    @property
    def sequence_shards(self) -> int:
        """The product of the declared splits: activations between stages are (b, T/shards, C)."""
        return math.prod(self.sequence_splits.values())

    def activation_shape(self, idx_shape) -> tuple:
        """Shape (b, T / sequence_shards, C) of the activation between stages for token ids of shape (b, T)."""
        return (idx_shape[0], idx_shape[1] // self.sequence_shards, self.config.n_embd)


def allreduce_tied_embedding_grads(stage: PipelineStage, embed_comm) -> None:
    """Sum the gradients of ``wte`` (first stage) and its copy ``lm_head.weight`` (last stage): one all-reduce of
    (V, C) over ``embed_comm`` (those two stages), V*C*itemsize bytes per rank; no-op on a middle stage and where one
    rank holds both ends."""
    if stage.is_first == stage.is_last:
        return
    p = stage.transformer["wte"].weight if stage.is_first else stage.lm_head.weight
    if p.grad is None:
        p.grad = backend.xp.zeros_like(p.data)
        get_ledger().track(p.grad, "gradients")
    all_reduce(embed_comm, p.grad, out=p.grad)


def deferred_weights(chunk) -> list:
    """The Parameters whose gradients a split backward leaves to W: the blocks' weight matrices (ndim >= 2).
    Embeddings, head, layer norms and biases get theirs at B, so a W keeps only the (input, output gradient) of the
    blocks' matrix products (Qi et al. 2024, section 2: W is the matmuls' weight gradients)."""
    return [p for p in chunk.transformer["h"].parameters() if p.data.ndim >= 2]


@dataclasses.dataclass
class _Step:
    """Step inputs (``scale``: S/m); by (mb, chunk): ``split`` Bs, ``held`` F's (input, output), ``deferred`` Ws."""
    micro_batches: list
    rows: list
    shares: list
    scale: float
    split: set
    held: dict = dataclasses.field(default_factory=dict)
    deferred: dict = dataclasses.field(default_factory=dict)
    loss_sum: float = 0.0


class _PendingSend(NamedTuple):
    """A blocking send held back to pair it with the next receive from ``dest`` (one ``sendrecv``)."""
    array: object
    dest: int
    label: str
    what: str
    tag: int


class _InFlightSend(NamedTuple):
    """An isend not yet waited for; ``array`` held until then, ``channel`` its (dest, tag)."""
    request: object
    array: object
    channel: tuple


class PipelineEngine:
    """Runs micro-batches through this rank's chunks by a schedule, exchanging activations and gradients.

    Args:
        stage: a :class:`PipelineStage` (v = 1) or an ``InterleavedStage`` (v > 1).  comm: the pipeline group.
        schedule: a name of :data:`~minizero.parallel.schedule.ALL_SCHEDULES`.  verbose: log every message.
        log: where ``verbose`` writes.  pair_sends: a send goes with the next receive from the same neighbour.
        forward_context: callable returning a context entered around every forward.  overlap: sends are ``isend``.
    Attributes: peak_in_flight (most micro-batches held in the last step); trace (the last step's ops).
    Traffic: per micro-batch and chunk one (b, T/shards, C) ``pp_activation`` forward, one ``pp_gradient`` backward.
    Raises ValueError: ``comm`` not this stage's pipeline group; unknown schedule; a zb-v schedule and a stage not
    built in a V (or the reverse); v > 1 without isend/irecv.
    """

    def __init__(self, stage: PipelineStage, comm, schedule: str = "1f1b", verbose: bool = False, log=print,
                 pair_sends: bool = True, forward_context=None, overlap: bool = False):
        if comm.world_size != stage.num_stages or comm.rank != stage.stage:
            raise ValueError(f"pipeline communicator rank {comm.rank}/{comm.world_size} does not match "
                             f"stage {stage.stage}/{stage.num_stages}")
        self.chunks = stage.chunks  # v = 1: the stage is its one chunk
        v = len(self.chunks)
        if (schedule in V_SHAPED) != stage.v_shape:
            raise ValueError(f"the {schedule!r} schedule needs a stage built with v_shape="
                             f"{schedule in V_SHAPED} (build_stage): zb-v runs chunks placed in a V, the others not")
        make_schedule(schedule, stage.num_stages, stage.num_stages, v)  # validates the name and v
        if v > 1 and not comm.nonblocking:  # every send an isend (a blocking one could deadlock with chunks)
            raise ValueError(f"the {schedule} schedule sends with isend/irecv, which {type(comm).__name__} "
                             "does not have (use MPI's communicator, or the 1f1b / gpipe schedule)")
        self.stage, self.comm, self.schedule = stage, comm, schedule
        self.verbose, self.log, self.pair_sends = verbose, log, pair_sends
        self.forward_context = forward_context or contextlib.nullcontext
        self.peak_in_flight, self.trace = 0, []
        self._pending = None  # a _PendingSend, without overlap
        #: overlap: every send is an isend posted at once, so the stage computes while it travels
        #: (Megatron's p2p_communication with async ops), waited for at a fixed point: the next send on its channel
        #: or, one chunk per stage, the next receive. So its buffer lives (and the ledger's peak is) the same
        #: whenever MPI completes it. Receives wait (their data is needed now). Off: blocking, paired.
        self.nonblocking = (overlap or v > 1) and comm.world_size > 1 and comm.nonblocking
        #: with chunks a rank sends activations and gradients to the same neighbour: a tag each keeps them apart
        self.act_tag, self.grad_tag = (ACT_TAG, GRAD_TAG) if v > 1 else (PP_TAG, PP_TAG)
        self._sends: list[_InFlightSend] = []
        self._local = {}  # tag -> arrays passed between this rank's own chunks (ZB-V's turn), oldest first

    # -- messages ------------------------------------------------------------------------
    def _say(self, text):
        if self.verbose:
            self.log(f"[stage {self.stage.stage}] {text}")

    def _post(self, array, dest: int, label: str, what: str, tag: int) -> None:
        if dest == self.comm.rank:  # to this rank's other chunk: no message
            self._say(f"{what} {array.shape} ──> own next chunk (no message)")
            self._local.setdefault(tag, []).append(array)
            return
        if self.nonblocking:
            array = backend.xp.ascontiguousarray(array)
            self._flush((dest, tag))  # the previous send on this channel completes first: one in flight on each
            self._say(f"{what} {array.shape} {array.nbytes} B ──> stage {dest} (isend)")
            with self.comm.traffic.op(label):
                self._sends.append(_InFlightSend(self.comm.isend(array, dest, tag=tag), array, (dest, tag)))
            return
        self._flush()
        self._pending = _PendingSend(backend.xp.ascontiguousarray(array), dest, label, what, tag)

    def _flush(self, channel=None) -> None:
        """Wait for the isends in flight (``channel``: only those to that (peer, tag)); send a held blocking send."""
        waited = [s.request for s in self._sends if channel is None or s.channel == channel]
        if waited:
            with self.comm.traffic.span("wait sends"):
                wait_all(self.comm, waited, "pipeline sends")
            self._sends = [s for s in self._sends if channel is not None and s.channel != channel]
        if self._pending is not None:
            send, self._pending = self._pending, None
            self._say(f"{send.what} {send.array.shape} {send.array.nbytes} B ──> stage {send.dest}")
            with self.comm.traffic.op(send.label):
                self.comm.send(send.array, send.dest, tag=send.tag)

    def _recv(self, shape, source: int, what: str, tag: int):
        if source == self.comm.rank:
            return self._local[tag].pop(0)
        buf = backend.xp.empty(shape, dtype=backend.get_dtype(self.stage.config.dtype))
        if self.nonblocking:
            with self.comm.traffic.span(f"recv {what}", peer=source, bytes=buf.nbytes):
                wait_all(self.comm, [self.comm.irecv(buf, source, tag=tag)], f"pipeline receive of {what}",
                         peer=source)
            # one chunk: our sends are waited for here, where the blocking engine sends them; with chunks (ZB-V)
            # that could deadlock: the neighbour may take our send only after one we have yet to post
            if len(self.chunks) == 1:
                self._flush()
            self._say(f"{what} {shape} <── stage {source}")
            return buf
        send = self._pending
        if send is not None and send.dest == source and send.tag == tag and self.pair_sends:  # one sendrecv for both
            self._pending = None
            self._say(f"{send.what} {send.array.shape} {send.array.nbytes} B ──> stage {source}, and "
                      f"{what} <── stage {source} (sendrecv)")
            with self.comm.traffic.op(send.label):
                self.comm.sendrecv(send.array, source, buf, source, tag=tag)
        else:
            self._flush()
            self.comm.recv(buf, source, tag=tag)
            self._say(f"{what} {shape} <── stage {source}")
        return buf

    # -- one optimizer step ----------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float = 1.0, shares=None, rows=None) -> float:
        """Forward and backward of every micro-batch by the schedule; gradients accumulate in ``.grad``.

        Args:
            micro_batches: m pairs (x, y) of (b, T) ids and targets, the same list on every stage.
            loss_scale: S; the last stage seeds each backward with S/m.
            shares: None, or m weights w_i (seed S w_i / m; the loss counts w_i times).
            rows: m pairs (lo, total): micro-batch i's rows of the step's global batch (default (i b, m b)); its
                forward runs in ``rng.batch_rows(lo, total)``: one process's dropout masks of those rows.
        Returns the sum of the (weighted) micro-batch mean losses on the last stage; 0.0 elsewhere.
        """
        mbs = list(micro_batches)
        rows = [(i * len(x), len(mbs) * len(x)) for i, (x, _) in enumerate(mbs)] if rows is None else list(rows)
        ops = make_schedule(self.schedule, self.stage.num_stages, len(mbs), len(self.chunks))[self.stage.stage]
        step = _Step(mbs, rows, [1.0] * len(mbs) if shares is None else list(shares), loss_scale / len(mbs),
                     split_backwards(ops))
        self.trace, self.peak_in_flight = [], 0
        for op in ops:
            {"F": self._forward, "B": self._backward, "W": self._weights}[op.kind](step, op)
            self.trace.append(op)
            self.peak_in_flight = max(self.peak_in_flight, len(step.held) + len(step.deferred))
        self._flush()
        assert self.peak_in_flight == peak_in_flight(ops)
        reserve(1)  # the next step's masks: new keys (rng.fold_in of the offset)
        return step.loss_sum

    def _chunk(self, op):
        """op's chunk, its index and the micro-batch's name in messages (``mb3`` or ``mb3 chunk1``)."""
        c = op.chunk
        return self.chunks[c], c, f"mb{op.mb}" + (f" chunk{c}" if len(self.chunks) > 1 else "")

    def _forward(self, step, op) -> None:
        """F: receive the input (or take the ids), run the chunk, send its output on (or add up the loss)."""
        (x, y), (chunk, c, what) = step.micro_batches[op.mb], self._chunk(op)
        if chunk.is_first:
            inp, x_in = None, backend.to_device(x)
        else:
            inp = x_in = Tensor(self._recv(self.stage.activation_shape(x.shape), chunk.prev_rank, f"act {what}",
                                           self.act_tag), requires_grad=True)
        with self.forward_context(), batch_rows(*step.rows[op.mb]):
            out = chunk(x_in, backend.to_device(y) if chunk.is_last else None)
        if chunk.is_last:
            # a weight-0 micro-batch (only padding) has a NaN mean loss and 0 * NaN is NaN: skipped;
            # the default weight 1.0 keeps the loss bit for bit (1.0 * x is x)
            share = step.shares[op.mb]
            step.loss_sum += share * out.item() if share else 0.0
        else:
            self._post(out.data, chunk.next_rank, "pp_activation", f"act {what}", self.act_tag)
            # backward needs out's graph node, not its values: drop our reference to them
            # (Megatron's deallocate_output_tensor); the pending send still holds the array
            out.data = backend.xp.empty(0, out.dtype)
        step.held[(op.mb, c)] = (inp, out)

    def _backward(self, step, op) -> None:
        """B: dL/d(output) in (last stage: seed S w_i / m), backward, dL/d(input) out; a split B defers to W."""
        (x, _), (chunk, c, what) = step.micro_batches[op.mb], self._chunk(op)
        inp, out = step.held.pop((op.mb, c))
        if chunk.is_last:
            # the seed S/m in at least float32: 65536 is inf in float16 (the loss is float32 anyway)
            grad = backend.xp.full((), step.scale * step.shares[op.mb],
                                   dtype=np.promote_types(out.dtype, np.float32))
        else:
            grad = self._recv(self.stage.activation_shape(x.shape), chunk.next_rank, f"grad {what}", self.grad_tag)
        if inp is not None:  # dL/d(input) accumulates into the buffer we will send: a comm buffer
            inp.grad = backend.xp.zeros(inp.shape, inp.dtype)
            get_ledger().track(inp.grad, "comm_buffers")
        w = WeightGradients(deferred_weights(chunk)) if (op.mb, c) in step.split else None
        if w is not None and not chunk.is_last:  # the received message may outlive B, kept by a W
            get_ledger().track(grad, "comm_buffers")
        with w.deferring() if w is not None else contextlib.nullcontext():
            backward(out, grad)
        if w is not None:
            step.deferred[(op.mb, c)] = w
        if not chunk.is_first:
            self._post(inp.grad, chunk.prev_rank, "pp_gradient", f"grad {what}", self.grad_tag)
            inp.grad = None

    def _weights(self, step, op) -> None:
        """W: the weight gradients a split B deferred."""
        _, c, what = self._chunk(op)
        with trace.span(f"W {what}", "backward"):  # the unit spans cover B; a W is one span of its own
            step.deferred.pop((op.mb, c)).run()

    # -- evaluation ------------------------------------------------------------------------
    def forward_only(self, x, y) -> float:
        """Mean loss of one batch (x, y) (b, T) without a graph; 0.0 off the last stage. Traffic label ``pp_eval``
        (``validation`` when :meth:`Strategy.evaluate` calls it: the outer label names the bytes)."""
        st, loss = self.stage, 0.0
        with no_grad():
            for chunk in self.chunks:
                if chunk.is_first:
                    x_in = backend.to_device(x)
                else:
                    x_in = Tensor(self._recv(st.activation_shape(x.shape), chunk.prev_rank, "eval act", self.act_tag))
                out = chunk(x_in, backend.to_device(y) if chunk.is_last else None)
                if chunk.is_last:
                    loss = out.item()
                else:
                    self._post(out.data, chunk.next_rank, "pp_eval", "eval act", self.act_tag)
                    self._flush()
        return loss
