"""Mixture of experts in the GPT, and expert parallelism over the data group (layer: parallel/moe.py).

``use_moe`` replaces the MLP of every ``every``-th block (blocks every-1, 2 every-1, ...; GShard and Switch put one in
every other block) by :class:`MoEMLP`, a child module that routes the micro-batch's b*T tokens as one group. The Switch
and z losses enter backward through :class:`_AddAuxLoss` (Megatron-Core's ``MoEAuxLossAutoScaler``): forward returns the
output unchanged, backward also seeds the layer's loss with ``grad_scale`` (the main loss's seed per micro-batch: 1/m,
S/(m dp) under FP16), so a pipeline stage needs no loss of its own.

Expert parallelism (ep ranks) splits the data group (D ranks) into D/ep expert groups of ep consecutive
data ranks (DeepSpeed's layout)::

    data ranks   0 1 | 2 3          expert groups {0,1} {2,3}: all-to-all dispatch / combine
    experts      a b | a b          expert-data groups {0,2} {1,3}: the same experts, other tokens

Gradients (:class:`ExpertDataParallel`): the dense ones (router included) averaged over the data group; an expert's
gradient, already summed over its expert group by the combine's backward, summed over its expert-data group and divided
by D. With ZeRO (:class:`ExpertZero`) the same split: the dense parameters sharded over the data group, the experts over
their expert-data group (DeepSpeed-MoE's layout). After each step (:class:`ExpertLoad`) every layer's counts are summed
over the world (one all-reduce of (MoE layers, E + 1) float64, label ``moe_load``), which feeds the bias update and the
progress lines.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from minizero import backend
from minizero.autograd import Function, is_grad_enabled
from minizero.comm.collectives import all_gather, all_reduce
from minizero.comm.flight import name_split
from minizero.nn.module import Module, ModuleDict
from minizero.parallel.data_parallel import DataParallel
from minizero.parallel.moe import MoELayer
from minizero.zero import zero_optimizer
from minizero.zero.hybrid import hybrid_groups, replica_members

MAX_EXPERTS = 1024  #: --moe-experts cap (each rank draws every expert at start), a checkpoint's layout.moe_experts too
MOE_EVERY = (1, 2)  #: --moe-every choices: an MoE layer in every block, or every other block


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Experts per MoE layer, top-k, capacity factor, every-th block, the losses' coefficients, the bias rate."""
    experts: int
    top_k: int = 2
    capacity_factor: float = 1.25
    every: int = 1
    aux_loss: float = 0.01
    z_loss: float = 0.001
    bias_update: float = 0.0

    def layers(self, n_layer: int) -> list[int]:
        """The block indices whose MLP is an MoE layer."""
        return [i for i in range(n_layer) if i % self.every == self.every - 1]

    def parameters(self, gpt) -> tuple[int, int]:
        """(total, active per token) parameters of the GPT config ``gpt`` with these MoE layers: each
        replaces an MLP (8C^2 + 5C) by a router (C E) and E (or top-k, active) experts of 8C^2 (no biases)."""
        c, n = gpt.n_embd, len(self.layers(gpt.n_layer))
        dense = gpt.num_parameters() - n * (8 * c * c + 5 * c)
        return (dense + n * (c * self.experts + 8 * c * c * self.experts),
                dense + n * (c * self.experts + 8 * c * c * self.top_k))


class _AddAuxLoss(Function):
    """forward: y unchanged; backward: g to y, and ``weight`` as the gradient of the scalar ``aux``."""

    @staticmethod
    def forward(ctx, y, aux, weight):
        ctx.weight, ctx.dtype = weight, aux.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        return g, backend.xp.full((), ctx.weight, dtype=ctx.dtype), None


class MoEMLP(Module):
    """The block's MLP as an MoE layer: x (b, T, C) -> (b, T, C), the b*T tokens routed as one group.

    ``moe``: the :class:`MoELayer`; ``aux_coef``, ``z_coef``: the coefficients of its Switch and z
    losses; ``grad_scale``: their backward seed, the main loss's per micro-batch (S/(m dp) under FP16), set each
    step by :func:`aux_loss_seeder` (Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``). No dropout.
    """

    def __init__(self, moe: MoELayer, aux_coef: float, z_coef: float, grad_scale: float):
        super().__init__()
        self.moe, self.aux_coef, self.z_coef, self.grad_scale = moe, aux_coef, z_coef, grad_scale

    def forward(self, x):
        b, t, c = x.shape
        y = self.moe(x.reshape(b * t, c)).reshape(b, t, c)
        if is_grad_enabled() and (self.aux_coef or self.z_coef):
            aux = self.moe.aux_loss * self.aux_coef + self.moe.z_loss * self.z_coef
            y = _AddAuxLoss.apply(y, aux, self.grad_scale)
        return y


