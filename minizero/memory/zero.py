"""ZeRO stages 1, 2 and 3: shard the optimizer state, then the gradients, then the parameters.

Source: Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020 (arXiv:1910.02054), section 5 and Figure 1
(P_os, P_os+g, P_os+g+p) and section 7.2 (communication). Behaviour mirrored from
DeepSpeed (``stage_1_and_2.py``, ``stage3.py``) and from PyTorch FSDP's flat parameters.

Per rank, for Ψ parameters over N data-parallel ranks, FP32 parameters and gradients
(4 bytes each) and Adam's m and v (K = 8 bytes), one micro-batch per step:

    stage  sharded            model-state bytes per parameter   bytes sent per step (x gradient bytes)
    0      nothing            4 + 4 + 8    = 16                 2(N-1)/N  all-reduce (DataParallel)
    1      optimizer state    4 + 4 + 8/N                       2(N-1)/N  reduce-scatter g + all-gather p
    2      + gradients        4 + (4 + 8)/N                     2(N-1)/N  the same, g reduced during backward
    3      + parameters       (4 + 4 + 8)/N                     3(N-1)/N  gather p for forward, again for
                                                                          backward, reduce-scatter g

The bookkeeping (zero_shards.py): parameters are grouped into *units* (each transformer
block one, every other parameter-owning module one), each laid flat and padded to a
multiple of N; rank r owns slice r of every unit (:class:`ShardMap`, ``--show-shards``).

The stages, as :class:`ZeroOptimizer` runs them (one optimizer step, M micro-batches):

    stage 1  backward fills full gradients (views of a flat, padded buffer per unit);
             reduce_gradients(): reduce-scatter each unit once per step; step(): AdamW on
             the owned slice; all-gather the parameters.
    stage 2  a unit's gradients go into a fresh flat bucket during backward; when the last
             one has arrived (post-accumulate-grad hooks) the bucket is reduce-scattered in a
             fixed unit order, added into the owned gradient shard and freed: once per
             micro-batch, so accumulation sends M(N-1)/N (zero_buckets.py).
    stage 3  as stage 2, and parameters live only as shards, gathered just before a unit
             runs and freed after, through module hooks and saved-tensor handles
             (zero_stage3.py). Per micro-batch: 3(N-1)/N.

Every collective on a unit first checks that all ranks are at the same (unit, phase)
(zero_collectives.py): ranks that disagree get a :class:`ZeroOrderError`, never a silent sum.

Memory in the ledger: ``parameters``, ``gradients`` and ``optimizer_state`` hold the
persistent figures above; a stage-3 unit's gathered parameters are ``gathered`` and the
stage-2/3 full-size gradient buckets ``comm_buffers``, both alive only while one unit
runs (plus the tied embedding, used at both ends of the model; with prefetch and the
overlapped reduce-scatter, two units: zero_prefetch.py). The ring collectives' own scratch
is ``comm_scratch`` (comm/collectives.py; the overlapped ring's receive chunk, zero_prefetch.py).
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_gather, all_reduce
from minizero.ledger import get_ledger
from minizero.memory.zero_buckets import GradientBuckets
from minizero.memory.zero_collectives import UnitState, ZeroOrderError
from minizero.memory.zero_prefetch import Prefetch
from minizero.memory.zero_shards import (PHASES, STEP_PHASES, Piece, ShardMap, Unit, find_units, model_state_formula,
                                         owned_shard, traffic_formula)
from minizero.memory.zero_stage3 import ParameterPartitioning
from minizero.optim.adamw import adamw_update, state_dtype
from minizero.optim.state_store import OptimizerStateStore
from minizero.optim.used_parameters import used_anywhere

__all__ = ["ZeroOptimizer", "ZeroOrderError", "ShardMap", "Unit", "Piece", "find_units", "model_state_formula",
           "traffic_formula", "model_state_bytes", "gather_figures", "STEP_PHASES", "PHASES"]


def model_state_bytes() -> dict:
    """The calling rank's ledger, current bytes of the model-state categories (and the transient ones)."""
    cur = get_ledger().current
    return {c: cur[c] for c in ("parameters", "gradients", "optimizer_state", "gathered", "comm_buffers")}


