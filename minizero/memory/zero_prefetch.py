"""ZeRO-3 prefetch: the next unit's all-gather runs while the current unit computes (FSDP's prefetch).

::

    forward, unit i starts        gather i (or take its prefetched buffer), then start i+1's all-gather
    backward reaches unit i       gather i (or take it), then start the all-gather of the next unit
                                  backward will reach: the highest-index unit not yet in backward
    any module starts, any        progress() the gather in flight (non-blocking ring steps,
    gradient arrives              minizero.comm.nonblocking)

Units run in their index order in forward and in reverse in backward (the order
``find_units`` gives and the fixed reduce order of zero_buckets.py already assumes), so every
rank prefetches the same unit at the same point; the header check (zero_collectives.py) runs
when the prefetch starts, as it ran when the gather started. The gathered buffer is counted as
``gathered`` from the moment the prefetch starts, so the ledger's peak shows the price: at most
**two units** gathered (the running one and the next), plus the tied embedding, which stays
gathered from the token lookup to the LM head. A unit a recompute forward runs again inside
backward prefetches nothing (its successor was already reduced).

Bytes and traffic labels are the blocking gather's (``gather_forward`` / ``gather_backward``,
``all_gather``). Only for stage 3 over the hand-written ring (not ``native``, not
``quantized_comm``) on a communicator with ``isend``/``irecv``.

Mirrors: PyTorch FSDP's ``forward_prefetch`` and ``backward_prefetch=BACKWARD_PRE`` (which
record the execution order in the first iteration; minizero uses the unit order), DeepSpeed's
``stage3_prefetch_bucket_size``.
"""
from __future__ import annotations

from minizero import backend
from minizero.comm.collectives import bytes_sent, shard_range
from minizero.comm.nonblocking import RingCollective, Stream, _wait_until
from minizero.autograd import is_grad_enabled
from minizero.ledger import get_ledger

PREFETCH_TAG = 1005  #: tag of the prefetching all-gathers (apart from the blocking rings' and the DP overlap's)


class Prefetch:
    """Mixin for :class:`~minizero.memory.zero.ZeroOptimizer` (before ``ParameterPartitioning`` in the MRO).

    Call :meth:`_init_prefetch` after the units are built. Overrides ``_gather`` (take a prefetched
    buffer when there is one) and adds hooks. Expects ``comm``, ``units``, ``stage``, ``native``,
    ``quantized_comm``, ``bytes_sent``, ``_pinned``, ``_agree``, ``_point_params``, ``_gathered``.
    """

    def _init_prefetch(self, model, enabled: bool) -> None:
        c = self.comm
        self.prefetch = bool(enabled and self.stage == 3 and c.world_size > 1 and not self.native
                             and not self.quantized_comm and c.nonblocking)
        self._pending = {}  # unit index -> (RingCollective, its buffer, phase)
        if not self.prefetch:
            return
        self._stream = Stream(c)
        for st in self.units:  # the unit's own module; its tied second use (the LM head) is the last module
            st.users[0].register_forward_pre_hook(self._prefetch_forward_hook(st))
        for _, m in model.named_modules():  # progress between modules, whichever runs
            m.register_forward_pre_hook(lambda module, args: self._progress())

    def _progress(self) -> None:
        if self._pending:
            self._stream.progress()

    def _gather(self, st, phase):
        pend = self._pending.pop(st.index, None)
        if pend is None:
            super()._gather(st, phase)
            return
        coll, full, _ = pend
        _wait_until(self.comm, lambda: self._stream.progress() or coll.done, f"prefetch of {st.unit.name!r}")
        st.full = full
        self._point_params(st, st.full)
        for p in st.params:
            self._gathered[id(p.data)] = p
        st.uses_left = len(st.users)

    def _start_prefetch(self, st, phase: str) -> None:
        """Start ``st``'s all-gather (non-blocking) unless it is gathered, pending or finished for this micro-batch."""
        if st is None or st.full is not None or st.index in self._pending or self._pinned:
            return
        self._agree(st, phase)
        n, padded = self.comm.world_size, st.unit.padded
        full = backend.xp.empty(padded, dtype=st.param_shard.dtype)
        off, size = shard_range(padded, n, self.comm.rank)
        full[off:off + size] = st.param_shard
        get_ledger().track(full, "gathered")
        self.bytes_sent[phase] += bytes_sent("all_gather", padded, full.itemsize, n, self.comm.rank)
        coll = RingCollective(self.comm, full, "all_gather", PREFETCH_TAG, name=f"all_gather {st.unit.name}",
                              unit=st.index, phase=phase)
        self._pending[st.index] = (coll, full, phase)
        self._stream.submit(coll)

    def _prefetch_forward_hook(self, st):
        """Forward pre-hook (after the gather hook): start the all-gather of unit ``st.index + 1``."""
        def hook(module, args):
            if st.index + 1 < len(self.units):
                nxt = self.units[st.index + 1]
                if not (nxt.reduced or nxt.in_backward):  # not a recompute inside backward
                    self._start_prefetch(nxt, "gather_forward" if is_grad_enabled() else "gather_no_grad")
        return hook

    def _prefetch_backward(self, st) -> None:
        """Backward reached ``st``: start the all-gather of the next unit backward will reach."""
        if not self.prefetch:
            return
        waiting = [u for u in self.units if u is not st and not (u.in_backward or u.reduced or u.complete)]
        if waiting:
            self._start_prefetch(max(waiting, key=lambda u: u.index), "gather_backward")
