"""ZeRO overlap: stage 3 prefetches the next unit's all-gather; stages 2-3 reduce-scatter without waiting.

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

Stages 2-3, **overlapped reduce-scatter** (``ZeroOptimizer(overlap_reduce=True)``, the CLI's
default; ``--no-overlap`` turns it off): when a unit's bucket is due (its fixed turn,
zero_buckets.py), its ring reduce-scatter is submitted to a second stream (its own tag) instead of
run to the end; backward continues, the hooks progress it, and when it finishes its mean chunk is
added into the owned gradient shard. Same ring, same additions, same order of the per-unit
accumulations: bitwise the blocking result.

**Double buffering**, so the memory is a formula and not a race: at most
:data:`REDUCE_BUCKETS` = 2 buckets are alive besides the tied embedding's, the one backward is
filling and the one whose reduce-scatter is in flight. Before a bucket is submitted, the one
submitted before it is *retired*: waited for (its ring finishes, its chunk is added) and only
then freed. A bucket is freed at that point and never earlier, even when its ring finished long
before, so the ledger's ``comm_buffers`` peak does not depend on timing: the tied embedding's
bucket (open from the LM head to the end of backward) plus the largest sum of two units
adjacent in backward order (``estimator/zero_overlap.py`` computes it from the same constant). The
ring's receive chunk (ceil(padded/N) elements) is counted as ``comm_scratch`` for the same
lifetime. ``reduce_gradients`` (and the next micro-batch's first forward) waits for the last one.

Mirrors: DeepSpeed stage 1-2's ``overlap_comm`` with ``contiguous_gradients`` (reduce in a side stream
during backward, alternating two IPG buffers: ``ipg_index = 1 - ipg_index`` in ``stage_1_and_2.py``'s
``reduce_independent_p_g_buckets_and_remove_grads``); PyTorch FSDP's ``forward_prefetch`` and
``backward_prefetch=BACKWARD_PRE`` (which
record the execution order in the first iteration; minizero uses the unit order), DeepSpeed's
``stage3_prefetch_bucket_size``.
"""
from __future__ import annotations

from minizero import backend
from minizero.comm.collectives import bytes_sent, mean_scale_, shard_range
from minizero.comm.nonblocking import RingCollective, Stream, _wait_until
from minizero.autograd import is_grad_enabled
from minizero.ledger import get_ledger

PREFETCH_TAG = 1005  #: tag of the prefetching all-gathers (apart from the blocking rings' and the DP overlap's)
REDUCE_TAG = 1004  #: tag of the overlapped gradient reduce-scatters
#: gradient buckets alive at once under the overlapped reduce-scatter, the tied embedding's aside:
#: the one backward fills and the one being reduced (DeepSpeed's two IPG buffers). The estimator
#: (``memory/estimator/zero_overlap.py``) imports it: one constant for both.
REDUCE_BUCKETS = 2
#: units gathered at once under stage 3's prefetch (one unit ahead), the tied embedding aside: the running
#: one and the next; the estimator imports it
GATHERED_UNITS = 2


class Prefetch:
    """Mixin for :class:`~minizero.memory.zero.ZeroOptimizer` (before ``ParameterPartitioning`` in the MRO).

    Call :meth:`_init_prefetch` after the units are built. Overrides ``_gather`` (take a prefetched
    buffer when there is one) and adds hooks. Expects ``comm``, ``units``, ``stage``, ``native``,
    ``quantized_comm``, ``bytes_sent``, ``_pinned``, ``_agree``, ``_point_params``, ``_gathered``.
    """

    def _init_prefetch(self, model, prefetch: bool, overlap_reduce: bool = False) -> None:
        c = self.comm
        usable = bool(c.world_size > 1 and not self.native and not self.quantized_comm and c.nonblocking)
        self.prefetch = usable and prefetch and self.stage == 3
        self.overlap_reduce = usable and overlap_reduce and self.stage >= 2
        self._pending = {}  # unit index -> (RingCollective, its buffer, phase)
        self._in_flight = []  # (RingCollective, bucket) submitted and not yet retired, oldest first
        self._reduce_stream = Stream(c) if self.overlap_reduce else None
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
        if self._reduce_stream is not None:
            self._reduce_stream.progress()

    def _start_reduce(self, st, flat) -> None:
        """Submit the unit's reduce-scatter of its (padded,) bucket ``flat`` (this rank's, consumed);
        when it finishes, the mean chunk is added into ``st.grad_shard`` (as the blocking path does).

        First retires the oldest buckets until fewer than ``REDUCE_BUCKETS - 1`` are in flight
        (double buffering, module docstring); the new bucket stays alive until it is retired.
        """
        while len(self._in_flight) >= REDUCE_BUCKETS - 1:
            self._retire_oldest()
        self._agree(st, "reduce_scatter_grads")
        n, rank = self.comm.world_size, self.comm.rank
        mean_scale_(flat, n, before_sum=True, predivided=self.predivided)
        self.bytes_sent["reduce_scatter_grads"] += bytes_sent("reduce_scatter", flat.size, flat.itemsize, n, rank)
        off, size = shard_range(flat.size, n, rank)

        def done():
            mine = flat[off:off + size].copy()
            st.grad_shard += mean_scale_(mine, n, before_sum=False, predivided=self.predivided)
        coll = RingCollective(self.comm, flat, "reduce_scatter", REDUCE_TAG, name=f"reduce_scatter {st.unit.name}",
                              unit=st.index)
        get_ledger().track(coll.tmp, "comm_scratch")  # the receive chunk, alive until retired
        self._in_flight.append((coll, flat))
        self._reduce_stream.submit(coll, done)

    def _retire_oldest(self) -> None:
        """Wait for the oldest overlapped reduce-scatter (its chunk is then added), then drop its bucket."""
        coll, _ = self._in_flight[0]
        if not coll.done:
            with self.comm.traffic.span("wait reduce_scatter"):
                _wait_until(self.comm, lambda: self._reduce_stream.progress() or coll.done, coll.name,
                            coll.waiting_on)
        self._in_flight.pop(0)  # the last reference: the bucket and the receive chunk are freed here

    def _wait_reduces(self) -> None:
        """Wait for every overlapped reduce-scatter (their chunks are then in the gradient shards)."""
        while self._in_flight:
            self._retire_oldest()

    def _gather(self, st, phase):
        pend = self._pending.pop(st.index, None)
        if pend is None:
            super()._gather(st, phase)
            return
        coll, full, _ = pend
        _wait_until(self.comm, lambda: self._stream.progress() or coll.done, f"prefetch of {st.unit.name!r}",
                    lambda: self._stream.queue[0][0].waiting_on() if self._stream.queue else None)
        st.full = full
        self._point_params(st, st.full)
        for p in st.params:
            self._gathered[id(p.data)] = p
        st.uses_left = len(st.users)

    def _start_prefetch(self, st, phase: str) -> None:
        """Start ``st``'s all-gather (non-blocking) unless it is gathered, pending or finished for this micro-batch."""
        if st is None or st.full is not None or st.index in self._pending or self._pinned:
            return
        self._agree(st, phase, prefetched=True)
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
