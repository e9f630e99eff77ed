"""Quantizers (round-trip bounds, INT4 packing, edge cases, exact bytes) and weight quantization of a GPT."""
import json

import numpy as np
import pytest

from minizero.numerals import unwrapped
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minizero.quantization import (GRANULARITIES, QuantizedTensor, absmax_scale, dequantize,
                                      dequantize_blockwise, dynamic_code, element_scale, linear_code, pack_int4,
                                      quantize, quantize_blockwise, quantized_nbytes, unpack_int4)

SCHEMES = [(bits, g) for bits in (8, 4) for g in GRANULARITIES]


def _roundtrip(x, bits, granularity, block_size=16, dtype=None):
    q, scale = quantize(x, bits, granularity, block_size)
    d = dequantize(q, scale, x.shape, bits, granularity, block_size, dtype=dtype or x.dtype)
    return q, scale, d, element_scale(scale, x.shape, granularity, block_size)


# --------------------------------------------------------------------------- round-trip bounds
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12), elements=finite),
       scheme=st.sampled_from(SCHEMES), block_size=st.integers(1, 20))
def test_error_is_at_most_half_a_scale_float32(x, scheme, block_size):
    bits, granularity = scheme
    q, scale, d, es = _roundtrip(x, bits, granularity, block_size)
    assert d.dtype == np.float32
    assert (np.abs(x - d) <= es / 2).all()  # exact, in float32 arithmetic (scales have 16 significant bits)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=9),
                    elements=st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False)),
       scheme=st.sampled_from(SCHEMES))
def test_error_is_at_most_half_a_scale_float64(x, scheme):
    bits, granularity = scheme
    q, scale, d, es = _roundtrip(x, bits, granularity, dtype=np.float64)
    assert (np.abs(x - d) <= es.astype(np.float64) / 2).all()
    codes = q.astype(np.int64) if bits == 8 else unpack_int4(q, x.size)
    assert np.abs(codes).max(initial=0) <= {8: 127, 4: 7}[bits]


@pytest.mark.parametrize("bits,granularity", SCHEMES)
def test_typical_weights_and_exact_bytes(bits, granularity):
    x = (np.random.default_rng(0).standard_normal((48, 40)) * 0.02).astype(np.float32)
    q, scale, d, es = _roundtrip(x, bits, granularity, block_size=64)
    assert (np.abs(x - d) <= es / 2).all()
    n_scales = {"tensor": 1, "row": 48, "block": 30}[granularity]
    code_bytes = 48 * 40 if bits == 8 else 48 * 40 // 2
    assert q.nbytes + scale.nbytes == quantized_nbytes(x.shape, bits, granularity, 64) == code_bytes + 4 * n_scales
    qt = QuantizedTensor.from_array(x, bits, granularity, 64)
    assert qt.nbytes == quantized_nbytes(x.shape, bits, granularity, 64) and qt.dense_nbytes == x.nbytes
    np.testing.assert_array_equal(qt.dequantize(), d)


def test_int4_odd_length_packs_into_ceil_half_bytes():
    x = np.linspace(-1, 1, 7)
    q, scale = quantize(x, 4, "block", 3)
    assert q.dtype == np.uint8 and q.shape == (4,) and scale.shape == (3,)
    assert quantized_nbytes((7,), 4, "block", 3) == 4 + 12


# --------------------------------------------------------------------------- INT4 packing
@given(hnp.arrays(np.int8, st.integers(0, 65), elements=st.integers(-8, 7)))
def test_int4_packing_is_lossless_on_codes(codes):
    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and packed.size == (codes.size + 1) // 2
    np.testing.assert_array_equal(unpack_int4(packed, codes.size), codes)


