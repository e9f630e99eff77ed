"""Bad input to the command lines: one clear line naming the value and what is allowed, exit status 2,
before any work, on every rank; nothing the user wrote (checkpoints, outputs) lost or half-written.

Each case here was a failure found by trying wrong values: a --trace path checked only after the last
step (the finished run lost), a checkpoint shard overwritten by ``consolidate --out``, a resume with
nothing left to train ending in a KeyError, compare and gpu_check refusing their outputs only after
every run, and a rank whose arguments its peers accept left waiting for them.
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from minizero.checkpoint import resolve
from minizero.train import UsageError, check_steps_left, parse_args
from tests.conftest import REPO_ROOT, earlier_json, mpi_env


def joined(printed: str) -> str:
    """What a program printed, read whole: its lines of <= 120 columns (numerals.wrapped) joined by one space."""
    return " ".join(printed.split())


TINY = ["--model", "tiny", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def _train(args, mpiexec=None, n=1, timeout=120):
    cmd = [sys.executable, "-m", "minizero.train", *args]
    if mpiexec:
        cmd = [mpiexec, "-n", str(n), *cmd]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save dir with the checkpoints of steps 1 and 2 of a one-process tiny run."""
    out = tmp_path_factory.mktemp("saved")
    proc, _ = _train([*TINY, "--steps", "2", "--save-every", "1", "--keep", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "sample:" not in proc.stdout  # --sample-tokens 0: no sample section (it printed the bare prompt)
    return out / "checkpoints"


def _digests(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- --trace
@pytest.mark.parametrize("trace,needle", [
    ("", "--trace must name a file"),
    ("/proc/minizero-trace.json", "'/proc' takes no file named 'minizero-trace.json'"),
    ("{file}/t.json", "does not exist or is not writable"),
    ("{tmp}", "is a directory; give a file path"),
    ("{tmp}/o/model.npz", "would overwrite the weights"),
    ("{tmp}/o/summary.json", "would overwrite the --json summary"),
])
def test_trace_path_is_checked_at_parse_time(tmp_path, trace, needle):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match=needle):
        parse_args([*TINY, "--out", str(tmp_path / "o"), "--trace", trace.format(file=afile, tmp=tmp_path)],
                   world_size=2)


@pytest.mark.parametrize("name,what", [("model.json", "the weights' config"), ("loss.png", "the loss plot"),
                                       ("memory.png", "the memory plot")])
def test_no_output_overwrites_another_file_of_the_run(tmp_path, name, what):
    """Before: --json OUT/model.json wrote the summary over the weights' config, and sample/quantize then
    refused the weights; --json OUT/loss.png was overwritten by the plot."""
    for flag in ("--json", "--trace"):
        with pytest.raises(UsageError, match=f"{flag} .* would overwrite {what}"):
            parse_args([*TINY, "--out", str(tmp_path / "o"), flag, str(tmp_path / "o" / name)])


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_an_output_in_a_missing_folder_is_refused_as_json_is(tmp_path, monkeypatch, flag):
    """Before: --trace nodir/t.json made the folder while --json nodir/s.json was refused."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=re.escape(f"{flag} 'nodir/t.json': directory "
                                                   f"{str(tmp_path / 'nodir')!r} does not exist or is not writable")):
        parse_args([*TINY, "--out", "o", flag, "nodir/t.json"])
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "o").exists()


def test_out_that_cannot_be_made_names_the_path_in_the_way(tmp_path):
    """Before: "(no writable parent directory)", said of an --out that exists (read-only) or whose parent does."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match=re.escape(f"({str(tmp_path / 'afile')!r} is not a writable directory)")):
        parse_args([*TINY, "--out", str(tmp_path / "afile" / "o")])


def test_trace_into_out_an_existing_folder_or_a_device_file_is_accepted(tmp_path):
    parse_args([*TINY, "--out", str(tmp_path / "new" / "o"), "--trace", str(tmp_path / "new" / "o" / "t.json")])
    parse_args([*TINY, "--no-save", "--trace", str(tmp_path / "t.json")])
    parse_args([*TINY, "--no-save", "--trace", os.devnull])
    with pytest.raises(UsageError, match="does not exist"):  # --no-save: OUT is not made
        parse_args([*TINY, "--no-save", "--out", str(tmp_path / "o"), "--trace", str(tmp_path / "o" / "t.json")])


@pytest.mark.timeout(120)
def test_unwritable_trace_under_mpi_fails_before_the_first_step(mpiexec, tmp_path):
    """Before: both ranks trained, then rank 0 failed writing the trace and no model.npz was written."""
    proc, elapsed = _train([*TINY, "--steps", "2", "--out", str(tmp_path / "o"), "--trace", "/proc/t.json"],
                           mpiexec, 2)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--trace '/proc/t.json'") == 1 and "Traceback" not in proc.stderr
    assert "step " not in proc.stdout and elapsed < 60


@pytest.mark.parametrize("value", ["1e-9", "0.5", "-1", "nan", "inf"])
def test_comm_timeout_below_a_second_is_refused(value):
    """Before: --comm-timeout 1e-9 ran, and every rank failed at the first collective blaming a stalled peer."""
    with pytest.raises(UsageError, match=f"--comm-timeout must be .* at least 1 .*got {re.escape(str(float(value)))}$"):
        parse_args([*TINY, "--no-save", "--comm-timeout", value])
    parse_args([*TINY, "--no-save", "--comm-timeout", "1"])


@pytest.mark.timeout(120)
def test_a_prompt_that_is_not_utf8_is_refused_before_training(tmp_path, capsys):
    """Before: training ran, model.npz was written, then the closing sample raised UnicodeEncodeError (a
    traceback, and no summary.json); python -m minizero.sample raised the same."""
    from minizero.sample import main as sample_main

    bad = os.fsdecode(b"ab\xff")  # what Python makes of a command-line byte that is not UTF-8
    with pytest.raises(UsageError, match=re.escape("--prompt b'ab\\xff' is not UTF-8 text")):
        parse_args([*TINY, "--no-save", "--prompt", bad])
    with pytest.raises(UsageError, match="is not UTF-8 text"):
        parse_args([*TINY, "--no-save", "--prompt", "\ud800"])
    assert sample_main(["--weights", str(tmp_path / "none.npz"), "--prompt", bad]) == 2
    assert "--prompt b'ab\\xff' is not UTF-8 text" in joined(capsys.readouterr().err)


def test_offload_dir_message_is_one_plain_line():
    """Before: ``[Errno 2] --offload-dir '/proc' is not writable: ...`` (the OSError's number first)."""
    with pytest.raises(UsageError) as e:
        parse_args([*TINY, "--no-save", "--offload-activations", "nvme", "--offload-dir", "/proc"])
    assert str(e.value).startswith("--offload-dir '/proc' is not writable")


# --------------------------------------------------------------------------- every rank's verdict
@pytest.mark.timeout(120)
def test_a_rank_refusing_what_its_peers_accept_ends_the_job(mpiexec, tmp_path):
    """Ranks that see different files or variables (another node) can disagree on the arguments: the
    refusing rank's message ends every rank (exit 2), instead of the others waiting for it forever."""
    good = [sys.executable, "-m", "minizero.train", *TINY, "--steps", "2", "--no-save"]
    cmd = [mpiexec, "-n", "1", *good, ":", "-n", "1", *good, "--data", str(tmp_path / "missing.txt")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("[rank 1] --data") == 1 and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("flags,needle", [
    (["--fp8-scaling", "current"], "--fp8-scaling only apply(ies) with --precision fp8"),
    (["--moe-every", "2", "--moe-z-loss", "0"], "--moe-every, --moe-z-loss only apply(ies) with --moe-experts > 0"),
    (["--json", "s.json", "--no-save"], "--no-save writes no summary"),
    (["--moe-top-k", "1"], "--moe-top-k only apply(ies) with --moe-experts > 0"),
    # before: accepted, as it equals the default (given = not None: LATE_DEFAULTS), as --cp-attention ring at --cp 1
    (["--moe-top-k", "2"], "--moe-top-k only apply(ies) with --moe-experts > 0 (a mixture of experts); got "
                           "--moe-experts 0"),
    (["--cp-attention", "ring"], "--cp-attention only apply(ies) with --cp > 1 (context parallelism); got --cp 1"),
    (["--cp-attention", "ulysses"], "--cp-attention only apply(ies) with --cp > 1 (context parallelism); got --cp 1"),
    (["--keep", "5", "--save-dir", "ck"],
     "--keep, --save-dir only apply(ies) with --save-every N > 0 (checkpoints); got --save-every 0"),
    # before: accepted; a run given --save-dir alone saved no checkpoint (it reads as if it did)
    (["--save-dir", "ck"], "--save-dir only apply(ies) with --save-every N > 0 (checkpoints); got --save-every 0"),
    # before: "got --save-every 0", a value not given
    (["--save-every", "-1", "--keep", "3"], "--keep only apply(ies) with --save-every N > 0 (checkpoints); got "
                                            "--save-every -1"),
    (["--recompute-every", "2"], "--recompute-every only apply(ies) with --recompute full or selective"),
    (["--attention-block", "8"], "--attention-block only apply(ies) with --attention flash; got --attention dense"),
    (["--adam8bit-block-size", "64"], "--adam8bit-block-size only apply(ies) with --optimizer adam8bit"),
    (["--prune-scope", "global"], "--prune-scope only apply(ies) with --prune-sparsity > 0"),
    (["--schedule", "gpipe"], "--schedule only apply(ies) with --pp > 1 (a pipeline); got --pp 1"),
    (["--pp-verbose"], "--pp-verbose only apply(ies) with --pp > 1"),
    # before: accepted; no sample, so the prompt went unused; --progress bar silently replaced by none
    (["--prompt", "Once"], "--prompt only apply(ies) with --sample-tokens > 0 (the closing sample)"),
    (["--progress", "bar"], "--no-progress is --progress none, but --progress bar is given too; give one"),
])
def test_a_flag_that_would_do_nothing_is_refused(flags, needle):
    """Before: silently ignored (as --show-shards or the loss-scale flags are not)."""
    with pytest.raises(UsageError, match=re.escape(needle)):
        parse_args([*TINY, *flags])


@pytest.mark.timeout(120)
def test_dependent_flags_with_their_setting_or_at_their_default_are_accepted():
    """Only a value the user changed is refused: the defaults, and each flag with what enables it, parse."""
    parse_args([*TINY, "--no-save", "--keep", "2", "--recompute-every", "1", "--schedule", "1f1b"])
    for flags in (["--save-every", "2", "--keep", "5"], ["--recompute", "full", "--recompute-every", "2"],
                  ["--attention", "flash", "--attention-block", "8"], ["--optimizer", "adam8bit",
                  "--adam8bit-block-size", "64"], ["--prune-sparsity", "0.5", "--prune-scope", "global"]):
        parse_args([*TINY, "--no-save", *flags])
    assert parse_args([*TINY, "--no-save", "--pp", "2", "--schedule", "gpipe", "--pp-verbose"], 2).pp == 2


@pytest.mark.parametrize("dtype,lr", [("float32", "1e308"), ("float32", "1e-320"), ("float32", "1e-39"),
                                      ("float64", "1e-320"), ("float32", "nan"), ("float32", "0")])
def test_lr_outside_the_dtypes_normal_range_is_refused(dtype, lr):
    """Before: 1e308 (inf in float32) stopped with raw overflow warnings and "gradient norm is nan"; 1e-320
    (0 in float32) trained nothing without a word."""
    with pytest.raises(UsageError, match=f"--lr must be a normal {dtype} number, in \\[.*\\] \\(--dtype {dtype}\\)"):
        parse_args([*TINY, "--no-save", "--dtype", dtype, "--lr", lr])
    parse_args([*TINY, "--no-save", "--dtype", "float64", "--lr", "1e-300"])  # normal in float64


@pytest.mark.parametrize("flags", [["--weight-decay", "1e308"], ["--weight-decay", "inf"],
                                   ["--lr", "0.5", "--weight-decay", "2"]])
def test_weight_decay_that_zeroes_or_flips_the_weights_is_refused(flags):
    """Before: --weight-decay 1e308 trained a step, then stopped as diverged telling the user to lower --lr."""
    with pytest.raises(UsageError, match=re.escape("--weight-decay must be >= 0 with --lr x --weight-decay < 1")):
        parse_args([*TINY, "--no-save", *flags])
    parse_args([*TINY, "--no-save", "--lr", "0.5", "--weight-decay", "1.9"])  # 0.95: strong, still a decay


def test_resume_or_inspect_of_a_file_says_it_is_a_file(tmp_path, capsys):
    """Before: "no such checkpoint folder or save dir" for a file that exists."""
    from minizero.checkpoint.cli import main

    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UsageError, match=f"--resume {re.escape(str(f))}: is a file, not a checkpoint folder"):
        parse_args([*TINY, "--no-save", "--resume", str(f)])
    assert main(["inspect", str(f)]) == 2
    assert f"error: {f}: is a file, not a checkpoint folder or save dir" in joined(capsys.readouterr().err)


@pytest.mark.timeout(120)
def test_ranks_started_with_different_flags_are_refused_naming_them(mpiexec, tmp_path):
    """Before: rank 0 trained tensor-parallel and rank 1 data-parallel, and the job ended with exit 0 and a loss
    twice the normal (other flags: a hang, or a traceback from inside a collective). Nothing is written."""
    out = tmp_path / "out"
    good = [sys.executable, "-m", "minizero.train", *TINY, "--steps", "2", "--out", str(out)]
    cmd = [mpiexec, "-n", "1", *good, "--tp", "2", ":", "-n", "1", *good]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert ("the ranks were started with different flags: --tp: 2 on rank 0, not given on rank 1;"
            in proc.stderr) and "start every rank with the same command" in proc.stderr
    assert not out.exists()  # refused before anything was made


@pytest.mark.timeout(120)
@pytest.mark.parametrize("var,first,second", [("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "0", "100000000"),
                                              ("MINIZERO_DEBUG_COLLECTIVES", "1", "0")])
def test_ranks_started_with_different_minizero_environment_are_refused(mpiexec, tmp_path, var, first, second):
    """Before: one rank ran recursive doubling and the other the ring (or one ZeRO's order check): they waited
    on each other for --comm-timeout (10 minutes by default), then blamed a stalled rank."""
    out = tmp_path / "out"
    good = [sys.executable, "-m", "minizero.train", *TINY, "--steps", "2", "--zero", "2", "--out", str(out)]
    cmd = [mpiexec, "-n", "1", "env", f"{var}={first}", *good, ":", "-n", "1", "env", f"{var}={second}", *good]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    said = proc.stderr.replace("\n  ", " ")  # a refusal past 120 columns goes on over indented lines
    assert f"the ranks were started with different flags: {var}: " in said and "on rank 1" in said
    assert not out.exists() and time.monotonic() - t0 < 60


@pytest.mark.timeout(120)
def test_finetune_ranks_that_refuse_differently_end_together(mpiexec, tmp_path):
    """Before: rank 0's bad flag ended rank 0 (argparse's exit) while rank 1 waited for it forever."""
    ft = [sys.executable, "-m", "minizero.finetune"]
    cmd = [mpiexec, "-n", "1", *ft, "--steps", "x", ":", "-n", "1", *ft, "--weights", str(tmp_path / "none.npz")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "invalid int value: 'x'" in proc.stderr and "[rank 1] --weights" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_ranks_with_different_debug_switches_are_named_with_the_values_typed(monkeypatch):
    """Before: MINIZERO_DEBUG_COLLECTIVES=1 on rank 0 and unset on rank 1 was refused as 'True on rank 0, False on
    rank 1': values the variable does not take (it allows "0" or "1")."""
    from minizero.flags import flags_refusal, job_environment

    envs = []
    for value in ("1", "0"):
        monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", value)
        envs.append(({}, {}, job_environment()))
    assert "MINIZERO_DEBUG_COLLECTIVES: 1 on rank 0, 0 on rank 1;" in flags_refusal(envs)


def test_differing_flags_names_the_given_flags_first_then_derived_ones():
    from minizero.flags import differing_flags

    given = [{"tp": 2, "lr": float("nan"), "steps": 3}, {"tp": None, "lr": float("nan"), "steps": 3},
             {"tp": None, "lr": float("nan"), "steps": 3}]
    resolved = [{"dp": 1, "tp": 2, "lr": float("nan"), "derived": ()},  # derived: which notes name a flag, no flag
                {"dp": 3, "tp": 1, "lr": float("nan"), "derived": ("warmup",)},
                {"dp": 3, "tp": 1, "lr": float("nan"), "derived": ("warmup",)}]
    assert differing_flags(list(zip(given, resolved))) == [  # NaN equals NaN; ranks 1-2 as one group
        "--tp: 2 on rank 0, not given on ranks 1, 2", "--dp: 1 on rank 0, 3 on ranks 1, 2"]
    env = [({}, {}, {"MINIZERO_X": 0}), ({}, {}, {"MINIZERO_X": 1})]  # a variable keeps its name
    assert differing_flags(env) == ["MINIZERO_X: 0 on rank 0, 1 on rank 1"]
    same = [({"a": 1}, {"a": 1})] * 4
    assert differing_flags(same) == []
    many = [({f"f{i}": r for i in range(5)}, {}) for r in range(4)]
    assert differing_flags(many, shown=2)[-1] == "and 3 more" and "0 on rank 0, 1 on rank 1" in differing_flags(many)[0]


def test_the_derived_min_lr_reads_as_typed():
    """Before: --lr 0.003 derived --min-lr 0.00030000000000000003 (lr / 10 in binary), shown so in the ranks'
    refusal ("--min-lr: 0.00030000000000000003 on rank 0, ...") and in a resumed run's note on the checkpoint's."""
    import dataclasses
    from minizero.flags import differing_flags

    ranks = [parse_args(["--model", "tiny", "--lr", lr]) for lr in ("0.003", "0.03")]
    assert repr(ranks[0].min_lr) == repr(parse_args(["--model", "tiny"]).min_lr) == "0.0003"  # the default lr: 3e-3
    every = [({}, {"min_lr": dataclasses.asdict(a)["min_lr"]}) for a in ranks]
    assert differing_flags(every) == ["--min-lr: 0.0003 on rank 0, 0.003 on rank 1"]


# --------------------------------------------------------------------------- --resume
@pytest.mark.timeout(120)
def test_resume_with_nothing_left_to_train_is_refused(saved, tmp_path):
    """Before: --steps <= the checkpoint's step ran no step and ended in a KeyError traceback in the report."""
    for steps in ("1", "2"):
        proc, _ = _train([*TINY, "--steps", steps, "--out", str(tmp_path / "o"), "--resume", str(saved)])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"was saved after step 2; --steps {steps} leaves nothing to train" in proc.stderr.replace("\n  ", " ")
        assert "minizero: 1 rank(s)" not in proc.stdout  # nothing built
    check_steps_left(parse_args([*TINY, "--steps", "3", "--out", str(tmp_path / "o"), "--resume", str(saved)]))


@pytest.mark.timeout(120)
def test_a_fault_before_the_resumed_step_is_refused_before_work(saved, tmp_path, monkeypatch):
    """Before: MINIZERO_FAULT=0:1:raise with a resume of step 2 trained on and never fired, without a word."""
    from minizero.args import check_fault_spec
    argv = [*TINY, "--steps", "4", "--out", str(tmp_path / "o"), "--resume", str(saved)]
    monkeypatch.setenv("MINIZERO_FAULT", "0:1:raise")
    proc, _ = _train(argv)
    assert proc.returncode == 2 and "minizero: 1 rank(s)" not in proc.stdout, proc.stderr
    assert ("MINIZERO_FAULT='0:1:raise' never fires: it names step 1 (0-based) and the resumed checkpoint starts this "
            "run at step 2; give a step >= 2") in proc.stderr.replace("\n  ", " "), proc.stderr
    monkeypatch.setenv("MINIZERO_FAULT", "0:2:raise")  # the resumed run's first step: fires
    check_fault_spec(1, 4, 0, start=check_steps_left(parse_args(argv)))


@pytest.mark.timeout(120)
def test_resume_refuses_pruning_it_would_skip_or_change(saved, tmp_path):
    """Before: resuming an unpruned step 2 with --prune-step 1 never pruned, without a word; resuming a pruned
    checkpoint with another (or no) --prune-sparsity kept applying its masks, without a word."""
    def check(resume, *flags):
        check_steps_left(parse_args([*TINY, "--steps", "4", "--out", str(tmp_path / "o"), "--resume", resume, *flags]))

    with pytest.raises(UsageError, match=r"--prune-step 1 \(0-based\) is before --resume .* saved after step 2 "
                                         r"unpruned: the run would never prune; give --prune-step in \[2, 4\)"):
        check(str(saved), "--prune-sparsity", "0.5", "--prune-step", "1")
    check(str(saved), "--prune-sparsity", "0.5", "--prune-step", "2")
    pruned = ["--prune-sparsity", "0.5", "--prune-step", "0"]
    proc, _ = _train([*TINY, "--steps", "2", "--save-every", "2", "--out", str(tmp_path / "p"), *pruned])
    assert proc.returncode == 0, proc.stderr
    ck = str(tmp_path / "p" / "checkpoints")
    for flags in ([], ["--prune-sparsity", "0.3"], [*pruned, "--prune-scope", "global"]):
        with pytest.raises(UsageError, match=r"was pruned to sparsity 0.5 \(scope layer\), this run asks for .*; its "
                                             r"masks keep applying: resume with --prune-sparsity 0.5 --prune-scope layer"):
            check(ck, *flags)
    check(ck, *pruned)


def test_a_save_dir_holding_a_step_folder_that_is_no_checkpoint_is_refused(tmp_path):
    """Before: a folder step_00000002 without manifest.json in --save-dir (the user's) was replaced by the save of
    step 2 and removed, after the work; now refused before it, the folder kept. An unpadded step_2: never written."""
    (tmp_path / "ck" / "step_00000002").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000002" / "notes.txt").write_text("mine")
    (tmp_path / "ck" / "step_2").mkdir()
    flags = [*TINY, "--steps", "2", "--save-every", "2", "--save-dir", str(tmp_path / "ck"), "--out", str(tmp_path)]
    with pytest.raises(UsageError, match=r"--save-dir '.*ck' holds 'step_00000002', which is not a checkpoint \(no "
                                         r"manifest.json in it\): a save of that step would replace it"):
        parse_args(flags)
    assert (tmp_path / "ck" / "step_00000002" / "notes.txt").read_text() == "mine"
    os.rename(tmp_path / "ck" / "step_00000002", tmp_path / "kept")
    parse_args(flags)


def test_a_pruning_left_over_step_folder_before_the_resumed_step_is_no_refusal(saved, tmp_path):
    """A save killed while pruning (rmtree of step_00000001, its manifest gone first) leaves a step folder without
    manifest.json below the newest step; resuming that run saves only later steps, so it replaces nothing. Before:
    refused as 'a save of that step would replace it', the run's own save dir unusable to resume it."""
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    (ck / "step_00000001" / "manifest.json").unlink()  # pruning's rmtree stopped part way
    flags = [*TINY, "--steps", "3", "--save-every", "1", "--save-dir", str(ck), "--out", str(tmp_path / "o")]
    parse_args([*flags, "--resume", str(ck)])  # resumes step 2: saves step 3 only
    with pytest.raises(UsageError, match=r"holds 'step_00000001', which is not a checkpoint"):
        parse_args(flags)  # a fresh run would save step 1 over it


def test_a_save_dir_holding_a_latest_file_of_the_users_is_refused(tmp_path):
    """Before: a file 'latest' in --save-dir that names no step folder (the user's) was overwritten by the first
    save; now refused before any work. One naming a step (its checkpoints removed by hand) is a save's pointer."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest").write_text("my notes\n")
    flags = [*TINY, "--steps", "2", "--save-every", "2", "--save-dir", str(tmp_path / "ck"), "--out", str(tmp_path)]
    with pytest.raises(UsageError, match=r"holds a file 'latest' that names no checkpoint \('my notes'\), which "
                                         r"every save would overwrite"):
        parse_args(flags)
    assert (tmp_path / "ck" / "latest").read_text() == "my notes\n"
    (tmp_path / "ck" / "latest").write_text("step_00000004")
    parse_args(flags)


def test_a_save_dir_holding_another_runs_checkpoints_is_refused(saved, tmp_path):
    """Before: a fresh run with --save-every into a save dir of an earlier run overwrote its step 1, moved its
    ``latest`` and left its step 2 beside: two runs mixed, one lost. Now refused unless resuming from there."""
    before = _digests(saved)
    flags = [*TINY, "--steps", "3", "--save-every", "1", "--save-dir", str(saved), "--out", str(tmp_path / "o")]
    with pytest.raises(UsageError, match=r"already holds the checkpoints of an earlier run \(step_00000001, "
                                         r"step_00000002\); continue that run with --resume"):
        parse_args(flags)
    other = tmp_path / "other"
    shutil.copytree(saved, other)
    with pytest.raises(UsageError, match="is not one of them"):  # resumed from elsewhere: still two runs mixed
        parse_args([*flags, "--resume", str(other)])
    parse_args([*flags, "--resume", str(saved)])  # continuing that run: its own save dir
    with pytest.raises(UsageError, match=r"is step_00000001, but --save-dir .* also holds later steps of that run "
                                         r"\(step_00000002\): .* give this run another --save-dir"):
        parse_args([*flags, "--resume", str(saved / "step_00000001")])  # a rewind in place: two runs mixed
    parse_args([*flags[:-4], "--save-dir", str(tmp_path / "rewound"), "--out", str(tmp_path / "o"),
                "--resume", str(saved / "step_00000001")])  # the rewind into a save dir of its own
    died = tmp_path / "died"  # ``latest`` names step 1 beside a complete step 2 (a save that died before moving it)
    shutil.copytree(saved, died)
    (died / "latest").write_text("step_00000001")
    again = [*flags[:-4], "--save-dir", str(died), "--out", str(tmp_path / "o")]
    assert resolve(str(died)) == str(died / "step_00000002")  # before: step 1, and step 2 was overwritten, no word
    parse_args([*again, "--resume", str(died)])  # continues from the newest complete step
    with pytest.raises(UsageError, match=r"also holds later steps of that run \(step_00000002\): .*; to continue, "
                                         r"--resume '.*step_00000002'"):  # an explicit rewind in place: refused
        parse_args([*again, "--resume", str(died / "step_00000001")])
    shutil.copytree(died / "step_00000001", died / "good")  # a copy under another name: not one of its steps
    with pytest.raises(UsageError, match="is not one of them"):
        parse_args([*again, "--resume", str(died / "good")])
    with pytest.raises(UsageError, match="--save-dir only apply"):  # saves nothing: refused as an idle flag
        parse_args([*TINY, "--steps", "3", "--save-dir", str(saved), "--out", str(tmp_path / "o")])
    assert _digests(saved) == before


@pytest.mark.parametrize("damage,needle", [
    (lambda m: m.pop("model"), "field 'model' is missing, expected a JSON object"),
    (lambda m: m.__setitem__("files", "x"), "field 'files' is 'x', expected a JSON array"),
    (lambda m: m["files"][0].pop("bytes"), "files[0] lacks bytes"),
    (lambda m: m["pieces"][3].pop("lo"), "pieces[3] lacks lo"),
    (lambda m: m.__setitem__("step", "2"), "field 'step' is '2', expected an integer >= 0"),
    (lambda m: m.pop("train"), "field 'train' is missing"),
    (lambda m: m["layout"].__setitem__("tp", None), "layout.tp is None, expected an integer"),
    # before: a TypeError (a list as a dict key) and NumPy's ValueError building a GPT of width 10^30, tracebacks
    (lambda m: m["pieces"][0].__setitem__("format", []), "pieces[0] format '[]', expected one of dense, 8bit"),
    (lambda m: m["model"].__setitem__("n_embd", 10 ** 30), "too large for its arrays to exist"),
])
def test_a_damaged_manifest_is_named_not_a_traceback(saved, tmp_path, damage, needle):
    """Before: KeyError/TypeError tracebacks on every rank, some after the model was built (MPI_Abort)."""
    import json
    import shutil

    folder = tmp_path / "ck"
    shutil.copytree(saved / "step_00000002", folder)
    man = json.loads((folder / "manifest.json").read_text())
    damage(man)
    (folder / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UsageError, match=re.escape(needle) + ".*the manifest is damaged"):
        parse_args([*TINY, "--steps", "4", "--no-save", "--resume", str(folder)])


@pytest.mark.parametrize("forge,said", [
    (lambda a: a[:-1], "F32 of shape [{n1}], the manifest says F32 of shape [{n}]"),  # before: NumPy's broadcast
    (lambda a: a.astype("float64"), "F64 of shape [{n}], the manifest says F32"),  # ValueError traceback, MPI_Abort;
    (lambda a: a.astype("int32"), "I32 of shape [{n}], the manifest says F32"),  # these three were loaded, cast
    (lambda a: a.reshape(1, -1), "F32 of shape [1, {n}], the manifest says F32 of shape [{n}]"),
    (None, "no such array, the manifest says F32 of shape [{n}]"),
])
def test_a_rank_file_whose_arrays_disagree_with_the_manifest_is_named(saved, tmp_path, forge, said):
    """A rank file rewritten with its checksum and size updated in the manifest (so both checks pass): its
    header's arrays are compared with the manifest's pieces before any work."""
    import json
    import shutil
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    folder = tmp_path / "ck"
    shutil.copytree(saved / "step_00000002", folder)
    path = folder / "rank00000.safetensors"
    with safe_open(str(path), framework="numpy") as st:
        meta = st.metadata()
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.startswith("m/"))
    n = tensors[key].size
    if forge is None:
        del tensors[key]
    else:
        tensors[key] = np.ascontiguousarray(forge(tensors[key]))
    save_file(tensors, str(path), metadata=meta)
    man = json.loads((folder / "manifest.json").read_text())
    man["files"][0].update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UsageError, match=re.escape(f"{path}: array {key!r}: " + said.format(n=n, n1=n - 1))):
        parse_args([*TINY, "--steps", "4", "--no-save", "--resume", str(folder)])


@pytest.mark.timeout(120)
def test_a_manifest_naming_what_its_files_lack_is_one_line_per_rank(saved, tmp_path, mpiexec):
    """A manifest that names a shard file or tensor its files do not hold (hand-edited: the manifest has no
    checksum). Before: FileNotFoundError / SafetensorError tracebacks; then one line per rank while loading, after
    the model was built; now the rank files' headers are compared with the pieces before any work."""
    import json
    import shutil

    folder = tmp_path / "ck"
    shutil.copytree(saved / "step_00000002", folder)
    man = json.loads((folder / "manifest.json").read_text())
    man["pieces"][0]["key"] = "no-such-tensor"
    (folder / "manifest.json").write_text(json.dumps(man))
    proc, elapsed = _train([*TINY, "--steps", "4", "--no-save", "--resume", str(folder)], mpiexec, 2)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    said = " ".join(proc.stderr.split())  # train wraps its refusals at 120 columns; the cut moves with the path
    assert "array 'no-such-tensor': no such array, the manifest says F32" in said and elapsed < 60, proc.stderr


@pytest.mark.timeout(120)
def test_help_on_some_ranks_only_ends_the_job(mpiexec):
    """Before: the rank given --help printed it and exited; the others waited for it forever."""
    good = [sys.executable, "-m", "minizero.train", *TINY, "--steps", "2", "--no-save"]
    proc = subprocess.run([mpiexec, "-n", "1", *good, ":", "-n", "1", *good, "--help"], env=mpi_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "--help was given to rank(s) [1] only" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- consolidate --out
def test_consolidate_never_writes_into_a_checkpoint(saved, tmp_path, capsys):
    """Before: --out STEP/rank00000.safetensors replaced the shard with the .npz; the checkpoint was lost."""
    from minizero.checkpoint.cli import main

    before = _digests(saved)
    step2 = saved / "step_00000002"
    for out, needle in [(step2 / "rank00000.safetensors", "is inside the checkpoint folder"),
                        (saved / "step_00000001" / "model.npz", "is inside the checkpoint folder"),
                        (saved / "latest", "pointer to its latest checkpoint"),
                        (saved, "is a directory"), ("", "is empty"),
                        ("/proc/model.npz", "'/proc/model.npz' cannot be written")]:
        assert main(["consolidate", str(saved), "--out", str(out)]) == 2
        assert needle in joined(capsys.readouterr().err)
    assert _digests(saved) == before
    assert main(["inspect", str(tmp_path / "missing")]) == 2  # PATH is positional: no "--resume" in the message
    assert joined(capsys.readouterr().err).endswith(f"error: {tmp_path / 'missing'}: no such checkpoint folder or save dir")
    assert main(["consolidate", str(saved), "--out", str(tmp_path / "new" / "model.npz")]) == 0
    assert (tmp_path / "new" / "model.npz").is_file()


def test_consolidate_never_writes_over_a_runs_json(saved, tmp_path, capsys):
    """Before: --out RUN/summary.json replaced the run's summary with the .npz; --out DIR/model.json wrote the .npz
    there, then the model.json beside it over it: the consolidated weights were lost as it said 'wrote'."""
    import shutil
    from minizero.checkpoint.cli import main
    run = tmp_path / "run"
    shutil.copytree(saved.parent, run, ignore=shutil.ignore_patterns("checkpoints"))
    before = _digests(run)
    for name in ("summary.json", "model.json"):
        assert main(["consolidate", str(saved), "--out", str(run / name)]) == 2
        err = joined(capsys.readouterr().err)
        assert err.count("error:") == 1 and f"is named as the {name} minizero's programs read back as JSON" in err, err
    assert main(["consolidate", str(saved), "--out", str(tmp_path / "new" / "model.json")]) == 2
    assert "consolidate writes it beside the weights" in joined(capsys.readouterr().err)
    assert _digests(run) == before and not (tmp_path / "new").exists()


def test_no_output_of_the_trainer_lands_inside_a_checkpoint(saved, tmp_path):
    """Before: --json STEP/manifest.json replaced the manifest with the summary; the checkpoint was lost."""
    step2 = saved / "step_00000002"
    for argv in (["--json", str(step2 / "manifest.json")], ["--out", str(step2)],
                 ["--no-save", "--trace", str(step2 / "rank00000.safetensors")]):
        with pytest.raises(UsageError, match="is inside the checkpoint folder"):
            parse_args([*TINY, "--steps", "3", "--resume", str(saved), *argv])


@pytest.mark.parametrize("save_dir,needle", [
    ("", "--save-dir must name a folder"), ("/proc/ck", "cannot be written"),
    ("{file}/ck", "is not a directory"), ("{saved}/step_00000002", "is inside the checkpoint folder"),
])
def test_save_dir_is_checked_before_the_first_save(saved, tmp_path, save_dir, needle):
    """Before: the first save, N steps in, failed with a FileNotFoundError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match=needle):
        parse_args([*TINY, "--steps", "3", "--out", str(tmp_path / "o"), "--save-every", "2",
                    "--save-dir", save_dir.format(file=afile, saved=saved)])


def test_quantize_json_never_overwrites_the_weights_or_the_data(saved, capsys):
    """Before: quantize --json OUT/model.npz measured, then wrote the JSON over the model it had read."""
    from minizero.quantize import main

    weights = saved.parent / "model.npz"
    config = saved.parent / "model.json"
    before = [hashlib.sha256(f.read_bytes()).hexdigest() for f in (weights, config)]
    assert main(["--weights", str(weights), "--json", str(weights)]) == 2
    assert "would overwrite --weights" in joined(capsys.readouterr().err)
    assert main(["--weights", str(weights), "--json", str(config)]) == 2
    assert "would overwrite --weights' config" in joined(capsys.readouterr().err)
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in (weights, config)] == before


def test_quantize_json_never_overwrites_the_data_summary_json_names(saved, tmp_path, capsys):
    """Before: with --data left out, quantize read summary.json's config.train.data, then wrote --json over it."""
    import json
    import shutil
    from minizero.quantize import main
    for name in ("model.npz", "model.json", "summary.json"):
        shutil.copy(saved.parent / name, tmp_path / name)
    corpus = tmp_path / "corpus.txt"
    text = earlier_json(baseline={}, rows="the user's text. " * 200)  # marked as a summary: --json would replace it
    corpus.write_text(text)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["config"]["train"]["data"] = str(corpus)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["--weights", str(tmp_path / "model.npz"), "--json", str(corpus)]) == 2
    assert f"would overwrite summary.json's config.train.data {str(corpus)!r}" in joined(capsys.readouterr().err)
    assert corpus.read_text() == text


@pytest.mark.parametrize("field,value,said", [
    ("train", [], "config.train is [], not an object"),  # before: AttributeError traceback
    ("seed", float("inf"), "config.train.seed inf is not a whole number >= 0"),  # before: OverflowError traceback
    ("seed", -1, "config.train.seed -1 is not"),  # before: NumPy's 'expected non-negative integer', nothing named
    ("seed", "x", "config.train.seed 'x' is not"),  # before: seed 0 used, another FP32 loss than train printed
    ("data", 1.5, "config.train.data 1.5 is not a file path"),  # before: TypeError traceback from os.stat
    ("data", "none.txt", "summary.json's config.train.data: --data 'none.txt': no such file"),
])
def test_quantize_names_a_bad_summary_json_train_field(saved, tmp_path, capsys, field, value, said):
    import json
    import shutil
    from minizero.quantize import main
    for name in ("model.npz", "model.json", "summary.json"):
        shutil.copy(saved.parent / name, tmp_path / name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    if field == "train":
        summary["config"]["train"] = value
    else:
        summary["config"]["train"][field] = value
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["--weights", str(tmp_path / "model.npz")]) == 2
    err = joined(capsys.readouterr().err)
    assert err.count("error:") == 1 and said in err, err


# --------------------------------------------------------------------------- compare
def test_compare_refuses_its_outputs_and_device_before_any_run(tmp_path, monkeypatch):
    """Before: a bad --out/--json failed after every run; --device cuda without CuPy failed every run; --timeout
    inf raised OverflowError from subprocess, --micro-batch-size 10**9 a UsageError traceback, and --steps 2e9
    failed each of the nine runs in turn."""
    from minizero.compare import UsageError as CompareUsage, parse_args as compare_args

    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in [(["--out", "/proc/compare"], "--out '/proc/compare' cannot be written"),
                         (["--timeout", "inf"], "--timeout must be in (0, 1e7] seconds (about 4 months), got inf"),
                         (["--timeout", "1e300"], "--timeout must be in (0, 1e7] seconds (about 4 months), got 1e+300"),
                         (["--micro-batch-size", "1000000000"], "at --ranks 2: --micro-batch-size must be <= 4,096"),
                         (["--steps", "2000000000"], "at --ranks 2: --steps must be <= 1,000,000,000"),
                         (["--json", str(afile / "c.json")], "does not exist or is not writable"),
                         (["--out", str(tmp_path), "--json", str(tmp_path / "compare.md")], "is OUT/compare.md"),
                         (["--json", str(tmp_path)], "is a directory")]:
        with pytest.raises(CompareUsage, match=re.escape(needle)):
            compare_args(argv)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(CompareUsage, match="--device cuda needs CuPy"):
        compare_args(["--device", "cuda", "--out", str(tmp_path)])
    compare_args(["--out", str(tmp_path / "new" / "deeper")])  # made at the end
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- bench/gpu_check.py
@pytest.mark.parametrize("argv,needle", [
    (["--peak-tflops", "abc"], "--peak-tflops 'abc'"), (["--peak-tflops", "nan"], "positive finite"),
    (["--steps", "8,3"], "1 <= K < K+S"), (["--steps", "x"], "--steps 'x'"), (["--budget-s", "nan"], "--budget-s"),
    (["--json", "{tmp}"], "is a directory"), (["--json", "{file}/g.json"], "is not a directory"),
])
def test_gpu_check_refuses_bad_flags_before_the_probe(tmp_path, capsys, argv, needle):
    """Before: a bad --json failed with a traceback after every check had run; --steps/--peak-tflops were
    read only on a GPU machine, after the probe."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    import gpu_check

    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = [a.format(tmp=tmp_path, file=afile) for a in argv]
    if "--json" not in argv:
        argv += ["--json", str(tmp_path / "g.json")]
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2 and needle in joined(capsys.readouterr().err)
    assert not (tmp_path / "g.json").exists()


# --------------------------------------------------------------------------- python -m minizero.plan
@pytest.mark.parametrize("text,name", [("cp2 cp4", "cp"), ("z1 zero=3", "zero"), ("dp2 dp=4", "dp"),
                                       ("recompute=full recompute=none", "recompute")])
def test_plan_strategy_naming_a_size_twice_is_refused(text, name):
    """Before: "cp2 cp4" planned cp 4 without a word about the cp 2 it dropped."""
    from minizero.models import MODELS
    from minizero.plan_strategy import parse_strategy

    with pytest.raises(ValueError, match=f"{name} is given twice"):
        parse_strategy(text, MODELS["llama3-8b"], 8)
    parse_strategy("dp2 tp2 pp2 sp offload=activations offload=none", MODELS["llama3-8b"], 8)  # offload words add up


# --------------------------------------------------------------------------- weight files' headers
def _npy_bytes(shape, dtype="<f4", data=b""):
    import io
    import numpy as np
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


def test_weights_headers_checked_before_any_array_is_read(tmp_path, monkeypatch):
    """Before: a forged .npy header of shape (2e6, 2e6), or a small .npz inflating to gigabytes, reached
    MemoryError. Now the zip directory and the headers alone are checked: nothing is allocated."""
    import zipfile
    import numpy as np
    from minizero.weights import read_weights
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load reached"))

    def archive(name, members):
        path = tmp_path / name
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for member, raw in members.items():
                zf.writestr(member, raw)
        return str(path)

    forged = archive("forged.npz", {"transformer.wte.weight.npy": _npy_bytes((2_000_000, 2_000_000))})
    with pytest.raises(ValueError, match=r"'transformer.wte.weight': header \(2000000, 2000000\) float32 needs "
                                         r"16,000,000,000,128 bytes but the archive member holds 128"):
        read_weights(forged)
    # consistent headers but a GPT far wider than any preset: 1.6 GB of zeros that deflate to ~7 MB (streamed in
    # at zlib level 1: 1.9 s, where one 1.6 GB string at the default level took 7 s and 3.2 GB of memory)
    c, chunk = 20_000, bytes(2 ** 24)
    big = str(tmp_path / "inflates.npz")
    with zipfile.ZipFile(big, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("transformer.wte.weight.npy", "w") as f:
            f.write(_npy_bytes((c, c)))
            for start in range(0, 4 * c * c, len(chunk)):
                f.write(chunk[:4 * c * c - start])
    with pytest.raises(ValueError, match=r"no 2-D transformer.wte.weight and transformer.wpe.weight"):
        read_weights(big)
    pickled = archive("obj.npz", {"a.npy": _npy_bytes((1,), dtype="|O")})
    with pytest.raises(ValueError, match=r"array 'a' has dtype object, not a number type"):
        read_weights(pickled)
    other = archive("other.npz", {"notes.txt": b"hi"})
    with pytest.raises(ValueError, match=r"member 'notes.txt' is not an .npy array"):
        read_weights(other)


@pytest.mark.parametrize("header,said", [
    (b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), ", "not the dictionary an .npy header holds"),
    (b"(", "not the dictionary an .npy header holds"), (b"{'descr': '<f4'}" + b" " * 20000, "Header info length"),
])
def test_a_damaged_npy_header_is_one_line_naming_the_weights(tmp_path, capsys, header, said):
    """Before: NumPy's header parser raised tokenize.TokenError / SyntaxError (a 45-line traceback from sample,
    quantize, finetune), or a ValueError of three lines for a header over 10,000 bytes."""
    import zipfile
    from minizero.sample import main as sample_main
    header = header.ljust(118) + b"\n" if len(header) < 118 else header + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(16)
    path = tmp_path / "model.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("transformer.wte.weight.npy", raw)
    assert sample_main(["--weights", str(path)]) == 2
    err = joined(capsys.readouterr().err)
    assert err.count("error:") == 1 and f"--weights {str(path)!r} is not a model.npz" in err and said in err, err


def test_weights_larger_than_every_preset_refused_from_headers(tmp_path, monkeypatch):
    """A consistent GPT whose depth (13) exceeds every preset's (12 at most) is named from the headers."""
    import zipfile
    import numpy as np
    from minizero.weights import expected_shapes, read_weights
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load reached"))
    path = tmp_path / "deep.npz"
    with zipfile.ZipFile(path, "w") as zf:
        for name, shape in expected_shapes(13, 16, 16, 256).items():
            zf.writestr(name + ".npy", _npy_bytes(shape, data=bytes(4 * int(np.prod(shape)))))
    with pytest.raises(ValueError, match=r"in the array headers, n_layer 13 exceeds 12, the largest any preset"):
        read_weights(str(path))


@pytest.mark.parametrize("section,field,value,needle", [
    ("model", "n_embd", 10 ** 6, "config.model's n_embd 1,000,000 exceeds 768, the largest any preset"),
    ("model", "n_layer", 10 ** 9, "config.model's n_layer 1,000,000,000 exceeds 12, the largest any preset"),
    ("train", "eval_batches", 10 ** 12, "config.train.eval_batches 1000000000000 is not in [1, 10,000]"),
])
def test_quantize_bounds_what_summary_json_says(saved, tmp_path, capsys, section, field, value, needle):
    """Before: quantize built a GPT of summary.json's n_layer = 10**9 (or ran 10**12 batches) for ever."""
    import json
    import shutil
    from minizero.quantize import main
    for name in ("model.npz", "model.json", "summary.json"):
        shutil.copy(saved.parent / name, tmp_path / name)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["config"][section][field] = value
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    if section == "model":  # summary.json set aside (model.json gives the config), and said
        assert main(["--weights", str(tmp_path / "model.npz"), "--eval-batches", "1"]) == 0
        assert "summary.json' set aside: " in joined(capsys.readouterr().err)
        (tmp_path / "model.json").unlink()  # no model.json: the preset of the shapes, the summary still set aside
        assert main(["--weights", str(tmp_path / "model.npz"), "--eval-batches", "1"]) == 0
    else:
        assert main(["--weights", str(tmp_path / "model.npz")]) == 2
    assert needle in joined(capsys.readouterr().err)


@pytest.mark.parametrize("flag,value,needle", [
    ("--eval-batches", "1000000000", "--eval-batches must be in [1, 10,000] as train's, got 1,000,000,000"),
    ("--block-size", "1000000000", "--block-size must be <= 65,536 elements per scale, got 1,000,000,000"),
])
def test_quantize_flags_bounded_as_train(tmp_path, capsys, flag, value, needle):
    from minizero.quantize import main
    with pytest.raises(SystemExit) as e:
        main(["--weights", str(tmp_path / "none.npz"), flag, value])
    assert e.value.code == 2 and needle in joined(capsys.readouterr().err)


@pytest.mark.parametrize("argv,needle", [
    (["--granularity", "tensor", "--block-size", "4"], "--block-size only applies with --granularity block "
     "(elements per scale); got --granularity tensor"),
    (["--table", "--bits", "4"], "--table measures every bits x granularity and ignores --bits; got --bits 4: drop "
     "--bits, or drop --table to measure --bits 4 alone"),
    (["--table", "--granularity", "tensor"], "ignores --granularity; got --granularity tensor: drop --granularity,"),
    (["--table", "--bits", "4", "--granularity", "block"], "ignores --bits and --granularity; got --bits 4 "
     "--granularity block: drop --bits and --granularity, or drop --table to measure --bits 4 --granularity block"),
])
def test_quantize_flags_that_would_do_nothing_are_refused(tmp_path, capsys, argv, needle):
    """Before: --granularity tensor --block-size 4 quantized per tensor and ignored the block size without a word;
    --table --bits 4 named '--granularity row' too, a flag the user never gave."""
    from minizero.quantize import main
    with pytest.raises(SystemExit) as e:
        main(["--weights", str(tmp_path / "none.npz"), *argv])
    assert e.value.code == 2 and needle in joined(capsys.readouterr().err)


@pytest.mark.parametrize("flag,value", [("--initial-loss-scale", "1024"), ("--min-loss-scale", "2"),
                                        ("--loss-scale-window", "10"), ("--hysteresis", "3")])
def test_loss_scale_flags_refused_without_fp16(tmp_path, flag, value):
    """Before: accepted and ignored under --precision fp32. Refused (not warned): the flag does nothing."""
    with pytest.raises(UsageError, match=f"{flag} only apply\\(ies\\) with --precision fp16 .*got --precision fp32"):
        parse_args([*TINY, "--out", str(tmp_path / "o"), flag, value])
    parse_args([*TINY, "--out", str(tmp_path / "o"), "--precision", "fp16", flag, value])


@pytest.mark.parametrize("program, argv", [("sample", ["--tokens", "5"]), ("quantize", ["--eval-batches", "1"]),
                                           ("finetune", ["--steps", "1"])])
def test_int32_weights_are_refused_by_every_program_that_reads_them(saved, tmp_path, capsys, program, argv):
    """Before: int32 weights (the float32 file's values truncated) were cast and sampled from; after sample refused
    them, quantize still measured them and finetune trained them and wrote a model.npz."""
    import importlib
    import shutil
    import numpy as np
    shutil.copy(saved.parent / "model.json", tmp_path / "model.json")
    with np.load(saved.parent / "model.npz") as z:
        np.savez(tmp_path / "model.npz", **{k: z[k].astype(np.int32) for k in z.files})
    main = importlib.import_module(f"minizero.{program}").main
    assert main(["--weights", str(tmp_path / "model.npz"), *argv]) == 2
    err = joined(capsys.readouterr().err)
    assert "has dtype int32; sampling, quantizing and fine-tuning need float16, float32 or float64 weights" in err \
        and err.count("error:") == 1, err


@pytest.mark.parametrize("flags, said", [
    (["--cp", "2", "--dp", "3"], "--dp 3 x --tp 1 x --pp 1 = 3, but world size 4 / cp 2 = 2; the product must equal "
                                 "that"),
    (["--cp", "2", "--tp", "2", "--pp", "2"], "cannot derive --dp: world size 4 / cp 2 = 2 is not divisible by --tp 2 "
                                              "x --pp 2 = 4"),  # --tp 3: tiny's 2 heads refuse it first
    (["--dp", "3"], "--dp 3 x --tp 1 x --pp 1 = 3, but the world has 4 rank(s)")])
def test_sizes_under_cp_name_the_world_and_the_context_split(flags, said):
    """Before: "the world has 2 rank(s)" for 4 ranks under --cp 2 (the world divided by cp, named as the world)."""
    with pytest.raises(UsageError) as e:
        parse_args(["--model", "tiny", *flags], 4)
    assert said in str(e.value)


# --------------------------------------------------------------------------- outputs of the other programs
def test_other_programs_never_write_over_what_the_user_has(saved, tmp_path, monkeypatch, capsys):
    """Before: finetune --json/--out, quantize --json and compare --json wrote over model.npz, model.json,
    summary.json or a checkpoint's manifest (exit 0, the weights or the checkpoint lost); parity passed --out
    through to train; consolidate's default --out replaced a model.npz. Now each is refused before any work."""
    from minizero import compare, finetune
    from minizero.checkpoint.cli import main as checkpoint_main
    from minizero.debug.__main__ import main as debug_main
    from minizero.overwrite import check_output

    run = saved.parent  # the run's folder: model.npz, model.json, summary.json, checkpoints/
    before = {**_digests(saved), **{f: (run / f).read_bytes() for f in ("model.npz", "model.json", "summary.json")}}
    manifest = saved / "step_00000002" / "manifest.json"
    for path, needle in [(run / "model.npz", "would overwrite model.npz"), (run / "summary.json", "summary.json"),
                         (manifest, "would overwrite manifest.json"),
                         (saved / "step_00000002" / "new.json", "inside the checkpoint folder")]:
        with pytest.raises(ValueError, match=needle):
            check_output(str(path))  # quantize's, finetune's and compare's --json
    weights = ["--weights", str(run / "model.npz")]
    for argv, needle in [(["--out", str(run)], "would overwrite --weights"),
                         (["--json", str(run / "model.json")], "would overwrite --weights' config"),
                         (["--out", str(tmp_path / "ft"), "--json", str(tmp_path / "ft" / "model.json")],
                          "would overwrite --out's model.json"),
                         (["--out", str(saved / "step_00000002")], "inside the checkpoint folder"),
                         (["--eval-batches", "1000000"], r"--eval-batches must be in \[1, 10,000\]")]:
        with pytest.raises(ValueError, match=needle):
            finetune.check(finetune.build_parser().parse_args([*weights, *argv]))
    for argv, needle in [(["--json", str(run / "model.npz")], "would overwrite model.npz"),
                         (["--out", str(saved / "step_00000002")], "is inside a checkpoint folder")]:
        with pytest.raises(compare.UsageError, match=needle):
            compare.parse_args(["--model", "tiny", "--strategies", "baseline", *argv])
    assert debug_main(["parity", "--dp 1 --out " + str(run), "--dp 1"]) == 2
    assert "--out sets what a run writes or reads; parity runs each layout in a temporary folder of its own" \
        in joined(capsys.readouterr().err)  # it said "--out is parity's own": parity has no --out
    assert debug_main(["parity", "-n 1000", "--dp 1"]) == 2
    assert "-n needs a number of ranks in [1, 64]" in joined(capsys.readouterr().err)
    monkeypatch.chdir(run)  # consolidate's default --out: model.npz, here another run's weights
    assert checkpoint_main(["consolidate", str(saved)]) == 2
    assert "model.npz exists here" in joined(capsys.readouterr().err)
    assert {**_digests(saved), **{f: (run / f).read_bytes() for f in ("model.npz", "model.json",
                                                                       "summary.json")}} == before
    from minizero.weights import SIDECAR, load_trained

    ft = tmp_path / "ft"  # finetune's merged model: model.npz and model.json, no summary.json
    ft.mkdir()
    shutil.copy(run / "model.npz", ft / "model.npz")
    shutil.copy(run / SIDECAR, ft / SIDECAR)
    model, summary = load_trained(str(ft / "model.npz"))  # before: "no summary.json ...; pass --model" (finetune has
    assert summary == {} and model.num_parameters() > 0   # no --model): a fine-tuned model could not be tuned again
    monkeypatch.setenv("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "abc")  # before: a traceback at import, even --help
    with pytest.raises(UsageError, match="MINIZERO_SMALL_ALLREDUCE_MAX_BYTES='abc'; allowed: an integer >= -1"):
        parse_args([*TINY, "--out", str(tmp_path / "o")])


def test_data_larger_than_memory_is_a_usage_error(tmp_path, monkeypatch):
    """A --data file larger than memory: before, a MemoryError traceback and then "error: MemoryError: " (train,
    finetune and quantize read it through load_tokens)."""
    import numpy as np

    from minizero.data import load_tokens

    text = tmp_path / "big.txt"
    text.write_text("hello world\n" * 1000)
    assert bytes(load_tokens(str(text))) == text.read_bytes()  # read once, into the array
    late = tmp_path / "late.txt"  # UTF-8 checked by 16 MiB pieces: a bad byte past the first named by its place
    late.write_bytes("é".encode() * (1 << 23) + b"ab\xff")
    with pytest.raises(ValueError, match=re.escape("is not UTF-8 text (invalid start byte at byte 16,777,218)")):
        load_tokens(str(late))

    def no_room(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(np, "fromfile", no_room)
    with pytest.raises(UsageError, match=re.escape(f"--data {str(text)!r} has 12,000 bytes, more than this process "
                                                   "can hold: every rank reads the file whole, so it must fit")):
        parse_args(["--model", "tiny", "--data", str(text)])


def test_utf16_data_is_named_as_such_with_the_conversion(tmp_path):
    """Before: a UTF-16 file (Windows' "Unicode" text) was only 'not UTF-8 text (invalid start byte at byte 0)'."""
    from minizero.data import load_tokens

    wide = tmp_path / "wide.txt"
    wide.write_text("hello world\n" * 100, encoding="utf-16")
    with pytest.raises(ValueError, match=re.escape("at byte 0; it starts with a UTF-16 byte-order mark: iconv -f "
                                                   "UTF-16 -t UTF-8 converts it); give a UTF-8 text file")):
        load_tokens(str(wide))
    wide.write_text("hello world\n" * 100, encoding="utf-32")  # before: its BOM read as UTF-16's (iconv garbles it)
    with pytest.raises(ValueError, match=re.escape("it starts with a UTF-32 byte-order mark: iconv -f UTF-32 -t")):
        load_tokens(str(wide))
