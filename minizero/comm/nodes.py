"""Which node (machine) each rank runs on, and the bytes that cross node boundaries.

Nodes come from ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` (MPI-3.1 section 6.4.2), numbered by their
lowest world rank; in-process every rank is on node 0.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from minizero import backend
from minizero.comm.collectives import _binomial_tree
from minizero.comm.communicator import Communicator
from minizero.comm.recursive_doubling import all_reduce_algorithm, recursive_doubling_peers


@dataclass(frozen=True)
class NodeLayout:
    """The node of every rank of one communicator: ``node_of[r]``, nodes numbered in the order of their lowest rank.

    Raises ValueError: empty ``node_of`` or negative node ids.
    """

    node_of: tuple
    #: each rank's process id where MPI discovered the layout, else (): for kill, py-spy, dmesg's OOM-killer lines
    pids: tuple = field(default=(), compare=False)

    def __post_init__(self):
        if not self.node_of or min(self.node_of) < 0:
            raise ValueError(f"node_of={self.node_of!r}; allowed: a non-empty tuple of node ids >= 0")
        object.__setattr__(self, "node_of", tuple(int(n) for n in self.node_of))

    @classmethod
    def single(cls, world_size: int) -> NodeLayout:
        """Every one of ``world_size`` ranks on node 0 (threads of one process)."""
        return cls((0,) * world_size)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.node_of)

    @property
    def nodes(self) -> list[int]:
        """The distinct node ids, in order of their lowest rank."""
        return list(dict.fromkeys(self.node_of))

    @property
    def n_nodes(self) -> int:
        """Number of distinct nodes (n)."""
        return len(self.nodes)

    def ranks_on(self, node: int) -> list[int]:
        """Ranks on ``node``, ascending."""
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks of its node."""
        return self.ranks_on(self.node_of[rank]).index(rank)

    def local_size(self, rank: int) -> int:
        """Number of ranks on ``rank``'s node (what BLAS threads are divided by)."""
        return self.node_of.count(self.node_of[rank])

    def restrict(self, members) -> NodeLayout:
        """The layout of a sub-group whose rank i is rank ``members[i]`` here."""
        return NodeLayout(tuple(self.node_of[m] for m in members))

    def spans(self, members) -> int:
        """How many nodes the ranks ``members`` occupy (1: the group stays inside a node)."""
        return len({self.node_of[m] for m in members})

    def describe(self) -> str:
        """``"2 node(s) x 2 rank(s) per node"``, or ``"2 nodes with 3+1 ranks"`` when uneven."""
        sizes = [len(self.ranks_on(n)) for n in self.nodes]
        if len(set(sizes)) == 1:
            return f"{len(sizes)} node(s) x {sizes[0]} rank(s) per node"
        return f"{len(sizes)} nodes with {'+'.join(map(str, sizes))} ranks"


def layout_of(comm: Communicator) -> NodeLayout:
    """``comm.nodes`` when ``comm`` knows its nodes (a :class:`NodeTrafficCommunicator`), else one node."""
    nodes = getattr(comm, "nodes", None)
    return nodes if isinstance(nodes, NodeLayout) else NodeLayout.single(comm.world_size)


def discover_nodes(comm: Communicator) -> NodeLayout:
    """Collective: the :class:`NodeLayout` of ``comm``, equal on every rank.

    MPI: split with ``MPI_COMM_TYPE_SHARED``, then one set-up all-gather of each node's lowest rank and each
    rank's process id (not in the traffic ledger). Any other communicator (threads of one process) is one node.
    """
    mpi_comm = getattr(comm, "mpi_comm", None)
    if mpi_comm is None:
        return NodeLayout.single(comm.world_size)
    from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only on the MPI path)

    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    leader = local.allreduce(mpi_comm.Get_rank(), op=MPI.MIN)
    local.Free()
    leaders, pids = zip(*mpi_comm.allgather((leader, os.getpid())))
    order = {lead: i for i, lead in enumerate(dict.fromkeys(leaders))}
    return NodeLayout(tuple(order[lead] for lead in leaders), pids)


class CrossNodeLedger:
    """Bytes this rank sent to other nodes: ``bytes_sent`` (total), ``by_op`` (per label); also added to ``parent``."""

    def __init__(self, parent: CrossNodeLedger | None = None):
        self.parent, self.bytes_sent, self.by_op = parent, 0, {}

    def record(self, label: str, nbytes: int) -> None:
        """Add ``nbytes`` bytes under ``label`` here and in every parent."""
        self.bytes_sent += int(nbytes)
        self.by_op[label] = self.by_op.get(label, 0) + int(nbytes)
        if self.parent is not None:
            self.parent.record(label, nbytes)

    def snapshot(self) -> dict:
        """``{"bytes_sent": int, "by_op": {label: bytes}}``."""
        return {"bytes_sent": self.bytes_sent, "by_op": dict(self.by_op)}


