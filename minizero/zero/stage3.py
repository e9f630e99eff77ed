"""ZeRO stage 3 (P_os+g+p): parameters live only as shards; a unit is gathered just before it runs, freed after.

::

    forward pre-hook     all-gather the unit's shards -> (padded,) buffer; p.data = views of it;
                         open a saved-tensor pack hook for the module's forward
    module forward       a gathered parameter a Function saves becomes a handle (_SavedParameter), and so does a
                         contiguous view of one (MoE's expert slice w1[j]: _SavedParameter with its offset)
    forward hook         after the unit's last use p.data = NaN placeholders again: the buffer is freed
    stage2.py's hook     puts _RunBeforeBackward on the output; its backward calls _begin_backward: re-gather
    backward             the unpack hook hands back the re-gathered array; freed again once stage2.py's
                         _grad_ready has reduce-scattered the unit's bucket (_end_backward)

Per micro-batch: two all-gathers and one reduce-scatter, 3(N-1)/N of the parameter bytes per rank.
Every rank runs the units in the same order. Source: Rajbhandari et al., SC 2020, section 7.2.2;
DeepSpeed ``stage3.py``, FSDP's ``FULL_SHARD``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minizero import backend
from minizero.autograd import is_grad_enabled, saved_tensors_hooks
from minizero.autograd.engine import current_saved_tensors_hooks
from minizero.ledger import get_ledger
from minizero.zero.base import ZeroOptimizer
from minizero.zero.overlap import Prefetcher, can_overlap
from minizero.zero.shards import owned_shard
from minizero.zero.stage2 import ZeroStage2


class _SavedParameter:
    """What a gathered parameter (or a contiguous view of one: ``view`` = (element offset, shape)) becomes when a
    Function saves it: a handle, not its array."""

    __slots__ = ("param", "view")

    def __init__(self, param, view=None):
        self.param, self.view = param, view

    def array(self):
        """The saved array, from the parameter's (re-)gathered data."""
        if self.view is None:
            return self.param.data
        start, shape = self.view
        return self.param.data.reshape(-1)[start:start + int(np.prod(shape))].reshape(shape)


#: (array module name, dtype) -> the one 0-d NaN every placeholder of that module and dtype broadcasts
_NANS: dict = {}


class _Unheld(np.ndarray):
    """A NumPy placeholder's type: any arithmetic on it raises, naming the parameter (FSDP2's parameters are DTensors
    outside forward, which refuse to mix with plain tensors); without it the NaN would flow on silently."""

    name = "a parameter"

    def __array_finalize__(self, obj):  # views (.T, reshape) keep the name
        self.name = getattr(obj, "name", _Unheld.name)

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"ZeRO-3: parameter {self.name} used outside its module's forward, where it holds no "
                           "values on this rank (its unit is gathered only while its module runs); use it inside "
                           "that module's forward, put the code in a module, or use ZeRO stage 1 or 2")

    __array_ufunc__ = __array_function__ = _refuse


def placeholder(shape, dtype, name: str = _Unheld.name):
    """What parameter ``name``'s ``data`` is while its unit is not gathered: one shared NaN broadcast to ``shape``
    (0 bytes of its own: the ledger counts the shared NaN's buffer, one element per array module and dtype; the
    right shape for code that asks); under NumPy an :class:`_Unheld` view, so a use raises."""
    xp = backend.xp
    key = (xp.__name__, np.dtype(dtype).str)
    if key not in _NANS:
        _NANS[key] = xp.asarray(np.nan, dtype=dtype)
    ph = xp.broadcast_to(_NANS[key], shape)
    if isinstance(ph, np.ndarray):
        ph = ph.view(_Unheld)
        ph.name = name
    return ph


def _forward_phase() -> str:  # a forward gather's traffic phase (no grad: evaluation)
    return "gather_forward" if is_grad_enabled() else "gather_no_grad"


def is_placeholder(a) -> bool:
    """Whether ``a`` is a :func:`placeholder`: a parameter between uses that holds no values on this rank."""
    return isinstance(a, _Unheld) or (a.base is not None and any(a.base is nan for nan in _NANS.values()))


