"""Dropout in every layout equals one process's dropout: masks addressed by dropout site and global batch row.

Inside ``rng.batch_rows`` a dropout reads its rows of the whole step's mask (key ``fold_in(fold_in(key, step),
site)``), so data, pipeline, tensor and context ranks, ZeRO, recompute and the micro-batch size all apply one
process's masks: float64 gradients (1e-12), weights after 3 steps (1e-12) and losses equal the one-process run's
with dropout 0.2; a checkpoint resumes them on another layout; ``mpiexec -n 2 --dp 2`` ends with one process's
weights.
"""

import numpy as np
import pytest

import tests.mp_reference as R
from minizero.autograd import Tensor, rng
from minizero.comm import run_in_threads
from minizero.nn import GPT, get_config
from minizero.nn.module import Dropout
from tests.test_checkpoint import F64, run as run_checkpointed

DROP = ["--dropout", "0.2"]


def _mask(site, shape, lo, total, offset=5):
    """The kept elements (bool) a site's dropout applies to ``shape`` at rows [lo, ...) of ``total``."""
    rng.set_rng_state({"key": 1234, "offset": offset})
    with rng.batch_rows(lo, total):
        y = Dropout(0.5, site=site)(Tensor(np.ones(shape)))
    return y.data != 0


def test_a_micro_batch_reads_its_rows_of_the_global_batch_mask():
    whole = _mask(3, (6, 4, 8), 0, 6)
    assert 0.3 < whole.mean() < 0.7
    for lo, b in [(0, 2), (2, 2), (4, 2), (1, 3), (5, 1)]:
        np.testing.assert_array_equal(_mask(3, (b, 4, 8), lo, 6), whole[lo:lo + b])
    assert not np.array_equal(_mask(4, (6, 4, 8), 0, 6), whole)  # another site: another mask
    assert not np.array_equal(_mask(3, (6, 4, 8), 0, 6, offset=6), whole)  # another step: another mask
    _mask(3, (6, 4, 8), 0, 6)
    assert rng.get_rng_state() == {"key": 1234, "offset": 5}  # reading a mask does not move the generator


def test_the_block_reader_and_the_state_carry_the_rows():
    rng.set_rng_state({"key": 99, "offset": 0})
    with rng.batch_rows(2, 8):
        drop = Dropout(0.3, site=1).reserve_mask((2, 3, 4, 4))  # what FlashAttention reads by blocks
        assert (drop.shape, drop.origin) == ((8, 3, 4, 4), (2, 0, 0, 0))
        state = rng.get_rng_state()
        assert state == {"key": 99, "offset": 0, "rows": [2, 8]}
        with pytest.raises(ValueError, match="needs a site"):
            Dropout(0.3)(Tensor(np.ones((2, 3))))
        with pytest.raises(ValueError, match=r"rows \[2, 10\) of 8"):
            Dropout(0.3, site=0)(Tensor(np.ones((8, 3))))
    assert rng.get_rng_state() == {"key": 99, "offset": 0}
    rng.set_rng_state(state)  # recompute's replay restores the rows with the rest
    assert rng.in_batch_rows()
    rng.set_rng_state({"key": 99, "offset": 0})
    assert not rng.in_batch_rows()
    for bad in ({"key": 1, "offset": 0, "rows": [3, 3]}, {"key": 1, "offset": 0, "rows": "x"}):
        with pytest.raises(ValueError, match="dropout generator"):
            rng.set_rng_state(bad)
    with pytest.raises(ValueError, match=r"rows start 4 must lie in \[0, total 4\)"):
        with rng.batch_rows(4, 4):
            pass


def test_a_block_of_whole_rows_equals_the_same_elements_read_by_pieces():
    """A dropout's own rows (one run of the C order, read with one arange) are the elements a sliced reader
    (sequence parallelism, flash attention) computes index by index."""
    rng.set_rng_state({"key": 7, "offset": 3})
    with rng.batch_rows(2, 6):
        drop = rng.MaskStream.reserve((3, 4, 5), 0.4, site=2)
        whole = drop.block((slice(0, 3), slice(0, 4), slice(0, 5)))
        pieces = [drop.block((slice(0, 3), slice(0, 4), slice(lo, hi))) for lo, hi in ((0, 2), (2, 5))]
        rows = [drop.block((slice(r, r + 1), slice(0, 4), slice(0, 5))) for r in range(3)]
    assert whole.shape == (3, 4, 5) and 0.3 < whole.mean() < 0.9
    np.testing.assert_array_equal(whole, np.concatenate(pieces, axis=2))
    np.testing.assert_array_equal(whole, np.concatenate(rows, axis=0))


def test_gpt_numbers_its_dropouts_in_module_order():
    model = GPT(get_config("tiny", dropout=0.1), meta=True)
    sites = [(n, m.site) for n, m in model.named_modules() if isinstance(m, Dropout)]
    assert [s for _, s in sites] == list(range(1 + 3 * 2))
    assert sites[0][0] == "transformer.drop"


def _one(micro_batch, m, extra=()):
    return run_in_threads(1, R.run_single, "tiny", micro_batch, m, [*DROP, *extra])[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("micro_batch, m", [(1, 4), (4, 1)])
def test_the_micro_batch_size_does_not_change_the_masks(micro_batch, m):
    ref, got = _one(2, 2), _one(micro_batch, m)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-12)
    for name, a in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], a, rtol=0, atol=1e-12 * np.abs(a).max(), err_msg=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--zero", "3"], ["--zero", "2", "--recompute", "full"]])