class NodeTrafficCommunicator(Communicator):
    """A Communicator over ``inner`` (sharing its ``traffic``) that also counts bytes sent across nodes in
    ``cross_node``.

    Native collectives count the bytes minizero's own algorithm would send to other nodes (the ring's right
    neighbour, recursive doubling's partners, the broadcast tree's children), so both ledgers agree.
    ``nodes``: None = :func:`discover_nodes` (collective). Raises ValueError: ``nodes`` of another world size.
    """

    def __init__(self, inner: Communicator, nodes: NodeLayout | None = None,
                 cross_parent: CrossNodeLedger | None = None):
        nodes = discover_nodes(inner) if nodes is None else nodes
        if nodes.world_size != inner.world_size:
            raise ValueError(f"the node layout has {nodes.world_size} ranks, the communicator {inner.world_size}")
        self.inner, self.nodes = inner, nodes
        self.rank, self.world_size, self.traffic = inner.rank, inner.world_size, inner.traffic
        self.cross_node = CrossNodeLedger(cross_parent)

    def __getattr__(self, name):  # mpi_comm, timeout, ...: the wrapped communicator's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def world_rank(self, rank: int) -> int:
        return self.inner.world_rank(rank)

    @property
    def nonblocking(self) -> bool:
        """The wrapped communicator's: ``isend``/``irecv`` work here only if they work on ``inner``
        (not over NCCL), so gradient overlap and pipeline sends choose their blocking paths there."""
        return self.inner.nonblocking

    def _count(self, nbytes: int, dest: int) -> None:
        if self.nodes.node_of[dest] != self.nodes.node_of[self.rank]:
            self.cross_node.record(self.traffic.current_label() or "p2p", nbytes)

    def send(self, buf, dest, tag=0):
        """``Communicator.send``; ``buf.nbytes`` also go to ``cross_node`` when ``dest`` is on another node."""
        super().send(buf, dest, tag)
        self._count(buf.nbytes, dest)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        """``Communicator.sendrecv``; ``sendbuf.nbytes`` also to ``cross_node`` when ``dest`` is on another node."""
        out = super().sendrecv(sendbuf, dest, recvbuf, source, tag)
        self._count(sendbuf.nbytes, dest)
        return out

    def isend(self, buf, dest, tag=0):
        """``Communicator.isend``; ``buf.nbytes`` also to ``cross_node`` when ``dest`` is on another node."""
        req = super().isend(buf, dest, tag)
        self._count(buf.nbytes, dest)
        return req

    def _native_count(self, label: str, nbytes: int, dests: list) -> None:
        """Of a native collective's estimated ``nbytes`` (equal messages to ``dests``), count those to other nodes."""
        crossing = sum(self.nodes.node_of[d] != self.nodes.node_of[self.rank] for d in dests)
        if crossing:
            self.cross_node.record(self.traffic.current_label() or label, nbytes * crossing // len(dests))

    def _right(self) -> list:  # where every message of a ring goes
        return [(self.rank + 1) % self.world_size]

    def native_allreduce(self, x, out=None):
        before = self.traffic.bytes_sent
        out = super().native_allreduce(x, out)
        small = all_reduce_algorithm(x.nbytes, self.world_size) == "recursive_doubling"
        self._native_count("all_reduce", self.traffic.bytes_sent - before,
                           recursive_doubling_peers(self.world_size, self.rank) if small else self._right())
        return out

    def native_reduce_scatter(self, x):
        before = self.traffic.bytes_sent
        out = super().native_reduce_scatter(x)
        self._native_count("reduce_scatter", self.traffic.bytes_sent - before, self._right())
        return out

    def native_allgather(self, shard, n):
        before = self.traffic.bytes_sent
        out = super().native_allgather(shard, n)
        self._native_count("all_gather", self.traffic.bytes_sent - before, self._right())
        return out

    def native_bcast(self, x, root=0):
        before = self.traffic.bytes_sent
        out = super().native_bcast(x, root)
        self._native_count("broadcast", self.traffic.bytes_sent - before,
                           _binomial_tree(self.rank, root, self.world_size)[1])
        return out

    # -- group management: the inner communicator's, with the sub-group's layout -----------
    def barrier(self):
        self.inner.barrier()

    def abort(self, errorcode=1):
        self.inner.abort(errorcode)

    def split(self, color, key=0):
        """``Communicator.split`` of ``inner``, wrapped with the sub-group's :class:`NodeLayout` (collective)."""
        sub = self.inner.split(color, key)
        # which of our ranks joined the new group, in its order: an all-gather through the inner
        # communicator's library path, which records nothing (group bookkeeping, not traffic)
        members = sub._native_allgather(backend.to_device(np.array([self.rank], dtype=np.int64)), sub.world_size)
        return NodeTrafficCommunicator(sub, self.nodes.restrict(backend.to_host(members).tolist()),
                                       cross_parent=self.cross_node)

    # -- the wrapped communicator's transport ----------------------------------------------
    def _send(self, buf, dest, tag):
        self.inner._send(buf, dest, tag)

    def _recv(self, buf, source, tag):
        self.inner._recv(buf, source, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self.inner._sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _isend(self, buf, dest, tag):
        return self.inner._isend(buf, dest, tag)

    def _irecv(self, buf, source, tag):
        return self.inner._irecv(buf, source, tag)

    def _native_allreduce(self, x, out):
        self.inner._native_allreduce(x, out)

    def _native_reduce_scatter(self, flat):
        return self.inner._native_reduce_scatter(flat)

    def _native_allgather(self, shard, n):
        return self.inner._native_allgather(shard, n)

    def _native_bcast(self, x, root):
        self.inner._native_bcast(x, root)
