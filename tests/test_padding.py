"""Padded batches (issue 26, section 4): ``ignore_index``, the global token count, --pad.

The loss leaves out targets equal to -100 (PyTorch's ``ignore_index``); a training step divides
by the number of real targets in the *global* batch, so any layout and any accumulation equal
one process on the whole batch in float64 (the mean of per-micro-batch means does not).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.autograd import Tensor
from minizero.autograd import functional as F
from minizero.comm import run_in_threads
from minizero.data import (DOCUMENT_SEPARATOR, DistributedSampler, builtin_corpus, document_ends, encode,
                           eval_batches, global_batch)
from minizero.nn import get_config
from minizero.parallel.strategy import build_strategy
from minizero.parallel.vocab_parallel import vocab_parallel_cross_entropy
from minizero.train import parse_args
from tests.conftest import REPO_ROOT, mpi_env

IGNORE = -100


def hand_ce(z, t):
    """Mean -log softmax(z)[t] over rows with t != -100, and its gradient (ignored rows zero), in float64."""
    keep = t != IGNORE
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    rows = np.flatnonzero(keep)
    loss = -logp[rows, t[rows]].sum() / len(rows)
    grad = np.exp(logp)
    grad[rows, t[rows]] -= 1
    grad[~keep] = 0
    return loss, grad / len(rows)


def both_losses(z, t, **kw):
    """(loss, gradient) of the plain cross-entropy, and per rank of the vocabulary-parallel one on 2 threads."""
    zt = Tensor(z.copy(), requires_grad=True)
    loss = F.cross_entropy(zt, t, **kw)
    loss.backward()
    v = z.shape[1] // 2

    def rank(comm):
        logits = Tensor(np.ascontiguousarray(z[:, comm.rank * v:(comm.rank + 1) * v]), requires_grad=True)
        vl = vocab_parallel_cross_entropy(logits, t, comm, comm.rank * v, **kw)
        vl.backward()
        return vl.item(), logits.grad
    out = run_in_threads(2, rank)
    return (loss.item(), zt.grad), ([o[0] for o in out], np.concatenate([o[1] for o in out], axis=1))


def test_ignored_targets_leave_the_mean_and_get_exactly_zero_gradient():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(9, 8)) * 3
    t = np.array([1, IGNORE, 7, 0, IGNORE, IGNORE, 3, 5, IGNORE])
    want_loss, want_grad = hand_ce(z, t)
    (loss, grad), (vlosses, vgrad) = both_losses(z, t)
    for got_loss, got_grad in [(loss, grad)] + [(vl, vgrad) for vl in vlosses]:
        assert abs(got_loss - want_loss) <= 1e-12 * want_loss
        np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=1e-12)
        assert np.all(got_grad[t == IGNORE] == 0)  # exactly zero, not rounding-small
    # the same as dropping the ignored rows first
    keep = t != IGNORE
    (kept_loss, kept_grad), _ = both_losses(z[keep], t[keep])
    assert abs(kept_loss - loss) <= 1e-13 * loss
    np.testing.assert_allclose(grad[keep], kept_grad, rtol=0, atol=1e-14)


def test_every_target_ignored_is_nan_with_zero_gradient_as_pytorch():
    """PyTorch's mean over zero targets is 0/0 = NaN and its backward writes nothing (zeros); a training step
    never divides by that count: it weighs each micro-batch by its real targets (test below)."""
    z = np.random.default_rng(1).normal(size=(4, 6))
    t = np.full(4, IGNORE)
    (loss, grad), (vlosses, vgrad) = both_losses(z, t)
    assert np.isnan(loss) and all(np.isnan(vl) for vl in vlosses)
    assert np.all(grad == 0) and np.all(vgrad == 0)


def test_another_ignore_index_as_pytorch():
    """ignore_index may be any value, a class among them (here 0)."""
    z = np.random.default_rng(2).normal(size=(5, 4))
    t = np.array([0, 1, 0, 3, 2])
    (loss, grad), (vlosses, _) = both_losses(z, t, ignore_index=0)
    want_loss, want_grad = hand_ce(z, np.where(t == 0, IGNORE, t))
    assert abs(loss - want_loss) <= 1e-12 * want_loss and abs(vlosses[1] - want_loss) <= 1e-12 * want_loss
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="target -100 at position 1"):
        F.cross_entropy(Tensor(z), np.array([0, IGNORE, 1, 1, 1]), ignore_index=0)


# --------------------------------------------------------------------------- documents: --pack / --pad
def test_padded_windows_stop_at_their_document_end():
    tokens = encode("hello world\x03ab\x03the third document is longer than a window\x03x y z")
    ends = document_ends(tokens)
    px, py = global_batch(tokens, 0, 64, 8, 0)
    x, y = global_batch(tokens, 0, 64, 8, 0, ends)
    for r in range(64):
        real = y[r] != IGNORE
        n = int(real.sum())
        assert n >= 1 and real[:n].all() and not real[n:].any()  # a prefix of real targets, then padding
        np.testing.assert_array_equal(x[r][:n], px[r][:n])  # the same window start as packed
        np.testing.assert_array_equal(y[r][:n], py[r][:n])
        assert (x[r][n:] == DOCUMENT_SEPARATOR).all()
        cut = np.flatnonzero(py[r] == DOCUMENT_SEPARATOR)
        assert n == (cut[0] + 1 if len(cut) else 8)  # the separator is the last real target
    assert (y == IGNORE).any() and (y != IGNORE).all(axis=1).any()


def test_sampler_and_validation_follow_the_same_rule():
    tokens = encode("".join(f"doc {i} " * (i % 5 + 1) + "\x03" for i in range(300)))
    s = DistributedSampler(tokens, 16, 2, 2, dp_rank=1, dp_size=2, seed=4, pad=True)
    gx, gy = global_batch(tokens, 3, 8, 16, 4, document_ends(tokens))
    got = list(s.micro_batches(3))
    np.testing.assert_array_equal(got[1][1], gy[6:8])  # micro-step 1, rank 1: rows (1 * 2 + 1) * 2
    v = eval_batches(tokens, 16, 2, 4, seed=9, pad=True)
    np.testing.assert_array_equal(v[1][1], global_batch(tokens, 1, 4, 16, 9, document_ends(tokens))[1])
    assert (v[1][1] == IGNORE).any()
    assert not (eval_batches(tokens, 16, 2, 4, seed=9)[1][1] == IGNORE).any()  # --pack (the default): none


def test_pad_is_refused_with_pack_and_stated_in_help():
    with pytest.raises(UsageError, match="--pad: not allowed with argument --pack"):
        parse_args(["--pack", "--pad"], 1)
    assert parse_args([], 1).documents == "pack" and parse_args(["--pad"], 1).documents == "pad"
    out = subprocess.run([sys.executable, "-m", "minizero.train", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT).stdout
    assert "0x03" in out and "--pad" in out and "--pack" in out


# --------------------------------------------------------------------------- the global count
@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A --data file of short documents (1-6 words, ended by 0x03): most 16-token windows hold padding."""
    rng = np.random.default_rng(0)
    words, out, i = builtin_corpus().split(), [], 0
    while sum(len(d) + 1 for d in out) < 20000:
        n = int(rng.integers(1, 7))
        out.append(" ".join(words[i:i + n]))
        i += n
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\x03".join(out) + "\x03")
    return str(path)


