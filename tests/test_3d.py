"""3D parallelism: the mesh, the command line, and dp x tp x pp (and ZeRO-1) equal to one process.

Equivalence (float64, tests/mp_reference.py): dp 2 x tp 2 x pp 2 on 8 ranks (threads, and
under mpiexec) and dp 2 x pp 2 with ZeRO-1, against one process on the same global batches:
gradient shards of step 0 to 1e-12, parameter shards after 3 steps to 2e-12, and the whole
model gathered on rank 0 to 2e-12; also with recompute, offload, and ZeRO-2/3 over tensor
parallelism. The loss curves of dp 2 x tp 2 x pp 2 and dp 8 equal one process's to 1e-13 in float64
and 2 float32 eps in float32; in FP16 it follows dp 2's (the same FP16 sums over the data group)
within 5e-3, and an overflow on one rank skips the step on every rank.
"""
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero.numerals import unwrapped
from threadpoolctl import threadpool_limits

from minizero.comm import all_gather, run_in_threads
from minizero.layout_checks import resolve_sizes
from minizero.parallel.topology import Topology, coordinates, mesh
from minizero.train import UsageError, parse_args, train
from tests import mp_reference as R
from tests.conftest import REPO_ROOT, mpi_env


@pytest.fixture(autouse=True)
def one_blas_thread():
    """Ranks are threads here: one BLAS thread each (oversubscribed BLAS is ~100x slower on 2 cores)."""
    with threadpool_limits(limits=1):
        yield


# ------------------------------------------------------------------------------ the mesh
def test_mesh_puts_tensor_ranks_next_to_each_other():
    grid = mesh(dp=2, tp=2, pp=2)
    assert grid.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(grid[p, d, t] == r for r in range(8) for d, t, p in [coordinates(r, 2, 2, 2)])


@pytest.mark.timeout(60)
def test_group_communicators_hold_the_right_ranks():
    def rank(comm):
        topo = Topology(comm, 2, 2, 2)
        me = np.array([comm.rank], dtype=np.float64)
        members = {name: all_gather(c, me).astype(int).tolist() for name, c in topo.groups().items()}
        members["mp"] = all_gather(topo.mp_comm, me).astype(int).tolist()
        return (topo.dp_rank, topo.tp_rank, topo.pp_rank), members

    got = run_in_threads(8, rank)
    assert got[5][0] == (0, 1, 1)
    assert got[5][1] == {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5], "embed": [1, 5], "mp": [0, 1, 4, 5]}
    assert got[2][1] == {"tp": [2, 3], "dp": [0, 2], "pp": [2, 6], "embed": [2, 6], "mp": [2, 3, 6, 7]}


def _traffic_table(comm):
    from minizero.optim.used_parameters import LABEL as USED
    from minizero.parallel.placement import node_traffic
    topo = Topology(comm, 2, 2, 2)
    for group, label, nbytes in [(topo.tp_comm, "all_reduce", 128), (topo.dp_comm, "all_reduce", 256),
                                 (topo.dp_comm, USED, 32), (topo.dp_comm, "replica_check", 64),
                                 (topo.pp_comm, "p2p", 512), (topo.embed_comm, "all_reduce", 96),
                                 (comm, "loss", 32), (comm, "validation", 1024)]:
        with group.traffic.op(label):
            group.traffic.record(nbytes)
    return node_traffic(topo, 1)


def test_the_traffic_rows_add_up_to_the_world_total():
    """Before: the loss, norm and digests had no row, and the tied embedding's reduction sat in the pp row
    unlabelled: `--zero 1` on 4 ranks showed dp 384.75 KiB of a world total of 387.83 KiB."""
    lines = run_in_threads(8, _traffic_table)[0]
    sent = {line.split()[0]: re.split(r" nodes?,", line)[1].split()[:2] for line in lines if re.search(r" nodes?,", line)}
    sent = {k: float(v) * {"B": 1, "KiB": 1024}[unit.rstrip(",")] for k, (v, unit) in sent.items()}
    assert sent == {"tp": 1024, "dp": 2048, "pp": 4096, "embed": 768, "other": 1024}, lines  # over the 8 ranks
    world = next(line for line in lines if line.startswith("  world: "))
    assert world.startswith(f"  world: {sum(sent.values()) / 1024:.2f} KiB sent;"), lines  # validation left out


