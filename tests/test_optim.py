"""AdamW, the LR schedule and clipping against references written here, apart from minizero/optim/adamw.py.

Every technique test compares with a one-process run that uses the same AdamW, so those tests cannot see a wrong
update rule; these can. References: Loshchilov & Hutter 2019, Algorithm 2, in torch.optim.AdamW's order (decay
p *= 1 - lr wd first, then the bias-corrected Adam step); float64, so they agree to rounding (1e-14 of the largest).
"""
import math

import numpy as np
import pytest

from minizero.nn.module import Parameter
from minizero.optim import AdamW, clip_grad_norm_, cosine_lr


def reference_adamw(p, grads, lrs, beta1, beta2, eps, wd):
    """Element by element, as the paper's pseudo-code: the parameter after len(grads) steps (Python floats)."""
    out = []
    for i, x in enumerate(p.ravel().tolist()):
        m = v = 0.0
        for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
            gi = g.ravel()[i]
            x = x - lr * wd * x
            m = beta1 * m + (1 - beta1) * gi
            v = beta2 * v + (1 - beta2) * gi * gi
            m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
            x = x - lr * m_hat / (math.sqrt(v_hat) + eps)
        out.append(x)
    return np.array(out).reshape(p.shape)


def test_adamw_steps_equal_the_paper_s_algorithm_with_nanogpt_decay_grouping():
    """4 steps at changing learning rates; the 2-D weight decays, the 1-D bias does not; a parameter whose grad is
    None is left as it was (no decay either, as PyTorch)."""
    rng = np.random.default_rng(0)
    w, b, frozen = Parameter(rng.standard_normal((3, 4))), Parameter(rng.standard_normal(5)), Parameter(np.ones((2, 2)))
    w0, b0 = w.data.copy(), b.data.copy()
    lrs, betas, eps, wd = [1e-2, 3e-2, 2e-2, 5e-3], (0.9, 0.95), 1e-8, 0.1
    opt = AdamW([w, b, frozen], lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    gw = [rng.standard_normal(w.shape) * 10.0 ** -k for k in range(4)]  # shrinking: v's bias correction matters
    gb = [rng.standard_normal(b.shape) for _ in range(4)]
    for t in range(4):
        w.grad, b.grad = gw[t].copy(), gb[t].copy()
        opt.set_lr(lrs[t])
        opt.step()
    for got, want in ((w.data, reference_adamw(w0, gw, lrs, *betas, eps, wd)),
                      (b.data, reference_adamw(b0, gb, lrs, *betas, eps, 0.0))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-14 * np.abs(want).max())
    np.testing.assert_array_equal(frozen.data, np.ones((2, 2)))


def test_adamw_first_step_is_decay_then_lr_times_the_gradient_sign():
    """t = 1: m_hat = g and v_hat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps), whatever the betas."""
    p = Parameter(np.array([[2.0, -1.0], [0.5, 3.0]]))
    g = np.array([[4.0, -1e-3], [0.0, 2.5e-9]])
    p.grad = g.copy()
    AdamW([p], lr=0.1, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.5).step()
    want = np.array([[2.0, -1.0], [0.5, 3.0]]) * (1 - 0.1 * 0.5) - 0.1 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(p.data, want, rtol=1e-15, atol=0)


def test_a_float16_parameter_without_masters_decays_and_steps_as_float32_rounded_once():
    """p float16, state float32: each step is the float32 step (decay, then Adam) from the same p, rounded to float16
    once; bit for bit, for the decayed 2-D weight and the undecayed bias."""
    rng = np.random.default_rng(3)
    w16, b16 = Parameter(rng.standard_normal((4, 8)).astype(np.float16)), Parameter(np.ones(8, np.float16))
    w32, b32 = Parameter(w16.data.astype(np.float32)), Parameter(b16.data.astype(np.float32))
    kw = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)
    opt16, opt32 = AdamW([w16, b16], **kw), AdamW([w32, b32], **kw)
    for _ in range(3):
        grads = [rng.standard_normal(p.shape).astype(np.float16) for p in (w16, b16)]
        for p16, p32, g in zip((w16, b16), (w32, b32), grads):
            p16.grad, p32.grad = g.copy(), g.astype(np.float32)
            p32.data[...] = p16.data  # the same float16 start
        opt16.step()
        opt32.step()
        for p16, p32 in ((w16, w32), (b16, b32)):
            assert p16.data.dtype == np.float16
            np.testing.assert_array_equal(p16.data, p32.data.astype(np.float16))


def test_cosine_schedule_at_hand_computed_steps():
    """Warmup 4 to max 1.0, cosine to 0.1 at step 12: linear (step + 1) / 4, then 0.1 + 0.45 (1 + cos(pi r))."""
    got = [cosine_lr(s, 1.0, 4, 12, 0.1) for s in (0, 1, 3, 4, 8, 10, 12, 50)]
    want = [0.25, 0.5, 1.0, 1.0, 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1, 0.1]
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_clipping_scales_to_max_norm_over_all_gradients_and_returns_the_norm_before():
    """Gradients (3, 4) and (12,): global norm 13 (3-4-5 then 5-12-13); clipped to 6.5 every element halves
    (coefficient 6.5 / (13 + 1e-6), torch's epsilon); a max above the norm leaves them alone."""
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0, 4.0]), np.array([12.0])
    assert clip_grad_norm_([a, b], 6.5) == 13.0
    coef = 6.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(np.concatenate([a.grad, b.grad]), [3 * coef, 4 * coef, 12 * coef], rtol=1e-15)
    assert abs(clip_grad_norm_([a, b], 100.0) - 13.0 * coef) <= 1e-15 * 13.0
    np.testing.assert_allclose(np.concatenate([a.grad, b.grad]), [3 * coef, 4 * coef, 12 * coef], rtol=1e-15)