def _step_grads(comm, data, splits, rule):
    """One float64 process: gradients of one step on a padded 4-row batch cut into micro-batches at ``splits``."""
    args = parse_args(["--model", "tiny", "--dtype", "float64", "--data", data, "--pad", "--block-size", "16"], 1)
    cfg = get_config("tiny", dtype="float64", block_size=16)
    s = build_strategy(args, comm, cfg)
    x, y = global_batch(encode(open(data).read()), 0, 4, 16, 5, document_ends(encode(open(data).read())))
    mbs = [(x[a:b], y[a:b]) for a, b in zip([0, *splits], [*splits, 4])]
    if rule == "global":
        s.forward_backward(mbs)
    else:  # the mean of the micro-batches' means: the bug kind
        s.engine.forward_backward(mbs)
    s.reduce_gradients()
    return {n: p.grad.copy() for n, p in s.stage.named_parameters()}, [int((b != IGNORE).sum()) for _, b in mbs]


@pytest.mark.timeout(120)
def test_accumulation_equals_the_whole_batch_only_with_the_global_count(docs):
    whole, _ = run_in_threads(1, _step_grads, docs, [], "global")[0]
    split, counts = run_in_threads(1, _step_grads, docs, [1], "global")[0]
    means, _ = run_in_threads(1, _step_grads, docs, [1], "mean of means")[0]
    assert counts[0] * 3 != counts[1], counts  # unequal micro-batches: the mean of means weighs them wrongly
    worst = max(np.abs(means[n] - whole[n]).max() / np.abs(whole[n]).max() for n in whole)
    assert worst > 1e-3, worst
    for n, g in whole.items():
        np.testing.assert_allclose(split[n], g, rtol=0, atol=1e-12 * np.abs(g).max(), err_msg=n)


