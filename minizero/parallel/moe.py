"""Mixture of experts with expert parallelism (Switch, Fedus et al. 2021; GShard, Lepikhin et al. 2020).

A token-level MLP replacement: (T, C) tokens -> (T, C). Routing (per rank, on its own T tokens):

* a linear router (C -> E, no bias), softmax over the E experts; each token picks its top-k experts (ties to the lower
  index); its gate for expert e is the softmax probability p_e, not renormalised over the k (Switch's top-1 gate and
  Megatron-Core's pre-softmax router; GShard's top-2 and Mixtral divide by the k probabilities' sum);
* capacity C_e = ceil(capacity_factor * T * k / E) slots per expert; slots are filled first-choice
  first, then second choice, in token order (GShard section 2.2); a choice past capacity is dropped
  (that slot adds nothing; the residual carries the token); in eval mode (``module.eval()``) nothing is
  dropped, so validation and sampling do not depend on how tokens are grouped;
* Switch balancing loss ``aux = E * sum_e f_e P_e`` with f_e the fraction of the T*k choices (before
  dropping) that picked e and P_e the mean router probability of e (Switch eq. 4; 1.0 when uniform);
  ST-MoE's router z-loss ``mean_t logsumexp(logits_t)^2`` (Zoph et al. 2022, arXiv:2202.08906, section 3);
* DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437, section 2.1.2): a per-expert ``bias``
  (host float64, not a parameter) added to the probabilities for the top-k choice only (gates stay
  p_e), moved by :meth:`MoELayer.update_bias` after each step by ``rate * sign(mean load - load_e)``.

Expert parallelism over ``comm`` (ep ranks): rank j holds experts j*E/ep .. (j+1)*E/ep - 1. Dispatch is an all-to-all
with variable splits (the kept rows, grouped by expert, to the expert's owner, with a count matrix first), the local
experts run on what arrived, and the combine is the inverse all-to-all; each is an autograd Function whose backward is
the other direction. Expert gradients thus sum over every rank's tokens; the router's gradient is this rank's own
(all-reduce it over the data group like any replicated parameter). Bytes per rank each way: the kept rows sent to other
ranks * C * itemsize (label ``all_to_all``), plus the counts: the (ep, E/ep) matrix (int64, ``all_to_all``) and
all_to_all_v's own row counts (``all_to_all_counts``).

Precision: the router's and experts' products are :class:`~minizero.nn.Matmul` children, converted as every
Linear is (bf16: BF16Matmul; fp16: float16 ``backend.matmul``). Softmax, top-k, gates and both losses run in
>= float32 (logits widened), as Megatron-Core's ``topk_softmax_with_capacity`` and DeepSeek-V3's ``Gate``
(``softmax(dim=-1, dtype=torch.float32)``); the gates join the combine in the activation dtype (``type_as``).
"""
from __future__ import annotations

import math

import numpy as np

from minizero import backend
from minizero.autograd import Function, is_grad_enabled
from minizero.autograd.functional import gelu
from minizero.autograd.ops import ToDtype, concat
from minizero.comm.all_to_all import all_to_all, all_to_all_v
from minizero.nn.module import Matmul, Module, Parameter


def route(probs: np.ndarray, k: int, capacity: int, bias=None):
    """Top-k choices under a per-expert capacity.

    ``probs``: (T, E) router probabilities; ``bias``: (E,) added for the choice only, or None. Returns
    ``(token, expert, kept)``: arrays of the T*k choices in priority order (choice rank, then token),
    ``kept`` a bool mask of those within capacity.
    """
    t, e = probs.shape
    scores = probs if bias is None else probs + bias
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (T, k)
    token = np.tile(np.arange(t), k)
    expert = top.T.reshape(-1)
    kept = np.zeros(t * k, dtype=bool)
    filled = np.zeros(e, dtype=np.int64)
    for i, x in enumerate(expert):
        if filled[x] < capacity:
            kept[i], filled[x] = True, filled[x] + 1
    return token, expert, kept


