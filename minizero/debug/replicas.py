"""Replica consistency (``--check-replicas N``): parameters and optimizer state hashed and compared across the
ranks that must hold them equal.

Data-parallel replicas must hold bit-identical parameters; one that drifted (a bit flip) trains on silently. Each
rank hashes each parameter (BLAKE2b, 8 bytes), the data group all-gathers the digests, and the first that differs
is named with both sides' ranks and the step (Megatron-LM's ``check_weight_hash_across_dp_replicas_interval``).
The optimizer state (m, v or 8-bit codes and absmax, masters, the step) is compared so over the data group (plain
DP), the replica group (hybrid ZeRO) or none (plain ZeRO: held once): a drifted state is named before the next
update carries it into the parameters. With ``--ep`` the experts (and their state) over their expert-data group.
One int64 per rank over the world tells every rank the verdict. FP16's loss scaler (scale and counters) is compared
over the world: every rank skips and grows the scale together.
"""
from __future__ import annotations

import hashlib

import numpy as np

from minizero import backend
from minizero.callbacks import Callback
from minizero.comm.collectives import all_gather
from minizero.optim.adam8bit import state_arrays
from minizero.parallel.expert_parallel import is_expert
from minizero.zero import shards_parameters
from minizero.zero.hybrid import replica_members

DATA_REPLICAS = "the data-parallel replicas"
SHARD_REPLICAS = "the replicas of this optimizer shard"
EXPERT_REPLICAS = "the expert-data replicas (the ranks holding these experts)"


class ReplicaMismatchError(RuntimeError):
    """Replicas hold different values of an array they must hold equal (parameter, optimizer state, loss scaler)."""


def digest(array) -> int:
    """The first 8 bytes of BLAKE2b over ``array``'s bytes (shape and dtype included), as a signed int64."""
    host = np.ascontiguousarray(backend.to_host(array))
    h = hashlib.blake2b(f"{host.shape}{host.dtype}".encode(), digest_size=8)
    h.update(host.tobytes())
    return int(np.frombuffer(h.digest(), dtype=np.int64)[0])


def _gather(comm, host):  # (world_size, n) on the host: every rank's (n,) ``host``, under ``replica_check``
    with comm.traffic.op("replica_check"):
        return backend.to_host(all_gather(comm, backend.to_device(np.ascontiguousarray(host)))).reshape(
            comm.world_size, -1)


def _first_difference(comm, array) -> str:
    """Collective over ``comm`` (the failing path only: all of ``array``'s bytes): where some rank's ``array``
    first differs from rank 0's, bitwise (a NaN equals itself), as the message's clause ("" if only the shape)."""
    host = np.ascontiguousarray(backend.to_host(array))
    every = _gather(comm, host.reshape(-1).view(np.uint8))
    differ = np.flatnonzero((every != every[0]).any(axis=0))
    return f", first at element {int(differ[0]) // host.itemsize}" if differ.size else ""


def find_mismatch(comm, named_arrays, step: int, members=None, what: str = "parameter",
                  among: str = DATA_REPLICAS, locate: bool = False) -> str | None:
    """The message naming the first array of ``named_arrays`` whose digests differ across ``comm``, or None.
    Collective over ``comm``: one all-gather of ``len(named_arrays)`` int64 digests per rank (``replica_check``);
    ``locate``: on a mismatch, one of that array's bytes too; a one-element array's values instead of digests (one
    more all-gather). ``members``: ``comm``'s world ranks, for the message.
    """
    names = [name for name, _ in named_arrays]
    if comm.world_size == 1 or not names:
        return None
    every = _gather(comm, np.array([digest(a) for _, a in named_arrays], dtype=np.int64))
    who = list(members) if members is not None else list(range(comm.world_size))
    for j, name in enumerate(names):
        column, array = every[:, j], named_arrays[j][1]
        if (column != column[0]).any():
            one = array.size == 1  # a number (the loss scale, the step): its values say more than its digests
            values = _gather(comm, np.ascontiguousarray(backend.to_host(array)).reshape(1))[:, 0] if one else None
            sides: dict[int, list[int]] = {}
            for r, d in enumerate(column):
                sides.setdefault(int(d), []).append(r)
            told = " but ".join(f"rank(s) {[who[r] for r in rs]} hold "
                                + (f"{values[rs[0]].item()}" if one else f"digest {d & 0xFFFFFFFFFFFFFFFF:016x}")
                                for d, rs in sorted(sides.items(), key=lambda kv: -len(kv[1])))
            where = _first_difference(comm, array) if locate and not one else ""
            shape = "" if one else f" {tuple(array.shape)}"
            return (f"after step {step}: {what} {name!r}{shape} differs across {among} {who}: {told}{where} "
                    "(--check-replicas)")
    return None


def check_replicas(comm, named_arrays, step: int, members=None, what: str = "parameter",
                   among: str = DATA_REPLICAS, locate: bool = False) -> int:
    """Compare every array of ``named_arrays`` (``[(name, array)]``, the same names in the same order on every
    rank) across ``comm``, the group whose ranks must hold them equal (:func:`find_mismatch`); returns how many.
    Raises:
        ReplicaMismatchError (on every rank): the first array whose digests differ, each digest's ranks, ``step``
            (named as given: the loop passes the progress log's step number, 1-based).
        ValueError: ranks gave different numbers of arrays (the all-gather's size check).
    """
    error = find_mismatch(comm, named_arrays, step, members, what, among, locate)
    if error is not None:
        raise ReplicaMismatchError(error)
    return len(named_arrays)


