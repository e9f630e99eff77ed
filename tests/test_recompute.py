"""Activation recompute: bitwise-equal gradients, and the activation memory it saves (ledger)."""
import numpy as np
import pytest

from minizero.autograd import Tensor, manual_seed
from minizero.autograd.rng import get_rng_state
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.recompute import CheckpointWrapper, apply_recompute, checkpoint
from minizero.nn import GPT, get_config
from minizero.nn.module import Linear, Module, ModuleDict, Parameter
from minizero.parallel.context_parallel import context_parallelize
from minizero.parallel.pipeline import PipelineStage


def grads_and_peak(mode, every, preset="tiny", dropout=0.1, dtype="float64", batch=2, offload=None):
    ledger = set_ledger(MemoryLedger())
    cfg = get_config(preset, dtype=dtype, dropout=dropout)
    model = GPT(cfg, seed=1)
    apply_recompute(model, mode, every)
    manual_seed(5)
    x = np.random.default_rng(0).integers(0, 256, (batch, cfg.block_size))
    ledger.reset_peaks()
    if offload is None:
        loss = model(x, x)[1]  # not keeping the logits alive, as the training loop does
    else:
        with offload():
            loss = model(x, x)[1]
    loss.backward()
    peak = ledger.peak["activations"]
    set_ledger(MemoryLedger())
    return [p.grad for p in model.parameters()], peak, loss.item()


@pytest.mark.parametrize("mode,every", [("selective", 1), ("selective", 2), ("full", 1), ("full", 2)])
def test_recompute_gradients_bitwise_equal_with_dropout(mode, every):
    ref, _, ref_loss = grads_and_peak("none", 1)
    got, _, loss = grads_and_peak(mode, every)
    assert loss == ref_loss
    for i, (a, b) in enumerate(zip(ref, got)):
        np.testing.assert_array_equal(a, b, err_msg=f"param {i}")


def second_step(mode, every):
    """The loss and gradients of a second forward + backward with dropout, after a first one, and the generator
    state between the two."""
    model = GPT(get_config("tiny", dtype="float64", dropout=0.1), seed=1)
    apply_recompute(model, mode, every)
    manual_seed(5)
    x = np.random.default_rng(0).integers(0, 256, (2, model.config.block_size))
    model(x, x)[1].backward()
    between = get_rng_state()
    model.zero_grad()
    loss = model(x, x)[1]
    loss.backward()
    return between, loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode,every", [("selective", 1), ("full", 2)])
def test_recompute_in_backward_leaves_the_dropout_generator_where_forward_left_it(mode, every):
    """Backward's recompute draws the masks again from saved states and puts the generator back: the next step's
    masks are the ones without recompute (its loss and gradients bitwise)."""
    ref_state, ref_loss, ref = second_step("none", 1)
    state, loss, got = second_step(mode, every)
    assert state == ref_state
    assert loss == ref_loss
    for i, (a, b) in enumerate(zip(ref, got)):
        np.testing.assert_array_equal(a, b, err_msg=f"param {i}")


def block_activation_bytes(cfg, batch):
    """Peak saved bytes of one block's forward+backward on its own (measured)."""
    ledger = set_ledger(MemoryLedger())
    block = GPT(cfg, seed=1).transformer["h"][0]
    x = Tensor(np.random.default_rng(0).normal(size=(batch, cfg.block_size, cfg.n_embd)).astype(cfg.dtype),
               requires_grad=True)
    ledger.reset_peaks()
    block(x).sum().backward()
    peak = ledger.peak["activations"]
    set_ledger(MemoryLedger())
    return peak


def test_recompute_memory_is_the_ledgers_exact_byte_count():
    """Peak saved bytes of a 12-layer float32 GPT (no dropout), byte for byte: each block keeps its input under full
    recompute, everything but its attention scores under selective; ``x`` is both inputs and targets (one array)."""
    cfg = get_config("deep", dtype="float32")  # 12 layers
    b, s, h, f, a, e = 2, cfg.block_size, cfg.n_embd, 4 * cfg.n_embd, cfg.n_head, 4
    _, none, _ = grads_and_peak("none", 1, "deep", 0.0, "float32", b)
    _, sel, _ = grads_and_peak("selective", 1, "deep", 0.0, "float32", b)
    _, full, _ = grads_and_peak("full", 1, "deep", 0.0, "float32", b)
    block_input, scores = e * b * s * h, e * a * s * s * b  # the softmax output: what selective drops
    # ln_1/QKV/projection/ln_2/MLP inputs, Q K V, GeLU in and out, 2 norms' mean and rstd, the scores
    one_block = e * b * s * (5 * h + 3 * h + 2 * f) + 4 * 4 * b * s + scores
    assert block_activation_bytes(cfg, b) == one_block
    ids = 8 * b * s + 8 * s  # the embedding's int64 token ids (the targets too: the same array) and positions
    head = 2 * block_input + 2 * 4 * b * s + e * b * s * cfg.vocab_size + 4 * b * s  # norm, lm_head in, logits, lse
    assert none == cfg.n_layer * one_block + ids + head
    assert sel == cfg.n_layer * (one_block - scores) + ids + head  # the rerun core fits in the freed MLP saves
    # full: the head is freed before block L-1 reruns, which shares its input with its checkpoint
    assert full == cfg.n_layer * block_input + (one_block - block_input) + ids
    assert full < sel < none


