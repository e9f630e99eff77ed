"""The main job end to end: bad input, outputs, one rank failing, and the model's nanoGPT names."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from minizero.nn import GPT, get_config
from minizero.memory.plots import PLOTS_OFF
from minizero.train import UsageError, parse_args
from tests.conftest import earlier_json, mpi_env, mpiexec_path

TINY = ["--model", "tiny", "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "8",
        "--no-progress"]


def launch(mpiexec, n, args, timeout=120, env=None):
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "minizero.train", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env or mpi_env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("argv,needle", [
    (["--model", "huge"], "'huge'"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--micro-batch-size", "-1"], "--micro-batch-size must be >= 1, got -1"),
    (["--batch-size", "7"], "--batch-size 7 is not divisible by micro-batch-size x data-parallel size = 2 x 2 = 4"),
    (["--batch-size", "8", "--grad-accum", "3"], "!= micro-batch-size x data-parallel size x grad-accum"),
    (["--data", "/no/such/file.txt"], "'/no/such/file.txt': no such file"),
    (["--lr", "nan"], "--lr must be a normal float32 number"),
    (["--dtype", "int8"], "'int8'"),
    (["--block-size", "4096"], "exceeds the 'default' preset's block_size 128"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--dropout", "0.999999999"], "at most 0.99999994 in float32, got 0.999999999"),  # before: float32(p) = 1 ran
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--micro-batch-size", "1000000000"], "--micro-batch-size must be <= 4,096"),
    (["--bucket-mb", "1e-9"], "--bucket-mb must be at least one byte"),
    (["--out", "o", "--json", "o/model.npz"], "would overwrite the weights"),
    (["--out", "/dev/null/out"], "cannot be created or written"),
])
def test_bad_arguments_are_named(argv, needle):
    with pytest.raises(UsageError) as e:
        parse_args(argv, world_size=2)
    assert needle in str(e.value)


def test_json_and_trace_never_overwrite_another_run_s_files_nor_wait_on_a_fifo(tmp_path, monkeypatch):
    from minizero.overwrite import check_output

    monkeypatch.chdir(tmp_path)
    os.mkdir("a")
    np.savez(tmp_path / "a" / "model.npz", w=np.zeros(1))  # another run's files (a user's own: test_output_paths)
    (tmp_path / "a" / "model.json").write_text('{"n_head": 2}')
    (tmp_path / "a" / "summary.json").write_text(earlier_json(train_loss=[], world_size=1, config={}))
    before = {n: (tmp_path / "a" / n).read_bytes() for n in ("model.npz", "model.json", "summary.json")}
    os.mkfifo("pipe")
    for flag in ("--json", "--trace"):
        for name in ("model.npz", "model.json", "summary.json"):
            with pytest.raises(UsageError, match=f"{flag} 'a/{name}' would overwrite {name}, which minizero's"):
                parse_args(["--out", "b", flag, f"a/{name}"], world_size=1)
        with pytest.raises(UsageError, match=f"{flag} 'pipe' is a named pipe"):
            parse_args(["--out", "b", flag, "pipe"], world_size=1)
    with pytest.raises(ValueError, match="'pipe' is a named pipe"):  # finetune, quantize and compare's --json
        check_output("pipe")
    assert parse_args(["--out", "a", "--json", "a/summary.json"], world_size=1).json == "a/summary.json"  # its own
    assert parse_args(["--out", "a"], world_size=1).json == os.path.join("a", "summary.json")
    assert all((tmp_path / "a" / n).read_bytes() == b for n, b in before.items())
    os.mkdir("res")  # a summary on its own (no weights beside it) is no run's: a re-run may replace it
    (tmp_path / "res" / "summary.json").write_text(earlier_json(train_loss=[], world_size=1, config={}))
    assert parse_args(["--out", "b", "--json", "res/summary.json"], world_size=1).json == "res/summary.json"
    os.symlink("a", "link")  # OUT's own summary through a link is still its own
    assert parse_args(["--out", "link", "--json", "a/summary.json"], world_size=1).json == "a/summary.json"
    for name in ("summary.json", "model.npz"):  # OUT's own files as FIFOs: the default --json, the weights
        os.makedirs("c", exist_ok=True)
        os.mkfifo(os.path.join("c", name))
        with pytest.raises(UsageError, match=f"c/{name}' is a named pipe"):
            parse_args(["--out", "c"], world_size=1)
        os.remove(os.path.join("c", name))


def test_batch_size_derives_grad_accum():
    args = parse_args(["--batch-size", "24", "--micro-batch-size", "3"], world_size=4)
    assert args.grad_accum == 2 and args.batch_size == 24


@pytest.mark.timeout(120)
def test_bad_argument_under_mpi_fails_fast_and_once(mpiexec):
    proc, elapsed = launch(mpiexec, 2, ["--batch-size", "7"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--batch-size 7 is not divisible") == 1  # printed by rank 0 only
    assert elapsed < 60


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """``mpiexec -n 2`` the main job (TINY, a checkpoint at step 2): (process, OUT). One run for the test of its
    outputs and the straight run of the resumed-traffic test."""
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found (pip install mpich, or a system MPI)")
    out = tmp_path_factory.mktemp("main_job") / "run"
    proc, _ = launch(mpiexec_path(), 2, TINY + ["--save-every", "2", "--out", str(out)], timeout=240)
    return proc, out


@pytest.mark.timeout(300)
def test_main_job_writes_weights_and_summary(main_job):
    proc, out = main_job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validation loss" in proc.stdout and "memory summary" in proc.stdout and "sample:" in proc.stdout
    said = " ".join(proc.stdout.split())  # prose is wrapped at 100 columns
    assert ("parameter gathers and broadcasts (the start-up broadcast: a binomial tree from rank 0, whose leaves "
            "send nothing): r0 ") in said
    assert "ZeRO" not in proc.stdout  # not asked for: no "ZeRO stage 0"
    # the suite's MINIZERO_PLOTS=0 (tests/conftest.py): said, and nothing drawn (test_memory_monitor draws both)
    assert PLOTS_OFF in proc.stdout and not {"loss.png", "memory.png"} & set(os.listdir(out))
    assert "model states per rank at the optimizer step (every rank holds them all)" in said
    report = proc.stdout[proc.stdout.index("validation loss:"):proc.stdout.index("sample:")]
    assert max(len(line) for line in report.splitlines()[1:]) <= 100, report  # the headline stays one line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["model"]["n_layer"] == 2
    assert summary["config"]["train"]["block_size"] == summary["config"]["model"]["block_size"] > 0  # resolved
    assert summary["schedule"] is None and summary["config"]["train"]["schedule"] is None  # no pipeline
    assert len(summary["train_loss"]) == 4 and summary["val_loss"] < summary["val_history"][0][1]
    assert summary["tokens_per_s"] > 0
    for key in ("ledger_peak_bytes", "process_peak_bytes", "bytes_sent", "bytes_sent_grad_allreduce"):
        assert len(summary[key]) == 2, key
    n_params = get_config("tiny").num_parameters()
    assert summary["ledger_peak_bytes"][0]["parameters"] == 4 * n_params
    assert summary["ledger_peak_bytes"][1]["optimizer_state"] == 8 * n_params
    # ring all-reduce: 2(N-1)/N of the gradient bytes per step = exactly the bytes once at N = 2
    assert summary["bytes_sent_grad_allreduce"][0] == 4 * 4 * n_params
    weights = np.load(out / "model.npz")
    assert "transformer.h.1.mlp.c_fc.weight" in weights and weights["lm_head.weight"].shape == (256, 16)
    assert not [f for f in os.listdir(out) if f.startswith(".")], "temporary files left behind"


@pytest.mark.timeout(120)
def test_header_names_every_layout_choice(mpiexec):
    """The header says cp beside dp (not folded into it, the mesh line too), the device, ZeRO, sequence parallelism."""
    proc, _ = launch(mpiexec, 4, TINY + ["--steps", "1", "--no-save", "--cp", "2", "--tp", "2", "--sequence-parallel",
                                         "--zero", "1", "--device", "strict"], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = [line for line in proc.stdout.splitlines() if not line.startswith("  ")]  # wrapped lines' first rows
    assert head[0].startswith("minizero: 4 rank(s) as dp 1 x cp 2 x tp 2 x pp 1,"), head[0]
    assert head[1] == "device strict (NumPy underneath; implicit host transfers raise); messages over mpi"
    assert head[2].startswith("global batch 2 sequences x 16 tokens (32 tokens per step) = micro-batch 2 x 1 data")
    assert "ZeRO stage 1: optimizer state sharded over the 2 rank(s) of the data group" in head
    assert any(line.startswith("sequence parallel: ") for line in head)
    assert "mesh: dp=1 x cp=2 x tp=2 x pp=1 = 4 ranks, grid = arange(4).reshape(pp=1, dp*cp=2, tp=2)" in head
    header = proc.stdout.split("\ntraffic per step")[0].splitlines()
    assert len(header) > 8 and max(len(line) for line in header) <= 100, header  # wrapped as the report
    plain, _ = launch(mpiexec, 2, TINY + ["--steps", "1", "--no-save", "--zero", "2"], timeout=90)
    assert plain.returncode == 0, plain.stderr
    assert "as dp 2 x tp 1 x pp 1," in plain.stdout
    # NumPy's BLAS, its kernel and the threads the main job set (cores / ranks on the node, at least 1)
    assert re.search(r"\ndevice cpu \(NumPy, \w+ [\d.]+( \w+ kernel)?, \d+ threads? per rank\); messages over mpi\n",
                     plain.stdout), plain.stdout
    assert ("ZeRO stage 2: optimizer state and gradients sharded over the 2 rank(s) of the data group; "
            "reduce-scatters overlap backward") in " ".join(plain.stdout.split())  # wrapped at 100 columns
    assert ("  parameter gathers and broadcasts (ZeRO's gathers, its start-up all-gather of the shards included): "
            "r0-1 ") in plain.stdout.replace("\n    ", " ")  # no start-up broadcast; the set-up gather counted, said
    z3, _ = launch(mpiexec, 2, TINY + ["--steps", "1", "--no-save", "--zero", "3", "--recompute", "full",
                                       "--quantized-comm", "--optimizer", "adam8bit"], timeout=90)
    assert z3.returncode == 0, z3.stderr
    assert ("also: activation recompute full; 8-bit Adam (an absmax per 256 elements); INT8 on the wire for the "
            "gradient reduce-scatters and parameter all-gathers") in " ".join(z3.stdout.split()), z3.stdout
    assert "also: " not in plain.stdout  # nothing beyond what the other lines name
    assert "of the data group; reduce-scatters" not in " ".join(z3.stdout.split())  # INT8 comm: blocking, as built
    assert "  (--recompute full: each block's saves exist only while backward recomputes them" in z3.stdout
    assert "(--recompute" not in plain.stdout
    assert ("  parameter gathers and broadcasts (ZeRO's gathers; the final gather for the weights and the sample, "
            "one forward's gathers more, comes after these figures): r0-1 ") in z3.stdout.replace("\n    ", " "), \
        z3.stdout  # wrapped


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attention, pp", [("ring", 2), ("ulysses", 1)])
def test_traffic_kinds_add_up_with_cp_and_pp(attention, pp, mpiexec, tmp_path):
    """Every byte in exactly one kind: ring attention (or Ulysses' all-to-alls) has its own, the tied embedding's
    all-reduce (its group is split from the pipeline group) is gradient reduction only; so no kind is negative and
    they sum to the total. (The pipeline's bytes do not depend on the attention: Ulysses runs without it.)"""
    proc, _ = launch(mpiexec, 2 * pp, TINY + ["--steps", "2", "--cp", "2", "--cp-attention", attention, "--pp", str(pp),
                                              "--out", str(tmp_path)], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = summary["bytes_sent_by_kind"]
    for r in range(2 * pp):
        mine = {k: v[r] for k, v in kinds.items()}
        assert all(v >= 0 for v in mine.values()), mine
        assert sum(mine.values()) == summary["bytes_sent"][r], mine
        assert mine["context_parallel_attention"] > mine["other"], mine
    assert "context parallel ring attention" in proc.stdout
    said = " ".join(proc.stdout.split())  # prose is wrapped at 100 columns
    holds = ("split over the ranks: each holds its pipeline stage" if pp > 1 else
             "every rank holds them all: context parallelism splits the sequence, not the model")
    assert f"model states per rank at the optimizer step ({holds})" in said
    assert "other (loss, norm, flags, metrics, replica digests): r0-1 " in said  # the default replica check's bytes
    # the per-step traffic table gives ring attention its own cp row (its group is split from the data group)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("  cp    (2 ranks each)"))
    value, unit = re.search(r"nodes?,\s+([\d.]+) (B|KiB|MiB)", row).groups()
    per_step = sum(kinds["context_parallel_attention"]) / 2
    assert float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit] == pytest.approx(per_step, rel=1e-3), (row, per_step)
    assert ("(ring attention)" if attention == "ring" else "(Ulysses all-to-all)") in row
    assert any(line.startswith("  dp-cp (2 ranks each)") for line in proc.stdout.splitlines())


@pytest.mark.timeout(180)
def test_zero3_final_gather_is_in_the_figures_only_where_the_report_says(mpiexec, tmp_path):
    """ZeRO-3's final gather (every unit once, for model.npz and the sample) sends (N-1) shards per rank. With tp = pp
    = 1 it comes after the figures: parameter_gathers is the steps' gathers alone, 2m (N-1) shards per step (the
    estimator's m (N-1)/N 2P). With --tp 2 the whole-model copy for rank 0 gathers first, inside the figures: once
    more (N-1) shards (and before, the model was gathered again after the figures, for nothing)."""
    from minizero.memory.estimator import Strategy, stage_state_bytes
    for tp in (1, 2):
        out = tmp_path / str(tp)
        proc, _ = launch(mpiexec, 2 * tp, TINY + ["--steps", "2", "--zero", "3", "--dp", "2", "--tp", str(tp),
                                                  "--out", str(out)], timeout=150)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        st = Strategy(dp=2, tp=tp, zero=3, precision="fp32", micro_batches=summary["micro_batches"])
        shard = stage_state_bytes(get_config("tiny"), st)["parameters"]  # this rank's 1/N of the stage, bytes
        want = 2 * (2 * st.micro_batches * shard) + (shard if tp > 1 else 0)  # 2 steps, N - 1 = 1
        sent = summary["bytes_sent_by_kind"]["parameter_gathers"]
        assert [sent[r] for r in range(2 * tp) if r != 1 or tp == 1] == [want] * (2 * tp - (tp > 1)), (sent, want)
        label = ("ZeRO's gathers, its final gather for the model's copy included" if tp > 1 else
                 "ZeRO's gathers; the final gather for the weights and the sample, one forward's gathers more, "
                 "comes after these figures")
        assert f"  parameter gathers and broadcasts ({label}" in proc.stdout.replace("\n    ", " "), proc.stdout  # wrapped
        # 'at the optimizer step r0-1 ...': the figures ran into the words, where every other layout has a colon
        assert "ZeRO stage 3: model states per rank at the optimizer step: r0" in " ".join(proc.stdout.split())

def test_blas_threads_honour_the_users_cap(monkeypatch):
    """Before: OPENBLAS_NUM_THREADS=1 was overridden by cores / ranks (and the report said so without a word)."""
    import minizero.train as T

    monkeypatch.setattr(T, "_cores", lambda: 8)
    for name in T.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert T._blas_threads(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert T._blas_threads(2) == 3 and T._blas_threads(8) == 1  # a cap, never more than cores / ranks
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # the first one set wins
    assert T._blas_threads(2) == 1
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "junk")  # not a positive integer: cores / ranks, as before
    assert T._blas_threads(2) == 4


@pytest.mark.timeout(120)
def test_traffic_per_step_leaves_validation_out(mpiexec, tmp_path):
    """Before: the table divided the run's bytes, validation's forward passes included, by the steps, so the
    same layout's "per step" moved with --steps and --eval-batches (up to 2x). Validation has its own kind now,
    and the model's final gather onto rank 0 is a parameter gather (it was "other")."""
    rows, kinds = [], []
    for i, eval_batches in enumerate(("1", "3")):
        out = tmp_path / str(i)
        proc, _ = launch(mpiexec, 2, TINY + ["--tp", "2", "--eval-batches", eval_batches, "--out", str(out)])
        assert proc.returncode == 0, proc.stderr
        rows.append(next(line for line in proc.stdout.splitlines() if line.startswith("  tp    (2 ranks each)")))
        assert "(split over the ranks: each holds its tensor-parallel shard)" in " ".join(proc.stdout.split())
        kinds.append(json.loads((out / "summary.json").read_text())["bytes_sent_by_kind"])
    assert rows[0] == rows[1]
    assert kinds[0]["tensor_parallel_activations"] == kinds[1]["tensor_parallel_activations"]
    assert 0 < kinds[0]["validation"][0] < kinds[1]["validation"][0]
    assert kinds[0]["parameter_gathers"][1] > 0 and kinds[0]["other"][1] < 1024  # rank 1 sends its half to rank 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_one_rank_failing_ends_the_job(mpiexec, kind, tmp_path):
    env = dict(mpi_env(), MINIZERO_FAULT=f"1:2:{kind}")
    proc, elapsed = launch(mpiexec, 2, TINY + ["--steps", "50", "--no-save"], timeout=90, env=env)
    assert proc.returncode != 0
    assert elapsed < 60, f"job took {elapsed:.1f} s to end after a rank failed"
    if kind == "raise":
        assert "[rank 1]" in proc.stderr and "injected fault" in proc.stderr


def test_state_dict_matches_nanogpt_names_and_shapes():
    cfg = get_config("tiny")
    sd = GPT(cfg).state_dict()
    c, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    expected = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (t, c),
                "transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,), "lm_head.weight": (v, c)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        expected.update({h + "ln_1.weight": (c,), h + "ln_1.bias": (c,), h + "ln_2.weight": (c,),
                         h + "ln_2.bias": (c,), h + "attn.c_attn.weight": (3 * c, c), h + "attn.c_attn.bias": (3 * c,),
                         h + "attn.c_proj.weight": (c, c), h + "attn.c_proj.bias": (c,),
                         h + "mlp.c_fc.weight": (4 * c, c), h + "mlp.c_fc.bias": (4 * c,),
                         h + "mlp.c_proj.weight": (c, 4 * c), h + "mlp.c_proj.bias": (c,)})
    assert {k: v.shape for k, v in sd.items()} == expected
    np.testing.assert_array_equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    model2 = GPT(cfg, seed=99)
    model2.load_state_dict(sd)
    np.testing.assert_array_equal(model2.state_dict()["transformer.h.0.mlp.c_fc.weight"],
                                  sd["transformer.h.0.mlp.c_fc.weight"])
    with pytest.raises(ValueError, match="has shape"):
        model2.load_state_dict({**sd, "transformer.wpe.weight": np.zeros((3, 3))})
    with pytest.raises(KeyError, match="missing keys"):
        model2.load_state_dict({k: v for k, v in sd.items() if "wpe" not in k})


