"""Checkpoints of MoE runs: experts and routing biases saved once, resumed on the same or another --ep.

Identical continuation as tests/test_checkpoint.py, in 4 steps (4 steps straight == 2 steps, save, resume, 2 steps;
float64 weights to 1e-12 and the same losses) with choices dropped and the routing bias moving; an expert slice is a
dim-0 shard in the checkpoint's coordinates, so a 4-rank --ep 2 checkpoint resumes at --ep 1 on 2 ranks and
at --ep 4 (the same groups are routed: micro-batch 2 everywhere). Another MoE shape is refused before any work.
"""
import re
import subprocess
import sys

import numpy as np
import pytest

from minizero.numerals import unwrapped

from minizero.checkpoint import read_manifest
from minizero.checkpoint.cli import main as checkpoint_main
from minizero.train import UsageError, parse_args
from tests.conftest import REPO_ROOT, mpi_env
from tests.test_checkpoint import BASE, F64, SharedRuns, assert_same_run, run

RESHARD_ATOL = 1e-13  # float64 weights and losses after a resume on another --ep (lesson 09 quotes it)

MOE = F64 + ["--steps", "4", "--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "1.0",
             "--moe-aux-loss", "0.1", "--moe-bias-update", "0.01", "--micro-batch-size", "2"]