#: (flags of the layout, micro-batch per data rank, data ranks x context ranks, micro-batches m, world size)
LAYOUTS = {
    "dp2": (["--dp", "2"], 2, 2, 1, 2),
    "grad-accum2": ([], 2, 1, 2, 1),
    "tp2": (["--tp", "2"], 4, 1, 1, 2),
    "pp2": (["--pp", "2"], 2, 1, 2, 2),
    "cp2": (["--cp", "2"], 4, 1, 1, 2),
    "dp2-tp2-pp2-zero1": (["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1"], 1, 2, 2, 8),
}


def _run_layout(comm, flags, b, m, extra):
    args = R.base_argv("tiny", b, extra) + flags + ["--micro-batches" if "--pp" in flags else "--grad-accum", str(m)]
    res = R.train(parse_args(args, comm.world_size), comm, log=lambda s: None)
    full = res["model"]
    return None if full is None else ({n: p.data.copy() for n, p in full.named_parameters()},
                                      np.array(res["train_losses"]), res["val_history"][-1][1])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_padded_run_equals_one_process_on_the_whole_batch(docs, layout):
    """float64, 3 steps, clipping on: parameters, training and validation losses as one process with the
    step's whole global batch in one micro-batch."""
    flags, b, d, m, world = LAYOUTS[layout]
    extra = ["--data", docs, "--pad"]
    ref = run_in_threads(1, _run_layout, [], b * d * m, 1, extra, timeout=300)[0]
    got = [r for r in run_in_threads(world, _run_layout, flags, b, m, extra, timeout=300) if r is not None]
    assert len(got) >= 1
    for params, losses, val in got:
        for n, a in ref[0].items():
            np.testing.assert_allclose(params[n], a, rtol=0, atol=1e-12 * np.abs(a).max(), err_msg=f"{layout}: {n}")
        np.testing.assert_allclose(losses, ref[1], rtol=1e-13, err_msg=f"{layout}: training losses")
        np.testing.assert_allclose(val, ref[2], rtol=1e-13, err_msg=f"{layout}: validation loss")


@pytest.mark.timeout(300)
def test_a_padded_run_under_mpiexec_equals_one_process(mpiexec, docs, tmp_path):
    """dp 2 x cp 2 with 2 micro-batches under mpiexec, against one process on the same global batches."""
    base = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3", "--block-size", "16",
            "--data", docs, "--pad"]
    outs = {}
    for name, n, flags in [("par", 4, ["--dp", "2", "--cp", "2", "--micro-batch-size", "2", "--grad-accum", "2"]),
                           ("one", 1, ["--micro-batch-size", "8"])]:
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "minizero.train", *base, *flags,
               "--out", str(tmp_path / name), "--json", str(tmp_path / f"{name}.json")]
        proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "documents (ended by byte 0x03) padded (--pad)" in " ".join(proc.stdout.split())  # wrapped at 100
        outs[name] = dict(np.load(os.path.join(tmp_path / name, "model.npz")))
    for k, a in outs["one"].items():
        np.testing.assert_allclose(outs["par"][k], a, rtol=0, atol=3e-12 * np.abs(a).max(), err_msg=k)