@pytest.mark.parametrize("mode,every", [("selective", 1), ("full", 1), ("full", 2)])
def test_recompute_wraps_modules_and_keeps_every_name(mode, every):
    plain, model = GPT(get_config("tiny"), seed=1), GPT(get_config("tiny"), seed=1)
    done = apply_recompute(model, mode, every)
    blocks = model.transformer["h"]
    wrapped = [blocks[i] if mode == "full" else blocks[i].attn.core for i in range(0, len(blocks), every)]
    assert all(isinstance(w, CheckpointWrapper) for w in wrapped) and len(done) == len(wrapped)
    assert done[0] == ("transformer.h.0" if mode == "full" else "transformer.h.0.attn.core")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert blocks[0].attn is getattr(blocks[0], "inner", blocks[0]).attn  # attribute reads reach the block
    with pytest.raises(ValueError, match="already applied to transformer.h.0"):
        apply_recompute(model, mode, every)


def test_module_traversal_is_public_and_a_wrapper_shows_its_inner_modules_tables():
    plain, model = GPT(get_config("tiny"), seed=1), GPT(get_config("tiny"), seed=1)
    apply_recompute(model, "full", 1)
    wrapped, block = model.transformer["h"][0], plain.transformer["h"][0]
    assert [n for n, _ in wrapped.named_children()] == [n for n, _ in block.named_children()] == \
        ["ln_1", "attn", "ln_2", "mlp"]
    assert [n for n, _ in block.ln_1.named_parameters(recurse=False)] == ["weight", "bias"]
    assert list(block.named_parameters(recurse=False)) == []  # a block owns no parameter itself
    every = [n for n, _ in plain.named_parameters(remove_duplicate=False)]  # the tied head's alias too
    assert every == list(plain.state_dict()) and len(every) == len(list(plain.named_parameters())) + 1


