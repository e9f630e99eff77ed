"""ZeRO's base: units and their shards, AdamW on the owned shard, the global norm. Stages add the rest.

Per rank, Ψ parameters over N ranks, float32 parameters and gradients, Adam's m and v (K = 8 bytes):

    stage  file        sharded            bytes per parameter   bytes sent per step, one micro-batch
    1      stage1.py   optimizer state    4 + 4 + 8/N           2(N-1)/N x 4Ψ  reduce-scatter g, all-gather p
    2      stage2.py   + gradients        4 + (4 + 8)/N         2(N-1)/N x 4Ψ  the same, g's during backward
    3      stage3.py   + parameters       (4 + 4 + 8)/N         3(N-1)/N x 4Ψ  gather p in forward and in
                                                                               backward, reduce-scatter g

Hybrid sharding (``replicas``, hybrid.py): N is the shard group's size; each reduce adds an all-reduce of the
(S,) shard over the R = D/N replicas, 2(R-1)/R x 4Ψ/N bytes.
Ledger: ``parameters``, ``gradients``, ``optimizer_state``; transient ``gathered`` and ``comm_buffers``.
Source: Rajbhandari et al., SC 2020 (arXiv:1910.02054), section 5, Figure 1, section 7.2;
DeepSpeed ``stage_1_and_2.py`` / ``stage3.py``, PyTorch FSDP's flat parameters.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_gather, all_reduce
from minizero.ledger import get_ledger
from minizero.optim.adamw import adamw_update, clip_coefficient, state_dtype
from minizero.optim.base import Optimizer, check_hyper_parameters
from minizero.optim.state_store import OptimizerStateStore
from minizero.optim.used_parameters import used_anywhere
from minizero.zero.collectives import PHASES, STEP_PHASES, UnitCollectives, UnitState
from minizero.zero.hybrid import counts_once, used_over_replicas
from minizero.zero.shards import ShardMap, find_units


def model_state_bytes() -> dict:
    """The calling rank's ledger, current bytes of the model-state categories (and the transient ones)."""
    cur = get_ledger().current
    return {c: cur[c] for c in ("parameters", "gradients", "optimizer_state", "gathered", "comm_buffers")}


def gather_figures(comm, figures: dict) -> list[dict]:
    """Collective: every rank's ``figures`` (name -> number) as a list by rank, via the ring all-gather."""
    keys = sorted(figures)
    vec = np.array([float(figures[k]) for k in keys])
    with comm.traffic.op("metrics"):
        allv = backend.to_host(all_gather(comm, backend.xp.asarray(vec))).reshape(comm.world_size, -1)
    return [{k: (int(v) if float(v).is_integer() else float(v)) for k, v in zip(keys, row)} for row in allv]


