"""ZeRO stage 2 (P_os+g): gradients too are sharded, reduce-scattered unit by unit during backward.

::

    backward reaches a unit's module      _RunBeforeBackward on its output: open a (padded,) bucket,
                                          point every p.grad into it
    a unit's last gradient arrives        post-accumulate-grad hook: the unit is *complete*
    complete units, highest index first   reduce-scatter the bucket (mean over ranks), add into the
                                          owned (S,) shard, free the bucket

Units reduce in a fixed order (U-1 down to 0), unused ones with zeros at the end of backward.
Source: Rajbhandari et al., SC 2020, section 7.2.1; DeepSpeed ``stage_1_and_2.py``.
"""
from __future__ import annotations

from minizero import backend
from minizero.autograd import Function, Tensor, is_grad_enabled
from minizero.autograd.engine import queue_callback
from minizero.ledger import get_ledger
from minizero.zero.overlap import OverlappedReduceScatter, can_overlap
from minizero.zero.stage1 import ZeroStage1


class _RunBeforeBackward(Function):
    """forward: identity on ``x``; backward: call ``callback()``, then pass the gradient through."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.callback()
        return g, None


class ZeroStage2(ZeroStage1):
    """Stage 2 (arguments: :class:`~minizero.zero.base.ZeroOptimizer`); ``overlap_reduce`` submits each
    bucket's reduce-scatter and goes on with backward (at most ``REDUCE_BUCKETS`` buckets alive)."""

    stage = 2
    shards = "optimizer state and gradients"
    reduces_in_backward = True

    def __init__(self, model, comm, overlap_reduce: bool = False, **kwargs):
        super().__init__(model, comm, **kwargs)
        self._next = len(self.units) - 1  # the next unit to reduce in this micro-batch (fixed order)
        self._in_micro_batch = False  # a backward touched a unit since the last micro-batch ended
        for st in self.units:
            for p in st.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
            for m in st.users:
                self._register_unit_hooks(st, m)
        self.overlap_reduce = overlap_reduce and can_overlap(self.collectives)
        self.reducer = OverlappedReduceScatter(self.collectives) if self.overlap_reduce else None

    def overlap_words(self) -> list[str]:
        return ["reduce-scatters overlap backward"] if self.overlap_reduce else []

    def _register_unit_hooks(self, st, module):
        module.register_forward_hook(self._open_bucket_hook(st))

    def _build_grads(self, st, lo, size):
        st.grad_shard = backend.xp.zeros(size, st.param_shard.dtype)
        get_ledger().track(st.grad_shard, "gradients")

    def _zero_grads(self) -> None:
        for st in self.units:
            st.grad_shard[...] = 0
            for p in st.params:
                p.grad = None

    def _reduce_owned(self) -> None:
        self._finish_micro_batch()  # a no-op when the backward's own callback already ran

    def _progress(self) -> None:
        """Advance the non-blocking rings in flight (called from hooks; never waits)."""
        if self.reducer is not None:
            self.reducer.progress()

    # ---- backward ---------------------------------------------------------------------
    def _touch(self):
        """A gradient hook ran: in the first of this backward, queue the end of the micro-batch."""
        if not self._in_micro_batch:
            self._in_micro_batch = True
            queue_callback(self._finish_micro_batch)

    def _open_bucket_hook(self, st):
        """Forward hook: wrap the module's output so backward opens the unit's bucket first."""
        def hook(module, args, out):
            if not is_grad_enabled():
                return None

            def wrap(t):
                if isinstance(t, Tensor) and t.requires_grad:
                    return _RunBeforeBackward.apply(t, lambda: self._begin_backward(st))
                return t
            return type(out)(wrap(t) for t in out) if isinstance(out, (tuple, list)) else wrap(out)
        return hook

    def _begin_backward(self, st):
        """Backward reached the unit: open its flat gradient bucket (once per micro-batch)."""
        self._touch()
        if not st.in_backward:
            self._open_bucket(st)

    def _open_bucket(self, st):
        """A zeroed (padded,) gradient bucket for the unit (``comm_buffers``); ``p.grad`` become views of it."""
        st.in_backward = True
        st.flat_grad = backend.xp.zeros(st.unit.padded, st.grad_shard.dtype)
        get_ledger().track(st.flat_grad, "comm_buffers")
        old = [p.grad for p in st.params]
        self._point_grads(st)
        for p, g in zip(st.params, old):
            if g is not None:  # a gradient that arrived before the bucket opened
                p.grad += g

    def _grad_ready(self, p):
        """Post-accumulate-grad hook: when a unit's last gradient is complete, reduce what the order allows."""
        self._progress()
        self._touch()
        st = self._unit_of[id(p)]
        st.ready.add(id(p))
        if len(st.ready) == len(st.params):
            st.complete = True
            while self._next >= 0 and self.units[self._next].complete:
                self._end_backward(self.units[self._next])

    def _finish_micro_batch(self):
        """End of a backward: reduce every unit not yet reduced, in order; wait for the overlapped ones."""
        if self._in_micro_batch:
            self._in_micro_batch = False
            while self._next >= 0:
                self._end_backward(self.units[self._next])
            for st in self.units:
                st.reduced = False
            self._next = len(self.units) - 1
        if self.reducer is not None:
            self.reducer.wait_all()

    def _end_backward(self, st):
        """Reduce-scatter the unit's bucket into the owned shard; drop the bucket."""
        assert st.index == self._next, (st.index, self._next)
        if not st.in_backward:
            self._open_bucket(st)  # gradients came without passing a module boundary, or none came
        if self.reducer is not None:
            self.reducer.start(st, st.flat_grad)
        else:
            st.grad_shard += self.collectives.reduce_scatter(st, st.flat_grad)
        for p in st.params:
            p.grad = None
        st.flat_grad, st.in_backward = None, False
        st.ready.clear()
        st.complete, st.reduced = False, True
        self._next -= 1
