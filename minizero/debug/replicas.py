"""Replica consistency (``--check-replicas N``): every parameter hashed and compared across the data group.

Data-parallel replicas must hold bit-identical parameters; one that drifted (a parameter updated on one rank
only, a bit flip) trains on silently. Each rank hashes each parameter (BLAKE2b, 8 bytes), the data group
all-gathers the digests, and the first parameter that differs is named with both sides' ranks and the step.
Mirrors Megatron-LM's ``check_weight_hash_across_dp_replicas_interval``.
"""
from __future__ import annotations

import hashlib

import numpy as np

from minizero import backend
from minizero.callbacks import Callback
from minizero.comm.collectives import all_gather


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different values of a parameter that they must hold equal."""


def digest(array) -> int:
    """The first 8 bytes of BLAKE2b over ``array``'s bytes (shape and dtype included), as a signed int64."""
    host = np.ascontiguousarray(backend.to_host(array))
    h = hashlib.blake2b(f"{host.shape}{host.dtype}".encode(), digest_size=8)
    h.update(host.tobytes())
    return int(np.frombuffer(h.digest(), dtype=np.int64)[0])


def check_replicas(comm, named_arrays, step: int, members=None) -> int:
    """Compare every array of ``named_arrays`` (``[(name, array)]``, the same names in the same order on every
    rank) across ``comm``, the group whose ranks must hold them equal; returns how many were compared.

    Collective over ``comm``: one all-gather of ``len(named_arrays)`` int64 digests per rank, counted under
    the traffic label ``replica_check``. ``members``: the world ranks of ``comm``'s ranks, for the message.
    Raises:
        ReplicaMismatchError (on every rank): the first array whose digests differ, each digest's ranks, ``step``
            (named as given: the loop passes the progress log's step number, 1-based).
        ValueError: ranks gave different numbers of arrays (the all-gather's size check).
    """
    names = [name for name, _ in named_arrays]
    mine = np.array([digest(a) for _, a in named_arrays], dtype=np.int64)
    if comm.world_size == 1 or not names:
        return len(names)
    with comm.traffic.op("replica_check"):
        every = backend.to_host(all_gather(comm, backend.to_device(mine))).reshape(comm.world_size, len(names))
    who = list(members) if members is not None else list(range(comm.world_size))
    for j, name in enumerate(names):
        column = every[:, j]
        if (column != column[0]).any():
            sides: dict[int, list[int]] = {}
            for r, d in enumerate(column):
                sides.setdefault(int(d), []).append(who[r])
            told = " but ".join(f"rank(s) {ranks} hold digest {d & 0xFFFFFFFFFFFFFFFF:016x}"
                                for d, ranks in sorted(sides.items(), key=lambda kv: -len(kv[1])))
            raise ReplicaMismatchError(f"after step {step}: parameter {name!r} {tuple(named_arrays[j][1].shape)} "
                                       f"differs across the data-parallel replicas {who}: {told} (--check-replicas)")
    return len(names)


class ReplicaCheck(Callback):
    """The loop's ``--check-replicas``: :func:`check_replicas` over the data group after every ``every``-th step,
    after each checkpoint's step (``save_every``, checked before the save) and after the last, on the full
    parameters (ZeRO-3 gathers them: its shards are not replicated, so there the check covers the gather).

    Args:
        every: steps between checks (>= 1), or None for checkpoints and the end only.
        save_every: the run's ``--save-every`` (0: no checkpoints).
    Raises:
        ValueError: ``every`` not None or an int >= 1.
    """

    def __init__(self, every: int | None, save_every: int = 0):
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every={every!r}; allowed: None or an int >= 1 (steps between checks)")
        self.every, self.save_every, self.checked = every, save_every, None

    def _check(self, run, step: int) -> None:
        s = run.strategy
        members = next(g for g in s.topo.all_groups("dp") if run.comm.rank in g)
        with s.full_parameters():
            check_replicas(s.topo.dp_comm, [(n, p.data) for n, p in s.stage.named_parameters()], step + 1, members)
        self.checked = step

    def on_step_end(self, run, step, record):
        if any(n and (step + 1) % n == 0 for n in (self.every, self.save_every)):
            self._check(run, step)

    def on_train_end(self, run):
        if run.args.steps > run.start and self.checked != run.args.steps - 1:
            self._check(run, run.args.steps - 1)
