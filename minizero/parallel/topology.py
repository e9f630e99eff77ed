"""The 3D mesh: ``dp * tp * pp`` ranks, and one communicator per parallel group.

Megatron-LM's order "tp-dp-pp": ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``; every group is a
:meth:`Communicator.split` of the world. Sources: Narayanan et al., arXiv:2104.04473, section 3;
DeepSpeed's ``PipeModelDataParallelTopology``.
"""
from __future__ import annotations

import numpy as np

from minizero.comm.nodes import NodeLayout, layout_of
from minizero.ledger import rank_runs


def mesh(dp: int, tp: int, pp: int) -> np.ndarray:
    """The rank grid, shape (pp, dp, tp): ``mesh(...)[pp_rank, dp_rank, tp_rank]`` is the world rank."""
    return np.arange(dp * tp * pp).reshape(pp, dp, tp)


def coordinates(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """``(dp_rank, tp_rank, pp_rank)`` of a world rank (inverse of :func:`mesh`)."""
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    return dp_rank, tp_rank, pp_rank


class Topology:
    """This rank's place in the mesh and its group communicators (collective: five splits of ``comm``).

    Attributes: dp, tp, pp and their ranks; world; tp_comm, dp_comm, pp_comm; mp_comm (same dp rank);
    embed_comm (first and last stage); nodes (the world's :class:`NodeLayout`).
    Raises ValueError: ``dp * tp * pp`` differs from ``comm.world_size``.
    """

    def __init__(self, comm, dp: int, tp: int = 1, pp: int = 1):
        if dp * tp * pp != comm.world_size:
            raise ValueError(f"dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} != world size {comm.world_size}")
        self.world, self.dp, self.tp, self.pp = comm, dp, tp, pp
        self.nodes: NodeLayout = layout_of(comm)
        self.dp_rank, self.tp_rank, self.pp_rank = coordinates(comm.rank, dp, tp, pp)
        d, t, p = self.dp_rank, self.tp_rank, self.pp_rank
        self.tp_comm = comm.split(color=p * dp + d, key=t)
        self.dp_comm = comm.split(color=p * tp + t, key=d)
        self.pp_comm = comm.split(color=d * tp + t, key=p)
        self.mp_comm = comm.split(color=d, key=comm.rank)
        self.embed_comm = self.pp_comm.split(color=0 if p in (0, pp - 1) else 1, key=p)
        recorder = comm.traffic.active_recorder()  # the flight recorder's names for this rank's groups
        if recorder is not None:
            for kind, group in self.groups().items():  # (middle stages' embed group is unused: no members)
                recorder.name_group(group, kind, next((g for g in self.all_groups(kind) if comm.rank in g), []))
            recorder.name_group(self.mp_comm, "mp", [r for r in range(comm.world_size)
                                                     if coordinates(r, dp, tp, pp)[0] == d])

    is_first_stage = property(lambda self: self.pp_rank == 0, doc="holds the embedding")
    is_last_stage = property(lambda self: self.pp_rank == self.pp - 1, doc="holds ln_f, the LM head, the loss")

    def rank_of(self, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> int:
        """World rank at these coordinates."""
        return int((pp_rank * self.dp + dp_rank) * self.tp + tp_rank)

    def groups(self) -> dict:
        """``{"tp": comm, "dp": comm, "pp": comm, "embed": comm}`` (for traffic reports)."""
        return {"tp": self.tp_comm, "dp": self.dp_comm, "pp": self.pp_comm, "embed": self.embed_comm}

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (``"tp"``, ``"dp"``, ``"pp"``, ``"embed"``) as lists of world ranks
        (else ValueError)."""
        grid = mesh(self.dp, self.tp, self.pp)
        if kind == "tp":
            groups = grid.reshape(-1, self.tp)
        elif kind == "dp":
            groups = grid.transpose(0, 2, 1).reshape(-1, self.dp)
        elif kind == "pp":
            groups = grid.transpose(1, 2, 0).reshape(-1, self.pp)
        elif kind == "embed":
            groups = grid[[0, self.pp - 1] if self.pp > 1 else [0]].transpose(1, 2, 0).reshape(-1, min(2, self.pp))
        else:
            raise ValueError(f"kind={kind!r}; allowed: 'tp', 'dp', 'pp', 'embed'")
        return [list(map(int, g)) for g in groups]

    def nodes_spanned(self, kind: str) -> int:
        """The most nodes any one group of ``kind`` occupies (1: every such group stays inside a node)."""
        return max(self.nodes.spans(g) for g in self.all_groups(kind))

    def placement_warnings(self) -> list[str]:
        """One line per tensor group that spans nodes (its per-layer all-reduces would cross the network)."""
        return [f"warning: tensor group {g} spans nodes {sorted({self.nodes.node_of[r] for r in g})}: its "
                f"all-reduces (4 per block and micro-batch) cross the network; give every node a multiple "
                f"of tp = {self.tp} consecutive ranks" for g in self.all_groups("tp") if self.nodes.spans(g) > 1]

    def describe_nodes(self) -> str:
        """One line: the node layout and how many nodes each kind of group spans; the ranks' process ids when known.

        The PIDs stay in the header, the one output a killed job has printed (summary.json is written at the end):
        the kernel's OOM-killer lines (``dmesg``) name the process killed by PID, and ``kill``/``py-spy`` on a hung rank
        need it. MPICH's launcher does not name the killed rank: it SIGKILLs the others and reports the PID of whichever
        bad exit it handled first. In rank order, consecutive ones as a range (``PIDs in rank order 4100-4107``; else
        ``4100-4101,4230,...``, rank 0 first).
        """
        if self.world.world_size == 1:
            return "nodes: one process on one machine: no message crosses a network"
        pids = (f"; PIDs in rank order {rank_runs(list(self.nodes.pids))} (for kill or py-spy on a rank; "
                "the kernel's OOM-killer lines in dmesg name PIDs)"
                if len(self.nodes.pids) > 1 else "")
        if self.nodes.n_nodes == 1:
            return (f"nodes: all {self.world.world_size} rank(s) on one node (one machine): no message crosses a "
                    f"network{pids}")
        names = {"tp": "tensor-parallel", "dp": "data-parallel", "pp": "pipeline"}
        spans = ", ".join(f"each {names[k]} group stays inside one node" if self.nodes_spanned(k) == 1 else
                          f"a {names[k]} group spans up to {self.nodes_spanned(k)} nodes"
                          for k in ("tp", "dp", "pp") if getattr(self, k) > 1)
        return (f"nodes: {self.nodes.describe()}, node of each rank "
                f"{list(self.nodes.node_of)}" + (f"; {spans}" if spans else "") + pids)

    def describe(self, cp: int = 1) -> str:
        """The mesh as text, one line per (pipeline stage, data-parallel rank), with each tensor group's nodes. ``cp``:
        the context-parallel ranks inside the data axis (runs of ``cp`` consecutive data ranks), named apart from dp.
        Raises ValueError: ``cp`` does not divide ``dp``."""
        if self.dp % cp:
            raise ValueError(f"cp={cp} does not divide the data axis of {self.dp} ranks")
        grid, world = mesh(self.dp, self.tp, self.pp), self.world.world_size
        dp, axis = (f"dp={self.dp // cp} x cp={cp}", f"dp*cp={self.dp}") if cp > 1 else (f"dp={self.dp}",) * 2
        lines = [f"mesh: {dp} x tp={self.tp} x pp={self.pp} = {world} ranks, "
                 f"grid = arange({world}).reshape(pp={self.pp}, {axis}, tp={self.tp})"]
        for p in range(self.pp):
            for d in range(self.dp):
                group = list(map(int, grid[p, d]))
                on = sorted({self.nodes.node_of[r] for r in group})
                lines.append(f"  stage {p}  dp {d // cp}{f' cp {d % cp}' if cp > 1 else ''}:  tensor group {group}  "
                             f"on node{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Topology(rank={self.world.rank}, dp={self.dp_rank}/{self.dp}, tp={self.tp_rank}/{self.tp}, "
                f"pp={self.pp_rank}/{self.pp})")
