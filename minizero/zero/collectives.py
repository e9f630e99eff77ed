"""ZeRO's collectives on one unit, and the check that every rank is at the same (unit, phase).

Under the debug switch (``MINIZERO_DEBUG_COLLECTIVES=1``) every rank all-gathers a header ``(unit, phase,
prefetched)`` (3 int64, label ``zero_header``) before each unit collective and raises :class:`ZeroOrderError`
on a mismatch (as PyTorch FSDP's debug mode); off, another order is a wrong sum or a hang.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_gather, mean_scale_, reduce_scatter
from minizero.comm.quantized import quantized_all_gather, quantized_reduce_scatter
from minizero.zero.hybrid import replica_count, sum_over_replicas

#: Traffic phases of a training step (per-step volume); the others are set-up, evaluation
#: (``gather_no_grad``), saving (``gather_full``) and the one-scalar ``grad_norm`` all-reduce.
#: ``optimizer_sync``: a ``sharded_state`` optimizer's own messages (8-bit Adam's block absmax).
STEP_PHASES = ("gather_forward", "gather_backward", "reduce_scatter_grads", "all_gather_params", "optimizer_sync")
PHASES = STEP_PHASES + ("grad_norm", "gather_no_grad", "gather_full", "setup", "used_parameters")


#: the environment variable of the debug switch: "1" turns the per-collective order check on
DEBUG_COLLECTIVES_ENV = "MINIZERO_DEBUG_COLLECTIVES"


def debug_collectives() -> bool:
    """Whether the per-collective order check is on (``MINIZERO_DEBUG_COLLECTIVES=1``; unset, empty or "0": off).

    Raises:
        ValueError: any other value ("yes", "true", "on" would otherwise mean off without a word); the programs
            check it with their arguments, so a bad value stops them before any work.
    """
    text = os.environ.get(DEBUG_COLLECTIVES_ENV) or "0"  # empty: unset (as every MINIZERO_ variable)
    if text not in ("0", "1"):
        raise ValueError(f"{DEBUG_COLLECTIVES_ENV}={text!r}; allowed: \"0\" (off, the default) or \"1\" (every rank "
                         "checks each ZeRO collective's unit and phase)")
    return text == "1"


class ZeroOrderError(RuntimeError):
    """Ranks of a ZeRO group reached different collectives (other unit or phase) at the same point."""


class UnitState:
    """Arrays and flags of one unit on one rank: ``complete`` (all gradients arrived),
    ``reduced`` (this micro-batch)."""

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
    """The unit collectives of one ZeRO optimizer over ``comm`` (the shard group); bytes added to ``bytes_sent[phase]``.

    ``quantized_comm``: INT8 on the wire; ``predivided``: plain sum; ``check_order``: None = :func:`debug_collectives`.
    ``replicas``: hybrid sharding's replica group (zero/hybrid.py), or None; the gradient mean is over
    ``data_ranks`` = N x R ranks.
    """

    def __init__(self, comm, units, bytes_sent, native=False, quantized_comm=False, predivided=False,
                 check_order=None, replicas=None):
        self.comm, self.units, self.bytes_sent, self.replicas = comm, units, bytes_sent, replicas
        self.data_ranks = comm.world_size * replica_count(replicas)
        self.native, self.quantized_comm, self.predivided = native, quantized_comm, predivided
        self.check_order = debug_collectives() if check_order is None else check_order

    @contextlib.contextmanager
    def count(self, phase):
        """Add the bytes sent inside the block (shard and replica group) to ``bytes_sent[phase]``."""
        before = self._sent()
        try:
            yield
        finally:
            self.bytes_sent[phase] += self._sent() - before

    def _sent(self) -> int:
        return self.comm.traffic.bytes_sent + (0 if self.replicas is None else self.replicas.traffic.bytes_sent)

    def unit_span(self, op: str, st, phase: str):
        """A trace span ``"{op} {unit name}"`` with args ``unit`` (name), ``phase`` (as the overlapped ones of
        zero/overlap.py): a blocking collective's unit on the timeline; a no-op when tracing is off."""
        return self.comm.traffic.span(f"{op} {st.unit.name}", unit=st.unit.name, phase=phase)

    def agree(self, st, phase: str, prefetched: bool = False) -> None:
        """Collective when ``check_order``: every rank is about to run ``phase`` on unit ``st``,
        blocking or ``prefetched``.

        Raises ZeroOrderError on every rank, naming each rank's unit and phase.
        """
        n = self.comm.world_size
        if n == 1 or not self.check_order:
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

    def all_gather(self, st, shard, phase: str, out=None):
        """(S,) shards -> the unit's (padded,) buffer (into ``out`` when given), counted as ``phase``. INT8 with
        ``quantized_comm`` only for stage 3's forward/backward gathers (a gathered copy that *is* the parameter
        stays exact)."""
        self.agree(st, phase)
        with self.unit_span("all_gather", st, phase), self.count(phase):
            if self.quantized_comm and phase in ("gather_forward", "gather_backward"):
                full = quantized_all_gather(self.comm, shard, st.unit.padded)
                if out is None:
                    return full
                out[...] = full
                return out
            return all_gather(self.comm, shard, st.unit.padded, native=self.native, out=out)

    def reduce_scatter(self, st, flat):
        """Mean over the data ranks of a unit's (padded,) gradient ``flat``: this rank's (S,) chunk
        (``reduce_scatter_grads``). Two hops under hybrid sharding: reduce-scatter inside the shard group, then
        :func:`~minizero.zero.hybrid.sum_over_replicas` (in the gradient's dtype, never INT8)."""
        self.agree(st, "reduce_scatter_grads")
        n = self.data_ranks
        with self.unit_span("reduce_scatter", st, "reduce_scatter_grads"), self.count("reduce_scatter_grads"):
            mean_scale_(flat, n, before_sum=True, predivided=self.predivided)
            if self.quantized_comm:
                mine = quantized_reduce_scatter(self.comm, flat)
            else:
                mine = reduce_scatter(self.comm, flat, native=self.native)
            sum_over_replicas(self.replicas, mine, self.native)
        return mean_scale_(mine, n, before_sum=False, predivided=self.predivided)
