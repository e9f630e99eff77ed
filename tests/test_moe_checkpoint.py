"""Checkpoints of MoE runs: experts and routing biases saved once, resumed on the same or another --ep.

Identical continuation as tests/test_checkpoint.py (6 steps straight == 3 steps, save, resume, 3 steps; float64
weights to 1e-12 and the same losses) with choices dropped and the routing bias moving; an expert slice is a
dim-0 shard in the checkpoint's coordinates, so a 4-rank --ep 2 checkpoint resumes at --ep 1 on 2 ranks and
at --ep 4 (the same groups are routed: micro-batch 2 everywhere). Another MoE shape is refused before any work.
"""
import numpy as np
import pytest

from minizero.checkpoint import read_manifest
from minizero.train import UsageError, parse_args
from tests.test_checkpoint import F64, assert_same_run, run

MOE = F64 + ["--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "1.0", "--moe-aux-loss", "0.1",
             "--moe-bias-update", "0.01", "--micro-batch-size", "2"]

CASES = {
    "ep2": (2, ["--ep", "2"]),
    "ep2-zero1-dp4": (4, ["--ep", "2", "--zero", "1"]),
    "ep2-zero3": (2, ["--ep", "2", "--zero", "3"]),
    "ep2-tp2-dp2": (4, ["--ep", "2", "--tp", "2", "--dp", "2"]),
    "ep1-pp2": (2, ["--pp", "2", "--grad-accum", "2"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_six_steps_equal_three_save_resume_three(case, tmp_path):
    n, flags = CASES[case]
    straight = run(n, MOE + flags)
    run(n, MOE + flags + ["--save-every", "3", "--save-dir", str(tmp_path)])
    man = read_manifest(str(tmp_path / "step_00000003"))
    routing = {name: b for f in man["files"] for name, b in f.get("routing", {}).items()}
    assert len(routing) == 2 and any(any(x != 0 for x in b) for b in routing.values())  # both layers, moved
    experts = [pc for pc in man["pieces"] if pc["param"].endswith("moe.w1") and pc["kind"] == "param"]
    assert sum(pc["hi"] - pc["lo"] for pc in experts) == 2 * np.prod(man["params"][experts[0]["param"]]["shape"])
    resumed = run(n, MOE + flags + ["--resume", str(tmp_path / "step_00000003")])
    assert_same_run(straight, resumed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,flags", [(2, ["--grad-accum", "2"]), (4, ["--ep", "4"]), (4, ["--ep", "4", "--zero", "3"])],
                         ids=["ep1-2ranks", "ep4", "ep4-zero3"])
def test_reshard_ep2_on_4_ranks_to_another_ep(n, flags, tmp_path):
    """Saved at --ep 2 on 4 ranks; resumed on another layout: the same state, so the same last 3 steps (1e-9)."""
    straight = run(4, MOE + ["--ep", "2", "--save-every", "3", "--save-dir", str(tmp_path)])
    resumed = run(n, MOE + flags + ["--resume", str(tmp_path / "step_00000003")])
    assert resumed["start_step"] == 3
    np.testing.assert_allclose(resumed["train_losses"], straight["train_losses"][3:], rtol=0, atol=1e-9)
    for k, a in straight["params"].items():
        np.testing.assert_allclose(resumed["params"][k], a, rtol=0, atol=1e-9, err_msg=k)


@pytest.mark.timeout(300)
def test_another_moe_shape_is_refused_before_any_work(tmp_path):
    run(2, MOE + ["--ep", "2", "--save-every", "3", "--save-dir", str(tmp_path)])
    folder = str(tmp_path / "step_00000003")
    with pytest.raises(UsageError, match="moe_experts 4, this run asks for 8; resume with the same --moe-experts"):
        parse_args(["--model", "tiny"] + MOE + ["--moe-experts", "8", "--resume", folder], 2)
    with pytest.raises(UsageError, match="moe_top_k 2, this run asks for 1"):
        parse_args(["--model", "tiny"] + MOE + ["--moe-top-k", "1", "--resume", folder], 2)
    with pytest.raises(UsageError, match="moe_experts 4, this run asks for 0"):  # a dense run
        parse_args(["--model", "tiny"] + F64 + ["--resume", folder], 2)
