"""FlashAttention (nn/flash_attention.py) equals the dense core in float64: forward, every gradient, dropout,
through the command line and under tp, sp, pp and recompute; its saved bytes equal the estimator's."""
import numpy as np
import pytest

from minizero.autograd import Tensor, manual_seed
from minizero.autograd.rng import MaskStream, dropout_keep_mask, get_rng_state, set_rng_state
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.attribution import layer_bytes, saved_by_module
from minizero.memory.estimator import layer_activation_bytes
from minizero.memory.recompute import apply_recompute
from minizero.nn import GPT, Dropout, get_config
from minizero.nn.flash_attention import FlashAttentionCore, check_block, flash_attention, use_flash_attention
from minizero.nn.gpt import DenseAttentionCore
from minizero.parallel.pipeline import PipelineStage
from minizero.parallel.tensor_parallel import HeadParallelDropout

TOL = 1e-12


def _run(core, qkv, g, dropout, seed=5):
    manual_seed(seed)
    ts = [Tensor(a.copy(), requires_grad=True) for a in qkv]
    y = core(*ts, dropout)
    (y * Tensor(g)).sum().backward()
    return [y.data] + [t.grad for t in ts], get_rng_state()


@pytest.mark.parametrize("t", [1, 7, 16])
@pytest.mark.parametrize("block", [1, 3, 4, 16, 40])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_flash_equals_dense_forward_and_every_gradient(t, block, p):
    rng = np.random.default_rng(t * 100 + block)
    qkv = [rng.standard_normal((2, 3, t, 5)) for _ in range(3)]
    g = rng.standard_normal((2, 3, t, 5))
    dense, state_d = _run(DenseAttentionCore(), qkv, g, Dropout(p))
    flash, state_f = _run(FlashAttentionCore(block), qkv, g, Dropout(p))
    assert state_d == state_f  # the generator advanced by the whole (B, H, T, T) mask either way
    for name, a, b in zip(["out", "dq", "dk", "dv"], dense, flash):
        assert np.abs(a - b).max() <= TOL, name


def test_dropout_changes_the_result_so_the_mask_comparison_can_fail():
    rng = np.random.default_rng(1)
    qkv = [rng.standard_normal((1, 2, 9, 4)) for _ in range(3)]
    g = rng.standard_normal((1, 2, 9, 4))
    dense, _ = _run(DenseAttentionCore(), qkv, g, Dropout(0.3), seed=5)
    other, _ = _run(FlashAttentionCore(4), qkv, g, Dropout(0.3), seed=6)  # another stretch of the stream
    assert np.abs(dense[0] - other[0]).max() > 1e-3


def test_head_parallel_dropout_reads_its_heads_of_every_heads_mask():
    """tp: a rank's flash core keeps the unsplit model's mask for its heads [lo, lo + h)."""
    manual_seed(3)
    start = get_rng_state()
    full = dropout_keep_mask((2, 4, 6, 6), 0.25)
    end = get_rng_state()
    set_rng_state(start)
    stream = HeadParallelDropout(0.25, 4, 2).reserve_mask((2, 2, 6, 6))
    assert get_rng_state() == end
    got = stream.block((slice(0, 2), slice(0, 2), slice(3, 6), slice(0, 4)))
    np.testing.assert_array_equal(got, full[:, 2:4, 3:6, 0:4])
    assert Dropout(0.25).eval().reserve_mask((1, 1, 2, 2)) is None
    assert isinstance(Dropout(0.25).reserve_mask((1, 1, 2, 2)), MaskStream)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, None])
def test_bad_block_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="positive integer"):
        check_block(bad)
    with pytest.raises(ValueError, match="positive integer"):
        FlashAttentionCore(bad)
    x = Tensor(np.zeros((1, 1, 2, 2)))
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(").replace(".", r"\.")):
        flash_attention(x, x, x, bad)


def test_a_numpy_integer_block_is_taken_as_recompute_every_is():
    """np.int64(8) was refused as not an integer (recompute's ``every`` took it): a plain int 8 now."""
    got = check_block(np.int64(8))
    assert got == 8 and type(got) is int
    with pytest.raises(ValueError, match="positive integer"):
        check_block(np.int64(0))


def _layer_bytes(cfg, b, mode, attention):
    set_ledger(MemoryLedger())
    stage = PipelineStage(GPT(cfg, seed=0), 0, 1)
    if attention == "flash":
        use_flash_attention(stage, 8)
    apply_recompute(stage, mode)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, cfg.block_size))
    got = saved_by_module(stage, x, x)
    assert not any(k.endswith(":scores") for k, v in got.items() if v) or attention == "dense"
    return layer_bytes(got, "transformer.h.0")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_measured_bytes_per_layer_equal_the_flash_formula(mode, dropout):
    cfg, b, s = get_config("default", dtype="float64", block_size=24, dropout=dropout), 2, 24
    kw = dict(recompute=mode, accounting="minizero", precision="fp64")
    flash = _layer_bytes(cfg, b, mode, "flash")
    assert flash == layer_activation_bytes(cfg, s, b, attention="flash", **kw)
    dense = _layer_bytes(cfg, b, mode, "dense")
    assert dense == layer_activation_bytes(cfg, s, b, **kw)
    if mode == "none":  # the (s, s) rows (probabilities, mask, dropout output) out; output + log-sum-exp in
        a, h, copies = cfg.n_head, cfg.n_embd, (2 * 8 + 1 if dropout else 8)
        assert dense - flash == copies * a * s * s * b - (8 * s * b * h + 8 * a * s * b)