def test_targets_ignored_without_pad_are_refused_not_averaged_per_micro_batch():
    def rank(comm):
        args = parse_args(["--model", "tiny", "--dtype", "float64", "--block-size", "16"], 1)
        s = build_strategy(args, comm, get_config("tiny", dtype="float64", block_size=16))
        y = np.zeros((1, 16), np.int64)
        y[0, 5:] = IGNORE
        with pytest.raises(ValueError, match="padded=True"):
            s.forward_backward([(np.zeros((1, 16), np.int64), y)])
        return True
    assert run_in_threads(1, rank)


def test_ignored_targets_under_the_strict_array_module(strict_backend):
    """The device path: no host transfer in the loss or its backward, the same bits as NumPy."""
    rng = np.random.default_rng(3)
    z = rng.normal(size=(6, 8)).astype(np.float32)
    t = np.array([1, IGNORE, 7, IGNORE, 3, 5])
    results = []
    for name in ["strict", "numpy"]:
        strict_backend.set_backend(name)
        zt = Tensor(strict_backend.xp.asarray(z), requires_grad=True)
        loss = F.cross_entropy(zt, strict_backend.xp.asarray(t))
        loss.backward()
        results.append((strict_backend.to_host(loss.data).tobytes(), strict_backend.to_host(zt.grad).tobytes()))
    assert results[0] == results[1]


def _fp16_grads0(comm, flags, b, extra):
    """Step 0's averaged gradients (float32 copies, loss scale S still in them) of this rank, FP16 on."""
    grads = {}

    def after_grads(step, params, opt=None):
        if step == 0:
            grads.update({i: p.grad.astype(np.float32) for i, p in enumerate(params)})
    argv = R.base_argv("tiny", b, extra) + flags + ["--precision", "fp16", "--steps", "1"]
    args = parse_args([a if a != "float64" else "float32" for a in argv], comm.world_size)
    R.train(args, comm, log=lambda s: None, after_grads=after_grads)
    return grads


@pytest.mark.timeout(200)
def test_fp16_seed_follows_the_global_count(docs):
    """FP16 seeds backward with S n_i / N on every data rank (the data group then sums): dp 2 x 2 micro-batches
    equal one process to float16 rounding; a per-rank or per-micro-batch normalisation is off by far more."""
    extra = ["--data", docs, "--pad"]
    ref = run_in_threads(1, _fp16_grads0, [], 8, extra, timeout=150)[0]
    got = run_in_threads(2, _fp16_grads0, ["--dp", "2", "--grad-accum", "2"], 2, extra, timeout=150)
    for g in got:
        for i, a in ref.items():
            np.testing.assert_allclose(g[i], a, rtol=0, atol=2e-2 * np.abs(a).max(), err_msg=f"parameter {i}")


def _header(comm, argv):
    lines = []
    R.train(parse_args(R.base_argv("tiny", 2, argv) + ["--steps", "1", "--sample-tokens", "1"], 1), comm,
            log=lines.append)
    return " ".join(" ".join(lines).split())


def test_the_header_names_the_data_file_its_size_and_its_documents(docs, tmp_path):
    """Before: "documents (ended by byte 0x03) packed (--pack)" of a file without one, and no file name or size."""
    from minizero.data import count_documents
    assert [count_documents(encode(t)) for t in ("one", "one\x03", "one\x03two", "one\x03two\x03")] == [1, 1, 2, 2]
    plain = tmp_path / "plain.txt"
    plain.write_text(builtin_corpus()[:5000])
    size = os.path.getsize(plain)
    said = run_in_threads(1, _header, ["--data", str(plain)])[0]
    assert f"--data {str(plain)!r} ({size:,} bytes): one document (no 0x03 byte splits it)" in said, said
    assert "packed" not in said
    n = count_documents(np.fromfile(docs, np.uint8))
    said = run_in_threads(1, _header, ["--data", docs, "--pad"])[0]
    assert f"({os.path.getsize(docs):,} bytes): {n:,} documents (ended by byte 0x03) padded (--pad)" in said, said