def _rows_and_world(lines):
    """A traffic table's rows' bytes sent ({name: bytes}) and the world line's."""
    def nbytes(value, unit):
        return float(value) * {"B": 1, "KiB": 1024}[unit.rstrip(",;")]
    sent = {line.split()[0]: nbytes(*re.split(r" nodes?,", line)[1].split()[:2])
            for line in lines if re.search(r" nodes?,", line)}
    return sent, nbytes(*next(line for line in lines if line.startswith("  world: ")).split()[1:3])


def _case_table(comm, case, steps=1, loss=7, sizes=(101, 29, 53)):
    """A table of ``case``'s groups with made-up records: ``loss`` and ``sizes`` (the cp or ep all-to-all, ep's
    expert gradients, the dense gradients: bytes per rank)."""
    from minizero.parallel.expert_parallel import expert_groups
    from minizero.parallel.placement import node_traffic
    topo = Topology(comm, *{"cp": (4, 1, 1), "ep": (4, 1, 1), "zbv": (1, 1, 2)}[case])
    records = [(comm, "loss", loss), (comm, "validation", 100)]
    kw = {}
    if case == "cp":
        kw = {"cp": 2}
        records += [(topo.dp_comm, "ring_attention", sizes[0]), (topo.dp_comm, "all_reduce", sizes[2])]
    elif case == "ep":
        ep_comm, edp = expert_groups(topo.dp_comm, 2)
        kw = {"ep": 2, "edp": edp}
        records += [(ep_comm, "all_to_all", sizes[0]), (edp, "all_reduce", sizes[1]),
                    (topo.dp_comm, "all_reduce", sizes[2])]
    else:  # ZB-V: one rank holds both ends of the model; the tied embedding's group sends nothing
        records += [(topo.pp_comm, "p2p", sizes[0])]
    for group, label, nbytes in records:
        if nbytes:
            with group.traffic.op(label):
                group.traffic.record(nbytes)
    return node_traffic(topo, steps, **kw)


@pytest.mark.parametrize("case, rows", [("cp", {"cp": 101, "dp-cp": 53}), ("ep", {"ep": 101, "edp": 29, "dp": 53}),
                                        ("zbv", {"pp": 101})])
def test_the_traffic_rows_add_up_to_the_world_total_under_cp_ep_and_zbv(case, rows):
    """Before: under ZB-V (one rank holds both ends) an "embed ... 0 B" row; now each case's rows (and the
    loss's "other" row) add up to the world line exactly, and a zero embed row is left out."""
    ranks = 2 if case == "zbv" else 4
    lines = run_in_threads(ranks, lambda comm: _case_table(comm, case))[0]
    sent, world = _rows_and_world(lines)
    assert sent == {**{k: v * ranks for k, v in rows.items()}, "other": 7 * ranks}, lines
    assert sum(sent.values()) == world and "embed" not in "".join(lines), lines


def test_the_traffic_rows_line_up_however_long_a_label_or_a_count():
    """Before: each row put its bytes in 9 columns after its own label: a 10-character count ("128.00 KiB", the MoE
    run's edp row) or a longer label ("other (all 4 ranks)") pushed that row's columns out of line."""
    from minizero.parallel.placement import traffic_rows

    rows = traffic_rows([("ep    (2 ranks each): 1 node,", "63.12 KiB", "0 B", "expert all-to-all"),
                         ("edp   (2 ranks each): 1 node,", "128.00 KiB", "0 B", "expert gradients"),
                         ("dp    (4 ranks each): 1 node,", "213.00 KiB", "?", ""),
                         ("other (all 1024 ranks): 128 nodes,", "4.41 KiB", "1023.99 MiB", "loss")])
    assert len({row.index("B, ") for row in rows}) == 1, rows  # every bytes-sent column ends at one column
    assert len({row.find("   (", 10) if "   (" in row[10:] else len(row) for row in rows}) == 1, rows  # across
    assert rows[2] == "  dp    (4 ranks each): 1 node,      213.00 KiB,           ?"
    assert traffic_rows([("tp    (2 ranks each): 1 node,", "1 B", "0 B", "")]) == [
        "  tp    (2 ranks each): 1 node,       1 B,       0 B"]  # 9 columns at least, as before


