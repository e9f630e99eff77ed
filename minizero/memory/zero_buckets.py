"""ZeRO stages 2 and 3: each unit's gradients go into a flat bucket during backward, reduced in a fixed unit order.

::

    backward reaches a unit's module      _RunBeforeBackward on its output: open a (padded,) bucket,
                                          point every p.grad into it (stage 3 also re-gathers the unit)
    a unit's last gradient arrives        post-accumulate-grad hook: the unit is *complete*
    complete units, highest index first   reduce-scatter the bucket (mean over ranks), add into the
                                          owned (S,) shard, free the bucket (stage 3: and the unit)

A micro-batch is one backward pass: the first gradient hook of a backward queues the end of
the micro-batch (:func:`~minizero.autograd.engine.queue_callback`, PyTorch DDP's and FSDP's
end-of-backward hook), which runs once every gradient of that pass has landed.

The order is fixed (unit U-1 down to 0, the order an ordinary backward completes them), as
the order of PyTorch DDP's buckets is fixed: a unit completed out of order waits, its bucket
alive, until every unit above it is reduced. So ranks whose backward completes units in
different orders (blocks run in a rank-dependent order) still pair unit u with unit u, and
the result is DataParallel's. Every unit is reduced once per micro-batch: when the backward
ends, every unit not yet reduced is, in order: one some of whose parameters got no gradient
in this pass (used only partly) with the gradients it got, one this rank did not use at all
as zeros. Such a unit holds back the units below it (their buckets, and at stage 3 their
gathered parameters, stay alive) until the end of the backward; a model that uses every
parameter in every micro-batch (the GPT) never waits. DeepSpeed stage 2 reduces in the order
gradients arrive instead, which is only right when every rank produces them in the same order.
"""
from __future__ import annotations

from minizero import backend
from minizero.autograd import Function, Tensor, is_grad_enabled
from minizero.autograd.engine import queue_callback
from minizero.ledger import get_ledger
from minizero.memory.zero_collectives import UnitCollectives


class _RunBeforeBackward(Function):
    """forward: identity on ``x``; backward: call ``callback()``, then pass the gradient through.

    Put on a module's output, its backward runs before any backward of that module
    (consumers come before producers), which is where ZeRO-3 re-gathers the module's
    parameters and ZeRO-2/3 open its gradient bucket.
    """

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.callback()
        return g, None


class GradientBuckets(UnitCollectives):
    """Stages 2-3: gradient buckets per unit, reduced in fixed unit order (see the module docstring).

    Expects on ``self`` (besides :class:`UnitCollectives`): ``stage``, ``_next`` (index of the
    next unit to reduce in this micro-batch; ``len(units) - 1`` at its start), ``_in_micro_batch``
    (a backward has touched a unit since the last end of a micro-batch; False at first), and
    ``_gather`` (stage 3's re-gather, :class:`~minizero.memory.zero_stage3.ParameterPartitioning`).
    """

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
        """Backward reached the unit: gather it (stage 3) and open its flat gradient bucket."""
        self._touch()
        if st.in_backward:
            return
        if self.stage == 3 and st.full is None:
            self._gather(st, "gather_backward")
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
        self._touch()
        st = self._unit_of[id(p)]
        st.ready.add(id(p))
        if len(st.ready) == len(st.params):
            st.complete = True
            while self._next >= 0 and self.units[self._next].complete:
                self._end_backward(self.units[self._next])

    def _finish_micro_batch(self):
        """End of a backward: reduce every unit not yet reduced in it, in order (zeros for one this rank did not use).

        Nothing to do when no backward touched a unit since the last end (``reduce_gradients``).
        """
        if not self._in_micro_batch:
            return
        self._in_micro_batch = False
        while self._next >= 0:
            self._end_backward(self.units[self._next])
        for st in self.units:
            st.reduced = False
        self._next = len(self.units) - 1

    def _end_backward(self, st):
        """Reduce-scatter the unit's bucket, add the mean into the owned shard, free bucket (and gathered params)."""
        assert st.index == self._next, (st.index, self._next)
        if not st.in_backward:
            self._open_bucket(st)  # gradients came without passing a module boundary, or none came
        self._reduce_bucket(st)
        for p in st.params:
            p.grad = None
        st.flat_grad, st.in_backward = None, False
        st.ready.clear()
        st.complete, st.reduced = False, True
        self._next -= 1
        if self.stage == 3:
            self._free(st)

    def _reduce_bucket(self, st):
        """Reduce-scatter the unit's bucket and add the mean into its owned shard, blocking."""
        st.grad_shard += self._reduce_scatter_unit(st, st.flat_grad)
