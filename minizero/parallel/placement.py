"""Where the bytes went: each kind of group's traffic per step, and the part that crossed nodes.

Source: Narayanan et al., arXiv:2104.04473, section 3.2.
"""
from __future__ import annotations

import re
import textwrap

import numpy as np

from minizero.comm.collectives import all_reduce
from minizero.comm.hierarchical import cross_node_bytes
from minizero.ledger import format_bytes
from minizero.numerals import counted, wrapped
from minizero.optim.used_parameters import LABEL as USED
from minizero.parallel.topology import Topology

KINDS = ("tp", "dp", "pp")
#: labels left out of "per step": sent once before training, and the validation batches' forward passes
SETUP = ("broadcast_params", "validation")


def _fmt(n: float) -> str:
    return format_bytes(n)


def _per_run(snapshot: dict | None) -> float:
    """Bytes in a ledger snapshot without the set-up labels (0 when there is no snapshot)."""
    if snapshot is None:
        return 0.0
    return float(snapshot["bytes_sent"] - sum(snapshot["by_op"].get(k, 0) for k in SETUP))


def _cross(comm) -> dict | None:
    ledger = getattr(comm, "cross_node", None)
    return None if ledger is None else ledger.snapshot()


def ring_vs_hierarchical(dp, topo: Topology) -> tuple[int, int]:
    """Cross-node bytes ``(ring, hierarchical)`` of one all-reduce of ``dp``'s buckets
    (hierarchical 0 for unequal nodes)."""
    nodes = topo.nodes.restrict(topo.all_groups("dp")[topo.pp_rank * topo.tp + topo.tp_rank])
    even = len({len(nodes.ranks_on(n)) for n in nodes.nodes}) == 1
    ring = hier = 0
    for flat, _ in (dp.buckets if dp is not None else []):
        ring += cross_node_bytes(flat.size, flat.itemsize, nodes, "ring")
        hier += cross_node_bytes(flat.size, flat.itemsize, nodes, "hierarchical") if even else 0
    return ring, hier


#: ledger labels of the cp (ring, Ulysses) or ep (MoE dispatch, combine, their counts) row, taken out of the dp row
CP_LABELS = ("ring_attention", "all_to_all", "all_to_all_counts")
#: labels of the data group's ledger shown in no group's row (the used-parameter agreement, replica digests)
NOT_GRADIENTS = (USED, "replica_check")


def _label(snapshot: dict | None, *labels: str) -> float:
    """Bytes under ``labels`` in a ledger snapshot (0 without one)."""
    return 0.0 if snapshot is None else float(sum(snapshot["by_op"].get(label, 0) for label in labels))


