"""Every ZeRO collective on a unit, with its identity checked: what ranks must agree on before they sum.

ZeRO pairs rank r's message about unit u with rank s's message about the *same* unit u. A
rank that reaches its collectives in another order (blocks run in a rank-dependent order, a
block skipped on one rank) would otherwise pair unit 0 with unit 1 and, when the two have the
same size, sum them without a word. So before each collective every rank all-gathers a
three-number header ``(unit index, phase, prefetched)`` and compares: on a mismatch every rank
raises the same :class:`ZeroOrderError` naming what each rank tried to do (PyTorch FSDP asks
for the same module order on every rank; its debug mode checks collective fingerprints the same
way). ``prefetched`` tells a blocking gather from a prefetching one (zero_prefetch.py): their
rings use different tags, so two ranks that agree on the unit but not on the way would wait
for each other until the communication timeout.

Cost: one ring all-gather of 3 int64 per rank before each unit collective, (N-1) x 24 bytes
per rank, under the traffic label ``zero_header`` (not in any ZeRO phase's byte count).

Means over ranks: float16 is divided by N before the sum, wider dtypes after
(:func:`minizero.comm.collectives.divide_before_sum`, PyTorch DDP's pre-division).
"""
from __future__ import annotations

import contextlib

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_gather, mean_scale_, reduce_scatter
from minizero.comm.quantized import quantized_all_gather, quantized_reduce_scatter
from minizero.memory.zero_shards import PHASES


class ZeroOrderError(RuntimeError):
    """Ranks of a ZeRO group reached different collectives (other unit or phase) at the same point."""


class UnitState:
    """Arrays and flags of one unit on one rank (see :class:`minizero.memory.zero.ZeroOptimizer` for who holds what).

    ``complete``: every parameter's gradient of this micro-batch's backward has arrived;
    ``reduced``: its bucket was reduce-scattered in this micro-batch (stages 2-3).
    """

    def __init__(self, index, unit, params, users):
        self.index, self.unit, self.params, self.users = index, unit, params, users
        self.flat_param = self.param_shard = self.full = None
        self.placeholders = self.pieces = self.master = None
        self.flat_grad = self.grad_shard = self.m = self.v = None
        self.uses_left = 0  # forward uses still to come before a stage-3 unit is freed
        self.ready = set()  # ids of parameters whose gradient is complete in this backward
        self.in_backward = False
        self.complete = self.reduced = False


class UnitCollectives:
    """The collectives of :class:`~minizero.memory.zero.ZeroOptimizer` on one unit, each behind a header check.

    Expects on ``self``: ``comm``, ``units`` (list of :class:`UnitState`), ``native``,
    ``quantized_comm``, ``bytes_sent`` (phase -> bytes).
    """

    @contextlib.contextmanager
    def _count(self, phase):
        """Add the bytes sent inside the block to ``self.bytes_sent[phase]``."""
        before = self.comm.traffic.bytes_sent
        try:
            yield
        finally:
            self.bytes_sent[phase] += self.comm.traffic.bytes_sent - before

    def _agree(self, st, phase: str, prefetched: bool = False) -> None:
        """Collective: check every rank is about to run ``phase`` on the same unit (``st``; None: no unit),
        the same way (``prefetched``: the non-blocking gather started ahead of use, zero_prefetch.py).

        Raises:
            ZeroOrderError: on every rank, naming each rank's unit and phase.
        """
        n = self.comm.world_size
        if n == 1:
            return
        mine = backend.xp.asarray([-1 if st is None else st.index, PHASES.index(phase), int(prefetched)],
                                  dtype=np.int64)
        with self.comm.traffic.op("zero_header"):
            every = backend.to_host(all_gather(self.comm, mine)).reshape(n, 3)
        if (every != every[0]).any():
            said = "; ".join(f"rank {r}: {PHASES[p]}{' (prefetch)' if f else ''}"
                             + (f" of {self.units[u].unit.name!r}" if u >= 0 else "")
                             for r, (u, p, f) in enumerate(every.tolist()))
            raise ZeroOrderError(
                f"ZeRO: ranks disagree on the next collective ({said}). Every rank must run the same units "
                "in the same order (stage 3 gathers each unit as its forward begins); stages 1-2 accept "
                "any order and units skipped on some ranks")

    def _all_gather_unit(self, st, shard, phase: str):
        """All-gather a unit's (S,) shards into its (padded,) buffer, after the header check; counted as ``phase``.

        INT8 on the wire (``quantized_comm``) only for stage 3's forward/backward gathers.
        """
        self._agree(st, phase)
        with self._count(phase):
            if self.quantized_comm and phase in ("gather_forward", "gather_backward"):
                return quantized_all_gather(self.comm, shard, st.unit.padded)
            return all_gather(self.comm, shard, st.unit.padded, native=self.native)

    def _reduce_scatter_unit(self, st, flat):
        """Mean over ranks of a unit's (padded,) gradient buffer ``flat``: this rank's (S,) chunk.

        The ring, or INT8 all-to-all with ``quantized_comm``; counted as ``reduce_scatter_grads``.
        ``flat`` (this rank's own buffer) is divided in place when its dtype divides before the sum.
        """
        self._agree(st, "reduce_scatter_grads")
        n = self.comm.world_size
        with self._count("reduce_scatter_grads"):
            mean_scale_(flat, n, before_sum=True, predivided=self.predivided)
            if self.quantized_comm:
                mine = quantized_reduce_scatter(self.comm, flat)
            else:
                mine = reduce_scatter(self.comm, flat, native=self.native)
        return mean_scale_(mine, n, before_sum=False, predivided=self.predivided)