def test_int4_packing_layout_and_range():
    assert pack_int4(np.array([1, -1])).tolist() == [0xF1]  # low nibble first, two's complement
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([8]))
    with pytest.raises(ValueError, match="hold at most"):
        unpack_int4(np.zeros(2, np.uint8), 5)


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("bits,granularity", SCHEMES)
def test_zero_blocks_round_trip_to_zeros(bits, granularity):
    x = np.zeros((4, 8), np.float32)
    x[1] = np.arange(8) - 3.5  # one nonzero row / block; the others are all zero
    q, scale, d, _ = _roundtrip(x, bits, granularity, block_size=8)
    assert np.isfinite(d).all()
    if granularity != "tensor":
        assert (scale[[0, 2, 3]] == 0).all()
        assert (d[[0, 2, 3]] == 0).all()
    q0, s0 = quantize(np.zeros(5), bits, granularity if granularity != "row" else "tensor")
    assert (s0 == 0).all() and not np.any(dequantize(q0, s0, (5,), bits, granularity if granularity != "row"
                                                    else "tensor"))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_input_raises(bad, bits):
    x = np.ones((3, 3))
    x[2, 1] = bad
    with pytest.raises(ValueError, match="non-finite value.*flat index 7"):
        quantize(x, bits, "row")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_blockwise(x.reshape(-1), dynamic_code(), 4)


def test_tiny_values_get_a_normal_scale_and_huge_ones_raise():
    x = np.array([1e-300, -3e-310, 2e-45])
    q, scale = quantize(x, 8)
    assert scale == np.float32(np.finfo(np.float32).tiny)
    assert (np.abs(x - dequantize(q, scale, dtype=np.float64)) <= float(scale) / 2).all()
    with pytest.raises(ValueError, match="too large for an FP32 scale"):
        quantize(np.array([1e300]), 8)
    assert absmax_scale(np.array([0.0]), 8)[0] == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits=3"):
        quantize(np.ones(4), bits=3)
    with pytest.raises(ValueError, match="granularity='col'"):
        quantize(np.ones(4), granularity="col")
    with pytest.raises(ValueError, match="block_size=0"):
        quantize(np.ones(4), granularity="block", block_size=0)
    with pytest.raises(ValueError, match="2\\+ dims"):
        quantize(np.ones(4), granularity="row")
    with pytest.raises(ValueError, match="pass the original shape"):
        dequantize(*quantize(np.ones(4), 4), bits=4)


# --------------------------------------------------------------------------- dynamic code (8-bit Adam)
def test_dynamic_code_matches_bitsandbytes_layout():
    for signed in (True, False):
        code = dynamic_code(signed)
        assert code.shape == (256,) and np.unique(code).size == 256 and code.max() == 1.0
        assert (code.min() < -0.99) if signed else (code.min() == 0.0)
    assert dynamic_code(True)[127] == 0.0  # sorted: 127 negatives, 0, 128 positives (the last is 1.0)
    # smallest nonzero magnitudes: 10**-6 * 0.55 (signed), 10**-6 * 0.325 (unsigned), to float32 rounding (isclose's
    # default atol of 1e-8 let 5.4e-7 pass)
    smallest = (np.abs(dynamic_code(True)[dynamic_code(True) != 0]).min(), dynamic_code(False)[1])
    np.testing.assert_allclose(smallest, [1e-6 * 0.55, 1e-6 * 0.325], rtol=2.0 ** -24, atol=0)


