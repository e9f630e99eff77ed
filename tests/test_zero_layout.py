"""ZeRO is one package (minizero/zero/): no other module branches on a ZeRO stage number; its order check is a debug switch."""
import ast
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ZERO = REPO / "minizero" / "zero"


def stage_comparisons(source: str) -> list[str]:
    """Comparisons (``==``, ``in``, ``>=``, ``<`` ...) of an ``X.stage`` attribute, X not the pipeline's ``stage``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Attribute) and side.attr == "stage" and \
                        not (isinstance(side.value, ast.Name) and side.value.id == "stage"):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_zero_stage_comparison_outside_the_zero_package():
    outside = [f"{p.relative_to(REPO)}:{f}" for p in sorted((REPO / "minizero").rglob("*.py"))
               if ZERO not in p.parents for f in stage_comparisons(p.read_text())]
    assert not outside, "ask the ZeRO optimizer through its methods instead:\n" + "\n".join(outside)


def test_the_scan_finds_a_stage_branch_and_spares_the_pipeline_stage():
    assert stage_comparisons("def f(zero):\n    return 1 if zero.stage >= 2 else 0\n") == \
        ["2: zero.stage >= 2"]
    assert stage_comparisons("def f(self):\n    return self.stage in (1, 2)\n") == ["2: self.stage in (1, 2)"]
    assert stage_comparisons("def f(stage, comm):\n    return comm.rank != stage.stage\n") == []


# --------------------------------------------------------------------------- the order check is a debug switch
def _one_step(comm, stage, check_order):
    from minizero.nn import GPT, get_config
    from minizero.zero import zero_optimizer

    model = GPT(get_config("tiny", dtype="float64"), seed=0)
    opt = zero_optimizer(model, comm, stage, lr=1e-2, check_order=check_order)
    x = np.arange(8, dtype=np.int64).reshape(2, 4) + 8 * comm.rank
    model(x, x)[1].backward()
    opt.reduce_gradients()
    opt.step()
    with opt.full_parameters():
        weights = {k: v.copy() for k, v in model.state_dict().items()}
    return weights, comm.traffic.snapshot()["by_op"].get("zero_header", 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_order_check_runs_only_when_asked_and_changes_no_number(stage):
    from minizero.comm import run_in_threads

    on = run_in_threads(2, _one_step, stage, True)
    off = run_in_threads(2, _one_step, stage, False)
    assert all(header > 0 for _, header in on) and all(header == 0 for _, header in off)
    for (w_on, _), (w_off, _) in zip(on, off):
        assert all(np.array_equal(w_on[k], w_off[k]) for k in w_on)


def test_the_debug_switch_is_the_environment_variable(monkeypatch):
    from minizero.zero.collectives import debug_collectives

    assert debug_collectives()  # tests/conftest.py turns it on for the suite
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")
    assert not debug_collectives()


def test_debug_collectives_turns_the_zero_order_check_on(monkeypatch):
    """--debug-collectives (the main job's switch) turns ZeRO's header check on even when the env switch is off."""
    from minizero.comm import run_in_threads
    from minizero.train import parse_args, train
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")

    def header_bytes(comm, flags):
        args = parse_args(["--model", "tiny", "--zero", "1", "--steps", "1", "--no-save", "--eval-batches", "1",
                           "--progress", "none", *flags], comm.world_size)
        res = train(args, comm, log=lambda s: None)
        return res["traffic"]["world"]["by_op"].get("zero_header", 0)

    assert run_in_threads(2, header_bytes, [])[0] == 0
    assert run_in_threads(2, header_bytes, ["--debug-collectives"])[0] > 0
