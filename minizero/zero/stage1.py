"""ZeRO stage 1 (P_os): optimizer state sharded; parameters and gradients full, in flat buffers per unit.

::

    backward             fills full gradients: p.grad are views of a flat (padded,) buffer per unit
    reduce_gradients()   reduce-scatter each unit's buffer once per step -> the owned (S,) mean
    step()               AdamW on the owned shard (base.py), then all-gather every unit's parameters

Source: Rajbhandari et al., SC 2020, section 7.1; DeepSpeed ``stage_1_and_2.py``.
"""
from __future__ import annotations

from minizero import backend
from minizero.ledger import get_ledger
from minizero.optim.base import whole_views
from minizero.zero.base import ZeroOptimizer

#: the traffic label of the set-up all-gather (once, before training): not a step's bytes (the traffic table's note)
SETUP_GATHER = "setup_gather"


class ZeroStage1(ZeroOptimizer):
    """Stage 1 (arguments: :class:`~minizero.zero.base.ZeroOptimizer`); set-up: one all-gather per unit (traffic label
    :data:`SETUP_GATHER`).

    Raises RuntimeError (``reduce_gradients``): a ``.grad`` is no longer a view of its unit's buffer.
    """

    stage = 1
    #: what this stage shards (the header's ZeRO line: "... sharded over ...")
    shards = "optimizer state"
    #: every rank holds the full parameters between steps (stage 3: only its shards; the model needs a final gather)
    holds_full_parameters = True
    #: the collectives ``quantized_comm`` carries in INT8
    quantized_collectives = "the gradient reduce-scatters"

    def __init__(self, model, comm, **kwargs):
        super().__init__(model, comm, **kwargs)
        if self.holds_full_parameters:  # stage 3 publishes nothing: its owned shard is the parameter
            with comm.traffic.op(SETUP_GATHER):
                self._publish_params("setup")

    def _build_params(self, st, lo, size, dtype):
        st.flat_param = backend.xp.zeros(st.unit.padded, dtype)
        for p, off in zip(st.params, st.unit.offsets):
            st.flat_param[off:off + p.size] = p.data.reshape(-1)
        st.param_shard = st.flat_param[lo:lo + size]

    def _home_params(self, st):
        get_ledger().track(st.flat_param, "parameters")
        self._point_params(st, st.flat_param)

    def _build_grads(self, st, lo, size):
        st.flat_grad = backend.xp.zeros(st.unit.padded, st.flat_param.dtype)
        get_ledger().track(st.flat_grad, "gradients")
        st.grad_shard = st.flat_grad[lo:lo + size]
        self._point_grads(st)

    def _reduce_owned(self) -> None:
        for st in self.units:
            for p in st.params:
                if p.grad is None or p.grad.base is not st.flat_grad:
                    raise RuntimeError(f"ZeRO-1: unit {st.unit.name!r}: a .grad was replaced (model.zero_grad()?); "
                                       "use ZeroOptimizer.zero_grad(), which keeps the flat gradient buffer")
            st.grad_shard[...] = self.collectives.reduce_scatter(st, st.flat_grad)

    def _publish_params(self, phase: str) -> None:
        """Every unit's owned shard to every rank: one all-gather per unit, straight into its flat buffer
        (which holds the owned shard itself)."""
        for st in self.units:
            self.collectives.all_gather(st, st.param_shard, phase, out=st.flat_param)

    def _zero_grads(self) -> None:
        for st in self.units:
            st.flat_grad[...] = 0
            self._point_grads(st)

    def views(self, which: str):
        """As the base's, but parameters whole (every rank holds them): ``(p, 0, p.size, p.data)``."""
        if which == "param":
            return whole_views([p for st in self.units for p in st.params], which)
        return super().views(which)

    def _whole_params_on_load(self) -> list:
        return [p for st in self.units for p in st.params]
