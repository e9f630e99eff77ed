"""QLoRA's pieces (memory/qlora.py): the NF4 code book, block quantization with double-quantized absmax,
LoRA adapters on a frozen base (bitwise frozen, adapters-only optimizer state, merge)."""
import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.ledger import MemoryLedger, set_ledger
from minizero.memory.qlora import (ABSMAX_BLOCK, BLOCK, NF4_CODE, LoRALinear, apply_lora, dequantize_nf4, nf4_code,
                                   quantize_nf4)
from minizero.nn import GPT, Linear, get_config
from minizero.optim import AdamW


def test_code_book_is_the_published_one_and_the_normal_quantiles():
    code = np.array(NF4_CODE)
    assert len(code) == 16 and (np.diff(code) > 0).all() and code[0] == -1 and code[-1] == 1 and code[7] == 0
    assert np.abs(nf4_code() - code).max() < 2e-7  # float32 precision (bitsandbytes stores float32)


def test_quantization_picks_the_nearest_code_value_per_block():
    w = (np.random.default_rng(0).standard_normal((64, 96)) * 0.02).astype(np.float32)
    t = quantize_nf4(w)
    d = dequantize_nf4(t)
    assert d.shape == w.shape and d.dtype == np.float32
    blocks, dq = w.reshape(-1, BLOCK), d.reshape(-1, BLOCK)
    code = np.array(NF4_CODE, np.float32)
    half_gap = np.diff(code).max() / 2
    scale = np.abs(blocks).max(axis=1, keepdims=True)
    assert (np.abs(blocks - dq) <= scale * (half_gap + 0.02) + 1e-7).all()  # half a gap (+ the absmax's rounding)
    t2 = quantize_nf4(w)
    assert np.array_equal(t.codes, t2.codes) and np.array_equal(dequantize_nf4(t2), d)  # deterministic


def test_double_quantized_absmax_and_bits_per_weight():
    n = 64 * 4096  # 4096 blocks of 64, 16 blocks of 256 absmax
    w = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    t = quantize_nf4(w)
    assert t.codes.dtype == np.uint8 and t.codes.size == n // 2 and t.absmax_q.dtype == np.int8
    assert t.absmax_scale.size == n // BLOCK // ABSMAX_BLOCK
    assert t.nbytes * 8 / n == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / n, abs=1e-12)  # 4.127 bits
    absmax = np.abs(w.reshape(-1, BLOCK)).max(axis=1)
    deq = (t.absmax_q.reshape(-1, ABSMAX_BLOCK) * t.absmax_scale[:, None]).reshape(-1) + np.float32(t.absmax_mean)
    assert (np.abs(deq - absmax) <= np.repeat(t.absmax_scale, ABSMAX_BLOCK) / 2 + 1e-6).all()


def test_lora_starts_at_the_base_and_merges_exactly():
    rng = np.random.default_rng(2)
    base = Linear(12, 10, dtype="float64", rng=rng)
    base.bias.data[...] = rng.standard_normal(10)
    lora = LoRALinear(base, 3, 6.0, quantize=False)
    x = rng.standard_normal((4, 12))
    np.testing.assert_array_equal(lora(Tensor(x)).data, base(Tensor(x)).data)  # B = 0
    lora.lora_B.data[...] = rng.standard_normal((10, 3))
    merged = x @ lora.merged_weight().T + base.bias.data
    assert np.abs(lora(Tensor(x)).data - merged).max() < 1e-12
    with pytest.raises(ValueError, match="LoRA rank"):
        LoRALinear(base, 11, 1.0, quantize=False)
    with pytest.raises(ValueError, match="no Linear named"):
        apply_lora(GPT(get_config("tiny")), 2, 4.0, targets=("q_proj",))