def _many_groups_on_many_nodes(comm):
    """dp 4 (ep 2) x tp 2 x pp 2 on 8 nodes of 2 ranks, with GiB counts in every group: the world line's sum
    names tp, dp, ep, edp, pp, embed and other."""
    from types import SimpleNamespace
    from minizero.comm.nodes import NodeLayout, NodeTrafficCommunicator
    from minizero.parallel.expert_parallel import expert_groups
    from minizero.parallel.placement import node_traffic

    comm = NodeTrafficCommunicator(comm, NodeLayout(tuple(r // 2 for r in range(16))))
    topo = Topology(comm, 4, 2, 2)
    ep_comm, edp = expert_groups(topo.dp_comm, 2)
    for group, label in [(topo.tp_comm, "all_reduce"), (topo.dp_comm, "all_reduce"), (ep_comm, "all_to_all"),
                         (edp, "all_reduce"), (topo.pp_comm, "p2p"), (topo.embed_comm, "all_reduce"), (comm, "loss")]:
        with group.traffic.op(label):
            group.traffic.record(2 ** 30 * 63 + 12345)
        group.cross_node.record(label, 2 ** 30 * 63 + 12345)  # every byte crosses nodes
    dp = SimpleNamespace(buckets=[(np.zeros(2 ** 20), None)])
    return node_traffic(topo, 1, dp, "hierarchical", ep=2, edp=edp)


def test_no_traffic_line_passes_120_columns_with_many_groups_on_many_nodes():
    """Before: the world line summing every group's bytes across nodes ran to 150 columns and more on one line."""
    lines = run_in_threads(16, _many_groups_on_many_nodes, timeout=120)[0]
    assert max(map(len, lines)) <= 120, "\n".join(lines)
    said = " ".join(unwrapped("\n".join(lines)))
    assert " across nodes = tp " in said and " + edp " in said and " + embed " in said, lines
    assert "dp gradient all-reduce (hierarchical) across nodes per step: " in said, lines
    assert not any(line[-1].isdigit() or line.endswith("+") for line in lines), lines  # a term is never cut


def test_the_traffic_other_row_is_taken_before_dividing_by_steps():
    """Before: the "other" remainder was taken per step (after / steps): 3 steps, every byte in a row, left
    8.9e-16 B and an "other ... 0 B" row. Now taken on the run's whole bytes."""
    lines = run_in_threads(4, lambda comm: _case_table(comm, "ep", steps=3, loss=0, sizes=(1, 1, 3)))[0]
    assert set(_rows_and_world(lines)[0]) == {"ep", "edp", "dp"}, lines


def test_the_node_line_of_one_process_and_of_several():
    """Before: "nodes: all 1 rank(s) on one node (one machine)" for a single process."""
    lines = run_in_threads(2, lambda comm: Topology(comm, 2, 1, 1).describe_nodes())
    assert lines[0] == "nodes: all 2 rank(s) on one node (one machine): no message crosses a network"
    assert run_in_threads(1, lambda comm: Topology(comm, 1, 1, 1).describe_nodes()) == [
        "nodes: one process on one machine: no message crosses a network"]


def test_the_node_line_gives_the_ranks_pids_as_ranges():
    """Before: "process id of each rank [10802, 10803, 10804, 10805] (a launcher's report of a killed process names
    its PID)", 8 numbers over two lines at 8 ranks; now a range when consecutive, in rank order either way. Then
    "(a launcher names a killed rank by its PID)": MPICH's names whichever rank's bad exit it handled first."""
    from minizero.comm.nodes import NodeLayout

    topo = run_in_threads(4, lambda comm: Topology(comm, 4, 1, 1))[0]
    topo.nodes = NodeLayout((0,) * 4, pids=(10802, 10803, 10804, 10805))
    assert topo.describe_nodes() == ("nodes: all 4 rank(s) on one node (one machine): no message crosses a network; "
                                     "PIDs in rank order 10802-10805 (for kill or py-spy on a rank; the kernel's "
                                     "OOM-killer lines in dmesg name PIDs)")
    topo.nodes = NodeLayout((0, 0, 1, 1), pids=(10802, 10803, 311, 310))
    assert topo.describe_nodes().endswith("; PIDs in rank order 10802-10803,311,310 (for kill or py-spy on a rank; "
                                          "the kernel's OOM-killer lines in dmesg name PIDs)")


def test_the_mesh_names_context_parallel_ranks_apart_from_data_parallel_ones():
    """Before: under cp the mesh line said dp=2 for dp 1 x cp 2 (the topology's data axis holds dp x cp ranks)."""
    topos = run_in_threads(4, lambda comm: Topology(comm, 2, 2, 1))
    assert topos[0].describe().splitlines()[:2] == [
        "mesh: dp=2 x tp=2 x pp=1 = 4 ranks, grid = arange(4).reshape(pp=1, dp=2, tp=2)",
        "  stage 0  dp 0:  tensor group [0, 1]  on node 0"]
    assert topos[0].describe(2).splitlines() == [
        "mesh: dp=1 x cp=2 x tp=2 x pp=1 = 4 ranks, grid = arange(4).reshape(pp=1, dp*cp=2, tp=2)",
        "  stage 0  dp 0 cp 0:  tensor group [0, 1]  on node 0",
        "  stage 0  dp 0 cp 1:  tensor group [2, 3]  on node 0"]
    with pytest.raises(ValueError, match="cp=3 does not divide the data axis of 2 ranks"):
        topos[0].describe(3)


@pytest.mark.parametrize("world, given, expect", [
    (8, (None, 2, 2), (2, 2, 2)), (8, (2, 2, None), (2, 2, 2)), (8, (2, None, 2), (2, 2, 2)),
    (8, (None, None, None), (8, 1, 1)), (8, (None, 2, None), (4, 2, 1)), (8, (None, None, 4), (2, 1, 4)),
    (4, (4, None, None), (4, 1, 1)), (1, (None, None, None), (1, 1, 1))])
def test_left_out_sizes_are_derived(world, given, expect):
    assert resolve_sizes(world, *given) == expect


@pytest.mark.parametrize("flag, given, derived", [("--tp", "--dp and --pp", "cp x dp x pp"),
                                                  ("--pp", "--dp and --tp", "cp x dp x tp")])
def test_help_says_which_left_out_size_is_derived(flag, given, derived):
    """mpirun -n 8 ... --dp 2 --tp 2 ran a 2-stage pipeline while --help said --pp's default is 1."""
    from minizero.flags import build_parser

    said = " ".join(build_parser()._option_string_actions[flag].help.split())
    assert f"default: 1; with {given} given, world size / ({derived})" in said, said


@pytest.mark.parametrize("world, argv, needle", [
    (4, ["--dp", "2", "--tp", "2", "--pp", "2"], "--dp 2 x --tp 2 x --pp 2 = 8, but the world has 4 rank(s)"),
    (8, ["--dp", "2"], "--dp 2 x --tp 1 x --pp 1 = 2, but the world has 8"),
    (6, ["--tp", "4"], "cannot derive --dp: world size 6 is not divisible by --tp 4 x --pp 1 = 4"),
    (4, ["--model", "tiny", "--tp", "4"], "--tp 4 does not divide the number of attention heads n_head=2"),
    (4, ["--model", "tiny", "--pp", "4"], "--pp 4 is larger than the number of layers n_layer=2"),
    (2, ["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (4, ["--pp", "2", "--micro-batches", "0"], "--micro-batches must be >= 1, got 0"),
    (4, ["--pp", "2", "--micro-batches", "4", "--grad-accum", "2"], "--micro-batches 4 and --grad-accum 2"),
    (4, ["--pp", "2", "--zero", "2"], "--zero 2 with --pp 2 is not supported"),
    (4, ["--pp", "2", "--zero", "3"], "--zero 3 with --pp 2 is not supported"),
    (4, ["--pp", "2", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
    (4, ["--pp", "2", "--prune-sparsity", "0.5"], "--prune-sparsity with --tp 1 --pp 2 is not supported"),
    (2, ["--tp", "2", "--prune-sparsity", "0.5"], "across ranks; use --tp 1 --pp 1 (--dp, --zero and --cp compose"),
])
def test_bad_sizes_fail_before_any_work_naming_the_numbers(world, argv, needle):
    with pytest.raises(UsageError) as e:
        parse_args(argv, world)
    assert needle in str(e.value)


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "2"], "= 2; launch a multiple of 2 ranks, e.g. mpirun -n 2 python -m minizero.train ..."),
    (["--pp", "2"], "= 2; launch a multiple of 2 ranks, e.g. mpirun -n 2 python -m minizero.train ..."),
    (["--dp", "2", "--cp", "1"], "the world size; launch 2 ranks, e.g. mpirun -n 2 python -m minizero.train ..."),
    (["--cp", "2"], "the world size 1; launch a multiple of 2 ranks, e.g. mpirun -n 2 python -m minizero.train"),
    (["--dp", "1", "--cp", "2"], "the world size 1; launch a multiple of 2 ranks, e.g. mpirun -n 2"),
    (["--dp-shard", "2"], "allowed: 1; launch a multiple of 2 ranks, e.g. mpirun -n 2 python -m minizero.train ..."),
    (["--ep", "2", "--moe-experts", "4"], "ep data ranks); launch a multiple of 2 ranks, e.g. mpirun -n 2 python")])
def test_sizes_in_one_process_name_the_launch(argv, needle):
    """Before: "the world has 1 rank(s)" for --tp 2 without mpirun, which did not say to start several ranks."""
    with pytest.raises(UsageError) as e:
        parse_args(["--model", "tiny", *argv], 1)
    assert needle in str(e.value)


@pytest.mark.parametrize("world, argv, needle", [
    (8, ["--tp", "3"], "--tp 3 does not divide the number of attention heads n_head=4 (tensor parallelism splits "
     "attention by heads); allowed: 1, 2, 4 (the divisors of n_head=4, n_embd=128, vocab_size=256)"),
    (8, ["--tp", "3", "--cp", "2"], "--tp 3 does not divide the number of attention heads n_head=4"),
    (9, ["--pp", "9"], "--pp 9 is larger than the number of layers n_layer=4 (every pipeline stage needs at least one "
     "layer); allowed: 1 to 4"),
    (8, ["--cp", "3"], "--cp 3 needs the context length 128 divisible by 2 x cp = 6 (two chunks per rank); allowed: "
     "2, 4, 8, 16, 32, 64 (or change --block-size)"),
    (8, ["--ulysses", "3"], "2 x cp = 6 (two chunks per rank); allowed: 2, 4 (or change --block-size)"),
    (2, ["--cp", "2", "--block-size", "15"], "(two chunks per rank); allowed: no cp at length 15: give --block-size 12, "
     "say"),  # before: "allowed: none (or change --block-size)"
    (2, ["--model", "tiny", "--ulysses", "4"], "divisible by cp = 4: the all-to-all splits heads; allowed: 2"),
    (8, ["--moe-experts", "4", "--ep", "3"], "--moe-experts 4 must be divisible by --ep 3 (each expert-parallel rank "
     "holds E/ep); allowed: 1, 2, 4")])
def test_a_size_the_model_refuses_is_named_before_the_launch(world, argv, needle):
    """mpirun -n 8 ... --tp 3 said "launch a multiple of 3 ranks, e.g. mpirun -n 3"; that launch then met
    "--tp 3 does not divide the number of attention heads n_head=4". The model's rule, with what is allowed, comes
    first (--cp 3 and --ulysses 3 named a launch of 3 ranks the same way)."""
    with pytest.raises(UsageError) as e:
        parse_args(argv, world)
    assert needle in str(e.value) and "launch" not in str(e.value), str(e.value)


def test_sizes_under_cp_launch_cp_times_the_product():
    with pytest.raises(UsageError, match="launch 8 ranks, e.g. mpirun -n 8 python"):
        parse_args(["--model", "tiny", "--cp", "2", "--dp", "4"], 2)


def test_finetune_tp_in_one_process_names_the_launch(capsys, tmp_path):
    """A --tp the model takes names the launch; one it does not (model.json, read before the weights) names the
    model's rule first: before, --tp 3 said "launch a multiple of 3 ranks", which then met n_head's refusal."""
    import dataclasses
    from minizero.finetune import main
    from minizero.nn import get_config

    (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(get_config("tiny"))))  # n_head 2, n_embd 16
    for weights in (str(tmp_path / "model.npz"), str(tmp_path / "none" / "model.npz")):  # without model.json: as ever
        assert main(["--weights", weights, "--tp", "2"]) == 2
        err = capsys.readouterr().err
        assert len(unwrapped(err)) == 1 and "--tp 2 must divide the 1 ranks; launch a multiple of 2 ranks, e.g. " \
            "mpirun -n 2 python -m minizero.finetune ..." in " ".join(err.split()), err
    assert main(["--weights", str(tmp_path / "model.npz"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert len(unwrapped(err)) == 1 and "--tp 3 does not divide the number of attention heads n_head=2 (tensor " \
        "parallelism splits attention by heads); allowed: 1, 2 (the divisors of n_head=2, n_embd=16)" \
        in " ".join(err.split()), err


def test_hidden_size_must_split_too():
    with pytest.raises(ValueError, match="--tp 2 does not divide the hidden size n_embd=7"):
        resolve_sizes(2, tp=2, n_head=2, n_embd=7)


def test_one_batch_rule_for_every_strategy():
    """B = micro-batch x dp x k, k defaulting to pp: tensor parallelism never changes the global batch."""
    a = parse_args(["--dp", "2", "--tp", "2", "--pp", "2"], 8)
    assert (a.dp, a.tp, a.pp, a.micro_batches, a.grad_accum, a.batch_size) == (2, 2, 2, 2, 2, 8)
    assert parse_args([], 8).batch_size == 16  # --dp 8
    b = parse_args(["--pp", "2", "--batch-size", "8"], 4)
    assert (b.dp, b.micro_batches) == (2, 2)
    c = parse_args([], 4)
    assert (c.dp, c.tp, c.pp, c.micro_batches) == (4, 1, 1, 1)
    # the input: --tp 2 on 2 ranks trains on micro-batch x dp = 8 sequences, not 16
    d = parse_args(["--tp", "2", "--micro-batch-size", "8"], 2)
    assert (d.dp, d.grad_accum, d.batch_size) == (1, 1, 8)
    e = parse_args(["--micro-batch-size", "8"], 1)
    assert e.batch_size == d.batch_size


def test_zero1_with_pipeline_is_accepted():
    assert parse_args(["--pp", "2", "--zero", "1"], 4).zero == 1


# ------------------------------------------------------------------------------ equivalence
@pytest.mark.timeout(120)
def test_dp2_tp2_pp2_equals_single_process():
    ref = run_in_threads(1, R.run_single, "tiny", 2 * 1, 3)[0]
    got = run_in_threads(8, R.run_parallel, "tiny", 1, 2, 2, 2, 3, "1f1b")
    R.assert_matches(ref, got, "dp2 tp2 pp2")
    for r in got:  # every group's messages went where they should
        t = r["traffic"]
        # tensor group: the blocks' and the embedding's all-reduces, the loss's all-gather (last stage); every
        # group also holds "validation", the bytes of the validation batches' forward passes
        assert set(t["tp"]["by_op"]) == ({"all_reduce", "all_gather"} if r["coords"][2] == 1 else {"all_reduce"}) | {
            "validation"}
        # (used_parameters: which parameters got a gradient on some data rank, one small all-gather a step;
        # the inner collective's label is listed with 0 bytes, as broadcast's inside broadcast_params)
        # (replica_check: the default --check-replicas after the last step, one all-gather of 8-byte digests)
        assert set(t["dp"]["by_op"]) <= {"all_reduce", "broadcast", "broadcast_params", "used_parameters", "all_gather",
                                         "replica_check", "validation"}
        assert t["dp"]["by_op"].get("all_gather", 0) == 0 < t["dp"]["by_op"]["used_parameters"]
        # the embedding group is a split of the pipeline group: its all-reduce shows in both
        assert set(t["pp"]["by_op"]) <= {"pp_activation", "pp_gradient", "pp_eval", "all_reduce", "validation"}
        # the validation forwards' activations: under the outer label (pp_eval's sends, counted, hold 0 bytes)
        assert t["pp"]["by_op"].get("pp_eval", 0) == 0 and (r["coords"][2] == 1 or t["pp"]["by_op"]["validation"] > 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dp2_pp2_with_zero1_equals_single_process(schedule):
    ref = run_in_threads(1, R.run_single, "tiny", 2 * 2, 3)[0]
    got = run_in_threads(4, R.run_parallel, "tiny", 2, 2, 1, 2, 3, schedule, ["--zero", "1"])
    R.assert_matches(ref, got, f"dp2 pp2 zero1 {schedule}")
    for r in got:  # ZeRO-1: reduce-scatter the gradients, all-gather the parameters, over the data group
        assert {"reduce_scatter", "all_gather"} <= set(r["traffic"]["dp"]["by_op"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_compose_with_tensor_parallelism(zero):
    ref = run_in_threads(1, R.run_single, "tiny", 2 * 2, 2)[0]
    got = run_in_threads(4, R.run_parallel, "tiny", 2, 2, 2, 1, 2, "1f1b", ["--zero", str(zero)])
    R.assert_matches(ref, got, f"dp2 tp2 zero{zero}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [["--recompute", "full"], ["--recompute", "selective"],
                                   ["--offload-activations", "cpu"], ["--offload-optimizer", "cpu"]])
def test_recompute_and_offload_compose_with_3d(extra):
    """Both act inside a stage (tp 2 x pp 2; a data axis adds nothing inside it): recompute re-runs a block (its
    tensor all-reduces too) in backward."""
    ref = run_in_threads(1, R.run_single, "tiny", 2, 2)[0]
    got = run_in_threads(4, R.run_parallel, "tiny", 2, 1, 2, 2, 2, "1f1b", extra)
    R.assert_matches(ref, got, f"tp2 pp2 {extra}")


@pytest.mark.timeout(300)
def test_mpi_dp2_tp2_pp2_equals_single_process(mpiexec, tmp_path):
    ref = run_in_threads(1, R.run_single, "tiny", 2 * 1, 3)[0]
    script = os.path.join(REPO_ROOT, "tests", "mpi_scripts", "mp_check.py")
    proc = subprocess.run([mpiexec, "-n", "8", sys.executable, script, str(tmp_path), "tiny", "1", "2", "2", "2", "3",
                           "1f1b"], env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(8)]
    R.assert_matches(ref, got, "mpi dp2 tp2 pp2")


LOSS_ARGV = ["--model", "tiny", "--steps", "8", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]


def _losses(comm, extra):
    return train(parse_args(LOSS_ARGV + extra, comm.world_size), comm, log=lambda s: None)["train_losses"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-13), ("float32", 2 * 2.0 ** -23)])
def test_loss_curve_of_3d_and_dp8_equal_one_process(dtype, rtol):
    """dp 2 x tp 2 x pp 2 and dp 8 vs one process (micro-batch 4 x 4 accumulated), the default flags, same batches.
    float64: measured 8.9e-16 apart. float32, the default dtype (its buffers and sums stay float32): measured 3e-7
    (0.6 ulp at 5.5), 5.4e-8 relative, bounded by 2 float32 eps (summation order only)."""
    d = ["--dtype", dtype]
    one = run_in_threads(1, _losses, d + ["--micro-batch-size", "4", "--grad-accum", "4"])[0]
    dp8 = run_in_threads(8, _losses, d)[0]
    three_d = run_in_threads(8, _losses, d + ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "4"])[0]
    assert one[-1] < one[0] - 0.2  # it learns (8 steps, all of them warm-up)
    np.testing.assert_allclose(three_d, one, rtol=rtol, atol=0)
    np.testing.assert_allclose(dp8, one, rtol=rtol, atol=0)


FP16 = ["--model", "tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
        "--precision", "fp16"]


def fp16_run(comm, extra):
    r = train(parse_args(FP16 + extra, comm.world_size), comm, log=lambda s: None)
    return r["train_losses"], r["grad_norms"], r["loss_scales"], r["skipped_steps"]


@pytest.mark.timeout(120)
def test_fp16_composes_with_3d():
    """Mixed precision in 3D follows data parallelism with the same data group (the same FP16 sums)."""
    ref = run_in_threads(2, fp16_run, ["--grad-accum", "2"])[0]
    got = run_in_threads(8, fp16_run, ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"])[0]
    assert ref[3] == got[3] == 0 and got[2] == [2.0 ** 16] * 4
    np.testing.assert_allclose(got[0], ref[0], rtol=0, atol=5e-3)  # FP16 rounding (tensor partial sums)


@pytest.mark.timeout(120)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(monkeypatch):
    monkeypatch.setenv("MINIZERO_FAULT", "5:2:inf")  # rank 5: tp 1 of stage 1
    res = run_in_threads(8, fp16_run, ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"])
    for losses, norms, scales, skipped in res:
        assert skipped == 1 and np.isnan(norms[2]) and np.isfinite(np.delete(norms, 2)).all()
        assert scales[:4] == [2.0 ** 16] * 3 + [2.0 ** 15]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [["--optimizer", "adam8bit"], ["--optimizer", "adam8bit", "--zero", "1"],
                                   ["--zero", "1", "--quantized-comm"]])
def test_optimizer_options_compose_with_the_pipeline(extra):
    """8-bit Adam (whole or ZeRO-sharded) and INT8 ZeRO traffic act per stage: dp 2 x pp 2 equals dp 2.

    (With tp > 1, 8-bit Adam's 256-element blocks are cut inside each shard, so it is no longer
    bit-equal to one process: a different quantization, not a bug.)
    """
    ref = run_in_threads(2, R.run_single_dp, "tiny", 1, 2, extra)
    got = run_in_threads(4, R.run_parallel, "tiny", 1, 2, 1, 2, 2, "1f1b", extra)
    full = next(r["full"] for r in got if r["full"] is not None)
    for name, a in ref[0]["params"].items():
        # measured 6.4e-15 of the largest: float64 summation order, no 8-bit code flipped
        np.testing.assert_allclose(full[name], a, rtol=0, atol=1e-12 * np.abs(a).max(), err_msg=name)
    np.testing.assert_allclose(got[0]["losses"], ref[0]["losses"], rtol=1e-13)


@pytest.mark.timeout(300)
def test_cli_tp2_pp2_writes_the_whole_model_and_the_mesh(mpiexec, tmp_path):
    out = tmp_path / "run"
    cmd = [mpiexec, "-n", "4", sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "3",
           "--tp", "2", "--pp", "2", "--micro-batches", "4", "--schedule", "gpipe", "--eval-batches", "1", "--sample-tokens", "20",
           "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp 1 x tp 2 x pp 2" in proc.stdout
    said = " ".join(proc.stdout.split())  # wrapped
    assert "bubble 0.200 (idle share of the schedule) = (p-1)/(m+p-1) = (2-1)/(4+2-1)" in said
    assert "(pipeline: a stage's modules hold the saves of every micro-batch it has in flight at once" in said
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["pp"], summary["micro_batches"]) == (1, 2, 2, 4)
    weights = np.load(out / "model.npz")
    assert weights["transformer.h.1.attn.c_attn.weight"].shape == (48, 16)  # gathered whole from 2 tensor ranks
    assert weights["lm_head.weight"].shape == (256, 16)
