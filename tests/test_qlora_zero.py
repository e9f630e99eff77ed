"""QLoRA and LoRA under ZeRO (issue 29): the adapters are what is reduced and sharded, never the frozen base.

* ``finetune --zero 1|2|3`` on 2 ranks (in-process threads, and once under ``mpiexec``) equals the
  one-process fine-tune in float64: the merged weights to 1e-13.
* Each ``LoRAAdapter`` is one ZeRO unit: the shard map holds the adapters' parameters and nothing else,
  and the bytes a rank sends per step are the ZeRO traffic formula over the adapters' count alone.
* The ledger's frozen, adapter and optimizer bytes per rank are the estimator's ``lora_state_bytes``, exactly.
"""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from minizero.comm.threads import run_in_threads
from minizero.data import load_tokens
from minizero.finetune import build_parser, finetune
from minizero.memory.estimator import lora_state_bytes
from minizero.nn import GPT, get_config
from minizero.nn.lora import adapters, add_lora
from minizero.nn.module import ModuleList
from minizero.zero import traffic_formula, zero_optimizer
from tests.conftest import REPO_ROOT, mpi_env


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A float64 tiny GPT as train writes it (model.npz + summary.json), and continuation text."""
    out = tmp_path_factory.mktemp("base64")
    cfg = get_config("tiny", dtype="float64")
    state = {k: np.asarray(v) for k, v in GPT(cfg, seed=3).state_dict().items()}
    np.savez(out / "model.npz", **state)
    (out / "summary.json").write_text(json.dumps({"config": {"model": dataclasses.asdict(cfg)}}))
    data = out / "data.txt"
    data.write_text(open(np.__file__).read() * 3)
    return out / "model.npz", data


def _args(base, *extra):
    weights, data = base
    return build_parser().parse_args(["--weights", str(weights), "--data", str(data), "--steps", "3",
                                      "--batch-size", "4", "--eval-batches", "1", "--lr", "3e-3", *extra])


def _assert_estimated(row, method, dp=1, zero=0):
    est = lora_state_bytes(get_config("tiny"), 8, base="nf4" if method == "qlora" else "float", element=8,
                           dp=dp, zero=zero)
    assert (row["frozen_bytes"], row["trainable_bytes"], row["optimizer_bytes"]) == \
        (est["frozen"], est["adapters"], est["optimizer_state"])


def _assert_equal(got, want, tol=1e-13):
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == np.float64
        np.testing.assert_allclose(got[name], a, rtol=0, atol=tol * max(1.0, np.abs(a).max()), err_msg=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["qlora", "lora"])
def test_zero_finetune_equals_one_process_and_reduces_only_the_adapters(base, method):
    tokens = load_tokens(str(base[1]))
    row1, model1, want = finetune(_args(base), method, tokens)
    assert any(not np.array_equal(want[k], v) for k, v in np.load(base[0]).items())  # the adapters moved
    psi = row1["trainable_parameters"]
    _assert_estimated(row1, method)
    for stage in (1, 2, 3):
        out = run_in_threads(2, lambda comm: finetune(_args(base, "--zero", str(stage)), method, tokens, comm),
                             timeout=120)
        for row, _, merged in out:
            _assert_equal(merged, want)
            assert row["val_after"] == pytest.approx(row1["val_after"], abs=1e-13)
            # every byte sent per step is the adapters' (8 bytes each): the frozen base is never reduced
            assert row["grad_sync_bytes_per_step"] == traffic_formula(stage, psi, 2, itemsize=8)
            assert row["frozen_bytes"] == row1["frozen_bytes"]
            _assert_estimated(row, method, 2, stage)
        if stage == 3:  # each rank holds half of the adapters (the tiny model's are even-sized: no padding)
            assert out[0][0]["trainable_bytes"] == row1["trainable_bytes"] // 2


def test_each_adapter_is_a_zero_unit_and_nothing_else_is():
    cfg = get_config("tiny", dtype="float64")
    model = GPT(cfg, seed=0)
    add_lora(model, 4, 8.0, base="nf4")
    names = run_in_threads(2, lambda comm: [u.param_names for u in zero_optimizer(
        ModuleList(adapters(model)), comm, 2, weight_decay=0.0).shard_map.units], timeout=60)[0]
    assert len(names) == 4 * cfg.n_layer and all(n[0].endswith("lora_A") and n[1].endswith("lora_B") and len(n) == 2
                                                 for n in names)


@pytest.mark.timeout(300)
def test_zero3_qlora_under_mpiexec_equals_one_process(mpiexec, base, tmp_path):
    got = {}
    for n, zero in ((1, "0"), (2, "3")):
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "minizero.finetune", "--weights", str(base[0]),
               "--data", str(base[1]), "--method", "qlora", "--steps", "3", "--batch-size", "4", "--lr", "3e-3",
               "--eval-batches", "1", "--zero", zero, "--out", str(tmp_path / f"ft{n}")]
        proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got[n] = dict(np.load(tmp_path / f"ft{n}" / "model.npz"))
    _assert_equal(got[2], got[1])
