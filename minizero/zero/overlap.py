"""ZeRO's overlap helpers: the overlapped gradient reduce-scatter (stages 2-3) and the parameter prefetch (stage 3).

Both run the blocking path's ring in a stream (bitwise equal); at most :data:`REDUCE_BUCKETS` buckets and
:data:`GATHERED_UNITS` gathered units are alive (plus the tied embedding's). Need :func:`can_overlap`.
Mirrors DeepSpeed's ``overlap_comm`` (two IPG buffers), PyTorch FSDP's ``forward_prefetch`` / ``backward_prefetch``.
"""
from __future__ import annotations

from minizero import backend
from minizero.comm.collectives import bytes_sent, mean_scale_, shard_range
from minizero.comm.nonblocking import RingCollective, Stream
from minizero.ledger import get_ledger
from minizero.zero.hybrid import sum_over_replicas

PREFETCH_TAG = 1005  #: tag of the prefetching all-gathers (every kind of message has its own: tests/test_tags.py)
REDUCE_TAG = 1004  #: tag of the overlapped gradient reduce-scatters
#: gradient buckets alive at once under the overlapped reduce-scatter, the tied embedding's aside (the
#: estimator, ``memory/estimator/zero_overlap.py``, imports it: one constant for both)
REDUCE_BUCKETS = 2
#: units gathered at once under stage 3's prefetch, the tied embedding aside; the estimator imports it
GATHERED_UNITS = 2


def can_overlap(collectives) -> bool:
    """Whether the non-blocking rings can run: N > 1, the hand-written ring, a non-blocking communicator."""
    c = collectives.comm
    return bool(c.world_size > 1 and not collectives.native and not collectives.quantized_comm and c.nonblocking)


class OverlappedReduceScatter:
    """Reduce-scatters of gradient buckets in flight, oldest first, over ``collectives.comm``."""

    def __init__(self, collectives):
        self.collectives = collectives
        self.stream = Stream(collectives.comm)
        self.in_flight = []  # (RingCollective, bucket, unit) submitted and not yet retired, oldest first

    def progress(self) -> None:
        self.stream.progress()

    def start(self, st, flat) -> None:
        """Submit the reduce-scatter of unit ``st``'s (padded,) bucket ``flat`` (consumed); when retired, the
        mean chunk is added into ``st.grad_shard``. First retires the oldest until ``REDUCE_BUCKETS - 2`` are in
        flight: with this one and the bucket backward fills next, ``REDUCE_BUCKETS`` are alive."""
        while len(self.in_flight) >= REDUCE_BUCKETS - 1:
            self.retire_oldest()
        c = self.collectives
        c.agree(st, "reduce_scatter_grads")
        n, rank = c.comm.world_size, c.comm.rank
        mean_scale_(flat, c.data_ranks, before_sum=True, predivided=c.predivided)
        c.bytes_sent["reduce_scatter_grads"] += bytes_sent("reduce_scatter", flat.size, flat.itemsize, n, rank)
        coll = RingCollective(c.comm, flat, "reduce_scatter", REDUCE_TAG, name=f"reduce_scatter {st.unit.name}",
                              unit=st.unit.name, phase="reduce_scatter_grads")
        get_ledger().track(coll.tmp, "comm_scratch")  # the receive chunk, alive until retired
        self.in_flight.append((coll, flat, st))
        self.stream.submit(coll)

    def retire_oldest(self) -> None:
        """Wait for the oldest reduce-scatter, add its mean chunk into the unit's shard (after the replica group's
        blocking all-reduce under hybrid sharding: every rank retires in the same order), then drop its bucket."""
        coll, flat, st = self.in_flight[0]
        c = self.collectives
        comm = c.comm
        if not coll.done:
            with comm.traffic.span("wait reduce_scatter"):
                self.stream.wait_for(coll)
        off, size = shard_range(flat.size, comm.world_size, comm.rank)
        mine = flat[off:off + size].copy()
        with c.count("reduce_scatter_grads"):  # nothing sent without replicas
            sum_over_replicas(c.replicas, mine, c.native)
        st.grad_shard += mean_scale_(mine, c.data_ranks, before_sum=False, predivided=c.predivided)
        self.in_flight.pop(0)  # the last reference: the bucket and the receive chunk are freed here

    def wait_all(self) -> None:
        while self.in_flight:
            self.retire_oldest()


class Prefetcher:
    """All-gathers of units started ahead of use, one stream, over ``collectives.comm``."""

    def __init__(self, collectives):
        self.collectives = collectives
        self.stream = Stream(collectives.comm)
        self.pending = {}  # unit index -> (RingCollective, its buffer)

    def progress(self) -> None:
        if self.pending:
            self.stream.progress()

    def start(self, st, phase: str) -> None:
        """Start unit ``st``'s all-gather (non-blocking) unless one is pending; its buffer counts as ``gathered`` in
        the ledger from now."""
        if st.index in self.pending:
            return
        c = self.collectives
        c.agree(st, phase, prefetched=True)
        n, padded = c.comm.world_size, st.unit.padded
        full = backend.xp.empty(padded, dtype=st.param_shard.dtype)
        off, size = shard_range(padded, n, c.comm.rank)
        full[off:off + size] = st.param_shard
        get_ledger().track(full, "gathered")
        c.bytes_sent[phase] += bytes_sent("all_gather", padded, full.itemsize, n, c.comm.rank)
        coll = RingCollective(c.comm, full, "all_gather", PREFETCH_TAG, name=f"all_gather {st.unit.name}",
                              unit=st.unit.name, phase=phase)
        self.pending[st.index] = (coll, full)
        self.stream.submit(coll)

    def take(self, st):
        """The (padded,) gathered buffer of ``st`` once its prefetch finished (waits), or None if none was started."""
        pend = self.pending.pop(st.index, None)
        if pend is None:
            return None
        coll, full = pend
        self.stream.wait_for(coll, f"prefetch of {st.unit.name!r}")
        return full