def _finetune(quantize: bool, steps: int = 30):
    set_ledger(MemoryLedger())
    model = GPT(get_config("tiny"), seed=0)
    apply_lora(model, 4, 8.0, quantize=quantize)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = {n: p.data.copy() for n, p in model.named_parameters() if not p.requires_grad}
    bases = [m.base for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    before = [(b.codes.copy(), b.absmax_q.copy()) if quantize else b.copy() for b in bases]
    opt = AdamW(trainable, lr=1e-2, weight_decay=0.0)
    x = np.random.default_rng(0).integers(0, 256, (4, 16))
    losses = []
    for _ in range(steps):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        model.zero_grad()
        losses.append(float(loss.data))
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and np.array_equal(p.data, frozen[n]), n  # bitwise frozen
    for b, was in zip(bases, before):
        if quantize:
            assert np.array_equal(b.codes, was[0]) and np.array_equal(b.absmax_q, was[1])
        else:
            assert np.array_equal(b, was)
    assert len(opt.m) == len(trainable) == 2 * 2 * 2  # adapters of c_attn and c_fc in 2 blocks: A and B
    return losses


def test_qlora_finetunes_the_adapters_only_and_tracks_lora_on_the_unquantized_base():
    lora, qlora = _finetune(False), _finetune(True)
    # a random tiny model's frozen c_proj and head damp what the adapters change: 5.347 -> 5.289 here
    assert lora[-1] < lora[0] - 0.03 and qlora[-1] < qlora[0] - 0.03  # the adapters learn
    assert abs(qlora[-1] - lora[-1]) < 0.01, (qlora[-1], lora[-1])  # the NF4 base costs little (1.4e-4 here)


@pytest.fixture(scope="module")
def trained_weights(tmp_path_factory):
    from minizero.comm import run_in_threads
    from minizero.train import parse_args, train
    out = tmp_path_factory.mktemp("weights")
    res = run_in_threads(1, lambda comm: train(parse_args(["--model", "tiny", "--steps", "30", "--no-progress",
                                                           "--eval-every", "0"], 1), comm, log=lambda s: None))[0]
    np.savez(out / "model.npz", **res.model.state_dict())
    return str(out / "model.npz")


def test_finetune_command_line_writes_merged_weights(trained_weights, tmp_path, capsys):
    from minizero.finetune import main
    from minizero.weights import load_gpt
    assert main(["--weights", trained_weights, "--method", "qlora", "--steps", "5", "--lr", "3e-3",
                 "--out", str(tmp_path)]) == 0
    assert "adapters merged" in capsys.readouterr().out
    merged = load_gpt(str(tmp_path / "model.npz"))
    base = load_gpt(trained_weights)
    names = [n for n, _ in merged.named_parameters()]
    changed = [n for n, p in merged.named_parameters() if not np.array_equal(p.data, dict(base.named_parameters())[n].data)]
    assert changed and all(n.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight")) for n in changed), changed
    assert len(names) == len(list(base.named_parameters()))


def test_finetune_table_and_bad_flags(trained_weights, capsys):
    from minizero.finetune import main
    main(["--weights", trained_weights, "--table", "--steps", "3", "--lora-rank", "2"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith(("| full", "| lora", "| qlora"))]
    full, lora, qlora = ([float(c) for c in r.split("|")[2:5]] for r in rows)
    assert full == [4.0, 4.0, 8.0]  # FP32 AdamW: 4 + 4 + 8 bytes per parameter
    assert qlora[0] < full[0] < lora[0]  # NF4 targets below FP32; LoRA keeps the FP32 base and adds adapters
    assert qlora[1:] == lora[1:] and lora[1] < full[1] and lora[2] < full[2]  # gradients, Adam: adapters only
    for argv, match in ((["--lora-rank", "0"], "--lora-rank must be >= 1"), (["--method", "dora"], "invalid choice"),
                        (["--lr", "0"], "must be > 0")):
        with pytest.raises(SystemExit):
            main(["--weights", trained_weights] + argv)
        assert match in capsys.readouterr().err