def test_data_parallel_with_dropout_equals_one_process(extra):
    ref = _one(4, 1, extra[2:])  # one process without ZeRO (its sharded gradients are the same numbers)
    for got in run_in_threads(2, R.run_single_dp, "tiny", 2, 1, [*DROP, *extra]):
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-12)
        for name, a in ref["params"].items():
            np.testing.assert_allclose(got["params"][name], a, rtol=0, atol=1e-12 * np.abs(a).max(), err_msg=name)
    wrong = run_in_threads(1, R.run_single, "tiny", 4, 1, ["--dropout", "0.2", "--seed", "8"])[0]
    assert not np.allclose(wrong["losses"], ref["losses"])  # the check can fail: other masks, other losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, dp, tp, pp, schedule, extra", [
    ("tiny", 1, 1, 2, "1f1b", ["--recompute", "full"]),
    ("tiny", 2, 1, 2, "gpipe", ["--recompute", "selective"]),
    ("tiny", 1, 2, 2, "1f1b", ["--sequence-parallel"]),
    ("tiny", 1, 1, 2, "zb-h1", []),
    ("default", 1, 1, 2, "interleaved", ["--virtual-stages", "2"]),
    ("tiny", 2, 2, 1, "1f1b", ["--attention", "flash", "--attention-block", "4"]),
])
def test_every_layout_with_dropout_equals_one_process(model, dp, tp, pp, schedule, extra):
    m = 2 * pp  # micro-batches per step on each data rank
    one = [] if "--virtual-stages" in extra else [a for a in extra if a != "--sequence-parallel"]
    ref = run_in_threads(1, R.run_single, model, 2 * dp, m, [*DROP, *one])[0]
    got = run_in_threads(dp * tp * pp, R.run_parallel, model, 2, dp, tp, pp, m, schedule, [*DROP, *extra])
    R.assert_matches(ref, got, f"dp {dp} tp {tp} pp {pp} {schedule} {extra} with dropout")


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_the_masks_on_another_layout(tmp_path):
    """Saved at step 3 of 6 on dp 2, resumed on pp 2 with twice the micro-batches: the straight run's losses and
    weights (1e-13), since every rank holds the one generator state."""
    flags = F64 + DROP + ["--recompute", "full"]
    straight = run_checkpointed(2, flags + ["--save-every", "3", "--save-dir", str(tmp_path)])
    resumed = run_checkpointed(2, flags + ["--pp", "2", "--micro-batch-size", "1", "--micro-batches", "4",
                                           "--resume", str(tmp_path / "step_00000003")])
    assert resumed["start_step"] == 3
    np.testing.assert_allclose(resumed["train_losses"], straight["train_losses"][3:], rtol=0, atol=1e-13)
    for k, a in straight["params"].items():
        np.testing.assert_allclose(resumed["params"][k], a, rtol=0, atol=1e-13, err_msg=k)


@pytest.mark.timeout(300)
def test_data_parallel_with_dropout_from_the_command_line(mpiexec, tmp_path):
    """``mpiexec -n 2 python -m minizero.train --dp 2 --dropout 0.1`` ends with one process's weights."""
    base = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
            "--sample-tokens", "1", "--progress", "none", "--seed", "3", "--micro-batch-size", "2", "--dropout", "0.1"]
    R.cli_matches_one_process(mpiexec, str(tmp_path), base, ["--zero", "1"], ["--grad-accum", "2"])


@pytest.mark.parametrize("p", [0.0, 2 ** -24, 0.1, 1 / 3, 0.5, 0.99999994, 0.9999999999])
def test_the_integer_keep_test_is_the_float_one(p):
    """``rng._keep`` compares the uint64 outputs with one integer; the float form, u = (z >> 40) 2**-24 >= float32(p),
    decides every output the same way (edges: 0, the threshold and one below it, 2**64 - 1; p rounding to 1)."""
    z = rng.uniform_bits(100_000)
    t = int(np.ceil(float(np.float32(p)) * 2 ** 24))
    edges = [0, 2 ** 64 - 1] + ([max(0, (t << 40) - 1), t << 40] if t < 2 ** 24 else [])
    z = np.concatenate([z, np.array(edges, dtype=np.uint64)])
    want = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24) >= np.float32(p)
    np.testing.assert_array_equal(rng._keep(z.copy(), p), want)


def test_a_mask_owns_its_bytes_in_its_own_shape():
    """The ledger counts a saved mask by its owner: a view of a flat array would be counted as another shape (the
    attention's (b, a, s, s) mask then leaves the scores' row)."""
    shape = (2, 3, 4, 4)
    assert rng.dropout_keep_mask(shape, 0.1).base is None
    with rng.batch_rows(2, 8):
        for sl in [tuple(slice(0, d) for d in shape), (slice(0, 2), slice(1, 3), slice(0, 4), slice(0, 4))]:
            keep = rng.MaskStream.reserve(shape, 0.1, site=1).block(sl)
            assert keep.base is None and keep.shape == tuple(s.stop - s.start for s in sl)


def test_a_training_forward_applies_every_dropout_of_the_gpt_once(monkeypatch):
    """nanoGPT's placement: the embedding sum, the attention probabilities, and the attention and MLP outputs of
    every block each pass one dropout once per forward. (Round-2 mutant: the embedding dropout dropped unnoticed:
    every layout compares against the same model.)"""
    model = GPT(get_config("tiny", dropout=0.2, dtype="float64"))
    called = []
    forward = Dropout.forward
    monkeypatch.setattr(Dropout, "forward", lambda self, x: called.append(self.site) or forward(self, x))
    model.train()
    model(np.zeros((2, 8), dtype=np.int64))
    sites = sorted(m.site for _, m in model.named_modules() if isinstance(m, Dropout))
    assert sites == list(range(1 + 3 * model.config.n_layer))
    assert sorted(called) == sites
