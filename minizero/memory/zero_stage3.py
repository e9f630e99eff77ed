"""ZeRO stage 3: parameters live only as shards; a unit is gathered just before it runs and freed after.

::

    forward pre-hook     all-gather the unit's shards -> (padded,) buffer; p.data = views of it;
                         open a saved-tensor pack hook for the module's forward
    module forward       every gathered parameter a Function saves becomes a small handle
                         (_SavedParameter), so freeing the buffer really frees it
    forward hook         close the pack hook; after the unit's last use in this forward (the tied
                         embedding has two) p.data = NaN placeholders again: the buffer is freed
    backward             the unpack hook (or the bucket's _RunBeforeBackward) re-gathers the unit;
                         it is freed again once its gradient bucket is reduced (zero_buckets.py)

Between uses ``p.data`` is a read-only NaN array of the right shape (``broadcast_to`` of one
element): shapes and parameter counts still work, and an accidental use is loud.
Per micro-batch: two all-gathers and one reduce-scatter, 3(N-1)/N of the parameter bytes
(Rajbhandari et al., SC 2020, section 7.2.2; DeepSpeed ``stage3.py``, PyTorch FSDP's
``FULL_SHARD``). Every rank must run the units in the same order (as FSDP requires): the
header before each gather (zero_collectives.py) turns a different order into a clear error.
"""
from __future__ import annotations

import contextlib

from minizero.autograd import is_grad_enabled, saved_tensors_hooks
from minizero.autograd.engine import current_saved_tensors_hooks
from minizero.ledger import get_ledger
from minizero.memory.zero_collectives import UnitCollectives


class _SavedParameter:
    """What a gathered parameter becomes when a Function saves it: a handle, not its array."""

    __slots__ = ("param",)

    def __init__(self, param):
        self.param = param


class ParameterPartitioning(UnitCollectives):
    """Stage 3's gather and free through module hooks and saved-tensor handles (see the module docstring).

    Expects on ``self`` (besides :class:`UnitCollectives`): ``stage``, ``_pinned`` (inside
    :meth:`full_parameters`), ``_gathered`` (id(p.data) -> p), ``_hook_stack``, ``_unit_of``,
    ``_point_params`` and ``_begin_backward``.
    """

    def _gather(self, st, phase):
        """All-gather a unit's shards into a full (padded,) buffer (``gathered``); point ``p.data`` into it."""
        st.full = self._all_gather_unit(st, st.param_shard, phase)
        get_ledger().track(st.full, "gathered")
        self._point_params(st, st.full)
        for p in st.params:
            self._gathered[id(p.data)] = p
        st.uses_left = len(st.users)

    def _free(self, st):
        """Drop a unit's gathered buffer: ``p.data`` back to its placeholder (nothing else holds it)."""
        if st.full is None or self._pinned:
            return
        for p, ph in zip(st.params, st.placeholders):
            self._gathered.pop(id(p.data), None)
            p.data = ph
        st.full = None

    def _saved_tensors_hooks(self):
        """A pack/unpack pair: a gathered parameter becomes a handle, re-gathered in backward if freed;
        every other array goes to the pair this one shadows (activation offload), if any."""
        outer = current_saved_tensors_hooks()

        def pack(array):
            p = self._gathered.get(id(array))
            if p is not None and p.data is array:
                return _SavedParameter(p)
            return outer[0](array) if outer else array

        def unpack(saved):
            if isinstance(saved, _SavedParameter):
                self._begin_backward(self._unit_of[id(saved.param)])  # gathers if not gathered yet
                return saved.param.data
            return outer[1](saved) if outer else saved
        return saved_tensors_hooks(pack, unpack)

    def _gather_hook(self, st):
        """Forward pre-hook: gather the unit (if not yet) and route the module's saves through pack."""
        def hook(module, args):
            if st.full is None:
                self._gather(st, "gather_forward" if is_grad_enabled() else "gather_no_grad")
            cm = self._saved_tensors_hooks() if is_grad_enabled() else None
            if cm is not None:
                cm.__enter__()  # closed by the forward hook: the module's saves go through pack
            self._hook_stack.append(cm)
        return hook

    def _free_hook(self, st):
        """Forward hook: close the pack hook; free the unit after its last use in this forward."""
        def hook(module, args, out):
            cm = self._hook_stack.pop()
            if cm is not None:
                cm.__exit__(None, None, None)
            st.uses_left -= 1
            if st.uses_left <= 0:  # last use in this forward (the tied embedding has two)
                self._free(st)
        return hook

    @contextlib.contextmanager
    def full_parameters(self):
        """Collective (every rank enters): inside, every ``p.data`` is the full parameter (stage 3 gathers all).

        For saving, generating and comparing. No-op for stages 1-2, whose parameters are always full.
        """
        if self.stage < 3:
            yield
            return
        for st in self.units:
            if st.full is None:
                self._gather(st, "gather_full")
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for st in self.units:
                self._free(st)