def use_moe(stage, cfg: MoEConfig, seed: int, ep_comm=None, grad_scale: float = 1.0) -> dict:
    """Assign ``block.mlp = MoEMLP(...)`` in the chosen blocks of ``stage`` (a GPT or a pipeline stage).

    Layer i draws its router and all E experts from seed ``seed * 1000 + i`` on every rank (ep ranks keep
    their slice); hidden = 4C, the model's dtype. Expert parameters get ``p.expert = True`` and, over ep > 1
    ranks, ``p.expert_shard = (0, 1, ep rank, ep)``: a dim-0 slice, as checkpoints describe shards.
    Returns ``{block index: MoELayer}`` of this stage.
    """
    mc, layers = stage.config, {}
    for name, block in stage.transformer["h"].named_children():  # named by their index in the model
        i = int(name)
        if i not in cfg.layers(mc.n_layer):
            continue
        moe = MoELayer(mc.n_embd, 4 * mc.n_embd, cfg.experts, cfg.top_k, cfg.capacity_factor, comm=ep_comm,
                       seed=seed * 1000 + i, dtype=mc.dtype)
        moe.w1.expert = moe.w2.expert = True
        if ep_comm is not None and ep_comm.world_size > 1:
            moe.w1.expert_shard = moe.w2.expert_shard = (0, 1, ep_comm.rank, ep_comm.world_size)
        block.mlp = MoEMLP(moe, cfg.aux_loss, cfg.z_loss, grad_scale)
        layers[i] = moe
    return layers


def aux_loss_seeder(stage):
    """A hook ``(seed)`` setting every :class:`MoEMLP` of ``stage``'s ``grad_scale``: the backward seed of one
    micro-batch's loss (``Strategy.before_forward``), so the Switch and z losses are seeded as the main loss is."""
    mlps = [m for _, m in stage.named_modules() if isinstance(m, MoEMLP)]

    def seed_aux_losses(seed: float) -> None:
        for mlp in mlps:
            mlp.grad_scale = seed
    return seed_aux_losses


