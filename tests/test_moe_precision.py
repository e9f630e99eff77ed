"""MoE under ``--precision bf16`` and ``fp16`` (parallel/moe.py, memory/bf16.py, memory/precision.py).

Each layout is compared with the one process *of the same precision* (micro-batch b, D times the
micro-batches: test_moe_train.py's reference), float32, 3 steps, capacity factor 1.0 (choices are
dropped), both losses and the bias update on:

* per-expert counts and drops exactly;
* step 0's gradients, after the data-group reduction and before the optimizer. ``--ep 1 --dp 2`` is
  data parallelism: within :data:`EP1_ULPS` ulp of each tensor's largest (only sums over the ranks differ
  in order). ``--ep 2``: an expert multiplies both ranks' rows in one product, where one process runs one
  product per micro-batch, so its weight gradient is rounded to bf16/fp16 once instead of twice: within
  :data:`EP2_ULPS` ulp of each tensor's largest;
* the losses (3 steps and validation) within :data:`LOSS_TOL`; the dense bf16 and fp16 data-parallel tests
  allow 1e-6 (bf16, one reduction order: test_bf16.py) and 5e-3 (fp16 in 3D: test_3d.py).

Parameters after the steps are not compared: Adam turns the rounding-level differences of gradients that
are numerically zero (the attention key bias's) into lr-sized steps (test_zero_bubble.py leaves FP16's out
for the same reason). The gradients are compared with FP32 MoE's too: close, and not equal (the precision
applies; under FP16 the MoE losses carry the loss scale, which a reference of the same precision cannot show).
"""
import numpy as np
import pytest

from minizero import backend
from minizero.comm import run_in_threads
from minizero.loop import train
from minizero.parallel.expert_parallel import is_expert
from minizero.train import parse_args

BASE = ["--model", "tiny", "--dtype", "float32", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
        "--progress", "none", "--lr", "1e-2", "--seed", "3", "--no-save", "--micro-batch-size", "2",
        "--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "1.0", "--moe-aux-loss", "0.1",
        "--moe-z-loss", "0.01", "--moe-bias-update", "0.01"]
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  #: unit roundoff (half an ulp at 1) of each format
EP1_ULPS, EP2_ULPS = 1, 2  #: measured 0.4 and 0.8 (both formats)
LOSS_TOL = {"bf16": 1e-3, "fp16": 1e-4}  #: measured 1.6e-4 and 9.3e-6 at --ep 2
NORM_RTOL = {"bf16": 5e-3, "fp16": 5e-4}  #: the global gradient norm; measured 6.5e-4 and 7.3e-5


def _host(a):
    return backend.to_host(a).astype(np.float64)


def _train(comm, flags, callbacks=()):
    grads, snaps = {}, {}

    def after_grads(step, params, opt):
        if step == 0:
            grads.update({id(p): _host(p.grad) for p in params if p.grad is not None})
        if getattr(opt, "masters", None) is not None:  # FP16 (AdamW): the optimizer's state before each update
            snaps[step] = [_host(a) for a in opt.masters + opt.m + opt.v]

    args = parse_args([*BASE, *flags], comm.world_size)
    out = train(args, comm, log=lambda s: None, after_grads=after_grads, callbacks=callbacks)
    named = {n: (grads[id(p)], is_expert(p)) for n, p in out.strategy.stage.named_parameters() if id(p) in grads}
    state = None if out.model is None else {k: _host(v) for k, v in out.model.state_dict().items()}
    return dict(state=state, load=out.strategy.expert_load.total, grads=named, snaps=snaps, result=out,
                losses=out.train_losses + [v for _, v in out.val_history])


def _whole_grads(ranks):
    """Step 0's gradients by name; experts' slices concatenated over the expert group (ranks 0..ep-1 here)."""
    first = ranks[0]["grads"]
    return {n: np.concatenate([r["grads"][n][0] for r in ranks]) if expert else g for n, (g, expert) in first.items()}


_REF = {}