class _ReadsItsMode(Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(self.training)  # as a core with its own dropout would
        return x * 2.0


def test_a_wrapped_module_follows_train_and_eval_of_the_model_around_it():
    """train/eval meet the wrapper where the inner module was, never the inner module: the wrapper's mode is
    inner's (before: inner kept training=True under model.eval(), and a wrapper of an eval module said True)."""
    inner = _ReadsItsMode()
    parent = ModuleDict({"core": inner})
    parent.swap_modules(lambda m: CheckpointWrapper(m) if m is inner else None)
    parent.eval()
    parent["core"](Tensor(np.ones(2), requires_grad=True))
    parent.train()
    parent["core"](Tensor(np.ones(2), requires_grad=True))
    assert inner.seen == [False, True] and parent["core"].training and inner.training
    inner.eval()
    assert not CheckpointWrapper(inner).training and not inner.training  # wrapping keeps the inner's mode


def test_parameters_registered_later_on_either_side_appear_once_under_the_same_names():
    """The wrapper shares inner's tables (the same dicts) and forwards attribute writes: nothing registered
    later is missing on one side or doubled (why it is not PyTorch's prefixed child: names stay the module's)."""
    inner = _ReadsItsMode()
    parent = ModuleDict({"core": inner})
    parent.swap_modules(lambda m: CheckpointWrapper(m) if m is inner else None)
    inner.w = Parameter(np.ones(2))
    parent["core"].v = Parameter(np.zeros(3))
    parent["core"].sub = Linear(2, 2, bias=False)
    assert [n for n, _ in parent.named_parameters()] == ["core.w", "core.v", "core.sub.weight"]
    assert [n for n, _ in inner.named_parameters()] == ["w", "v", "sub.weight"] and parent["core"].v is inner.v


def test_full_recompute_reaches_the_chunks_of_an_interleaved_stage():
    from minizero.parallel.interleaved import InterleavedStage, interleave
    model = GPT(get_config("default"), seed=1)  # 4 layers: chunks hold layers (0, 1) and (2, 3) at pp = 1, v = 2
    stage = InterleavedStage(interleave(model, 0, 1, 2), 1)
    assert apply_recompute(stage, "full", 2) == ["transformer.h.0", "transformer.h.2"]
    for chunk in stage.chunks:
        kinds = [isinstance(b, CheckpointWrapper) for b in chunk.transformer["h"]]
        assert kinds == [True, False], kinds  # the chunk runs its own list: it holds the wrapper too


class _StageWithATable(PipelineStage):
    """A stage holding its own (unregistered) name -> module table, kept current by ``swap_modules`` as an
    interleaved stage keeps its chunks: a technique reaches it only through that seam."""

    def __init__(self, model):
        super().__init__(model, 0, 1)
        object.__setattr__(self, "table", dict(self.named_modules()))

    def swap_modules(self, fn, memo=None):
        memo = {} if memo is None else memo
        done = super().swap_modules(fn, memo)
        for name, m in self.table.items():
            new = memo.get(id(m), (m, None))[1]
            self.table[name] = m if new is None else new
        return done


def _replace_and_compare_tables(comm, steps):
    stage = _StageWithATable(GPT(get_config("tiny", dropout=0.0), seed=1))
    for step in steps:
        if step in ("ring", "ulysses"):
            context_parallelize(stage, comm, step)
        else:
            apply_recompute(stage, step, 1)
    now = dict(stage.named_modules())
    return [name for name, m in stage.table.items() if now[name] is not m]


@pytest.mark.parametrize("steps", [["full"], ["selective"], ["ring"], ["ulysses"], ["selective", "ring"],
                                   ["full", "ulysses"], ["ulysses", "selective"]])
def test_recompute_and_context_parallelism_replace_modules_through_swap_modules(steps):
    """Every module they replace is replaced by ``Module.swap_modules``: a holder that overrides it sees them all."""
    assert run_in_threads(2, _replace_and_compare_tables, steps) == [[], []]


def test_checkpoint_rejects_bad_input():
    with pytest.raises(TypeError, match="input 0"):
        checkpoint(lambda a: a, np.zeros(3))
    with pytest.raises(ValueError, match="recompute mode 'half'"):
        apply_recompute(GPT(get_config("tiny")), "half")
    with pytest.raises(ValueError, match="K >= 1"):
        apply_recompute(GPT(get_config("tiny")), "full", 0)


# ---- composed with data parallelism, ZeRO and activation offload, dropout on ----------------
COMBOS = [("selective", 1, "none"), ("full", 1, "none"), ("full", 2, "none"), ("none", 1, "cpu"),
          ("none", 1, "nvme"), ("full", 1, "nvme"), ("selective", 2, "cpu")]


def _step0_grads(comm, zero, recompute, every, offload, offload_dir):
    from minizero.ledger import MemoryLedger, set_ledger
    from minizero.train import parse_args, train

    set_ledger(MemoryLedger())
    argv = ["--model", "tiny", "--dtype", "float64", "--dropout", "0.1", "--steps", "1", "--grad-accum", "2",
            "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--zero", str(zero),
            "--recompute", recompute, "--recompute-every", str(every), "--offload-activations", offload]
    if offload == "nvme":
        argv += ["--offload-dir", offload_dir]
    grads = []

    def after_grads(step, params, opt):
        shards = opt.grad_shards() if hasattr(opt, "grad_shards") else [p.grad for p in params]
        grads.extend(g.copy() for g in shards)

    train(parse_args(argv, comm.world_size), comm, log=lambda s: None, after_grads=after_grads)
    return grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_recompute_and_offload_bitwise_under_dp_and_zero(zero, tmp_path):
    """3 data ranks: the DP all-reduce and ZeRO's shards, padded (a tiny block's 3,280 elements split evenly over 2)."""
    n = 3
    from minizero.comm import run_in_threads

    ref = run_in_threads(n, _step0_grads, zero, "none", 1, "none", str(tmp_path))
    for recompute, every, offload in COMBOS:
        got = run_in_threads(n, _step0_grads, zero, recompute, every, offload, str(tmp_path))
        for r in range(n):
            assert len(got[r]) == len(ref[r])
            for i, (a, b) in enumerate(zip(ref[r], got[r])):
                np.testing.assert_array_equal(a, b, err_msg=f"{recompute}/{every}/{offload}, rank {r}, array {i}")


def test_the_hotspot_note_names_the_recomputed_blocks_under_recompute_every():
    """The main job's footnote under the activation hotspots: with --recompute-every K only blocks 0, K, 2K, ...
    (apply_recompute's [::K]) drop their saves; it said "each block's" for any K."""
    from minizero.memory.recompute import apply_recompute
    from minizero.nn import GPT, get_config
    from minizero.report import recompute_note

    model = GPT(get_config("tiny"), seed=0)
    wrapped = apply_recompute(model, "full", every=2)
    assert len(wrapped) == 1 and wrapped[0].endswith("h.0")  # tiny: 2 blocks, block 0 only
    assert " ".join(recompute_note("full", 1, 2).split()) == ("(--recompute full: each block's saves exist only "
                                                             "while backward recomputes them, one at a time)")
    note = " ".join(recompute_note("full", 2, 6).split())
    assert "the saves of blocks 0, 2, 4 (--recompute-every 2; the other blocks keep theirs)" in note
    assert "attention scores of blocks 0, 3, 6, ..., 45 (" in " ".join(recompute_note("selective", 3, 48).split())
    # the blocks that exist (before: "the saves of blocks 0, 7, 14, ..." of the 2-block tiny model)
    assert "the saves of block 0 (--recompute-every 7;" in " ".join(recompute_note("full", 7, 2).split())
    assert all(len(line) <= 100 for m in ("full", "selective") for k in (1, 2, 16)
               for line in recompute_note(m, k, 64).splitlines())


def test_the_header_names_the_recomputed_blocks_with_an_ordinal():
    """Before: "(every 2-th block)"; and every 7-th of the 2-block tiny model named no existing block."""
    from minizero.args import parse_args
    from minizero.header import header_lines
    from minizero.nn import get_config
    from minizero.numerals import ordinal
    from types import SimpleNamespace as NS

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 102, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "102nd", "111th"]
    args = parse_args(["--model", "tiny", "--recompute", "full", "--recompute-every", "7"])
    topo = NS(dp=1, tp=1, pp=1, describe_nodes=lambda: "", placement_warnings=lambda: [])
    text = " ".join(header_lines(args, get_config("tiny"), NS(topo=topo, cp=1, opt=None), 1))
    assert "activation recompute full (every 7th block: block 0 of the model's 2)" in text, text