def raise_on_any(comm, error: str | None) -> None:
    """Collective over ``comm``: one all-gather of an int64 per rank (the length of its ``error``); where some
    rank has one, a second of the longest's bytes, and every rank raises the lowest such rank's error."""
    text = b"" if error is None else error.encode()
    lengths = _gather(comm, np.array([len(text)], np.int64))[:, 0]
    if not lengths.any():
        return
    mine = np.zeros(int(lengths.max()), np.uint8)
    mine[:len(text)] = np.frombuffer(text, np.uint8)
    first = int(np.flatnonzero(lengths)[0])
    raise ReplicaMismatchError(_gather(comm, mine)[first, :lengths[first]].tobytes().decode())


def optimizer_state(opt, names: dict, keep=lambda p: True) -> list:
    """``[(name, array)]``: the optimizer state this rank holds of the parameters ``keep`` takes, as a checkpoint
    writes it (``state_views``; parameters left out: the parameter check has them), then Adam's step count.
    ``names``: id(param) -> name."""
    out = []
    for kind, p, lo, hi, a in opt.state_views(save=True):
        if kind == "param" or not keep(p):
            continue
        label = f"{kind} of {names.get(id(p), '?')}" + ("" if (lo, hi) == (0, int(p.size)) else f"[{lo}:{hi}]")
        out += [(f"{label} {part}" if part else label, x) for part, x in state_arrays(a).items()]  # 8-bit: 2 parts
    return out + [("step", np.array([opt.step_count], np.int64))]


def has_replicas(data_ranks: int, shard_ranks: int, zero: int) -> bool:
    """Whether some rank's parameters are held bitwise equal by another (the default of ``--check-replicas``): a data
    group (dp x cp) of ``data_ranks`` > 1, below ZeRO-3 (the dense parameters, with ``--ep`` too) or under hybrid
    ZeRO-3 (``shard_ranks`` < ``data_ranks``: the shard groups replicate each other). Plain ZeRO-3 holds each shard
    once (the gathered parameters are equal by construction of the gather); one data rank holds everything once."""
    return data_ranks > 1 and (not shards_parameters(zero) or shard_ranks < data_ranks)


class ReplicaCheck(Callback):
    """The loop's ``--check-replicas``: :func:`find_mismatch` over the data group after every ``every``-th step,
    after each checkpoint's step (``save_every``, checked before the save) and after the last, on the full
    parameters (ZeRO-3 gathers them: its shards are not replicated, so there the check covers the gather), then
    on the optimizer state over the optimizer's ``state_replicas``; :func:`raise_on_any` over the world; FP16's
    loss scaler over the world.

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
        s, world = run.strategy, run.strategy.topo.world
        groups = self._replica_groups(s)
        error = self._parameter_mismatch(s, groups, step + 1)
        if s.edp_comm is not None:  # expert-data groups' verdicts differ inside a data group: agree before the state
            raise_on_any(world, error)
        if error is None:
            error = self._state_mismatch(s, groups, step + 1)
        if s.topo.dp_comm.world_size > 1:  # every data group's size: else no replicas, nothing sent
            raise_on_any(world, error)
        if run.scaler is not None:  # FP16: one loss scale for the whole job, held by every rank
            state = [(k, np.array([v], np.float64)) for k, v in run.scaler.state_dict().items()]
            check_replicas(world, state, step + 1, what="loss scaler", among="all ranks")
        self.checked = step

    @staticmethod
    def _replica_groups(s) -> list:
        """``[(comm, its world ranks, keep(param), among)]``: the data group holds the dense parameters equal; with
        ``--ep`` a rank's experts are held by its expert-data group only (ep data ranks apart)."""
        data, edp = s.topo.dp_comm, s.edp_comm
        members = next(g for g in s.topo.all_groups("dp") if s.topo.world.rank in g)
        groups = [(data, members, lambda p: not is_expert(p), DATA_REPLICAS)]
        if edp is not None:
            ep = data.world_size // edp.world_size
            groups.append((edp, members[data.rank % ep::ep], is_expert, EXPERT_REPLICAS))
        return groups

    @staticmethod
    def _parameter_mismatch(s, groups, step: int) -> str | None:  # the full parameters (ZeRO-3 gathers them)
        named = list(s.stage.named_parameters())
        with s.full_parameters():
            for comm, who, keep, among in groups:
                error = find_mismatch(comm, [(n, p.data) for n, p in named if keep(p)], step, who, among=among)
                if error is not None:
                    return error
        return None

    @staticmethod
    def _state_mismatch(s, groups, step: int) -> str | None:  # over opt.state_replicas: hybrid ZeRO's, DP's groups
        data, group = s.topo.dp_comm, s.opt.state_replicas(s.topo.dp_comm)
        names = {id(p): n for n, p in s.stage.named_parameters()}
        if group is None:  # plain ZeRO: every optimizer shard is held once
            return None
        if group is not data:  # hybrid ZeRO: every part (ExpertZero's too) over the dense part's replica group
            same = replica_members(data.world_size, data.world_size // group.world_size, data.rank)
            data_members = groups[0][1]  # the data group's world ranks (_replica_groups)
            return find_mismatch(group, optimizer_state(s.opt, names), step, [data_members[k] for k in same],
                                 "optimizer state", SHARD_REPLICAS, locate=True)
        for comm, who, keep, among in groups:  # DP: over the parameters' groups
            error = find_mismatch(comm, optimizer_state(s.opt, names, keep), step, who, "optimizer state", among,
                                  locate=True)
            if error is not None:
                return error
        return None

    def on_step_end(self, run, step, record):
        if any(n and (step + 1) % n == 0 for n in (self.every, self.save_every)):
            self._check(run, step)

    def on_train_end(self, run):
        if run.args.steps > run.start and self.checked != run.args.steps - 1:
            self._check(run, run.args.steps - 1)