def test_tied_head_gets_both_gradients():
    """The shared wte / lm_head matrix receives the embedding's and the head's gradient, summed."""
    cfg = get_config("tiny", dtype="float64")
    model = GPT(cfg)
    x = np.random.default_rng(0).integers(0, 256, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    g_total = model.transformer["wte"].weight.grad.copy()
    # finite difference on one entry used by both the lookup and the head
    w = model.transformer["wte"].weight.data
    i, j, eps = int(x[0, 0]), 3, 1e-6
    w[i, j] += eps
    lp = model(x, x)[1].item()
    w[i, j] -= 2 * eps
    lm = model(x, x)[1].item()
    w[i, j] += eps
    assert abs((lp - lm) / (2 * eps) - g_total[i, j]) < 1e-7 * max(1.0, abs(g_total[i, j]))


def test_data_and_output_paths_checked_before_work(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("hello world " * 10)
    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(256)) * 10)
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [(["--data", str(empty)], "is empty"), (["--data", str(short)], "needs at least"),
             (["--data", str(binary)], "is not UTF-8 text"), (["--data", str(tmp_path)], "is a directory"),
             (["--out", str(afile)], "exists and is not a directory"), (["--json", str(tmp_path)], "is a directory")]
    for argv, needle in cases:
        with pytest.raises(UsageError, match=needle):
            parse_args(["--model", "tiny"] + argv)


