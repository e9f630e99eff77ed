"""The planner's memory is its fullest pipeline stage's, over every stage: not only the first and the last.

Under 1F1B stage i keeps p - i micro-batches in flight, so a middle stage with more MoE blocks than the ends
(DeepSeek-V3's first blocks are dense) can hold the most; interleaving mixes the blocks of each stage again."""
import dataclasses

import pytest

from minizero.memory.estimator import estimate_memory, estimate_stages
from minizero.models import MODELS
from minizero.plan_search import Hardware, enumerate_strategies, plan

DEEPSEEK = MODELS["deepseek-v3"]
CASES = [(MODELS["llama3-8b"], 32, sched) for sched in ("1f1b", "gpipe", "interleaved")] + [
    (dataclasses.replace(DEEPSEEK, name="deepseek-8", n_layer=8), 16, "1f1b"),  # 3 dense blocks, then MoE
    (dataclasses.replace(DEEPSEEK, name="deepseek-16", n_layer=16), 16, "interleaved"),
    (dataclasses.replace(MODELS["mixtral-8x7b"], name="mixtral-every-2", moe_every=2), 16, "gpipe")]


def _every_stage(model, st, seq):
    return max(estimate_memory(model, st, seq, stage=i).total for i in range(st.pp))


@pytest.mark.parametrize("model,gpus,schedule", CASES, ids=[f"{m.name}-{s}" for m, _, s in CASES])
def test_the_stages_the_planner_estimates_hold_the_fullest(model, gpus, schedule):
    seq, pps = 4096, set()
    for st in enumerate_strategies(model, gpus, global_batch=64, schedule=schedule, seq_len=seq):
        if st.pp > 1 and st.recompute != "full" and not st.offload_activations:  # a spread, not every layout
            pps.add(st.pp)
            assert max(e.total for e in estimate_stages(model, st, seq)) == _every_stage(model, st, seq), st
    assert {2, 4, 8} <= pps


def test_the_plans_rows_and_smallest_footprint_are_their_fullest_stages():
    model, seq = CASES[3][0], 4096  # a middle stage is the fullest (it failed with the ends alone)
    hw = Hardware(gpu_memory=10 ** 15, host_memory=10 ** 15)  # every strategy fits
    fits, count, (small, device, _) = plan(model, 8, hw, seq, global_batch=16, ep=1)
    assert device == _every_stage(model, small, seq)
    assert len(fits) == count and any(c.strategy.pp > 2 for c in fits)
    for c in (c for c in fits if c.strategy.pp > 2):
        assert c.memory.total == _every_stage(model, c.strategy, seq), c.strategy