def expert_groups(dp_comm, ep: int):
    """Collective over the data group: ``(expert group, expert-data group)`` communicators (module docstring), named
    ``ep`` and ``edp`` in the flight recorder."""
    r = dp_comm.rank
    groups = dp_comm.split(color=r // ep, key=r), dp_comm.split(color=r % ep, key=r)
    name_split(dp_comm, groups[0], "ep", range(r - r % ep, r - r % ep + ep))
    name_split(dp_comm, groups[1], "edp", replica_members(dp_comm.world_size, ep, r))
    return groups


def is_expert(p) -> bool:
    """True for an expert's parameter (:func:`use_moe` sets ``p.expert`` on w1 and w2)."""
    return getattr(p, "expert", False)


class DenseAndExperts:
    """Two parts behind one synchroniser interface (``strategy.Synchroniser``): ``dense`` (the non-expert parameters,
    over the data group) and ``experts`` (over the expert-data group), two DataParallels or two ZeRO optimizers."""

    def __init__(self, dense, experts, ep: int, predivided: bool):
        self.dense, self.experts = dense, experts
        self.parts = (dense, experts)
        self.expert_grad_factor = 1.0 if predivided else 1.0 / ep

    def reduce_gradients(self) -> None:
        """Collective: each part's, dense first; then the experts' gradients (their part's mean over the D/ep ranks
        that hold them) times 1/ep, so both parts' are means over the D data ranks (``predivided``, FP16: sums,
        factor 1)."""
        for part in self.parts:
            part.reduce_gradients()
        for g in self.experts.local_grads():
            g *= g.dtype.type(self.expert_grad_factor)

    def local_grads(self) -> list:
        """The dense part's gradient arrays, then the experts' (every ``.grad``, or a ZeRO rank's owned shards)."""
        return self.dense.local_grads() + self.experts.local_grads()

    def held_grad_pieces(self, params) -> list | None:
        """Both parts' pieces, dense first; None where either keeps whole gradients (``strategy.Synchroniser``)."""
        held = [part.held_grad_pieces(params) for part in self.parts]
        if (held[0] is None) != (held[1] is None):  # one order for both parts, or a part's norms go unsummed
            raise ValueError("the dense part and the experts reduce gradients at different times")
        return None if held[0] is None else held[0] + held[1]

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective, once per part (ZeRO: over ``world``; each element of either part is owned by one data rank)."""
        return sum(part.grad_norm_sq(counts, model_comm, world) for part in self.parts)

    @contextlib.contextmanager
    def full_parameters(self):
        """Collective context: both parts' nested, dense outside (each whole inside: ZeRO-3 gathers)."""
        with self.dense.full_parameters(), self.experts.full_parameters():
            yield

    def bytes_per_step(self, steps: int | None = None) -> float:
        """Both parts' bytes sent per optimizer step (over ``steps`` steps), added."""
        return sum(part.bytes_per_step(steps) for part in self.parts)


class ExpertDataParallel(DenseAndExperts):
    """The gradient synchroniser with experts (the interface of :class:`DataParallel`): the dense parameters'
    :class:`DataParallel` over ``dp_comm`` (D ranks), the experts' over ``edp_comm`` (D/ep ranks). ``kw``:
    DataParallel's keyword arguments (``predivided=True`` under FP16: seeds carry 1/D)."""

    def __init__(self, params, dp_comm, edp_comm, ep: int, **kw):
        params = list(params)
        super().__init__(DataParallel([p for p in params if not is_expert(p)], dp_comm, **kw),
                         DataParallel([p for p in params if is_expert(p)], edp_comm, **kw),
                         ep, kw.get("predivided", False))
        self.edp = edp_comm.world_size

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective: the dense part over ``model_comm``; the experts' squares summed over ``world`` (one
        float64, label ``grad_norm``) and divided by D/ep, the copies of each expert."""
        dense = self.dense.grad_norm_sq(counts, model_comm, world)
        local = backend.xp.zeros(1, dtype=np.float64)
        for p in self.experts.params:
            if p.grad is not None and counts(p):
                local += (backend.to_dtype(p.grad, np.float64) ** 2).sum()
        with world.traffic.op("grad_norm"):
            return dense + float(backend.to_host(all_reduce(world, local))[0]) / self.edp


class ExpertZero(DenseAndExperts):
    """ZeRO with experts (a ZeRO stage's interfaces) as two ZeRO optimizers of one stage. ``dense``: the non-expert
    parameters over ``dp_comm`` (D ranks, or hybrid sharding's N-rank shard group with ``replicas``, zero/hybrid.py).
    ``experts``: this rank's E/ep experts, a unit per MoE layer, over the D/ep ranks of ``edp_comm`` that hold them
    (hybrid: N/ep, N a multiple of ep). ``kw``: ZeroOptimizer's. Source: Rajbhandari et al., DeepSpeed-MoE (ICML
    2022)."""

    def __init__(self, stage, dp_comm, edp_comm, ep: int, zero_stage: int, predivided: bool = False, replicas=None,
                 **kw):
        layers = {n.replace(".", "_"): m for n, m in stage.named_modules() if isinstance(m, MoELayer)}
        dense = zero_optimizer(stage, dp_comm, zero_stage, predivided=predivided, replicas=replicas,
                               include=lambda p: not is_expert(p), **kw)
        shard, expert_replicas = hybrid_groups(edp_comm, dp_comm.world_size // ep, ("edp_shard", "edp_replicate"))
        super().__init__(dense, zero_optimizer(ModuleDict(layers), shard, zero_stage, predivided=predivided,
                                               replicas=expert_replicas, include=is_expert, **kw), ep, predivided)

    @property
    def shards_state(self) -> bool:  # the first shard group writes (both parts' replica rank 0 are its ranks)
        return self.dense.shards_state

    @property
    def replicas(self):  # both parts' replica group: data ranks d + k N
        return self.dense.replicas

    def state_replicas(self, data_comm):  # both parts' (ZeroOptimizer.state_replicas)
        return self.dense.state_replicas(data_comm)

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    def set_step(self, n: int) -> None:  # a resumed checkpoint's applied steps (Adam's t), both parts
        self.dense.set_step(n)
        self.experts.set_step(n)

    @property
    def shard_map(self):  # the dense part's (--show-shards)
        return self.dense.shard_map

    def overlap_words(self) -> list[str]:
        """Either part's :meth:`~minizero.zero.base.ZeroOptimizer.overlap_words`, once each."""
        return list(dict.fromkeys(w for part in self.parts for w in part.overlap_words()))

    def set_lr(self, lr: float) -> None:
        for part in self.parts:
            part.set_lr(lr)

    def step(self, grad_scale: float = 1.0) -> None:
        for part in self.parts:
            part.step(grad_scale)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def views(self, which: str):
        for part in self.parts:
            yield from part.views(which)

    def state_views(self, save: bool = True):
        for part in self.parts:
            yield from part.state_views(save)


def _all_experts(mine, ep_comm):
    """Collective over ``ep_comm``: this rank's (E/ep, ...) expert slice ``mine`` -> (E, ...), rank order."""
    return all_gather(ep_comm, backend.xp.ascontiguousarray(mine).reshape(-1)).reshape((-1,) + mine.shape[1:])


def gather_experts(model, whole, ep_comm):
    """Collective over ``ep_comm``: ``whole`` (the same GPT with ep = 1 MoE layers) filled from ``model``.

    Expert slices (E/ep, ...) are all-gathered in rank order (label ``all_gather``); the rest, and each
    layer's bias, copied. Returns ``whole``.
    """
    mine = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        q = mine[name]
        if is_expert(q):
            p.data[...] = _all_experts(q.data, ep_comm)
        else:
            p.data[...] = q.data
    biases = {n: m.bias for n, m in model.named_modules() if isinstance(m, MoELayer)}
    for n, m in whole.named_modules():
        if isinstance(m, MoELayer):
            m.bias = biases[n].copy()
    return whole


@contextlib.contextmanager
def whole_experts(module, ep_comm):
    """Collective over ``ep_comm``: inside, every expert parameter of ``module`` holds all E experts
    (all-gathered in rank order, label ``all_gather``); its own slice again on exit. ``ep_comm`` None: nothing to do."""
    params = [p for p in module.parameters() if is_expert(p)] if ep_comm is not None else []
    mine = [p.data for p in params]
    for p, w in zip(params, mine):
        p.data = _all_experts(w, ep_comm)
    try:
        yield
    finally:
        for p, w in zip(params, mine):
            p.data = w


def routing_state(model) -> dict:
    """``{MoE layer name: [E floats]}``: the routing biases (the same on every rank; exact through JSON)."""
    return {name: [float(b) for b in m.bias] for name, m in model.named_modules() if isinstance(m, MoELayer)}


def load_routing_state(model, state: dict) -> list[str]:
    """Set :func:`routing_state`'s biases by layer name; returns the MoE layers ``state`` has none for."""
    missing = []
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            if name in state:
                m.bias = np.array(state[name], dtype=np.float64)
            else:
                missing.append(name)
    return missing


class ExpertLoad:
    """After each step: every MoE layer's load summed over the world, the bias update, running totals.

    ``layers``: this stage's ``{block index: MoELayer}``; ``counts_here``: whether this rank's counts
    are added (False on tensor ranks > 0, which route the same tokens). Attributes after a step:
    ``last`` and ``total``: {block index: (E + 1,) counts then drops} of the last step and of the run;
    ``applied``: whether the last step was applied (a step FP16 skips is counted, its bias update left out).
    """

    def __init__(self, layers: dict, all_layers: list, experts: int, world, counts_here: bool, rate: float = 0.0):
        self.layers, self.all_layers, self.experts = layers, all_layers, experts
        self.world, self.counts_here, self.rate = world, counts_here, rate
        self.last, self.total, self.applied = {}, {i: np.zeros(experts + 1) for i in all_layers}, True

    def after_step(self, applied: bool = True) -> None:
        """Collective over the world: one all-reduce of (MoE layers, E + 1) float64; the bias update if ``applied``
        (every step drains the counts, so a checkpoint after a skipped step holds none of them)."""
        table = np.zeros((len(self.all_layers), self.experts + 1))
        for row, i in enumerate(self.all_layers):
            if i in self.layers:
                load = self.layers[i].take_load()
                table[row] = load if self.counts_here else 0
        with self.world.traffic.op("moe_load"):
            table = backend.to_host(all_reduce(self.world, backend.to_device(table)))
        self.applied = applied
        for row, i in enumerate(self.all_layers):
            self.last[i] = table[row]
            self.total[i] = self.total[i] + table[row]
            if self.rate and applied and i in self.layers:
                self.layers[i].update_bias(table[row, :self.experts], self.rate)

    @staticmethod
    def shares(loads: dict) -> tuple[np.ndarray, float]:
        """(E,) fraction of the choices each expert got, summed over layers; the fraction dropped."""
        t = sum(loads.values())
        n = t[:-1].sum()
        return t[:-1] / max(n, 1), float(t[-1] / max(n, 1))

    def line(self) -> str:
        """The last step's load for a progress line: ``experts 26/24/25/25%  dropped 1.2%``."""
        f, drop = self.shares(self.last)
        kept = "" if self.applied or not self.rate else " (step skipped: routing bias kept)"
        return f"experts {'/'.join(f'{100 * x:.0f}' for x in f)}%  dropped {100 * drop:.1f}%{kept}"

    def summary(self) -> dict:
        """The run's totals: tokens per expert and drop rate, over all MoE layers and per layer."""
        f, drop = self.shares(self.total)
        per = {str(i): {"tokens_per_expert": [int(x) for x in t[:-1]], "dropped": int(t[-1]),
                        "drop_rate": self.shares({i: t})[1]} for i, t in self.total.items()}
        return {"tokens_per_expert": [int(x) for x in sum(self.total.values())[:-1]], "load_share": f.tolist(),
                "drop_rate": drop, "layers": per}