def test_malformed_fault_spec_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("MINIZERO_FAULT", "abc")
    with pytest.raises(UsageError, match="expected RANK:STEP:KIND"):
        parse_args([])


@pytest.mark.timeout(120)
def test_divergence_stops_without_writing_nan_weights(mpiexec, tmp_path):
    """Also: ``python -m minizero.train`` loads the module once: the pipeline path's TrainingDiverged is recognised,
    one line, not a traceback (the path without a pipeline: test_divergence_is_diagnosed_before_the_update)."""
    out = tmp_path / "run"
    out.mkdir()
    np.savez(out / "model.npz", previous=np.arange(3.0))  # an earlier run's weights (a user's own file is refused)
    before = (out / "model.npz").read_bytes()
    proc, _ = launch(mpiexec, 2, TINY + ["--lr", "1e30", "--weight-decay", "0", "--warmup", "0", "--pp", "2",
                                         "--out", str(out)], timeout=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "minizero.train stopped: step" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr  # a diagnosis, not a crash
    assert "RuntimeWarning" not in proc.stderr + proc.stdout  # NumPy's overflow lines before it: noise
    assert "training diverged" in " ".join((proc.stderr + proc.stdout).split())
    assert (out / "model.npz").read_bytes() == before


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # lr 1e30 overflows on purpose
def test_divergence_is_diagnosed_before_the_update():
    from minizero.comm import run_in_threads
    from minizero.train import TrainingDiverged, train

    args = parse_args(TINY + ["--lr", "1e30", "--weight-decay", "0", "--no-save"], 2)
    with pytest.raises(TrainingDiverged, match="step 2: the gradient norm is nan; training diverged"):
        run_in_threads(2, lambda comm: train(args, comm, log=lambda s: None))


@pytest.mark.timeout(120)
def test_the_diverged_error_names_the_step_as_the_progress_log_does(monkeypatch, capsys):
    """Before: loop step 2 (0-based), the log's "step 3/4", failed as "step 2: the gradient norm is nan", the number
    of the log's last good line."""
    from minizero.comm import run_in_threads
    from minizero.train import TrainingDiverged, train

    monkeypatch.setenv("MINIZERO_FAULT", "0:2:inf")  # 0-based: the third step's gradients become inf
    args = parse_args([*TINY[:-1], "--no-save", "--progress", "log", "--log-every", "1"], 1)
    with pytest.raises(TrainingDiverged) as e:
        run_in_threads(1, lambda comm: train(args, comm, log=lambda s: None))
    logged = [ln.split()[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    # inf x a gradient's exact zero is NaN: whether one is exactly 0 depends on the BLAS kernel (Haswell: nan)
    assert re.search(r"\] step 3: the gradient norm is (inf|nan); training diverged", str(e.value)), e.value
    assert logged[-1] == "2/4" and "3/4" not in logged, logged  # the log's next line would have been step 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--dp", "2"], ["--dp", "2", "--zero", "2"]])
def test_the_traffic_table_names_what_it_leaves_out_in_bytes_of_the_run(layout):
    """Before: validation (the start's and the final one even at --eval-every 0; at tp 2 four steps' worth) and the
    start-up broadcast were left out of the per-step table without a word; ZeRO-1/2's start-up all-gather of the
    parameter shards was counted into the dp row's bytes per step (4 steps of ZeRO-2 on 4 ranks: 8% too many)."""
    from minizero.comm import run_in_threads
    from minizero.ledger import format_bytes
    from minizero.train import train

    args = parse_args(TINY + ["--eval-every", "0", "--sample-tokens", "0", "--no-save", *layout], 2)

    def one(comm):
        lines = []
        res = train(args, comm, log=lines.append)
        by_op = res["strategy"].topo.world.traffic.by_op  # every group's bytes, through its parent ledger
        return lines, by_op.get("validation", 0), by_op.get("broadcast_params", 0), by_op.get("setup_gather", 0)
    ranks = run_in_threads(2, one, timeout=120)
    val, bcast, gather = (sum(r[k] for r in ranks) for k in (1, 2, 3))
    zero = "--zero" in layout
    assert val > 0 and (bcast > 0) == (layout[0] == "--dp" and not zero) and (gather > 0) == zero
    note = (f"  left out above, totals for the run: validation {format_bytes(val)} (before the first step, each "
            "periodic one, the end)")
    note += f"; start-up broadcast of the parameters {format_bytes(bcast)}" if bcast else ""
    note += f"; start-up all-gather of the parameters {format_bytes(gather)}" if gather else ""
    lines = ranks[0][0]
    start = next(i for i, line in enumerate(lines) if line.startswith("traffic per step"))
    assert note in "\n".join(lines[start:start + 6]).replace("\n    ", " "), lines  # wrapped at 100 columns


@pytest.mark.timeout(300)
def test_a_resumed_run_reports_traffic_per_step_of_the_steps_it_ran(mpiexec, main_job, tmp_path):
    """Per-step traffic of a run resumed at step 2 of 4 is the straight run's (the main job's): divided by the 2
    steps it ran, not by --steps (before: 2x too small here, 31x for 10 steps resumed at 300)."""
    straight, a = main_job
    assert straight.returncode == 0, straight.stderr
    resumed, _ = launch(mpiexec, 2, [*TINY, "--out", str(tmp_path / "b"), "--resume",
                                     str(a / "checkpoints" / "step_00000002")], timeout=240)
    assert resumed.returncode == 0, resumed.stderr

    def per_step(proc, out):  # (the world's KiB per step, each rank's gradient bytes per step)
        world = re.search(r"^  world: ([\d.]+) KiB sent", proc.stdout, re.M)
        zero = json.loads((out / "summary.json").read_text())["zero"]
        figures = zero["per_rank"]
        assert zero["stage"] == 0 and zero["dp_shard"] is None  # no ZeRO: no shard degree (it said dp)
        return float(world.group(1)), [f["bytes_sent_per_step"] for f in figures]
    (world_a, grads_a), (world_b, grads_b) = per_step(straight, a), per_step(resumed, tmp_path / "b")
    assert grads_a[0] > 0 and grads_b == grads_a  # the same all-reduces every step
    assert world_b == pytest.approx(world_a, rel=0.05)  # the world's total includes set-up, spread over the steps


#: the main job in one process, twice: argv[1] the "whole" run's OUT, argv[2] the "full" run's (memory.png meets a
#: full disk), the flags after; os.replace (every atomic write's last step) and the closing sample recorded in
#: OUT/order.txt, main's exit status in OUT/status.txt; "--- full ---" on stderr between the runs
_RECORD_ORDER = """
import errno, os, sys
import minizero.memory.monitor as monitor, minizero.report as report
from minizero.files import WriteError
from minizero.train import main
replace, sample = os.replace, report.sample_text
def note(name):
    with open(os.path.join(out, "order.txt"), "a") as f:
        f.write(name + "\\n")
def recorded(src, dst, **kw):
    replace(src, dst, **kw)
    if os.path.dirname(os.path.abspath(dst)) == os.path.abspath(out):
        note(os.path.basename(dst))
def full(path, *args, **kw):
    raise WriteError(errno.ENOSPC, f"could not write {path!r}: no space left on device (the disk is full)")
os.replace = recorded
report.sample_text = lambda *a, **kw: (note("sample"), sample(*a, **kw))[1]
for out in sys.argv[1:3]:
    if out == sys.argv[2]:
        os.write(2, b"\\n--- full ---\\n")
        monitor.plot_timeline = full
    status = main([*sys.argv[3:], "--out", out])
    with open(os.path.join(out, "status.txt"), "w") as f:
        f.write(str(status))
"""


@pytest.mark.timeout(120)
def test_the_final_outputs_are_written_cheap_and_precious_first(tmp_path):
    """Before: memory.png was drawn before model.npz, so a SIGTERM or a full disk there cost the trained weights."""
    argv = ["--model", "tiny", "--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "4",
            "--no-progress"]
    for case in ("whole", "full"):
        (tmp_path / case).mkdir()
    proc = subprocess.run([sys.executable, "-c", _RECORD_ORDER, str(tmp_path / "whole"), str(tmp_path / "full"),
                           *argv], env=dict(mpi_env(), MINIZERO_PLOTS="1"), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stderr = dict(zip(("whole", "full"), proc.stderr.split("\n--- full ---\n")))
    runs = {}
    for case in ("whole", "full"):
        out = tmp_path / case
        written = (out / "order.txt").read_text().split() if (out / "order.txt").exists() else []
        runs[case] = (int((out / "status.txt").read_text()), stderr.get(case, ""), written,
                      json.loads((out / "summary.json").read_text()) if "summary.json" in written else {})
    status, err, order, summary = runs["whole"]
    assert status == 0, proc.stdout + proc.stderr
    assert order == ["model.npz", "model.json", "summary.json", "memory.png", "loss.png", "sample", "summary.json"]
    assert summary["sample"] and summary["memory_plot"] == str(tmp_path / "whole" / "memory.png")
    status, err, order, summary = runs["full"]
    assert status == 1 and "memory.png': no space left on device" in " ".join(err.split()), proc.stderr
    assert "no space left on device" not in runs["whole"][1]
    assert order == ["model.npz", "model.json", "summary.json"]  # the weights and the figures are kept
    assert summary["sample"] is None and summary["memory_plot"] is None and summary["val_loss"] > 0


def test_a_json_device_takes_one_summary_the_final_one(tmp_path, monkeypatch):
    """summary.json is written before the plots and the sample, then again complete; ``--json /dev/stdout`` (or a
    FIFO) would have taken two documents."""
    import minizero.report as report

    calls = []
    monkeypatch.setattr(report, "atomic_write", lambda path, write, mode="wb": calls.append(path))
    for path in ("/dev/null", str(tmp_path / "s.json")):
        report._write_summary(path, {"sample": None}, final=False)
        report._write_summary(path, {"sample": "x"}, final=True)
    assert calls == ["/dev/null", str(tmp_path / "s.json"), str(tmp_path / "s.json")]