class _AllToAllV(Function):
    """forward: all_to_all_v with ``send_counts``; backward: the inverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, send_counts):
        out, ctx.recv_counts = all_to_all_v(comm, backend.xp.ascontiguousarray(x), send_counts)
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx, g):
        return all_to_all_v(ctx.comm, backend.xp.ascontiguousarray(g), ctx.recv_counts)[0], None, None


class _ScatterAdd(Function):
    """forward: (R, C) rows added into zeros (T, C) at ``index``; backward: the gradient's rows at ``index``."""

    @staticmethod
    def forward(ctx, rows, index, t):
        ctx.index = index
        out = backend.xp.zeros((t,) + rows.shape[1:], rows.dtype)
        backend.xp.add.at(out, index, rows)
        return out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.index], None, None


class MoELayer(Module):
    """(T, C) -> (T, C): router, top-k of ``num_experts`` GELU MLPs (C -> hidden -> C), over ``comm``.

    Args: ``comm`` the expert-parallel group (None: one rank, every expert here); ``top_k`` in
    1..num_experts; ``capacity_factor`` > 0; ``seed`` draws the router and all E experts
    identically on every rank (std 0.02), so ep ranks hold slices of the ep=1 experts; ``dtype``.
    After each forward: ``aux_loss`` and ``z_loss`` (Tensors, at least float32), ``expert_counts`` (E,) choices per
    expert before dropping, ``dropped`` (choices past capacity) on this rank; forwards with grad
    enabled also add both into ``load`` ((E + 1,) int64: counts, then drops) until :meth:`take_load`.
    Raises ValueError when ep does not divide num_experts or an argument is out of range.
    """

    def __init__(self, n_embd, hidden, num_experts, top_k=1, capacity_factor=1.25, comm=None, seed=0,
                 dtype=np.float64):
        super().__init__()
        ep = 1 if comm is None else comm.world_size
        if num_experts < 1 or num_experts % ep:
            raise ValueError(f"num_experts={num_experts} must be a positive multiple of the {ep} expert-parallel ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
        self.comm, self.num_experts, self.top_k, self.capacity_factor = comm, num_experts, top_k, capacity_factor
        self.ep, self.local = ep, num_experts // ep
        first = (0 if comm is None else comm.rank) * self.local
        rng = np.random.default_rng(seed)
        xp = backend.xp
        self.router = Parameter(xp.asarray(rng.normal(0, 0.02, (n_embd, num_experts)).astype(dtype)))
        w1 = rng.normal(0, 0.02, (num_experts, n_embd, hidden)).astype(dtype)
        w2 = rng.normal(0, 0.02, (num_experts, hidden, n_embd)).astype(dtype)
        # copies: a slice is a view that would keep all E experts alive on every rank (NumPy's asarray keeps it)
        self.w1 = Parameter(xp.asarray(w1[first:first + self.local].copy()))
        self.w2 = Parameter(xp.asarray(w2[first:first + self.local].copy()))
        self.router_matmul, self.expert_matmul = Matmul(), Matmul()  # the products a precision converts
        self.bias = np.zeros(num_experts)  # aux-loss-free balancing (selection only)
        self.load = np.zeros(num_experts + 1, dtype=np.int64)

    def capacity(self, t: int) -> int:
        """Slots per expert for ``t`` tokens on this rank."""
        return math.ceil(self.capacity_factor * t * self.top_k / self.num_experts)

    def forward(self, x):
        t = x.shape[0]
        probs = self._probabilities(x)
        token, expert = self._choose(probs, t)
        token_d = backend.xp.asarray(token)  # on the device: gather rows, scatter them back
        rows = x[token_d]
        gates = probs[token_d, backend.xp.asarray(expert)]
        if gates.dtype != x.dtype:  # float16 activations: the combine in float16
            gates = ToDtype.apply(gates, x.dtype)
        rows, got_counts = self._dispatch(rows, np.bincount(expert, minlength=self.num_experts))
        y = self._experts(rows, got_counts)
        if self.ep > 1:  # combine: the dispatch's inverse exchange
            y = _AllToAllV.apply(y, self.comm, got_counts.sum(axis=1))
        return _ScatterAdd.apply(y * gates.reshape(-1, 1), token_d, t)

    def _probabilities(self, x):
        """(T, E) softmax of the router's logits, in >= float32; sets ``z_loss``."""
        logits = self.router_matmul(x, self.router)
        wide = np.promote_types(logits.dtype, np.float32)  # routing and losses in >= float32
        if logits.dtype != wide:
            logits = ToDtype.apply(logits, wide)
        m = backend.xp.max(logits.data, axis=1, keepdims=True)
        ez = (logits - m).exp()
        probs = ez / ez.sum(axis=1, keepdims=True)
        lse = ez.sum(axis=1).log() + m.reshape(-1)  # logsumexp(logits), (T,)
        self.z_loss = (lse * lse).mean()
        return probs

    def _choose(self, probs, t: int):
        """The kept choices ``(token, expert)`` (host int arrays) grouped by expert, priority order within; sets
        ``expert_counts``, ``dropped``, ``load`` (grad enabled) and ``aux_loss``."""
        e = self.num_experts
        cap = self.capacity(t) if self.training else t  # eval mode drops nothing: no group dependence
        p = backend.to_host(probs.data)
        token, expert, kept = route(p, self.top_k, cap, self.bias if self.bias.any() else None)
        self.expert_counts = np.bincount(expert, minlength=e)
        self.dropped = int((~kept).sum())
        if is_grad_enabled():
            self.load += np.append(self.expert_counts, self.dropped)
        f = self.expert_counts / (t * self.top_k)
        self.aux_loss = (probs.mean(axis=0) * backend.xp.asarray(f * e, dtype=probs.dtype)).sum()
        order = np.argsort(expert[kept], kind="stable")
        return token[kept][order], expert[kept][order]

    def _dispatch(self, rows, per_expert):
        """Collective over ``comm`` (ep > 1): ``rows`` grouped by expert, ``per_expert`` (E,) of them, to the
        experts' owners. Returns the rows this rank's experts got and the (ep, local) count matrix of their blocks."""
        if self.ep == 1:
            return rows, per_expert.reshape(1, self.num_experts)
        by_rank = per_expert.reshape(self.ep, self.local)
        got_counts = all_to_all(self.comm, by_rank.astype(np.int64))  # [i, j]: rows rank i sends local expert j
        return _AllToAllV.apply(rows, self.comm, by_rank.sum(axis=1)), got_counts

    def take_load(self) -> np.ndarray:
        """(E + 1,) int64: choices per expert, then dropped choices, since the last call; resets them."""
        load, self.load = self.load, np.zeros_like(self.load)
        return load

    def update_bias(self, counts, rate: float) -> None:
        """DeepSeek-V3's update: ``bias += rate * sign(mean(counts) - counts)``; ``counts`` (E,) the step's load."""
        counts = np.asarray(counts, dtype=np.float64)
        self.bias += rate * np.sign(counts.mean() - counts)

    def _experts(self, rows, counts):
        """Rows in (source rank, local expert) blocks -> each block through its expert, same order."""
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))])
        outs, src = [], []
        for j in range(self.local):
            idx = np.concatenate([np.arange(starts[i * self.local + j], starts[i * self.local + j + 1])
                                  for i in range(counts.shape[0])]).astype(np.int64)
            if idx.size:
                xi = rows[backend.xp.asarray(idx)]
                outs.append(self.expert_matmul(gelu(self.expert_matmul(xi, self.w1[j])), self.w2[j]))
                src.append(idx)
        if not outs:  # no row for this rank's experts: w1, w2 still get a (zero) gradient, as one process's
            return rows * 0.0 + self.w1[:0].sum() + self.w2[:0].sum()  # whole (E, ...) tensors do: AdamW steps
        back = np.argsort(np.concatenate(src), kind="stable")
        return concat(outs, axis=0)[backend.xp.asarray(back)]