def test_recompute_puts_no_activation_gradient_in_the_ledgers_gradients():
    """The gradients' peak under recompute is the plain run's, byte for byte: the rerun's input gradients are
    activation gradients (``grad_category`` None), not parameter gradients."""
    def gradient_peak(mode):
        ledger = set_ledger(MemoryLedger())
        try:
            cfg = get_config("tiny", dtype="float64", dropout=0.0)
            model = GPT(cfg, seed=1)
            apply_recompute(model, mode, 1)
            x = np.random.default_rng(0).integers(0, 256, (2, cfg.block_size))
            model(x, x)[1].backward()
            return ledger.peak["gradients"], sum(p.grad.nbytes for p in model.parameters())
        finally:
            set_ledger(MemoryLedger())

    none = gradient_peak("none")
    assert none[0] == none[1]  # every parameter's gradient, nothing else
    assert gradient_peak("full") == gradient_peak("selective") == none


def test_recomputed_blocks_names_the_blocks_apply_recompute_wraps():
    """Including the last block when n_blocks - 1 is a multiple of ``every`` (12 blocks, every 11: 0 and 11)."""
    from minizero.memory.recompute import recomputed_blocks

    model = GPT(get_config("deep", dtype="float32"), seed=0)  # 12 blocks
    assert apply_recompute(model, "full", 11) == ["transformer.h.0", "transformer.h.11"]
    assert recomputed_blocks(12, 11) == "blocks 0, 11"
    assert [recomputed_blocks(n, k) for n, k in ((1, 1), (5, 2), (5, 7), (16, 3))] == [
        "block 0", "blocks 0, 2, 4", "block 0", "blocks 0, 3, 6, ..., 15"]


def test_checkpoint_records_no_graph_in_forward_and_records_one_in_the_recompute():
    """forward runs ``fn`` under no_grad (no saves kept, nothing to free); backward's rerun records the graph it
    differentiates. Gradients are the plain function's, float64 bitwise."""
    from minizero.autograd import is_grad_enabled

    w = Parameter(np.random.default_rng(0).standard_normal((3, 3)))
    x = Tensor(np.random.default_rng(1).standard_normal((2, 3)), requires_grad=True)
    seen = []

    def fn(t):
        seen.append(is_grad_enabled())
        return (t @ w).tanh().sum()

    checkpoint(fn, x).backward()
    gx, gw = x.grad.copy(), w.grad.copy()
    assert seen == [False, True]
    x.grad = w.grad = None
    fn(x).backward()
    np.testing.assert_array_equal(gx, x.grad)
    np.testing.assert_array_equal(gw, w.grad)
