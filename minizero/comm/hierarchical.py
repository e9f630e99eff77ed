"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes, all-gather inside each node.

n nodes, S bytes per rank: one node sends 2(n-1)/n * S across nodes (a flat ring: 2(N-1)/N * S). Sums are
in another order than the ring's: each within gamma_(N-1) * sum|x_i| (Higham 2002), bit-identical
on every rank. Mirrors: NCCL's and Horovod's hierarchical all-reduce (arXiv:1802.05799, 1807.11205).
"""
from __future__ import annotations

from minizero import backend
from minizero.comm.collectives import (_check_array, _check_summable, _scratch, all_reduce, bytes_sent, ring_,
                                      shard_range)
from minizero.comm.communicator import Communicator
from minizero.comm.nodes import NodeLayout, layout_of


class HierarchicalAllReduce:
    """A node-aware all-reduce over ``comm``, called like :func:`minizero.comm.all_reduce` (construction collective).

    Attributes: local (this node's L ranks), cross (local rank j of every node; its traffic is the cross-node bytes).
    Raises ValueError: ``nodes`` has the wrong size, or nodes hold different numbers of ranks.
    """

    def __init__(self, comm: Communicator, nodes: NodeLayout | None = None):
        nodes = layout_of(comm) if nodes is None else nodes
        if nodes.world_size != comm.world_size:
            raise ValueError(f"the node layout has {nodes.world_size} ranks, the communicator {comm.world_size}")
        sizes = {len(nodes.ranks_on(n)) for n in nodes.nodes}
        if len(sizes) != 1:
            raise ValueError(f"hierarchical all-reduce needs the same number of ranks on every node; the group "
                             f"has {nodes.describe()} (use the flat ring all-reduce)")
        self.comm, self.nodes = comm, nodes
        node, local_rank = nodes.node_of[comm.rank], nodes.local_rank(comm.rank)
        self.n_nodes, self.local_size = nodes.n_nodes, sizes.pop()
        self.local = comm.split(color=nodes.nodes.index(node), key=comm.rank)
        self.cross = comm.split(color=local_rank, key=nodes.nodes.index(node))

    def __call__(self, x, native: bool = False, out=None):
        """Elementwise sum of ``x`` over ``comm``, bit-identical on every rank; returns ``out`` (new if None).

        Bytes (``"all_reduce"``): 2(L-1)/L of the buffer per rank inside the node; 2(n_nodes-1)/n_nodes of
        this rank's 1/L chunk across nodes. Raises ValueError: ``native=True``; bad (read-only...) arrays.
        """
        if native:
            raise ValueError("the hierarchical all-reduce is minizero's own; native=True has no meaning here")
        _check_array(x, "x")
        _check_summable(x, "x")
        if out is None:
            out = backend.array_module(x).empty(x.shape, dtype=x.dtype)
        _check_array(out, "out", writeable=True)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out is {out.shape} {out.dtype}, x is {x.shape} {x.dtype}; they must match")
        with self.comm.traffic.op("all_reduce", x):  # x: --debug-collectives checks its descriptor
            if out is not x:
                out[...] = x
            buf = out.reshape(-1)
            L, j = self.local.world_size, self.local.rank
            off, size = shard_range(buf.size, L, j)
            tmp = _scratch(backend.array_module(x).empty(shard_range(buf.size, L, 0)[1], dtype=x.dtype))
            ring_(self.local, buf, "reduce_scatter", tmp)  # 1. chunk j of the node's sum on local rank j
            chunk = buf[off:off + size]
            all_reduce(self.cross, chunk, out=chunk)  # 2. across nodes, one ring per local rank
            ring_(self.local, buf, "all_gather")  # 3. every chunk to every rank of the node
        return out


def cross_node_bytes(n_elements: int, itemsize: int, nodes: NodeLayout, algorithm: str) -> int:
    """Bytes all ranks together send across nodes in one all-reduce of ``n_elements * itemsize`` bytes.

    ``algorithm``: ``"ring"`` or ``"hierarchical"``. Raises ValueError: unknown ``algorithm``.
    """
    N = nodes.world_size
    if algorithm == "ring":
        from_ring = [bytes_sent("all_reduce", n_elements, itemsize, N, r) for r in range(N)]
        return sum(b for r, b in enumerate(from_ring) if nodes.node_of[(r + 1) % N] != nodes.node_of[r])
    if algorithm == "hierarchical":
        n, L = nodes.n_nodes, N // nodes.n_nodes
        total = 0
        for j in range(L):  # local rank j's ring over the n nodes carries chunk j
            chunk = shard_range(n_elements, L, j)[1]
            total += sum(bytes_sent("all_reduce", chunk, itemsize, n, r) for r in range(n))
        return total
    raise ValueError(f"algorithm={algorithm!r}; allowed: 'ring', 'hierarchical'")