class ZeroStage3(ZeroStage2):
    """Stage 3 (arguments: :class:`~minizero.zero.base.ZeroOptimizer`); ``prefetch``: gather the next unit meanwhile.

    Raises RuntimeError (``step``): inside :meth:`full_parameters`.
    """

    stage = 3
    shards = "optimizer state, gradients and parameters"
    holds_full_parameters = False
    quantized_collectives = "the gradient reduce-scatters and parameter all-gathers"

    def __init__(self, model, comm, prefetch: bool = False, **kwargs):
        self._pinned = False  # inside full_parameters()
        self._gathered = {}  # id(p.data) -> p, for the pack hook
        self._hook_stack = []  # saved_tensors_hooks opened by pre-hooks, closed by post-hooks
        super().__init__(model, comm, **kwargs)
        self.prefetcher = Prefetcher(self.collectives) if prefetch and can_overlap(self.collectives) else None
        if self.prefetcher is not None:
            for st in self.units:  # the unit's own module; its tied second use (the LM head) is the last module
                st.users[0].register_forward_pre_hook(self._prefetch_forward_hook(st))
            for _, m in model.named_modules():  # progress between modules, whichever runs
                m.register_forward_pre_hook(lambda module, args: self._progress())

    def overlap_words(self) -> list[str]:
        prefetched = ["the next unit's all-gather is prefetched"] if self.prefetcher is not None else []
        return super().overlap_words() + prefetched

    # ---- set-up: only the owned piece is ever built (meta parameters draw just it: nn/init.py) -----
    def _build_params(self, st, lo, size, dtype):
        st.param_shard = owned_shard(st.params, st.unit.offsets, lo, size, dtype)

    def _home_params(self, st):
        get_ledger().track(st.param_shard, "parameters")
        st.placeholders = [placeholder(p.shape, st.param_shard.dtype, name)
                           for p, name in zip(st.params, st.unit.param_names)]
        for p, ph in zip(st.params, st.placeholders):
            p.data = ph  # the full array is freed here; the shard is all that stays

    def _publish_params(self, phase: str) -> None:
        """Nothing: the owned shard *is* the parameter; the next forward gathers it."""

    def _register_unit_hooks(self, st, module):
        module.register_forward_pre_hook(self._gather_hook(st))
        module.register_forward_hook(self._free_hook(st))
        super()._register_unit_hooks(st, module)

    # ---- gather and free ---------------------------------------------------------------
    def _gather(self, st, phase):
        """All-gather a unit's shards into a (padded,) buffer (``gathered``; or take its prefetched one);
        point ``p.data`` into it."""
        full = self.prefetcher.take(st) if self.prefetcher is not None else None
        if full is None:
            full = self.collectives.all_gather(st, st.param_shard, phase)
            get_ledger().track(full, "gathered")
        st.full = full
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
            view = self._view_of_gathered(array)
            if view is not None:
                return view
            return outer[0](array) if outer else array

        def unpack(saved):
            if isinstance(saved, _SavedParameter) and id(saved.param) in self._unit_of:  # not another ZeRO's
                self._begin_backward(self._unit_of[id(saved.param)])  # gathers if not gathered yet
                return saved.array()
            return outer[1](saved) if outer else saved
        return saved_tensors_hooks(pack, unpack)

    def _view_of_gathered(self, array):
        """A :class:`_SavedParameter` for a C-contiguous view inside a gathered parameter (None otherwise): saved as
        the array, it would keep the unit's whole buffer alive until backward."""
        if getattr(array, "base", None) is None or not array.flags.c_contiguous or not array.size:
            return None
        at = backend.data_ptr(array)
        for key, p in self._gathered.items():
            if key != id(p.data) or p.data.dtype != array.dtype:  # a stale entry (p.data re-pointed), another dtype
                continue
            start = backend.data_ptr(p.data)
            if start <= at < start + p.data.nbytes:
                offset, rest = divmod(at - start, array.itemsize)
                fits = not rest and offset + array.size <= p.data.size
                return _SavedParameter(p, (offset, array.shape)) if fits else None
        return None

    def _gather_hook(self, st):
        """Forward pre-hook: gather the unit (if not yet) and route the module's saves through pack."""
        def hook(module, args):
            if st.full is None:
                self._gather(st, _forward_phase())
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

    def _begin_backward(self, st):
        """Backward reached the unit: gather it if freed, open its bucket (stage 2), prefetch the next one."""
        first = not st.in_backward
        if first and st.full is None:
            self._gather(st, "gather_backward")
        super()._begin_backward(st)
        if first:
            self._prefetch_backward(st)

    def _end_backward(self, st):
        super()._end_backward(st)
        self._free(st)

    # ---- prefetch: forward in unit order, backward in reverse ------------------------------
    def _progress(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.progress()
        super()._progress()

    def _start_prefetch(self, st, phase: str) -> None:
        if st.full is None and not self._pinned:
            self.prefetcher.start(st, phase)

    def _prefetch_forward_hook(self, st):
        """Forward pre-hook (after the gather hook): start the all-gather of unit ``st.index + 1``."""
        def hook(module, args):
            if st.index + 1 < len(self.units):
                nxt = self.units[st.index + 1]
                if not (nxt.reduced or nxt.in_backward):  # not a recompute inside backward
                    self._start_prefetch(nxt, _forward_phase())
        return hook

    def _prefetch_backward(self, st) -> None:
        """Start the all-gather of the next unit backward will reach: the highest index not yet in backward."""
        if self.prefetcher is None:
            return
        waiting = [u for u in self.units if u is not st and not (u.in_backward or u.reduced or u.complete)]
        if waiting:
            self._start_prefetch(max(waiting, key=lambda u: u.index), "gather_backward")

    # ---- the step and reading: the owned shard is all there is -----------------------------
    # stage 1 (so 2) overrides these to read whole parameters, which every rank holds there; stage 3 holds only
    # its shards: back to the base's versions, which read owned pieces
    views = ZeroOptimizer.views
    _whole_params_on_load = ZeroOptimizer._whole_params_on_load

    def step(self, grad_scale: float = 1.0) -> None:
        if self._pinned:
            raise RuntimeError("ZeroOptimizer.step() inside full_parameters(): the full copies would go stale")
        for st in self.units:
            self._free(st)  # a unit still gathered would go stale
        super().step(grad_scale)

    @contextlib.contextmanager
    def full_parameters(self):
        """Collective (every rank enters): inside, every ``p.data`` is the full parameter (all gathered)."""
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