class ZeroOptimizer(GradientBuckets, Prefetch, ParameterPartitioning):
    """AdamW on ZeRO-sharded model states: replaces ``DataParallel`` + ``AdamW`` for stages 1, 2, 3.

    Args:
        model: a Module; its parameters are re-homed (see below). Same model, same init on
            every rank (the owner's values win: stages 1-2 all-gather once at set-up).
        comm: the data-parallel Communicator (N = ``comm.world_size``; N = 1 works and saves nothing).
        stage: 1, 2 or 3 (stage 0 is DataParallel + AdamW and stays there).
        lr, betas, eps, weight_decay: as :class:`~minizero.optim.AdamW` (decay on ndim >= 2).
        native: use the MPI library's collectives instead of the hand-written rings.
        master_weights: keep an FP32 master copy of the owned shard (mixed precision, 4/N
            bytes per parameter, counted as ``optimizer_state`` as in the paper's K = 12).
        sharded_state: None (AdamW, m and v below), or ``factory(shard_map) -> state`` of an
            optimizer that keeps its own per-shard state and updates a unit's owned shard with
            ``state.step_unit(unit_index, target, grad_shard, step, lr, beta1, beta2, eps,
            weight_decay, grad_scale)`` (8-bit Adam: ``minizero.optim.adam8bit.ShardedAdam8bit``);
            its messages are counted as ``optimizer_sync``.
        quantized_comm: INT8 on the wire (ZeRO++, ``minizero/comm/quantized.py``) for the
            gradient reduce-scatters and stage 3's forward/backward gathers. The gathers for
            evaluation and saving and the stage 1-2 all-gather of updated parameters stay exact
            (there the gathered copy *is* the parameter, and rounding it every step would lose updates).
        prefetch: stage 3: start the next unit's all-gather while the current one computes
            (zero_prefetch.py; at most two units gathered, plus the tied embedding); default off.
        overlap_reduce: stages 2-3: submit each unit's reduce-scatter and go on with backward
            (zero_prefetch.py), at most ``REDUCE_BUCKETS`` = 2 buckets alive (double buffering: a
            bucket is freed when the next one is submitted, so ``comm_buffers`` is a formula the
            estimator computes). Default off here; the CLI turns it on (``--no-overlap``: off).
        find_unused_parameters: as :class:`~minizero.parallel.data_parallel.DataParallel`'s.
    Who holds what, per unit (S = padded / N elements, d = parameter dtype, s = state dtype):

        stage  parameters               gradients                      m, v     transient
        1      flat (padded,) d,         flat (padded,) d, p.grad views  (S,) s   -
               p.data views
        2      flat (padded,) d          shard (S,) d                    (S,) s   bucket (padded,) d during backward
        3      shard (S,) d; p.data is   shard (S,) d                    (S,) s   gathered (padded,) d while the unit
               a NaN placeholder                                                  runs; bucket during its backward
    Stage 3: between uses ``p.data`` is a read-only NaN array of the right shape
    (``broadcast_to`` of one element), so shapes and parameter counts still work and an
    accidental use is loud; :meth:`full_parameters` gathers everything for saving.
    A tied weight (the LM head's is ``transformer.wte``'s) belongs to one unit used by two
    modules: it stays gathered from its first forward use to its last, and its gradient
    bucket is reduced once, after both contributions (post-accumulate-grad hook).
    A step: forward/backward per micro-batch (loss scaled by 1/M) -> :meth:`reduce_gradients`
    -> :meth:`clip_grad_norm_` -> :meth:`set_lr` -> :meth:`step` -> :meth:`zero_grad`.
    Attributes: ``shard_map``; ``bytes_sent`` (phase -> bytes, cumulative); ``step_bytes``
    (one dict per optimizer step, phase -> bytes).
    Raises:
        ValueError: a stage other than 1, 2, 3; a hyper-parameter out of range; ``quantized_comm``
            with ``native`` (the library's collectives send full precision).
    """

    def __init__(self, model, comm, stage: int, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 native: bool = False, master_weights: bool = False, sharded_state=None, quantized_comm: bool = False,
                 store=None, prefetch: bool = False, overlap_reduce: bool = False, find_unused_parameters: bool = True):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer: stage={stage!r}; allowed: 1, 2, 3 (stage 0 is DataParallel + AdamW)")
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or weight_decay < 0:
            raise ValueError(f"ZeroOptimizer: need lr >= 0, 0 <= betas < 1, eps > 0, weight_decay >= 0; "
                             f"got lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        if quantized_comm and native:
            raise ValueError("ZeroOptimizer: quantized_comm and native exclude each other "
                             "(MPI's collectives send FP32)")
        self.comm, self.stage, self.native, self.master_weights = comm, stage, native, master_weights
        self.predivided = False  # gradients already carry 1/N (FP16's seed): reduce by a plain sum
        self.store = store if store is not None else OptimizerStateStore("none")  # where m, v, masters live
        self.quantized_comm, self.find_unused_parameters = quantized_comm, find_unused_parameters
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.bytes_sent = {ph: 0 for ph in PHASES}
        self.step_bytes = []
        self._step_mark = dict(self.bytes_sent)
        self._pinned = False  # inside full_parameters()
        self._gathered = {}  # id(p.data) -> p, for the pack hook (stage 3)
        self._hook_stack = []  # saved_tensors_hooks opened by pre-hooks, closed by post-hooks
        self.shard_map = ShardMap.from_model(model, comm.world_size)
        self.sharded_state = None if sharded_state is None else sharded_state(self.shard_map)
        self.units = []
        for i, (name, module, params) in enumerate(find_units(model)):
            self.units.append(UnitState(i, self.shard_map.units[i], [p for _, p in params], [module]))
        self._next = len(self.units) - 1  # the next unit to reduce in this micro-batch (stages 2-3, fixed order)
        self._in_micro_batch = False  # a backward touched a unit since the last micro-batch ended (stages 2-3)
        self._unit_of = {id(p): st for st in self.units for p in st.params}
        self._add_tied_users(model)
        for st in self.units:
            self._build(st)
        self._track_gradients()
        if stage in (1, 2):  # every rank takes the owner's values: one all-gather, like DDP's broadcast
            self._all_gather_params("setup")
        for st in self.units if stage >= 2 else ():
            for p in st.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            for m in st.users:
                if stage == 3:
                    m.register_forward_pre_hook(self._gather_hook(st))
                    m.register_forward_hook(self._free_hook(st))
                m.register_forward_hook(self._open_bucket_hook(st))
        self._init_prefetch(model, prefetch, overlap_reduce)

    def _begin_backward(self, st):
        first = not st.in_backward
        super()._begin_backward(st)
        if first:
            self._prefetch_backward(st)  # stage 3 with prefetch: the next unit backward will reach

    def _grad_ready(self, p):
        self._progress()
        super()._grad_ready(p)

    def _reduce_bucket(self, st):
        """As :class:`GradientBuckets`'s, but with overlap the reduce-scatter is submitted, not waited for."""
        if self.overlap_reduce:
            self._start_reduce(st, st.flat_grad)
        else:
            super()._reduce_bucket(st)

    def _finish_micro_batch(self):
        super()._finish_micro_batch()
        self._wait_reduces()

    # ---- set-up -----------------------------------------------------------------------
    def _track_gradients(self):
        """Record, per step, the names of the parameters that received a gradient (post-accumulate-grad hooks);
        ``step`` skips the owned pieces of the others that no rank touched (:meth:`_agree_on_used`), as
        AdamW skips ``grad is None``. A ``sharded_state`` (8-bit Adam) updates its whole shard."""
        self._with_grad = set()
        self._names = [name for st in self.units for name in st.unit.param_names]
        for st in self.units:
            for name, p in zip(st.unit.param_names, st.params):
                p.register_post_accumulate_grad_hook(lambda _p, name=name: self._with_grad.add(name))

    def _agree_on_used(self):
        """Collective: ``_with_grad`` becomes the parameters some rank gave a gradient (a rank that skipped
        one reduced zeros for it): one bitmask all-gather (``used_anywhere``), phase ``used_parameters``."""
        if not self.find_unused_parameters:
            return
        with self._count("used_parameters"):
            used = used_anywhere(self.comm, [name in self._with_grad for name in self._names])
        self._with_grad = {name for name, u in zip(self._names, used) if u}

    def _add_tied_users(self, model):
        """A module outside a unit's subtree that owns one of its parameters (the tied LM head) uses it too."""
        for st in self.units:
            inside = {id(m) for _, m in st.users[0].named_modules()}
            mine = {id(p) for p in st.params}
            for _, m in model.named_modules():
                if id(m) not in inside and any(id(p) in mine for p in m._parameters.values()):
                    st.users.append(m)

    def _build(self, st):
        """Move a unit's parameters into its flat buffer (stages 1-2) or its shard (stage 3)."""
        xp, ledger, u = backend.xp, get_ledger(), st.unit
        dtype = st.params[0].dtype
        if any(p.dtype != dtype for p in st.params):
            raise ValueError(f"unit {u.name!r} mixes parameter dtypes {sorted({str(p.dtype) for p in st.params})}")
        lo, size = self.shard_map.shard(st.index, self.comm.rank)
        if self.stage in (1, 2):
            flat = xp.zeros(u.padded, dtype)
            for p, off in zip(st.params, u.offsets):
                flat[off:off + p.size] = p.data.reshape(-1)
        else:  # stage 3 builds only the owned piece (meta parameters draw just it: nn/init.py)
            flat = None
            st.param_shard = owned_shard(st.params, u.offsets, lo, size, dtype)
        sdt = state_dtype(dtype)
        if self.sharded_state is None:  # otherwise the sharded_state object holds (and counts) its own
            st.m, st.v = self.store.zeros(size, sdt), self.store.zeros(size, sdt)
        if self.master_weights:
            st.master = self.store.copy_of(st.param_shard if flat is None else flat[lo:lo + size], np.float32)
        if self.stage in (1, 2):
            st.flat_param, st.param_shard = flat, flat[lo:lo + size]
            ledger.track(flat, "parameters")
            self._point_params(st, flat)
        else:
            ledger.track(st.param_shard, "parameters")
            st.placeholders = [xp.broadcast_to(xp.asarray(np.nan, dtype=dtype), p.shape) for p in st.params]
            for p, ph in zip(st.params, st.placeholders):
                p.data = ph  # the full array is freed here; the shard is all that stays
        if self.stage == 1:
            st.flat_grad = xp.zeros(u.padded, dtype)
            ledger.track(st.flat_grad, "gradients")
            st.grad_shard = st.flat_grad[lo:lo + size]
            self._point_grads(st)
        else:
            st.grad_shard = xp.zeros(size, dtype)
            ledger.track(st.grad_shard, "gradients")
        st.pieces = self.shard_map.pieces(self.comm.rank, st.index)

    @staticmethod
    def _point_params(st, flat):
        for p, off in zip(st.params, st.unit.offsets):
            p.data = flat[off:off + p.size].reshape(p.shape)

    @staticmethod
    def _point_grads(st):
        for p, off in zip(st.params, st.unit.offsets):
            p.grad = st.flat_grad[off:off + p.size].reshape(p.shape)

    # ---- the optimizer step ------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """After the last micro-batch: every rank's owned gradient shard = mean over ranks.

        Stage 1 reduce-scatters every unit here (once per step); stages 2-3 did it at the end of
        every backward (and here wait for the overlapped reduce-scatters). Then every rank agrees
        on the parameters some rank gave a gradient (:meth:`_agree_on_used`): those ``step`` updates.
        Raises:
            RuntimeError: stage 1 and a ``.grad`` is no longer a view of its unit's gradient
            buffer (``model.zero_grad()`` was called; use this optimizer's ``zero_grad``).
        """
        if self.stage >= 2:
            self._finish_micro_batch()
        else:
            for st in self.units:
                for p in st.params:
                    if p.grad is None or p.grad.base is not st.flat_grad:
                        raise RuntimeError(f"ZeRO-1: unit {st.unit.name!r}: a .grad was replaced (model.zero_grad()?); "
                                           "use ZeroOptimizer.zero_grad(), which keeps the flat gradient buffer")
                st.grad_shard[...] = self._reduce_scatter_unit(st, st.flat_grad)
        self._agree_on_used()

    def grad_norm(self, grad_scale: float = 1.0) -> float:
        """Collective: the global L2 norm of ``gradient * grad_scale`` over all shards (a float).

        Each rank sums g^2 over its owned pieces only (padding excluded) in float64; one
        all-reduce of that scalar gives the unsharded norm.
        """
        local = backend.xp.zeros(1, dtype=np.float64)  # summed on the device; one transfer for the norm
        for st in self.units:
            for pc in st.pieces:
                g = st.grad_shard[pc.shard_lo:pc.shard_lo + pc.hi - pc.lo].astype(np.float64)
                local += (g * g).sum()
        self._agree(None, "grad_norm")
        with self._count("grad_norm"):
            total = math.sqrt(float(backend.to_host(all_reduce(self.comm, local))[0]))
        return total * grad_scale

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global-norm clipping over the shards; returns the norm before clipping.

        The norm is :meth:`grad_norm`. Coefficient as ``torch.nn.utils.clip_grad_norm_``:
        max_norm / (norm + 1e-6), applied in place if < 1; ``max_norm`` <= 0 or inf
        disables clipping.
        """
        total = self.grad_norm()
        if max_norm > 0 and math.isfinite(max_norm):
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                for st in self.units:
                    st.grad_shard *= st.grad_shard.dtype.type(coef)
        return total

    def set_lr(self, lr: float) -> None:
        """Set the learning rate for the next step."""
        self.lr = lr

    def step(self, grad_scale: float = 1.0) -> None:
        """AdamW on the owned shard, one call of ``adamw_update`` per parameter piece; stages 1-2 then all-gather.

        ``grad_scale`` multiplies the gradient inside the update (mixed precision's 1/loss-scale),
        as :meth:`AdamW.step`. Padding is in no piece, so it is never read or updated.

        Raises:
            RuntimeError: called inside :meth:`full_parameters`.
        """
        if self._pinned:
            raise RuntimeError("ZeroOptimizer.step() inside full_parameters(): the full copies would go stale")
        self.step_count += 1
        b1, b2 = self.betas
        for st in self.units:
            self._free(st)  # a stage-3 unit still gathered would go stale
            if self.sharded_state is not None:  # another optimizer's update of the whole owned shard
                target = st.param_shard if st.master is None else st.master
                with self._count("optimizer_sync"):
                    self.sharded_state.step_unit(st.index, target, st.grad_shard, self.step_count, self.lr, b1, b2,
                                                 self.eps, self.weight_decay, grad_scale)
                if st.master is not None:
                    st.param_shard[...] = target.astype(st.param_shard.dtype)
                continue
            # offloaded state: the update runs where the state lives, on host copies (same arrays on NumPy)
            grad = self.store.to_store(st.grad_shard)
            params = self.store.to_store(st.param_shard) if st.master is None else st.master
            for pc in st.pieces:
                if pc.param not in self._with_grad:  # no gradient this step: left as it is
                    continue
                sl = slice(pc.shard_lo, pc.shard_lo + pc.hi - pc.lo)
                wd = self.weight_decay if pc.ndim >= 2 else 0.0  # nanoGPT grouping, as AdamW.decays
                adamw_update(params[sl], grad[sl], st.m[sl], st.v[sl], self.step_count,
                             self.lr, b1, b2, self.eps, wd, grad_scale)
            if params is not st.param_shard:  # masters or a host copy: round/copy back to the device shard
                st.param_shard[...] = backend.to_device(params.astype(st.param_shard.dtype, copy=False))
        if self.stage in (1, 2):
            self._all_gather_params("all_gather_params")

    def _all_gather_params(self, phase):
        """Stages 1-2: every unit's updated owned shard to every rank (``phase``: setup or all_gather_params)."""
        for st in self.units:
            st.flat_param[...] = self._all_gather_unit(st, st.param_shard, phase)

    def zero_grad(self) -> None:
        """Zero the gradients this stage keeps (stage 1: the flat buffers, re-pointing ``.grad``; 2-3: the shards).

        Also closes this step's traffic record (``step_bytes``): the training loops call it once per
        step, applied or skipped (an FP16 overflow), so a skipped step's reduce-scatter is its own.
        """
        self.step_bytes.append({ph: self.bytes_sent[ph] - self._step_mark[ph] for ph in STEP_PHASES + ("grad_norm",)})
        self._step_mark = dict(self.bytes_sent)
        self._with_grad.clear()
        for st in self.units:
            if self.stage == 1:
                st.flat_grad[...] = 0
                self._point_grads(st)
            else:
                st.grad_shard[...] = 0
                for p in st.params:
                    p.grad = None

    # ---- reading the state ----------------------------------------------------------------
    def grad_shards(self) -> list:
        """This rank's owned gradient shard of every unit, ``(S,)`` arrays in unit order (after reduce)."""
        return [st.grad_shard for st in self.units]

    def bytes_per_step(self) -> float:
        """Mean bytes this rank sent per optimizer step for model states (``STEP_PHASES``)."""
        if not self.step_bytes:
            return 0.0
        return sum(sum(s[ph] for ph in STEP_PHASES) for s in self.step_bytes) / len(self.step_bytes)


def gather_figures(comm, figures: dict) -> list[dict]:
    """Collective: every rank's ``figures`` (name -> number) as a list by rank, via the ring all-gather."""
    keys = sorted(figures)
    vec = np.array([float(figures[k]) for k in keys])
    with comm.traffic.op("metrics"):
        allv = backend.to_host(all_gather(comm, backend.xp.asarray(vec))).reshape(comm.world_size, -1)
    return [{k: (int(v) if float(v).is_integer() else float(v)) for k, v in zip(keys, row)} for row in allv]