@pytest.mark.parametrize("offset", [0, 5, 300])
def test_blockwise_roundtrip_picks_the_nearest_code(offset):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(700) * np.exp(rng.uniform(-8, 0, 700))
    code = dynamic_code(True)
    c, absmax = quantize_blockwise(x, code, 64, offset=offset)
    assert c.dtype == np.uint8 and absmax.shape == ((offset % 64 + 700 + 63) // 64,)
    d = dequantize_blockwise(c, absmax, code, 64, offset=offset, dtype=np.float64)
    block = (offset % 64 + np.arange(700)) // 64
    normed = x / absmax.astype(np.float64)[block]
    best = np.abs(code.astype(np.float64)[None, :] - normed[:, None]).min(axis=1)
    assert np.allclose(np.abs(code.astype(np.float64)[c] - normed), best, rtol=0, atol=1e-12)
    assert np.abs(d - x).max() <= absmax.max() * 0.01  # the code's largest gap is ~2% of absmax
    # the dynamic code keeps small values; the linear code rounds them to zero
    lin = linear_code(True)
    dl = dequantize_blockwise(*quantize_blockwise(x, lin, 64, offset=offset), lin, 64, offset=offset,
                              dtype=np.float64)
    rel = lambda y: np.median(np.abs(y - x) / np.abs(x))  # noqa: E731
    assert rel(d) < rel(dl) / 5


def test_blockwise_zero_block_and_given_absmax():
    x = np.zeros(10)
    c, absmax = quantize_blockwise(x, dynamic_code(False), 4)
    assert (absmax == 0).all() and not dequantize_blockwise(c, absmax, dynamic_code(False), 4).any()
    with pytest.raises(ValueError, match="span 3 blocks"):
        quantize_blockwise(x, dynamic_code(), 4, absmax=np.ones(2))


# --------------------------------------------------------------------------- weight quantization of a GPT
@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """A tiny GPT trained 60 steps in-process, saved as the trainer saves it (model.npz + summary.json)."""
    import dataclasses

    from minizero.data import global_batch, load_tokens, train_val_split
    from minizero.nn import GPT, get_config
    from minizero.optim import AdamW

    cfg = get_config("tiny")
    model = GPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-2)
    train_tok, _ = train_val_split(load_tokens())
    for step in range(60):
        x, y = global_batch(train_tok, step, 8, cfg.block_size, 0)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("q_run")
    np.savez(out / "model.npz", **model.state_dict())
    (out / "summary.json").write_text(json.dumps({"config": {"model": dataclasses.asdict(cfg),
                                                              "train": {"seed": 0, "data": None, "eval_batches": 4}}}))
    return out


def test_quantized_linear_is_linear_with_the_dequantized_weight():
    from minizero.autograd import Tensor, functional as F
    from minizero.nn import Linear
    from minizero.quantize import QuantizedLinear

    lin = Linear(12, 6, rng=np.random.default_rng(3))
    lin.bias.data[...] = np.arange(6)
    x = Tensor(np.random.default_rng(4).standard_normal((2, 3, 12)).astype(np.float32))
    for bits, gran in SCHEMES:
        ql = QuantizedLinear.from_linear(lin, bits, gran, block_size=8)
        w = dequantize(ql.weight_q.q, ql.weight_q.scale, (6, 12), bits, gran, 8)
        np.testing.assert_array_equal(ql(x).data, F.linear(x, Tensor(w), lin.bias).data)
        assert ql.weight_nbytes == quantized_nbytes((6, 12), bits, gran, 8)
    ql = QuantizedLinear.from_linear(lin, 8, "row", outlier_columns=[2, 7])
    w = ql.dequantized_weight()
    np.testing.assert_array_equal(w[:, [2, 7]], lin.weight.data[:, [2, 7]])  # kept exactly
    assert ql.weight_nbytes == 6 * 12 + 4 * 6 + 4 * 6 * 2 + 8 * 2


def test_quantize_model_replaces_linears_but_not_the_tied_head(trained_tiny):
    from minizero.quantize import QuantizedLinear, load_trained, model_nbytes, quantize_model

    model, summary = load_trained(str(trained_tiny / "model.npz"))
    dense = model_nbytes(model)
    rep = quantize_model(model, 8, "row")
    assert rep["skipped"] == ["lm_head"] and len(rep["layers"]) == 4 * model.config.n_layer
    assert all(isinstance(dict(model.named_modules())[n], QuantizedLinear) for n in rep["layers"])
    c, L = model.config.n_embd, model.config.n_layer
    linear_elems = L * (3 * c * c + c * c + 4 * c * c + 4 * c * c)
    linear_rows = L * (3 * c + c + 4 * c + c)
    assert rep["dense_bytes"] == 4 * linear_elems and rep["quantized_bytes"] == linear_elems + 4 * linear_rows
    assert model_nbytes(model) == dense - rep["dense_bytes"] + rep["quantized_bytes"]