def traffic_rows(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """The table's rows (group and nodes spanned, bytes sent, across nodes, a note or ''), each column as wide as
    its widest cell (the bytes' at least 9): every row's columns line up, however long its label."""
    head = max((len(r[0]) for r in rows), default=0)
    sent, across = (max([9] + [len(r[i]) for r in rows]) for i in (1, 2))
    return [f"  {h:{head}s} {s:>{sent}s}, {a:>{across}s}" + (f"   ({note})" if note else "") for h, s, a, note in rows]


def _group(label: str, ranks: int, nodes: int) -> str:  # a row's first cell: "tp    (2 ranks each): 1 node,"
    return f"{label:5s} ({ranks} ranks each): {counted(nodes, 'node')},"


def node_traffic(topo: Topology, steps: int, dp=None, algorithm: str = "ring", cp: int = 1,
                 cp_attention: str = "ring", ep: int = 1, edp=None) -> list[str]:
    """Collective over ``topo.world``: the per-step traffic table lines on world rank 0 ([] elsewhere).

    ``steps``: optimizer steps (>= 1); ``dp``: DataParallel or None (ring-vs-hierarchical line); ``cp`` > 1 or
    ``ep`` > 1 (MoE's expert groups, never with cp): its own row of the all-to-alls; ``edp``: MoE's expert-data
    communicator (split from the data group; ``expert_groups``) or None: its ledger's bytes (the expert gradients'
    reduction, ZeRO's expert shards) are the ``edp`` row, taken out of the ``dp`` row, which keeps the dense
    parameters'. Validation and the start-up broadcast (:data:`SETUP`) are left out of the rows and named in a
    note, in bytes per run. Bytes: one small float64 all-reduce (``"metrics"``). Raises ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}; allowed: >= 1")
    groups = topo.groups()
    known = _cross(topo.world) is not None
    # one row per kind: [sent, sent across nodes]; then the world's; then the analytic ring and
    # hierarchical figures, added by one rank of each data group (they are per group, not per rank)
    ring, hier = ring_vs_hierarchical(dp, topo) if topo.dp_rank == 0 else (0, 0)
    row = [v for k in KINDS for v in (_per_run(groups[k].traffic.snapshot()), _per_run(_cross(groups[k])))]
    row += [_per_run(topo.world.traffic.snapshot()), _per_run(_cross(topo.world)), ring * steps, hier * steps]
    row += [_label(groups["dp"].traffic.snapshot(), *CP_LABELS), _label(_cross(groups["dp"]), *CP_LABELS)]
    row += [_label(groups["dp"].traffic.snapshot(), *NOT_GRADIENTS), _label(_cross(groups["dp"]), *NOT_GRADIENTS)]
    # the expert-data group's bytes are in the data group's ledger too (its parent): moved to their own row
    row += [0.0, 0.0] if edp is None else [_per_run(s) - _label(s, *NOT_GRADIENTS)
                                           for s in (edp.traffic.snapshot(), _cross(edp))]
    row += [_label(topo.world.traffic.snapshot(), label) for label in SETUP]  # every group's, through its parent
    row += [_per_run(topo.embed_comm.traffic.snapshot()), _per_run(_cross(topo.embed_comm))]  # in the pp group's too
    with topo.world.traffic.op("metrics"):
        run = all_reduce(topo.world, np.array(row, dtype=np.float64))
    if topo.world.rank != 0:
        return []
    lines = ["traffic per step, summed over ranks (group: nodes spanned, bytes sent, of which across nodes):"]
    net = run.copy()  # whole bytes of the run: the rows' sums and the "other" remainder are exact before / steps
    net[2:4] -= net[10:12] + net[12:14] + net[14:16]  # the dp row: without ring attention or the
    # all-to-alls (the cp or ep row), the agreement on the parameters used, the replica check's digests, the edp row
    net[4:6] -= net[18:20]  # the pp row: without the tied embedding's reduction (the embed row)
    total = net / steps
    shown, rows = [], []  # the index of each row's bytes sent (across nodes: the next): the world's rest is "other"
    embed = topo.pp > 1 and bool(net[18] or net[19])  # ZB-V: one rank holds both ends, nothing to reduce
    for i, k in enumerate(KINDS):
        if getattr(topo, k) == 1:
            continue
        if k == "dp" and max(cp, ep) > 1:
            n = max(cp, ep)
            sub = [g[j:j + n] for g in topo.all_groups("dp") for j in range(0, len(g), n)]
            what = ("expert all-to-all" if ep > 1
                    else "ring attention" if cp_attention == "ring" else "Ulysses all-to-all")
            rows.append((_group("ep" if ep > 1 else "cp", n, max(topo.nodes.spans(g) for g in sub)), _fmt(total[10]),
                         _fmt(total[11]) if known else "?", what))
            shown.append(10)
            if topo.dp == n and not total[2]:
                continue
        if k == "dp" and edp is not None and edp.world_size > 1:
            sub = [g[j::ep] for g in topo.all_groups("dp") for j in range(ep)]  # expert_groups' colour r % ep
            rows.append((_group("edp", edp.world_size, max(topo.nodes.spans(g) for g in sub)), _fmt(total[14]),
                         _fmt(total[15]) if known else "?", "expert gradients over the ranks holding the same experts"))
            shown.append(14)
        label = "dp-cp" if k == "dp" and cp > 1 else k  # gradients go over dp x cp (Megatron-LM's dp-cp group)
        rows.append((_group(label, getattr(topo, k), topo.nodes_spanned(k)),
                     _fmt(total[2 * i]), _fmt(total[2 * i + 1]) if known else "?", ""))
        shown.append(2 * i)
        if k == "pp" and embed:
            rows.append((_group("embed", 2, topo.nodes_spanned("embed")), _fmt(total[18]),
                         _fmt(total[19]) if known else "?", "the tied embedding's gradient"))
            shown.append(18)
    other_sent = (net[6] - sum(net[i] for i in shown)) / steps
    other = (net[7] - sum(net[i + 1] for i in shown)) / steps
    if other_sent or other:  # the world's bytes in no row above: the rows add up to its total
        rows.append((f"other (all {topo.world.world_size} ranks): {counted(topo.nodes.n_nodes, 'node')},",
                     _fmt(other_sent), _fmt(other) if known else "?", "loss, norm, flags, metrics, digests"))
    lines += traffic_rows(rows)
    if known and topo.nodes.n_nodes == 1:
        lines.append(f"  world: {_fmt(total[6])} sent (one node: nothing crosses nodes)")
    else:
        cp_part = f" + {'ep' if ep > 1 else 'cp'} {_fmt(total[11])}" if max(cp, ep) > 1 else ""
        cp_part += f" + edp {_fmt(total[15])}" if edp is not None and edp.world_size > 1 else ""
        lines.append(f"  world: {_fmt(total[6])} sent; " + (
            f"{_fmt(total[7])} across nodes = tp {_fmt(total[1])} + dp {_fmt(total[3])}{cp_part} + pp {_fmt(total[5])} "
            f"{f'+ embed {_fmt(total[19])} ' if embed else ''}+ other {_fmt(other)}" if known
            else "? across nodes"))
    setup = f"; start-up broadcast of the parameters {_fmt(run[16])}" if run[16] else ""
    lines += textwrap.wrap(f"left out above, totals for the run: validation {_fmt(run[17])} (before the first "
                           f"step, each periodic one, the end){setup}", 100, initial_indent="  ",
                           subsequent_indent="    ")
    if dp is not None and topo.dp > 1 and topo.nodes.n_nodes > 1:  # on one node nothing crosses
        lines.append(f"  dp gradient all-reduce ({algorithm}) across nodes per step: "
                     f"{_fmt(total[3]) if known else '?'}; computed: flat ring {_fmt(total[8])}, "
                     f"hierarchical {_fmt(total[9])} ({counted(topo.nodes.n_nodes, 'node')})")
    if not known:
        lines.append("  (across nodes: unknown, the world communicator does not know its nodes)")
    return [cut for line in lines for cut in _wrapped(line)]


def _wrapped(line: str) -> list[str]:
    """``line`` cut to 120 columns as :func:`numerals.wrapped` cuts it, never inside a term ("+ dp 213.00 KiB")."""
    glued = re.sub(r"(\+ )?([\w-]+ )?[\d.]+ (B|[KMGT]iB)\b", lambda term: term[0].replace(" ", "\xa0"), line)
    return wrapped(glued).replace("\xa0", " ").splitlines()