def test_adamw_takes_numpy_hyper_parameters_as_floats_and_still_refuses_bools_strings_nan():
    """Before: a 0-d array lr and betas as a length-2 ndarray (what PyTorch-style code passes) were refused."""
    p = Parameter(np.ones(2))
    opt = AdamW([p], lr=np.array(1e-3), betas=np.array([0.9, 0.95]), eps=np.float64(1e-8), weight_decay=np.int64(0))
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (1e-3, (0.9, 0.95), 1e-8, 0.0)
    assert all(type(v) is float for v in (opt.lr, *opt.betas, opt.eps, opt.weight_decay))
    for kw in ({"lr": np.array(True)}, {"lr": np.bool_(True)}, {"lr": np.array("1")}, {"lr": np.array(np.nan)},
               {"lr": np.array([1e-3])}, {"betas": np.array([0.9, 1.0])}, {"betas": np.array([[0.9, 0.95]])},
               {"lr": True}, {"lr": "1e-3"}):
        with pytest.raises(ValueError, match=r"AdamW: need finite lr >= 0.* got lr="):
            AdamW([p], **kw)


def test_the_loops_clip_coefficient_never_scales_gradients_up():
    """The loop folds ``clip_coefficient`` into the update itself (no ``coef < 1`` test around it): a norm below the
    max gives exactly 1. (Round-2 mutant: the coefficient without its min(1, .) survived.)"""
    from minizero.optim import clip_coefficient
    assert clip_coefficient(13.0, 6.5) == 6.5 / (13.0 + 1e-6)
    assert [clip_coefficient(n, 1.0) for n in (0.0, 0.5, 1.0 - 1e-6)] == [1.0, 1.0, 1.0]
    assert clip_coefficient(5.0, 0.0) == clip_coefficient(5.0, math.inf) == 1.0


def test_grad_scale_is_the_gradient_s_factor_in_every_moment():
    """step(grad_scale=c) (the loop's clip coefficient / loss scale) equals the paper's algorithm on c * g, c changing
    per step. (Mutant: grad_scale ignored survived every test: Adam divides m by sqrt(v), so a constant factor cancels
    but for eps; a factor changing per step, as clipping's does, does not.)"""
    rng = np.random.default_rng(5)
    w = Parameter(rng.standard_normal((3, 5)))
    w0 = w.data.copy()
    grads, scales = [rng.standard_normal(w.shape) for _ in range(4)], [0.5, 1.0, 1e-3, 3.0]
    opt = AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g, c in zip(grads, scales):
        w.grad = g.copy()
        opt.step(grad_scale=c)
    want = reference_adamw(w0, [g * c for g, c in zip(grads, scales)], [1e-2] * 4, 0.9, 0.95, 1e-8, 0.1)
    np.testing.assert_allclose(w.data, want, rtol=0, atol=1e-14 * np.abs(want).max())


def test_the_global_norm_of_float32_gradients_is_summed_in_float64_and_skips_none():
    """Squares of 3e20 and 4e20 overflow float32 (max 3.4e38): summed in the gradients' own dtype the norm was inf and
    clipping zeroed every gradient; a frozen parameter (grad None) beside them is left alone while the rest clip."""
    a, b, frozen = Parameter(np.zeros(2, np.float32)), Parameter(np.zeros(1, np.float32)), Parameter(np.zeros(3))
    a.grad, b.grad = np.array([3e20, 4e20], np.float32), np.array([0.0], np.float32)
    exact = math.hypot(*a.grad.astype(np.float64).tolist())
    assert abs(clip_grad_norm_([a, frozen, b], 1.0) - exact) <= 1e-15 * exact
    assert frozen.grad is None and a.grad.dtype == np.float32
    np.testing.assert_allclose(a.grad, np.array([3e20, 4e20]) / exact, rtol=1e-6)


@pytest.mark.parametrize("kw", [{"eps": 0.0}, {"betas": (1.0, 0.95)}, {"lr": -1e-3}, {"weight_decay": -0.1}])
def test_each_bound_of_the_hyper_parameters_is_refused_at_its_edge(kw):
    """eps 0 makes a zero gradient's update 0/0 = NaN, beta1 1 a bias correction of 0; the refusals were tested for
    beta2 = 1 and NaN only, and 'eps >= 0' or 'beta1 <= 1' survived."""
    from minizero.optim.adam8bit import Adam8bit
    for cls in (AdamW, Adam8bit):
        with pytest.raises(ValueError, match=f"{cls.__name__}: need finite lr >= 0"):
            cls([Parameter(np.ones(2))], **kw)
