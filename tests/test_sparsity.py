"""Magnitude pruning: exact sparsity, global vs per-layer ranking, compressed sizes, masks held through training."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.ledger import get_ledger
from minizero.memory.sparsity import Pruner, compressed_nbytes, magnitude_masks, prunable_weights
from minizero.nn import GPT, get_config
from minizero.optim import AdamW
from minizero.optim.adam8bit import Adam8bit

ZERO_RTOL = 1e-12  # ZeRO 1-3 against one process, of the largest entry (lesson 07 quotes it)


@settings(max_examples=40, deadline=None)
@given(sparsity=st.floats(0, 0.99), scope=st.sampled_from(["global", "layer"]), seed=st.integers(0, 100))
def test_exact_count_and_smallest_magnitudes_go(sparsity, scope, seed):
    rng = np.random.default_rng(seed)
    w = {"a": rng.standard_normal((7, 5)), "b": rng.standard_normal(13) * 3}
    masks = magnitude_masks(w, sparsity, scope)
    if scope == "layer":
        for k in w:
            assert (~masks[k]).sum() == round(sparsity * w[k].size)
            if masks[k].any() and (~masks[k]).any():
                assert np.abs(w[k][~masks[k]]).max() <= np.abs(w[k][masks[k]]).min()
    else:
        pruned = sum((~m).sum() for m in masks.values())
        assert pruned == round(sparsity * 48)
        kept = np.concatenate([np.abs(w[k][masks[k]]).ravel() for k in w])
        gone = np.concatenate([np.abs(w[k][~masks[k]]).ravel() for k in w])
        if kept.size and gone.size:
            assert gone.max() <= kept.min()


def test_global_prunes_small_layers_harder():
    rng = np.random.default_rng(0)
    w = {"small": rng.standard_normal((10, 10)) * 0.1, "large": rng.standard_normal((10, 10))}
    g = magnitude_masks(w, 0.5, "global")
    lay = magnitude_masks(w, 0.5, "layer")
    assert (~g["small"]).sum() > 80 and (~g["large"]).sum() < 20
    assert (~lay["small"]).sum() == (~lay["large"]).sum() == 50


def test_ties_and_bad_arguments():
    masks = magnitude_masks({"z": np.zeros((2, 4))}, 0.25, "layer")
    assert (~masks["z"]).sum() == 2  # exactly k even when every magnitude ties
    with pytest.raises(ValueError, match="sparsity=1.0"):
        magnitude_masks({"z": np.zeros(3)}, 1.0)
    with pytest.raises(ValueError, match="scope='rows'"):
        magnitude_masks({"z": np.zeros(3)}, 0.5, "rows")
    with pytest.raises(ValueError, match="non-finite"):
        magnitude_masks({"z": np.array([1.0, np.nan])}, 0.5)


def test_compressed_sizes_are_honest():
    mask = np.zeros((4, 10), bool)
    mask[:, :3] = True  # 70% sparse, 12 kept
    b = compressed_nbytes(mask)
    assert b == {"nnz": 12, "dense": 160, "csr": 12 * 8 + 5 * 4, "bitmap": 5 + 48}
    half = compressed_nbytes(np.tile([True, False], (64, 64)))
    assert half["csr"] > half["dense"]  # CSR with FP32 values and int32 indices breaks even only above 50%


def test_prunable_weights_are_the_untied_linear_weights():
    model = GPT(get_config("tiny"))
    names = sorted(prunable_weights(model))
    assert len(names) == 4 * 2 and "lm_head.weight" not in names
    assert "transformer.h.0.attn.c_attn.weight" in names


def _train(model, opt, pruner, steps, start=0):
    from minizero.data import global_batch, load_tokens, train_val_split

    train_tok, _ = train_val_split(load_tokens())
    for step in range(start, start + steps):
        x, y = global_batch(train_tok, step, 8, 16, 0)
        model(x, y)[1].backward()
        if pruner is not None:
            pruner.mask_gradients_(opt)
        opt.step()
        if pruner is not None:
            pruner.mask_weights_(opt)
        opt.zero_grad()


@pytest.mark.parametrize("opt_cls", [AdamW, Adam8bit])
def test_mask_is_kept_through_training_after_dense_steps(opt_cls):
    """Pruned after 10 dense steps: Adam's momentum would revive the weights without the re-mask."""
    model = GPT(get_config("tiny"))
    opt = opt_cls(model.parameters(), lr=1e-2)
    _train(model, opt, None, 10)
    ledger = get_ledger()
    before = ledger.current["parameters"]
    pruner = Pruner(model, 0.6, "layer")
    n = sum(p.size for p in pruner.params.values())
    assert ledger.current["parameters"] - before == pruner.report()["mask_bytes"] == sum(
        -(-p.size // 8) for p in pruner.params.values())
    pruner.prune_(opt)
    _train(model, opt, pruner, 10, start=10)
    for k, p in pruner.params.items():
        assert not p.data[~pruner.mask(k)].any()
    rep = pruner.report()
    assert rep["pruned"] == sum(round(0.6 * p.size) for p in pruner.params.values()) and rep["total"] == n
    assert rep["dense"] == 4 * n and rep["bitmap"] < rep["dense"] and rep["csr"] < rep["dense"]


# --------------------------------------------------------------------------- the main job: --prune-sparsity
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2])
def test_pruned_training_under_zero_equals_one_process(n):
    """Masks made at step 1 (after a dense step, so Adam's state must not revive them), float64:
    ZeRO 1-3 shards mask their owned gradient and parameter shards and match one process to 1e-12."""
    from minizero.comm import run_in_threads
    from tests.mpi_scripts import zero_check

    extra = ("--prune-sparsity", "0.5", "--prune-step", "1", "--prune-scope", "global")
    ref = run_in_threads(1, zero_check.run, 0, 2 * n, extra=extra)[0]
    pruned = [k for k in ref["params"] if "attn.c_attn.weight" in k or "mlp.c_fc.weight" in k]
    assert all((ref["params"][k] == 0).mean() > 0.2 for k in pruned)
    for stage in (1, 2, 3):
        for rank, got in enumerate(run_in_threads(n, zero_check.run, stage, 2, extra=extra)):
            for name, a in ref["params"].items():
                np.testing.assert_allclose(got["params"][name], a, rtol=0, atol=ZERO_RTOL * np.abs(a).max(),
                                           err_msg=f"stage {stage}, rank {rank}/{n}: {name}")
                assert ((got["params"][name] == 0) == (a == 0)).all()


def test_prune_flags_are_checked():
    from minizero.train import UsageError, parse_args

    with pytest.raises(UsageError, match="--prune-sparsity must be in"):
        parse_args(["--prune-sparsity", "1.0"])
    with pytest.raises(UsageError, match="--prune-step must be in"):
        parse_args(["--prune-sparsity", "0.5", "--steps", "10", "--prune-step", "10"])


@pytest.mark.timeout(120)
def test_main_job_says_what_the_masks_add_to_parameters():
    """The report's pruning line names the keep-masks' bytes, which the ledger counts under parameters."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    proc = subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "2", "--eval-every",
                           "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-save", "--no-progress",
                           "--prune-sparsity", "0.5"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    linear = sum(w.size for w in prunable_weights(GPT(get_config("tiny"), seed=0)).values())
    said = " ".join(proc.stdout.split())
    assert f"the keep-masks (one bit per weight) add {-(-linear // 8):,} B to parameters" in said, said[-1500:]