def test_quantize_model_replaces_layers_through_module_swap_modules(monkeypatch):
    """quantize_model goes through the one module-replacing seam (Module.swap_modules): one call, and the
    report's layers are the names the seam replaced."""
    from minizero.nn import GPT, get_config
    from minizero.nn.module import Module
    from minizero.quantize import QuantizedLinear, quantize_model
    calls, original = [], Module.swap_modules
    monkeypatch.setattr(Module, "swap_modules", lambda self, fn, memo=None: calls.append(original(self, fn, memo))
                        or calls[-1])
    model = GPT(get_config("tiny"), seed=1)
    rep = quantize_model(model, 8, "row")
    assert calls == [rep["layers"]] and len(rep["layers"]) == 4 * model.config.n_layer
    assert rep["skipped"] == ["lm_head"]
    assert all(isinstance(dict(model.named_modules())[n], QuantizedLinear) for n in rep["layers"])


def test_quantize_command_table(trained_tiny, capsys):
    from minizero.quantize import main

    out = trained_tiny / "q.json"
    assert main(["--weights", str(trained_tiny / "model.npz"), "--table", "--outlier-threshold", "2.0",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8 row" in text and "int4 block 64" in text and "fp32 col" in text
    assert max(map(len, text.splitlines())) <= 120, text  # before: the first and the last two lines ran to 160
    assert "ratio: model bytes / the fp32 row's; val loss in nats per byte; delta: val loss minus the fp32 row's" in (
        " ".join(text.split()))  # before: no column said its unit
    result = json.loads(out.read_text())
    rows = {(r["bits"], r["granularity"], r["outlier_threshold"]): r for r in result["rows"]}
    assert len(rows) == 8
    assert abs(rows[8, "row", None]["delta"]) < 0.02  # the bound, on this tiny model
    assert rows[8, "row", 2.0]["outlier_columns"] > 0
    for (bits, gran, threshold), r in rows.items():
        assert r["model_bytes"] < result["baseline"]["model_bytes"]
        if threshold is None:
            assert r["linear_bytes"] < r["linear_dense_bytes"] / (3 if bits == 8 else 5)  # 16-wide rows: scales weigh
        assert r["block_size"] == (64 if gran == "block" else None)  # one scale per row/tensor: no block size


def test_quantize_s_fp32_loss_is_the_one_the_trainer_saved(tmp_path):
    """The baseline row evaluates the trainer's own validation batches (its data, seed and --eval-batches from
    summary.json): the same loss, bit for bit, as summary.json's val_loss."""
    from minizero.quantize import main as quantize_main
    from minizero.train import main as train_main

    out = tmp_path / "run"
    assert train_main(["--model", "tiny", "--steps", "2", "--eval-batches", "2", "--eval-every", "0", "--seed", "7",
                       "--progress", "none", "--sample-tokens", "8", "--out", str(out)]) == 0
    assert quantize_main(["--weights", str(out / "model.npz"), "--json", str(tmp_path / "q.json")]) == 0
    saved = json.loads((out / "summary.json").read_text())["val_loss"]
    assert json.loads((tmp_path / "q.json").read_text())["baseline"]["val_loss"] == saved


def test_quantize_command_errors(tmp_path, capsys):
    from minizero.quantize import main

    assert main(["--weights", str(tmp_path / "nope.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--bits", "3"])


def _q_error(capsys, argv):
    from minizero.quantize import main

    code = main(argv)
    err = capsys.readouterr().err
    assert max(map(len, err.splitlines()), default=0) <= 120, err  # a long refusal over lines of <= 120 columns
    return code, " ".join(err.split())


def test_quantize_rejects_files_that_are_not_weights(tmp_path, capsys, trained_tiny):
    (tmp_path / "text.npz").write_text("hello")
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 3)
    whole = (trained_tiny / "model.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(whole[:len(whole) // 2])
    for name in ("text.npz", "empty.npz", "junk.bin", "trunc.npz"):
        code, err = _q_error(capsys, ["--weights", str(tmp_path / name)])
        assert code == 2, name
        assert "is not a model.npz written by minizero.train" in " ".join(err.split()) and name in " ".join(err.split()) and len(unwrapped(err)) == 1
        assert "allow_pickle" not in err


def test_quantize_without_summary_names_the_preset_and_nan_tensor(tmp_path, capsys):
    from minizero.nn import GPT, get_config

    state = GPT(get_config("tiny")).state_dict()
    np.savez(tmp_path / "model.npz", **state)
    from minizero.weights import load_trained
    assert load_trained(str(tmp_path / "model.npz"))[0].config == get_config("tiny")  # the preset of its shapes,
    odd = tmp_path / "odd"  # as sample reads it (weights.model_config); of no preset's shapes, --model is named
    odd.mkdir()
    np.savez(odd / "model.npz", **GPT(get_config("tiny", block_size=8)).state_dict())
    code, err = _q_error(capsys, ["--weights", str(odd / "model.npz")])
    assert code == 2 and "no model.json or summary.json" in err and "head count is unknown" in err, err
    assert "--model" in err and len(err) < 400
    code, err = _q_error(capsys, ["--weights", str(tmp_path / "model.npz"), "--model", "small"])
    assert code == 2 and "--model small disagrees with the arrays of --weights" in err and "model.npz" in err
    (tmp_path / "summary.json").write_text("{oops")  # never fatal: set aside, and said
    code, err = _q_error(capsys, ["--weights", str(tmp_path / "model.npz"), "--eval-batches", "1"])
    assert code == 0 and "summary.json' set aside: " in err and "not a file minizero.train writes" in err
    (tmp_path / "summary.json").unlink()
    bad = dict(state)
    w = bad["transformer.h.0.mlp.c_fc.weight"].copy()
    w[1, 2] = np.nan
    bad["transformer.h.0.mlp.c_fc.weight"] = w
    np.savez(tmp_path / "model.npz", **bad)
    code, err = _q_error(capsys, ["--weights", str(tmp_path / "model.npz"), "--model", "tiny"])
    assert code == 2 and "transformer.h.0.mlp.c_fc.weight" in err and "model.npz" in err


def test_quantize_short_data_and_bad_json_fail_before_work(tmp_path, capsys, trained_tiny):
    (tmp_path / "short.txt").write_text("abc" * 10)
    weights = str(trained_tiny / "model.npz")
    code, err = _q_error(capsys, ["--weights", weights, "--data", str(tmp_path / "short.txt")])
    assert code == 2 and "short.txt" in err and "at least" in err
    code, err = _q_error(capsys, ["--weights", weights, "--json", str(tmp_path)])
    assert code == 2 and "is a directory" in err
    code, err = _q_error(capsys, ["--weights", weights, "--json", str(tmp_path / "no" / "x.json")])
    assert code == 2 and "does not exist" in err
    assert capsys.readouterr().out == ""  # nothing measured


def test_the_calibration_line_says_the_papers_threshold_once_when_it_is_the_one_given():
    """Before: --outlier-threshold 6 printed 'reaching 6.0: 0, reaching 6.0 (the paper's threshold): 0'."""
    from minizero.quantize import format_table

    row = {"skipped": [], "bits": 8, "granularity": "row", "outlier_threshold": None, "outlier_columns": 0,
           "linear_bytes": 1, "linear_dense_bytes": 4, "model_bytes": 2, "val_loss": 1.0, "delta": 0.0,
           "block_size": None}
    cal = {"max_input_absmax": {"a": 7.0, "b": 1.0}, "columns_at_threshold": 3, "columns_at_6": 1}

    def line(threshold):
        result = {"weights": "w", "num_parameters": 1, "tokens": 1, "baseline": {"model_bytes": 4, "val_loss": 1.0},
                  "rows": [row], "calibration": cal, "outlier_threshold": threshold}
        return " ".join(format_table(result).split("outlier calibration")[1].split())

    assert line(6.0).endswith("input features reaching 6.0 (the paper's threshold): 1"), line(6.0)
    assert line(2.0).endswith("input features reaching 2.0: 3, reaching 6.0 (the paper's threshold): 1"), line(2.0)
