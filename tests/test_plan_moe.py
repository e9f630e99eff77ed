"""MoE and expert parallelism in the estimator and the planner (issue 31): parameter counts, the expert
all-to-all and model-state bytes against the trainer's ledgers, the presets, and ``plan`` searching ep."""
import pytest

from minizero.memory.estimator import ModelShape, Strategy
from minizero.nn import GPT, get_config
from minizero.parallel.expert_parallel import MoEConfig, use_moe


# ---- 1: the shape and its parameter counts ------------------------------------------------------
@pytest.mark.parametrize("every", [1, 2])
def test_tiny_moe_parameters_equal_moeconfig_and_the_model(every):
    cfg, moe = get_config("tiny"), MoEConfig(4, top_k=2, every=every)
    shape = ModelShape.from_gpt_config(cfg, moe=moe)
    model = GPT(cfg)
    use_moe(model, moe, seed=0)
    assert (shape.num_parameters(), shape.active_parameters()) == moe.parameters(cfg)
    assert shape.num_parameters() == model.num_parameters() == sum(shape.tensor_sizes())
    assert shape.moe_layers() == moe.layers(cfg.n_layer)


def test_a_dense_shape_is_unchanged_by_the_moe_fields():
    cfg = get_config("tiny")
    shape = ModelShape.from_gpt_config(cfg)
    assert shape.num_parameters() == shape.active_parameters() == cfg.num_parameters()
    assert shape.moe_layers() == []


@pytest.mark.parametrize("kw,words", [
    (dict(experts=4, top_k=5), "top_k must be in 1..experts=4"),
    (dict(experts=4, top_k=1, capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
    (dict(experts=4, dense_layers=2), "no block has an MoE layer"),
    (dict(shared_experts=1), "need experts > 0"),
    (dict(experts=-1), "experts must be an integer >= 0"),
])
def test_bad_moe_shapes_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        ModelShape("x", 2, 16, 2, 2, 64, 256, 16, **kw).validate()


@pytest.mark.parametrize("kw,words", [
    (dict(dp=4, ep=3), "ep=3 must divide dp=4"),
    (dict(dp=8, ep=8), "ep=8 must divide x's 4 experts"),
])
def test_bad_ep_is_refused(kw, words):
    m = ModelShape("x", 2, 16, 2, 2, 64, 256, 16, experts=4, top_k=2)
    with pytest.raises(ValueError, match=words):
        Strategy(**kw).validate(m)
    with pytest.raises(ValueError, match="a dense model: use ep=1"):
        Strategy(dp=2, ep=2).validate(ModelShape("y", 2, 16, 2, 2, 64, 256, 16))