CASES = {
    "ep2": (2, ["--ep", "2"]),
    "ep2-zero1-dp4": (4, ["--ep", "2", "--zero", "1"]),
    "ep2-tp2-dp2": (4, ["--ep", "2", "--tp", "2", "--dp", "2"]),
    "ep1-pp2": (2, ["--pp", "2", "--grad-accum", "2"]),
    # the first shard group writes: ZeRO-3 of the dense part over ranks 0-1, the experts over their 1-rank expert-data
    # group, as --ep 2 --zero 3 on 2 ranks (a case of its own before: its save and load are this case's ranks 0-1's)
    "ep2-zero3-dp4-shard2": (4, ["--ep", "2", "--zero", "3", "--dp-shard", "2"]),
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Each save run once: the cases below resume from it on its own layout, the tests after them on others."""
    return SharedRuns(tmp_path_factory, save_at=2)  # at step 2 of 4 (test_checkpoint's dense cases: 3 of 6): a
    # resumed step from the loaded state and one from its own show what 3 would


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_four_steps_equal_two_save_resume_two(case, shared):
    n, flags = CASES[case]
    straight, folder = shared.saved(n, MOE + flags)  # its own 4 steps are the straight run (the dense cases in
    # tests/test_checkpoint.py also check that a save leaves the run it is taken from as a run without one)
    man = read_manifest(str(folder))
    routing = {name: b for f in man["files"] for name, b in f.get("routing", {}).items()}
    assert len(routing) == 2 and any(any(x != 0 for x in b) for b in routing.values())  # both layers, moved
    experts = [pc for pc in man["pieces"] if pc["param"].endswith("moe.w1") and pc["kind"] == "param"]
    assert sum(pc["hi"] - pc["lo"] for pc in experts) == 2 * np.prod(man["params"][experts[0]["param"]]["shape"])
    resumed = run(n, MOE + flags + ["--resume", str(folder)])
    assert_same_run(straight, resumed, at=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,flags", [(2, ["--grad-accum", "2"]), (4, ["--ep", "4"]), (4, ["--ep", "4", "--zero", "3"])],
                         ids=["ep1-2ranks", "ep4", "ep4-zero3"])
def test_reshard_ep2_on_4_ranks_to_another_ep(n, flags, shared):
    """Saved at --ep 2 --zero 1 on 4 ranks (the case above's save run: its optimizer state in shards); resumed on
    another layout: the same state, so the same last 2 steps (1e-13)."""
    straight, folder = shared.saved(4, MOE + CASES["ep2-zero1-dp4"][1])
    resumed = run(n, MOE + flags + ["--resume", str(folder)])
    assert resumed["start_step"] == 2
    np.testing.assert_allclose(resumed["train_losses"], straight["train_losses"][2:], rtol=0, atol=RESHARD_ATOL)
    for k, a in straight["params"].items():
        np.testing.assert_allclose(resumed["params"][k], a, rtol=0, atol=RESHARD_ATOL, err_msg=k)


@pytest.mark.timeout(300)
def test_hybrid_sharded_experts_resume_on_plain_zero_and_the_other_way(shared):
    """Saved at --ep 2 --zero 3 --dp-shard 2 on 4 ranks, resumed at --ep 2 --zero 1 (plain); saved plain,
    resumed hybrid: the same last 2 steps (1e-13)."""
    hybrid, plain = CASES["ep2-zero3-dp4-shard2"][1], CASES["ep2-zero1-dp4"][1]
    for src, dst in [(hybrid, plain), (plain, hybrid)]:
        straight, folder = shared.saved(4, MOE + src)
        resumed = run(4, MOE + dst + ["--resume", str(folder)])
        np.testing.assert_allclose(resumed["train_losses"], straight["train_losses"][2:], rtol=0, atol=RESHARD_ATOL)
        for k, a in straight["params"].items():
            np.testing.assert_allclose(resumed["params"][k], a, rtol=0, atol=RESHARD_ATOL, err_msg=k)


@pytest.mark.timeout(300)
def test_another_moe_shape_is_refused_before_any_work(shared):
    n, flags = CASES["ep2"]  # its save run: 2 ranks, --ep 2
    folder = str(shared.saved(n, MOE + flags)[1])
    with pytest.raises(UsageError, match="moe_experts 4, this run asks for 8; resume with the same --moe-experts"):
        parse_args(["--model", "tiny"] + MOE + ["--moe-experts", "8", "--resume", folder], 2)
    with pytest.raises(UsageError, match="moe_top_k 2, this run asks for 1"):
        parse_args(["--model", "tiny"] + MOE + ["--moe-top-k", "1", "--resume", folder], 2)
    with pytest.raises(UsageError, match="moe_experts 4, this run asks for 0"):  # a dense run
        parse_args(["--model", "tiny"] + F64 + ["--resume", folder], 2)
    from minizero.checkpoint import ShardReader
    from minizero.checkpoint.cli import describe
    text = describe(ShardReader(folder))  # before: the dense model's lines, nothing of the experts
    assert "float64\n  MoE in blocks [0, 1]: 4 experts, top-2, capacity factor 1\n  layout: 2 rank(s)" in text, text


def _rename_layer0(files):
    for f in files:
        f["routing"] = {"transformer.h.9.mlp.moe": f["routing"]["transformer.h.0.mlp.moe"]}


def _move_rank1s_bias(files):
    files[1]["routing"]["transformer.h.1.mlp.moe"][2] += 0.5


def _drop_a_bias(files):
    for f in files:
        f["routing"]["transformer.h.0.mlp.moe"].pop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, edit, said", [
    (1, _rename_layer0, "files hold no routing biases of 'transformer.h.0.mlp.moe', 'transformer.h.1.mlp.moe', "
                        "expected"),
    (2, _move_rank1s_bias, "files[1].routing['transformer.h.1.mlp.moe'] differs from files[0]'s, expected one "
                           "state in every file"),
    (1, _drop_a_bias, "files[0].routing['transformer.h.0.mlp.moe'] has 3 numbers, expected 4 (layout.moe_experts) "
                      "(MoE's routing biases)"),  # mutation audit: the count unchecked passed every test
], ids=["layer-renamed", "ranks-differ", "an-expert-short"])
def test_a_manifest_whose_routing_biases_are_not_as_saved_is_refused_before_any_work(tmp_path, capsys, n, edit, said):
    """Attacker: the routing section dropped from every files entry (or its layers renamed) passed the manifest
    check; --resume built the model, then failed in restore (exit 1, MPI_Abort under mpiexec). Two files with
    different biases for one layer (save writes each rank's copy of one state) loaded the last file's, silently.
    inspect in-process (the CI budget; ``python -m minizero.checkpoint``: test_checkpoint's refusal tests)."""
    import json
    run(n, MOE + ["--steps", "1", "--warmup", "1", "--save-every", "1", "--save-dir", str(tmp_path)])
    folder = tmp_path / "step_00000001"
    man = json.loads((folder / "manifest.json").read_text())
    edit(man["files"])
    (folder / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UsageError, match=re.escape(said)):
        parse_args(["--model", "tiny"] + MOE + ["--resume", str(folder)], n)
    code, err = checkpoint_main(["inspect", str(folder)]), capsys.readouterr().err
    assert code == 2 and said in " ".join(err.split()) and len(unwrapped(err)) == 1, err


@pytest.mark.timeout(300)
def test_save_at_ep2_resume_at_ep1_under_mpiexec(mpiexec, tmp_path):
    """``mpiexec -n 4 ... --ep 2 --save-every 2`` (the expert replicas of data ranks 2-3 write nothing), then a resume
    at ep 1 on 2 rank threads (2 micro-batches; a resume under mpiexec: tests/test_train.py and test_checkpoint's
    test_a_resumed_run_...): the first run's final model.npz (1e-13); ``minizero.checkpoint consolidate`` of step 4 is
    that model.npz, name for name."""
    flags = [a for a in BASE if a != "--no-save"] + MOE + ["--sample-tokens", "1"]
    cmd = [mpiexec, "-n", "4", sys.executable, "-m", "minizero.train", *flags, "--out", str(tmp_path / "a"),
           "--ep", "2", "--save-every", "2"]
    done = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = []
    b = run(2, MOE + ["--grad-accum", "2", "--resume", str(tmp_path / "a" / "checkpoints" / "step_00000002")],
            lines)["params"]
    assert any(line.startswith("resumed from") for line in lines), lines
    a = np.load(tmp_path / "a" / "model.npz")
    assert sorted(a) == sorted([*b, "lm_head.weight"])  # the tied head: transformer.wte.weight
    for k in a:
        got = b["transformer.wte.weight" if k == "lm_head.weight" else k]
        np.testing.assert_allclose(got, a[k], rtol=0, atol=1e-13 * max(1.0, np.abs(a[k]).max()), err_msg=k)
    con = subprocess.run([sys.executable, "-m", "minizero.checkpoint", "consolidate", str(tmp_path / "a" / "checkpoints"),
                          "--out", str(tmp_path / "c.npz")], env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert con.returncode == 0, con.stderr
    c = np.load(tmp_path / "c.npz")
    assert sorted(c) == sorted(a)
    for k in a:
        np.testing.assert_array_equal(c[k], a[k], err_msg=k)


def test_equal_routing_biases_holding_nan_are_not_reported_as_differing():
    """Two files' copies of one layer's biases, both [nan, 1.0] as float("nan") objects (a manifest built in memory;
    json.load shares one NaN object, which compares equal by identity): NaN != NaN read them as "differs" on top of
    the entry check's "holds nan". A real difference beside the NaN is still one."""
    from minizero.checkpoint.state_fields import routing_problems
    layer = "transformer.h.0.mlp.moe"

    def manifest(second):
        return {"params": {layer + ".router": {}},
                "files": [{"routing": {layer: [float("nan"), 1.0]}}, {"routing": {layer: second}}]}
    assert routing_problems(manifest([float("nan"), 1.0])) == []
    assert routing_problems(manifest([float("nan"), 2.0])) == [
        f"files[1].routing[{layer!r}] differs from files[0]'s, expected one state in every file (MoE's routing "
        "biases: each rank saves its copy)"]
