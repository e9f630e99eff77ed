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
from minizero.zero.stage1 import SETUP_GATHER

KINDS = ("tp", "dp", "pp")
#: labels left out of "per step": sent once before training (data parallelism's broadcast, ZeRO-1/2's all-gather),
#: and the validation batches' forward passes
SETUP = ("broadcast_params", SETUP_GATHER, "validation")


_fmt = format_bytes  # the table formats many byte counts


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
    nodes = topo.nodes.restrict(topo.all_groups("dp")[topo.pp_rank * topo.tp + topo.tp_rank])  # this rank's group
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
    parameters'. Validation and the start-up broadcast or ZeRO-1/2's all-gather (:data:`SETUP`) are left out of the
    rows and named in a note, in bytes per run. Bytes: one small float64 all-reduce (``"metrics"``). Raises
    ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}; allowed: >= 1")
    groups = topo.groups()
    known = _cross(topo.world) is not None
    world, data = topo.world.traffic.snapshot(), groups["dp"].traffic.snapshot()
    # this rank's bytes by column, each a pair (sent, of which across nodes) unless noted, summed over ranks below
    mine = {k: (_per_run(groups[k].traffic.snapshot()), _per_run(_cross(groups[k]))) for k in KINDS}
    mine["world"] = (_per_run(world), _per_run(_cross(topo.world)))
    # the dp all-reduce's computed bytes across nodes (ring, hierarchical): per data group, so one rank of each adds
    ring, hier = ring_vs_hierarchical(dp, topo) if topo.dp_rank == 0 else (0, 0)
    mine["computed"] = (ring * steps, hier * steps)
    mine["cp"] = (_label(data, *CP_LABELS), _label(_cross(groups["dp"]), *CP_LABELS))  # or ep's all-to-alls
    mine["not_gradients"] = (_label(data, *NOT_GRADIENTS), _label(_cross(groups["dp"]), *NOT_GRADIENTS))
    # the expert-data group's bytes are in the data group's ledger too (its parent): moved to their own row
    mine["edp"] = (0.0, 0.0) if edp is None else tuple(_per_run(s) - _label(s, *NOT_GRADIENTS)
                                                       for s in (edp.traffic.snapshot(), _cross(edp)))
    broadcast, gather, validation = (_label(world, label) for label in SETUP)  # every group's, through its parent
    mine["setup"] = (broadcast + gather, validation)  # one pair: the all-reduce's size is the estimator's METRICS_ROW
    # which start-up copy ran: rank 0, the root of every broadcast and in every all-gather, sent bytes in each
    how = [w for w, sent in (("broadcast", broadcast), ("all-gather", gather)) if sent]
    mine["embed"] = (_per_run(topo.embed_comm.traffic.snapshot()), _per_run(_cross(topo.embed_comm)))  # in pp's too
    with topo.world.traffic.op("metrics"):
        summed = all_reduce(topo.world, np.array(list(mine.values()), dtype=np.float64).reshape(-1))
    if topo.world.rank != 0:
        return []
    run = dict(zip(mine, summed.reshape(-1, 2)))  # whole bytes of the run: the rows and "other" add up before / steps
    start, validation = run.pop("setup")
    # the dp row without the cp or ep row's all-to-alls, the agreement on the parameters used, the replica check's
    # digests and the edp row; the pp row without the tied embedding's reduction (the embed row)
    run["dp"] = run["dp"] - (run["cp"] + run["not_gradients"] + run["edp"])
    run["pp"] = run["pp"] - run["embed"]
    step = {k: v / steps for k, v in run.items()}

    def cells(k):  # a row's (bytes sent, across nodes) per step
        return _fmt(step[k][0]), _fmt(step[k][1]) if known else "?"

    lines = ["traffic per step, summed over ranks (group: nodes spanned, bytes sent, of which across nodes):"]
    shown, rows = [], []  # the columns with a row: the world's rest is "other"
    embed = topo.pp > 1 and bool(run["embed"].any())  # ZB-V: one rank holds both ends, nothing to reduce
    for k in KINDS:
        if getattr(topo, k) == 1:
            continue
        if k == "dp" and max(cp, ep) > 1:
            n = max(cp, ep)
            sub = [g[j:j + n] for g in topo.all_groups("dp") for j in range(0, len(g), n)]
            what = ("expert all-to-all" if ep > 1
                    else "ring attention" if cp_attention == "ring" else "Ulysses all-to-all")
            spans = max(topo.nodes.spans(g) for g in sub)
            rows.append((_group("ep" if ep > 1 else "cp", n, spans), *cells("cp"), what))
            shown.append("cp")
            if topo.dp == n and not step["dp"][0]:
                continue
        if k == "dp" and edp is not None and edp.world_size > 1:
            sub = [g[j::ep] for g in topo.all_groups("dp") for j in range(ep)]  # expert_groups' colour r % ep
            rows.append((_group("edp", edp.world_size, max(topo.nodes.spans(g) for g in sub)), *cells("edp"),
                         "expert gradients over the ranks holding the same experts"))
            shown.append("edp")
        label = "dp-cp" if k == "dp" and cp > 1 else k  # gradients go over dp x cp (Megatron-LM's dp-cp group)
        rows.append((_group(label, getattr(topo, k), topo.nodes_spanned(k)), *cells(k), ""))
        shown.append(k)
        if k == "pp" and embed:
            rows.append((_group("embed", 2, topo.nodes_spanned("embed")), *cells("embed"),
                         "the tied embedding's gradient"))
            shown.append("embed")
    other_sent, other = (run["world"] - sum(run[k] for k in shown)) / steps
    if other_sent or other:  # the world's bytes in no row above: the rows add up to its total
        rows.append((f"other (all {topo.world.world_size} ranks): {counted(topo.nodes.n_nodes, 'node')},",
                     _fmt(other_sent), _fmt(other) if known else "?", "loss, norm, flags, metrics, digests"))
    lines += traffic_rows(rows)
    sent, across = ({k: v[i] for k, v in step.items()} for i in (0, 1))
    if known and topo.nodes.n_nodes == 1:
        lines.append(f"  world: {_fmt(sent['world'])} sent (one node: nothing crosses nodes)")
    else:
        cp_part = f" + {'ep' if ep > 1 else 'cp'} {_fmt(across['cp'])}" if max(cp, ep) > 1 else ""
        cp_part += f" + edp {_fmt(across['edp'])}" if edp is not None and edp.world_size > 1 else ""
        embed_part = f"+ embed {_fmt(across['embed'])} " if embed else ""
        lines.append(f"  world: {_fmt(sent['world'])} sent; " + (
            f"{_fmt(across['world'])} across nodes = tp {_fmt(across['tp'])} + dp {_fmt(across['dp'])}{cp_part} "
            f"+ pp {_fmt(across['pp'])} {embed_part}+ other {_fmt(other)}" if known else "? across nodes"))
    setup = f"; start-up {' and '.join(how)} of the parameters {_fmt(start)}" if start else ""
    lines += textwrap.wrap(f"left out above, totals for the run: validation {_fmt(validation)} (before the first "
                           f"step, each periodic one, the end){setup}", 100, initial_indent="  ",
                           subsequent_indent="    ")
    if dp is not None and topo.dp > 1 and topo.nodes.n_nodes > 1:  # on one node nothing crosses
        flat_ring, hierarchical = step["computed"]
        lines.append(f"  dp gradient all-reduce ({algorithm}) across nodes per step: "
                     f"{_fmt(across['dp']) if known else '?'}; computed: flat ring {_fmt(flat_ring)}, "
                     f"hierarchical {_fmt(hierarchical)} ({counted(topo.nodes.n_nodes, 'node')})")
    if not known:
        lines.append("  (across nodes: unknown, the world communicator does not know its nodes)")
    return [cut for line in lines for cut in _wrapped(line)]


def _wrapped(line: str) -> list[str]:
    """``line`` cut to 120 columns as :func:`numerals.wrapped` cuts it, never inside a term ("+ dp 213.00 KiB")."""
    glued = re.sub(r"(\+ )?([\w-]+ )?[\d.]+ (B|[KMGT]iB)\b", lambda term: term[0].replace(" ", "\xa0"), line)
    return wrapped(glued).replace("\xa0", " ").splitlines()