def _reference(precision):
    """One process, --grad-accum 2 (the two data ranks' micro-batches)."""
    if precision not in _REF:
        flags = [] if precision == "fp32" else ["--precision", precision]
        _REF[precision] = run_in_threads(1, _train, flags + ["--grad-accum", "2"], timeout=240)
    return _REF[precision]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_precision_layout_equals_one_process_of_that_precision(precision, ep):
    ref = _reference(precision)
    got = run_in_threads(2, _train, ["--precision", precision, "--ep", str(ep)], timeout=240)
    for i, counts in ref[0]["load"].items():
        for r in got:
            assert r["load"][i].tolist() == counts.tolist(), i  # counts and drops, exactly
    assert sum(t[-1] for t in ref[0]["load"].values()) > 0  # choices were dropped
    want, have = _whole_grads(ref), _whole_grads([got[0]] if ep == 1 else got)
    assert set(want) == set(have)
    ulps = EP1_ULPS if ep == 1 else EP2_ULPS
    for name, a in want.items():
        np.testing.assert_allclose(have[name], a, rtol=0, atol=ulps * 2 * EPS[precision] * np.abs(a).max(),
                                   err_msg=name)
    np.testing.assert_allclose(got[0]["losses"], ref[0]["losses"], rtol=0, atol=LOSS_TOL[precision])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_precision_reaches_the_experts_and_the_router(precision):
    """Step 0's gradients (FP16's divided by its loss scale) against FP32 MoE's: within 8 unit roundoffs of each
    tensor's largest (measured 2.2 bf16, 2.6 fp16; without the loss scale in the MoE losses' seed the router's
    are ~100% off), yet different in every MoE parameter; the final weights differ too."""
    low, fp32 = _reference(precision)[0], _reference("fp32")[0]
    scale = low["result"].loss_scales[0] if precision == "fp16" else 1.0
    for name, (g32, _) in fp32["grads"].items():
        g = low["grads"][name][0] / scale
        np.testing.assert_allclose(g, g32, rtol=0, atol=8 * EPS[precision] * np.abs(g32).max(), err_msg=name)
        if ".moe." in name:
            assert np.abs(g - g32).max() > 0, name
    assert max(np.abs(low["state"][k] - v).max() for k, v in fp32["state"].items() if ".moe." in k) > 1e-6


@pytest.mark.timeout(300)
def test_fp16_moe_overflow_on_one_rank_skips_the_step_everywhere(monkeypatch):
    """--ep 2: rank 1's gradients (experts included) made inf at step 2; both ranks skip it, the scale halves,
    and the optimizer's state (masters, m, v) before step 3 is the state before step 2."""
    monkeypatch.setenv("MINIZERO_FAULT", "1:2:inf")
    res = run_in_threads(2, _train, ["--precision", "fp16", "--ep", "2", "--steps", "5", "--initial-loss-scale",
                                     "1024"], None, timeout=240)
    for r in res:
        out = r["result"]
        assert out.skipped_steps == 1 and out.loss_scales == [1024.0] * 3 + [512.0] * 2
        assert np.isnan(out.grad_norms[2]) and np.isfinite(np.delete(out.grad_norms, 2)).all()
        assert out.opt.step_count == 4
        for a, b in zip(r["snaps"][2], r["snaps"][3]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("flags", [["--ep", "2", "--recompute", "full"], ["--pp", "2"], ["--zero", "3"],
                                   ["--ep", "2", "--zero", "1"], ["--ep", "2", "--zero", "3"]],
                         ids=["ep2-recompute-full", "pp2", "zero3-dp2", "ep2-zero1", "ep2-zero3"])
def test_moe_precision_composes_with_recompute_pipeline_and_zero(precision, flags):
    """The same counts exactly and the same losses (LOSS_TOL) as the one process of that precision."""
    ref = _reference(precision)[0]
    got = run_in_threads(2, _train, ["--precision", precision, *flags], timeout=240)[-1]  # pp: the last stage
    for i, counts in ref["load"].items():
        assert got["load"][i].tolist() == counts.tolist(), i
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=0, atol=LOSS_TOL[precision])
    # the global gradient norm: an expert gradient scaled wrong (ExpertZero's 1/ep under FP16) changes it
    np.testing.assert_allclose(got["result"].grad_norms, ref["result"].grad_norms, rtol=NORM_RTOL[precision])