def test_flash_formula_drops_korthikantis_s_squared_term():
    """paper accounting, GPT-3-like layer with dropout: dense - flash = 5as^2b - (2sbh + 4asb) exactly."""
    from minizero.memory.estimator import ModelShape
    m = ModelShape(name="t", n_layer=1, hidden=1024, n_head=16, n_kv_head=16, ffn_hidden=4096, vocab_size=1000,
                   seq_len=4096, dropout=True)
    s, b, a, h = 4096, 1, 16, 1024
    dense = layer_activation_bytes(m, s, b)
    flash = layer_activation_bytes(m, s, b, attention="flash")
    assert dense == s * b * h * 34 + 5 * a * s * s * b
    assert dense - flash == 5 * a * s * s * b - (2 * s * b * h + 4 * a * s * b)
    with pytest.raises(ValueError, match="attention 'sparse'"):
        layer_activation_bytes(m, s, b, attention="sparse")


# ---- the command line: --attention flash equals dense ------------------------------------------------
def _train(comm, extra, dropout="0.1"):
    from minizero.train import parse_args, train

    set_ledger(MemoryLedger())
    argv = ["--model", "tiny", "--dtype", "float64", "--dropout", dropout, "--steps", "2", "--eval-every", "0",
            "--eval-batches", "1", "--no-progress"] + extra
    argv += ["--attention-block", "5"] if "flash" in extra else []  # refused with --attention dense
    grads = []

    def after_grads(step, params, opt):
        shards = opt.grad_shards() if hasattr(opt, "grad_shards") else [p.grad for p in params]  # ZeRO: its shards
        grads.extend(g.copy() for g in shards)

    res = train(parse_args(argv, comm.world_size), comm, log=lambda s: None, after_grads=after_grads)
    return res.train_losses, grads


LAYOUTS = [(1, []), (1, ["--recompute", "selective"]), (1, ["--recompute", "full"]), (2, ["--tp", "2"]),
           (2, ["--pp", "2"]), (2, ["--tp", "2", "--sequence-parallel"]), (2, ["--dp", "2", "--zero", "3"]),
           (2, ["--tp", "2", "--recompute", "selective"]), (1, ["--offload-activations", "cpu"])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,extra", LAYOUTS, ids=[" ".join(e) or "single" for _, e in LAYOUTS])
def test_command_line_flash_equals_dense(n, extra):
    dense = run_in_threads(n, _train, extra + ["--attention", "dense"])
    flash = run_in_threads(n, _train, extra + ["--attention", "flash"])
    for (ld, gd), (lf, gf) in zip(dense, flash):
        assert len(ld) == len(lf) == 2 and len(gd) == len(gf) > 0
        np.testing.assert_allclose(lf, ld, rtol=0, atol=1e-13)  # float64: measured 8.9e-16 (losses ~5.5)
        for a, b in zip(gd, gf):
            assert np.abs(a - b).max() <= 1e-13  # measured 1.1e-16 (|grad| <= 0.47)


@pytest.mark.parametrize("argv,match", [
    (["--attention-block", "0"], "--attention-block must be a positive integer"),
    (["--attention-block", "-2"], "got -2"),
    (["--attention", "flash", "--cp", "2"], "--attention flash with --cp 2 is not supported"),
    (["--attention", "sparse"], "invalid choice: 'sparse'")])
def test_command_line_refuses_bad_attention_flags(argv, match):
    from minizero.flags import UsageError
    from minizero.train import parse_args
    with pytest.raises((UsageError, ValueError), match=match):
        parse_args(["--model", "tiny"] + argv, 2)


def test_planner_takes_the_attention_choice():
    from minizero.models import MODELS
    from minizero.memory.estimator import estimate_memory
    from minizero.plan_report import describe
    from minizero.plan_search import enumerate_strategies
    from minizero.plan_strategy import parse_strategy
    model = MODELS["llama3-8b"]
    flash = parse_strategy("tp8 attention=flash", model, 8, seq_len=8192)
    dense = parse_strategy("tp8", model, 8, seq_len=8192)
    assert (flash.attention, dense.attention) == ("flash", "dense") and describe(flash).endswith("attention=flash")
    assert estimate_memory(model, flash, 8192).activations < estimate_memory(model, dense, 8192).activations
    assert {st.attention for st in enumerate_strategies(model, 8, seq_len=8192, attention="flash")} == {"flash"}
    with pytest.raises(ValueError, match="cannot read 'attention=sparse'"):
        parse_strategy("tp8 attention=sparse", model, 8, seq_len=8192)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n,flags", [(2, ["--tp", "2"]), (2, ["--pp", "2", "--grad-accum", "2"])], ids=["tp2", "pp2"])
def test_mpiexec_flash_equals_dense(mpiexec, tmp_path, n, flags):
    """Under ``mpiexec -n 2`` (MPI ranks, dropout 0.1, float64): the weights --attention flash writes equal dense's."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT, mpi_env

    def cli(attention):
        out = tmp_path / attention
        argv = ["--model", "tiny", "--steps", "2", "--dtype", "float64", "--dropout", "0.1", "--progress", "none",
                "--sample-tokens", "0", "--attention", attention, *flags, "--out", str(out)]
        argv += ["--attention-block", "5"] if attention == "flash" else []
        proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "minizero.train", *argv], env=mpi_env(),
                              capture_output=True, text=True, timeout=150, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return dict(np.load(os.path.join(out, "model.npz")))

    dense, flash = cli("dense"), cli("flash")
    assert sorted(dense) == sorted(flash)
    for name in dense:
        assert np.abs(dense[name] - flash[name]).max() <= 1e-9, name