class ZeroOptimizer:
    """AdamW on ZeRO-sharded model states, replacing ``DataParallel`` + ``AdamW``; the base of the three stages.

    Args:
        model: a Module, same init on every rank (parameters re-homed into flat units).  comm: the data group, or
        the shard group, with ``replicas`` the replica group (hybrid.py; gradients summed over both).
        lr, betas, eps, weight_decay: as :class:`~minizero.optim.AdamW`.  native: the library's collectives.
        master_weights: an FP32 master of the owned shard (4/N bytes per parameter).
        sharded_state: None (AdamW's m, v) or ``factory(shard_map)`` with ``step_unit(...)`` (``ShardedAdam8bit``).
        quantized_comm: INT8 on the wire (ZeRO++).  store: where m, v and masters live (offload).
        prefetch, overlap_reduce: taken by stages 2-3.  find_unused_parameters: as DataParallel's.
        predivided: gradients carry 1/N already.  check_order: the (unit, phase) header check (None: debug switch).
        include: a predicate on parameters; only those are sharded (None: all; see :func:`find_units`).
    Attributes: ``stage``, ``shard_map``, ``units``, ``bytes_sent`` (phase -> bytes), ``step_bytes`` (per step).
    Raises ValueError: a hyper-parameter out of range; ``quantized_comm`` with ``native``.
    """

    stage = 0  # set by each stage's class
    reduces_in_backward = False  #: stages 2-3: the gradients are reduce-scattered inside backward

    def __init__(self, model, comm, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, native: bool = False,
                 master_weights: bool = False, sharded_state=None, quantized_comm: bool = False, store=None,
                 prefetch: bool = False, overlap_reduce: bool = False, find_unused_parameters: bool = True,
                 predivided: bool = False, check_order: bool | None = None, include=None, replicas=None):
        lr, betas, eps, weight_decay = check_hyper_parameters(  # lr=nan passed before
            "ZeroOptimizer", lr, betas, eps, weight_decay)
        if quantized_comm and native:
            raise ValueError("ZeroOptimizer: quantized_comm and native exclude each other "
                             "(MPI's collectives send FP32)")
        self.comm, self.native, self.master_weights, self.replicas = comm, native, master_weights, replicas
        self.store = store if store is not None else OptimizerStateStore("none")  # where m, v, masters live
        self.quantized_comm, self.find_unused_parameters = quantized_comm, find_unused_parameters
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.bytes_sent = {ph: 0 for ph in PHASES}
        self.step_bytes = []
        self._step_mark = dict(self.bytes_sent)
        self.shard_map = ShardMap.from_model(model, comm.world_size, include)
        self.sharded_state = None if sharded_state is None else sharded_state(self.shard_map)
        self.units = [UnitState(i, self.shard_map.units[i], [p for _, p in params], [module])
                      for i, (_, module, params) in enumerate(find_units(model, include))]
        self.collectives = UnitCollectives(comm, self.units, self.bytes_sent, native, quantized_comm, predivided,
                                           check_order, replicas)
        self._unit_of = {id(p): st for st in self.units for p in st.params}
        self._param_of = {n: p for st in self.units for n, p in zip(st.unit.param_names, st.params)}
        self._add_tied_users(model)
        for st in self.units:
            self._build(st)
        self._track_gradients()

    # ---- set-up -----------------------------------------------------------------------
    def _add_tied_users(self, model):
        """A module outside a unit's subtree that owns one of its parameters (the tied LM head) uses it too."""
        for st in self.units:
            inside = {id(m) for _, m in st.users[0].named_modules()}
            mine = {id(p) for p in st.params}
            for _, m in model.named_modules():
                owned = m.named_parameters(recurse=False, remove_duplicate=False)
                if id(m) not in inside and any(id(p) in mine for _, p in owned):
                    st.users.append(m)

    def _build(self, st):
        """Home a unit: parameters and gradients (the stage's ``_build_params``/``_build_grads``), m, v, master."""
        u = st.unit
        dtype = st.params[0].dtype
        if any(p.dtype != dtype for p in st.params):
            raise ValueError(f"unit {u.name!r} mixes parameter dtypes {sorted({str(p.dtype) for p in st.params})}")
        lo, size = self.shard_map.shard(st.index, self.comm.rank)
        self._build_params(st, lo, size, dtype)
        sdt = state_dtype(dtype)
        if self.sharded_state is None:  # otherwise the sharded_state object holds (and counts) its own
            st.m, st.v = self.store.zeros(size, sdt), self.store.zeros(size, sdt)
        if self.master_weights:
            st.master = self.store.copy_of(st.param_shard, np.float32)
        self._home_params(st)
        self._build_grads(st, lo, size)
        st.pieces = self.shard_map.pieces(self.comm.rank, st.index)

    def _build_params(self, st, lo, size, dtype):
        """Set ``st.param_shard`` (size,) ``dtype`` (and what else the stage keeps), not yet in the ledger."""
        raise NotImplementedError

    def _home_params(self, st):
        """Count the stage's parameter arrays in the ledger and point ``p.data`` at them (the old arrays go)."""
        raise NotImplementedError

    def _build_grads(self, st, lo, size):
        """Set ``st.grad_shard`` (size,) and whatever else the stage keeps of the gradients."""
        raise NotImplementedError

    def _track_gradients(self):
        """Post-accumulate-grad hooks record which parameters got a gradient this step; ``step`` skips the
        owned pieces of the others (as AdamW skips ``grad is None``); a ``sharded_state`` updates all."""
        self._with_grad = set()
        self._names = [name for st in self.units for name in st.unit.param_names]
        for st in self.units:
            for name, p in zip(st.unit.param_names, st.params):
                p.register_post_accumulate_grad_hook(lambda _p, name=name: self._with_grad.add(name))

    def _agree_on_used(self):
        """Collective: the parameters *some* rank gave a gradient (one bitmask all-gather, ``used_parameters``;
        a second over the replica group under hybrid sharding)."""
        if not self.find_unused_parameters:
            return
        with self.collectives.count("used_parameters"):
            used = used_anywhere(self.comm, [name in self._with_grad for name in self._names])
            used = used_over_replicas(self.replicas, used)
        self._with_grad = {name for name, u in zip(self._names, used) if u}

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
        """Collective, after the last micro-batch: every rank's owned gradient shard = mean over ranks
        (the stage's :meth:`_reduce_owned`), then agreement on the parameters some rank used."""
        self._reduce_owned()
        self._agree_on_used()

    def _reduce_owned(self) -> None:
        raise NotImplementedError

    def grad_norm(self, grad_scale: float = 1.0) -> float:
        """Collective: global L2 norm of ``gradient * grad_scale`` (float). Each rank sums g^2 over its owned
        pieces (padding excluded) in float64; one all-reduce of that scalar (``grad_norm``)."""
        local = self._owned_grad_sq(self.units, keep=lambda p: True)
        self.collectives.agree(None, "grad_norm")
        with self.collectives.count("grad_norm"):
            total = math.sqrt(float(backend.to_host(all_reduce(self.comm, local))[0]))
        return total * grad_scale

    def _owned_grad_sq(self, units, keep):
        """(1,) float64 on the device: sum of g^2 over the owned pieces of ``units``' parameters ``keep(p)`` takes."""
        local = backend.xp.zeros(1, dtype=np.float64)  # summed on the device: one transfer a step
        for st in units:
            for pc in st.pieces:
                if keep(self._param_of[pc.param]):
                    g = backend.to_dtype(st.grad_shard[pc.shard_slice], np.float64)
                    local += (g * g).sum()
        return local

    def clip_grad_norm_(self, max_norm: float, norm_sq: float | None = None) -> float:
        """Global-norm clipping over the shards (``torch.nn.utils.clip_grad_norm_``'s coefficient
        max_norm / (norm + 1e-6)); returns the norm before; ``max_norm`` <= 0 or inf: no clipping.
        ``norm_sq``: the squared norm when the caller summed it over more ranks (:meth:`grad_norm_sq`)."""
        total = self.grad_norm() if norm_sq is None else math.sqrt(norm_sq)
        coef = clip_coefficient(total, max_norm)
        if coef < 1.0:
            for st in self.units:
                st.grad_shard *= st.grad_shard.dtype.type(coef)
        return total

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def set_step(self, n: int) -> None:  # a resumed checkpoint's applied steps (Adam's t)
        self.step_count = n

    def step(self, grad_scale: float = 1.0) -> None:
        """AdamW on the owned shard, one ``adamw_update`` per parameter piece (padding is in none), then
        the stage's :meth:`_publish_params`. ``grad_scale`` multiplies the gradient (1/loss-scale)."""
        self.step_count += 1
        for st in self.units:
            if self.sharded_state is not None:
                self._step_sharded_state(st, grad_scale)
            else:
                self._step_adamw(st, grad_scale)
        self._publish_params("all_gather_params")

    def _step_sharded_state(self, st, grad_scale: float) -> None:
        """Another optimizer's update (8-bit Adam) of ``st``'s whole owned shard (or its master), then the shard."""
        b1, b2 = self.betas
        target = st.param_shard if st.master is None else st.master
        with self.collectives.count("optimizer_sync"):
            self.sharded_state.step_unit(st.index, target, st.grad_shard, self.step_count, self.lr, b1, b2,
                                         self.eps, self.weight_decay, grad_scale)
        if st.master is not None:
            st.param_shard[...] = backend.to_dtype(target, st.param_shard.dtype)

    def _step_adamw(self, st, grad_scale: float) -> None:
        """AdamW on each owned piece of ``st`` that got a gradient, where the state lives (offload: host copies,
        the same arrays on NumPy), then the device shard rounded/copied from masters or the host copy."""
        b1, b2 = self.betas
        grad = self.store.to_store(st.grad_shard)
        params = self.store.to_store(st.param_shard) if st.master is None else st.master
        for pc in st.pieces:
            if pc.param not in self._with_grad:  # no gradient this step: left as it is
                continue
            sl = pc.shard_slice
            wd = self.weight_decay if Optimizer.decays(pc) else 0.0  # a piece has its parameter's ndim
            adamw_update(params[sl], grad[sl], st.m[sl], st.v[sl], self.step_count, self.lr, b1, b2, self.eps, wd,
                         grad_scale)
        if params is not st.param_shard:
            st.param_shard[...] = backend.to_device(backend.to_dtype(params, st.param_shard.dtype))

    def _publish_params(self, phase: str) -> None:
        """Make the updated owned shards what every rank computes with (``phase``: setup or all_gather_params)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Zero the gradients this stage keeps (:meth:`_zero_grads`) and close this step's ``step_bytes``
        record (the loops call it once per step, applied or skipped)."""
        self.step_bytes.append({ph: self.bytes_sent[ph] - self._step_mark[ph] for ph in STEP_PHASES + ("grad_norm",)})
        self._step_mark = dict(self.bytes_sent)
        self._with_grad.clear()
        self._zero_grads()

    def _zero_grads(self) -> None:
        raise NotImplementedError

    # ---- the gradient synchroniser's interface (as DataParallel's) and reading the state -------
    def full_parameters(self):
        """Collective context: inside, every ``p.data`` is the full parameter (only stage 3 has to gather)."""
        return contextlib.nullcontext()

    def grad_shards(self) -> list:
        """This rank's owned gradient shard of every unit, ``(S,)`` arrays in unit order (after reduce)."""
        return [st.grad_shard for st in self.units]

    local_grads = grad_shards  #: the gradient arrays this rank holds (the FP16 overflow check reads them)

    def held_grad_pieces(self, params) -> list | None:
        """Stages 2-3 (reduced inside backward): :meth:`views` of ``params``' owned gradient pieces; stage 1: None."""
        if not self.reduces_in_backward:
            return None
        wanted = {id(p) for p in params}
        return [v for v in self.views("grad") if id(v[0]) in wanted]

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective over ``world`` (data x model ranks; ``model_comm`` unused: each data rank owns a slice):
        the squared global norm (float64) of the owned pieces of the parameters ``counts(p)`` accepts,
        padding excluded; under hybrid sharding only the first shard group's ranks add theirs (the replicas hold the
        same shards: :func:`~minizero.zero.hybrid.counts_once`). Traffic label ``grad_norm``: one float64."""
        local = self._owned_grad_sq(self.units if counts_once(self.replicas) else (), keep=counts)
        with world.traffic.op("grad_norm"):
            return float(backend.to_host(all_reduce(world, local))[0])

    def bytes_per_step(self, steps: int | None = None) -> float:
        """Mean bytes this rank sent per optimizer step for model states (``STEP_PHASES``; ``steps`` unused:
        the steps are recorded by :meth:`zero_grad`)."""
        if not self.step_bytes:
            return 0.0
        return sum(sum(s[ph] for ph in STEP_PHASES) for s in self.step_bytes) / len(self.step_bytes)

    def overlap_words(self) -> list[str]:
        """What this optimizer overlaps with computation, as built, in the run header's words (stages 2-3 add
        theirs; none on 1 rank or over native or INT8 collectives, which block)."""
        return []

    @property
    def shards_state(self) -> bool:
        """Whether this rank writes its own part of m, v and the masters to a checkpoint: every data rank under plain
        ZeRO, the first shard group's under hybrid sharding (the other groups hold copies)."""
        return counts_once(self.replicas)

    def state_replicas(self, data_comm):
        """The ranks holding this rank's m, v and masters bitwise equal: the replica group under hybrid sharding, None
        under plain ZeRO (each shard is held once); ``data_comm`` unused (as :class:`~minizero.optim.Optimizer`'s)."""
        return self.replicas

    def views(self, which: str):
        """``(param, lo, hi, array)``: the owned piece ``[lo, hi)`` (flat elements) of each parameter's
        ``which`` ("param", "grad", "master"); ``array`` a (hi - lo,) view into the shard."""
        for st in self.units:
            shard = {"param": st.param_shard, "grad": st.grad_shard, "master": st.master}[which]
            for pc in st.pieces if shard is not None else ():
                yield self._param_of[pc.param], pc.lo, pc.hi, shard[pc.shard_slice]

    def state_views(self, save: bool = True):
        """``(kind, param, lo, hi, array)`` a checkpoint writes (``save``) or reads on this rank: the owned
        pieces of parameters, m, v (or 8-bit Adam's ``QuantizedState``) and masters; a stage that holds
        whole parameters reads them whole (:meth:`_whole_params_on_load`)."""
        whole = [] if save else self._whole_params_on_load()
        yield from (("param", p, 0, int(p.size), p.data) for p in whole)
        for st in self.units:
            for j, pc in enumerate(st.pieces):
                p, sl = self._param_of[pc.param], pc.shard_slice
                if not whole:  # saved as owned pieces; read so too where the stage holds only those
                    yield "param", p, pc.lo, pc.hi, st.param_shard[sl]
                m, v = (st.m[sl], st.v[sl]) if self.sharded_state is None else self.sharded_state.state[st.index][j]
                for kind, a in (("m", m), ("v", v), ("master", None if st.master is None else st.master[sl])):
                    if a is not None:
                        yield kind, p, pc.lo, pc.hi, a

    def _whole_params_on_load(self) -> list:
        """Parameters a checkpoint loads whole (a stage keeping them whole on every rank), else []."""
        return []
