"""Bad input found at the command lines (a switch, a list with a repeat, a non-ASCII number, a world size):
each is refused before any work, with exit status 2 and a message naming the value and what is allowed."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from minizero import compare, finetune
from minizero.numerals import unwrapped
from minizero.train import UsageError, parse_args
from tests.conftest import mpi_env, one_refusal

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


def joined(printed: str) -> str:
    """What a program printed, read whole: its lines of <= 120 columns (numerals.wrapped) joined by one space."""
    return " ".join(printed.split())
NOT_ASCII = ["٣", "８", "²", "1٣", "1_000"]  # Arabic-Indic 3, fullwidth 8 (int() reads both), superscript 2, a mix;
# and '_' separators (int() reads 1_000; the message says digits 0-9)


# --------------------------------------------------------------------------- MINIZERO_DEBUG_COLLECTIVES
@pytest.mark.parametrize("value", ["yes", "true", "on", "2", " 1"])
def test_debug_collectives_other_than_0_or_1_is_refused_by_train(monkeypatch, tmp_path, value):
    """Before: any value but "1" meant off without a word (ZeRO's order check silently skipped)."""
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", value)
    with pytest.raises(UsageError, match=re.escape(f"MINIZERO_DEBUG_COLLECTIVES={value!r}; allowed: \"0\"")) as e:
        parse_args([*TINY, "--out", str(tmp_path / "o")])
    assert '"1"' in str(e.value)
    args = finetune.build_parser().parse_args(["--weights", str(tmp_path / "w.npz")])
    with pytest.raises(ValueError, match="MINIZERO_DEBUG_COLLECTIVES"):
        finetune.check(args)  # ZeRO reads it there too (--zero)


@pytest.mark.parametrize("value,on", [("0", False), ("1", True), ("", False)])  # empty: unset, as MINIZERO_FAULT
def test_debug_collectives_0_and_1_are_accepted(monkeypatch, tmp_path, value, on):
    from minizero.zero.collectives import debug_collectives

    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", value)
    parse_args([*TINY, "--out", str(tmp_path / "o")])
    assert debug_collectives() is on
    monkeypatch.delenv("MINIZERO_DEBUG_COLLECTIVES")
    assert debug_collectives() is False


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_plots_other_than_0_or_1_is_refused_by_train(monkeypatch, tmp_path, value):
    """MINIZERO_PLOTS (the suite sets "0"): anything but "0" or "1" is refused with the arguments, before any work."""
    monkeypatch.setenv("MINIZERO_PLOTS", value)
    with pytest.raises(UsageError, match=re.escape(f"MINIZERO_PLOTS={value!r}; allowed: \"1\" (draw")):
        parse_args([*TINY, "--out", str(tmp_path / "o")])


# --------------------------------------------------------------------------- finetune --targets
@pytest.mark.parametrize("targets,twice", [("c_attn,c_attn", "c_attn"), ("c_fc,c_proj,c_fc", "c_fc")])
def test_finetune_targets_named_twice_are_refused(capsys, targets, twice):
    """Before: "c_attn,c_attn" was accepted (one name, given twice)."""
    assert finetune.main(["--targets", targets]) == 2
    err = joined(capsys.readouterr().err)
    assert f"--targets {targets!r} names {twice!r} twice; give each of c_attn, c_proj, c_fc at most once" in err


# --------------------------------------------------------------------------- plan --strategy
@pytest.mark.parametrize("text,name", [("dp2 tp2 pp2 sp sp", "sp"), ("dp2 tp2 pp2 sp sequence-parallel", "sp"),
                                       ("zero3 offload=params+params", "offload=params"),
                                       ("offload=activations offload=activations", "offload=activations")])
def test_plan_strategy_setting_a_switch_twice_is_refused(capsys, text, name):
    """Before: "sp sp" and "offload=params+params" were accepted as if said once."""
    from minizero import plan

    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama3-8b", "--gpus", "8", "--strategy", text])
    assert e.value.code == 2 and f"--strategy {text!r}: {name} is given twice" in joined(capsys.readouterr().err)


@pytest.mark.parametrize("text,said", [
    ("recompute=full recompute=bogus", "cannot read 'recompute=bogus'"),  # the bad word first, not "twice"
    ("zero3 offload=params+params", "offload=params is given twice in 'offload=params+params'"),
    ("dp2 tp2 dp4", "dp is given twice ('dp2' and 'dp4')")])
def test_plan_strategy_names_the_word_that_is_wrong(capsys, text, said):
    """Review: an unreadable word was reported as a setting "given twice", and a repeat inside one word was
    named as two words."""
    from minizero import plan

    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama3-8b", "--gpus", "8", "--strategy", text])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_plan_strategy_ep_that_disagrees_with_the_ep_flag_is_refused(capsys):
    """Before: --ep 2 beside "ep4" in --strategy was dropped without a word."""
    from minizero import plan

    text = "dp32 ep4 zero3 shard8"
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "mixtral-8x7b", "--gpus", "32", "--strategy", text, "--ep", "2"])
    assert e.value.code == 2 and f"--strategy {text!r}: ep 4 disagrees with --ep 2; give ep once" in \
        capsys.readouterr().err
    plan.main(["--model", "mixtral-8x7b", "--gpus", "32", "--strategy", text, "--ep", "4"])  # the same: fine


def test_plan_strategy_attention_that_disagrees_with_the_attention_flag_is_refused(capsys):
    """Before: --attention flash beside "attention=dense" evaluated dense under a header saying "flash attention",
    and "attention=flash" alone under one saying "dense attention"."""
    from minizero import plan

    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama2-7b", "--gpus", "8", "--attention", "flash", "--strategy", "dp8 attention=dense"])
    assert e.value.code == 2 and "--strategy 'dp8 attention=dense': attention=dense disagrees with --attention " \
        "flash; give attention once" in " ".join(capsys.readouterr().err.split())
    plan.main(["--model", "llama2-7b", "--gpus", "8", "--strategy", "dp8 attention=flash"])
    head = " ".join(capsys.readouterr().out.split("strategy:")[0].split())
    assert "flash attention" in head and "dense attention" not in head, head


# --------------------------------------------------------------------------- numbers in ASCII digits only
def test_no_parser_reads_numbers_with_int_or_float():
    """Every program's argparse numbers go through minizero.numerals (int/float read '٣' as 3)."""
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "minizero").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"type=(int|float)\b", line)]
    assert not found


@pytest.mark.parametrize("digit", NOT_ASCII)
def test_non_ascii_digits_are_refused_by_every_program(tmp_path, capsys, digit):
    from minizero import plan, quantize, sample
    from minizero.debug.__main__ import main as debug_main
    from minizero.plan_strategy import parse_strategy
    from minizero.models import MODELS

    allowed = f"invalid int value: {digit!r}; allowed: an integer in ASCII digits 0-9"
    for flags in (["--steps", digit], ["--dp", digit], ["--micro-batch-size", digit]):
        with pytest.raises(UsageError, match=re.escape(allowed)):
            parse_args([*TINY, "--out", str(tmp_path / "o"), *flags])
    with pytest.raises(UsageError, match=re.escape(f"invalid float value: {digit!r}; allowed: a number in ASCII")):
        parse_args([*TINY, "--out", str(tmp_path / "o"), "--lr", digit])
    for main, argv in ((plan.main, ["--model", "llama3-8b", "--gpus", digit]),
                       (sample.main, ["--tokens", digit]), (quantize.main, ["--bits", digit])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and allowed in joined(capsys.readouterr().err)
    for main, argv in ((finetune.main, ["--steps", digit]), (compare.main, ["--steps", digit])):
        assert main(argv) == 2 and allowed in joined(capsys.readouterr().err)
    assert compare.main(["--ranks", f"2,{digit}"]) == 2
    assert f"got '2,{digit}'" in capsys.readouterr().err
    assert debug_main(["parity", f"-n {digit}", "--dp 1"]) == 2  # before: '٣' started 3 ranks, '²' a traceback
    assert f"layout '-n {digit}': -n needs a number of ranks in [1, 64] (ASCII digits)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape(f"cannot read 'dp{digit}'")):
        parse_strategy(f"dp{digit}", MODELS["llama3-8b"], 3)


@pytest.mark.parametrize("var,value,needle", [
    ("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "٣", "MINIZERO_SMALL_ALLREDUCE_MAX_BYTES='٣'; allowed: an integer >= -1"),
    ("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "²", "MINIZERO_SMALL_ALLREDUCE_MAX_BYTES='²'; allowed: an integer >= -1"),
    ("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "1_000", "MINIZERO_SMALL_ALLREDUCE_MAX_BYTES='1_000'; allowed: an integer"),
    ("MINIZERO_FAULT", "٠:0:raise", "MINIZERO_FAULT='٠:0:raise'; expected RANK:STEP:KIND"),
    ("MINIZERO_FAULT", "0:²:raise", "MINIZERO_FAULT='0:²:raise'; expected RANK:STEP:KIND"),
    ("MINIZERO_FAULT", "0:0:boom", "KIND raise, kill, inf, stop, kill_in_save, diverge, diverge_state or slow"),  # a tuple before
])
def test_non_ascii_digits_in_the_environment_are_refused(monkeypatch, tmp_path, var, value, needle):
    """Before: '٣' read as 3, and '²' (isdigit() but not int()) ended in a traceback."""
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError, match=re.escape(needle)):
        parse_args([*TINY, "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("value", ["²", "٣", "x"])
def test_a_launchers_rank_variable_that_is_not_ascii_digits_is_not_read(monkeypatch, value):
    """Before: LOCAL_RANK='²' (isdigit(), which int() refuses) ended sample --device strict and every Ctrl-C
    (PMI_RANK) in a ValueError traceback, and a folder step_² in a save dir ended the run's save in one."""
    from minizero import backend, interrupts
    from minizero.checkpoint.format import step_of

    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_RANK", value)
    monkeypatch.setenv("PMI_RANK", value)
    assert backend.local_rank() == 0 and interrupts.launched_rank() == 0
    assert step_of(f"step_{value}") is None and step_of("step_00000012") == 12


@pytest.mark.parametrize("argv,said", [
    (["--allreduce", "99999999999999999999"], "--allreduce 99999999999999999999: allowed: a multiple of 4 bytes"),
    (["--allreduce", "5"], "--allreduce 5: allowed: a multiple of 4 bytes (float32) in [4, 4,294,967,296]"),
    (["--allreduce", "8", "--runs", "99999999999"], "--runs 99999999999: allowed: 1..1000")])
def test_the_hardware_job_bounds_its_array_and_runs_before_any_mpi(capsys, argv, said):
    """Before: 1e20 bytes ended in a NumPy ValueError traceback (a few GB more, an out-of-memory kill), 5 bytes
    timed 4, and 1e11 runs never ended. One ``prog: error:`` line, as every program's (argparse's usage block was
    printed above it)."""
    from minizero import hardware

    with pytest.raises(SystemExit) as e:
        hardware.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in one_refusal(err) and err.startswith("python -m minizero.hardware: error: ")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,printed", [(["--help"], "usage: "), (["--allreduce", "5"], "error: ")])
def test_the_hardware_job_says_its_help_or_refusal_once_under_mpiexec(mpiexec, argv, printed):
    """Before: each launched rank printed it (twice with -n 2); train's and finetune's say it on rank 0 only."""
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "minizero.hardware", *argv], env=mpi_env(),
                          capture_output=True, text=True, timeout=100)
    assert (proc.stdout + proc.stderr).count(printed) == 1, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- compare --ranks
@pytest.mark.parametrize("ranks", ["1000", "2,65"])
def test_compare_refuses_more_ranks_than_parity_allows(tmp_path, ranks):
    """Before: --ranks 1000 printed an oversubscription note and started 1000 ranks."""
    from minizero.debug.parity import MAX_RANKS

    assert MAX_RANKS == 64
    with pytest.raises(compare.UsageError, match=re.escape(f"--ranks must be a comma list of world sizes (integers) "
                                                           f"in [1, {MAX_RANKS}], got {ranks!r}")):
        compare.parse_args(["--ranks", ranks, "--out", str(tmp_path / "c")])
    assert compare.parse_args(["--ranks", "1,64", "--strategies", "baseline", "--out", str(tmp_path / "c")]).ranks \
        == [1, 64]


def test_flight_records_are_capped_before_any_work(tmp_path):
    """Attacker: --flight-records 10**30 passed the checks and ended in an OverflowError traceback at start-up."""
    from minizero.flags import MAX_FLIGHT_RECORDS

    with pytest.raises(UsageError, match=re.escape(f"--flight-records must be <= {MAX_FLIGHT_RECORDS:,}, got {10 ** 30:,}")):
        parse_args([*TINY, "--out", str(tmp_path / "o"), "--flight-records", str(10 ** 30)])
    assert parse_args([*TINY, "--out", str(tmp_path / "o"), "--flight-records", str(MAX_FLIGHT_RECORDS)])


def test_finetune_that_diverges_writes_nothing(tmp_path, capsys):
    """Attacker: --lr 1e30 ended with a validation loss of nan, exit 0, and a model.npz of NaN in --out. Later:
    the one-line diagnosis came after 17 lines of NumPy's overflow warnings (the main job silences them)."""
    import dataclasses
    import json
    import warnings

    import numpy as np

    from minizero.nn import GPT, get_config

    np.savez(tmp_path / "model.npz", **GPT(get_config("tiny"), seed=1).state_dict())
    (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(get_config("tiny"))))
    out = tmp_path / "ft"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an overflow warning: an exception here
        assert finetune.main(["--weights", str(tmp_path / "model.npz"), "--steps", "2", "--eval-batches", "1",
                              "--out", str(out), "--lr", "1e30", "--method", "full"]) == 1
    assert "the run diverged; " in joined(capsys.readouterr().err) and not out.exists()


# --------------------------------------------------------------------------- values that start with '-'
@pytest.mark.parametrize("argv,said", [
    (["--steps", "-1,5"], "argument --steps: invalid int value: '-1,5'; allowed: an integer in ASCII digits 0-9"),
    (["--lr", "-1e-3"], "--lr must be a normal float32 number, in [1.175e-38, 3.403e+38] (--dtype float32), "
     "got -0.001"),
    (["--seed", "-2x"], "argument --seed: invalid int value: '-2x'"),
    (["--steps", "--lr", "1"], "argument --steps: expected one argument"),  # a real option is still an option
    (["--lr", "-inf"], "--lr must be a normal float32 number"),  # before: "argument --lr: expected one argument"
    (["--dropout", "-NaN"], "--dropout must be in [0, 1), at most 0.99999994 in float32, got nan"),
    (["--grad-clip", "-Infinity"], "--grad-clip must be >= 0 (0 disables), got -inf"),
])
def test_a_value_starting_with_minus_reaches_the_flags_own_check(argv, said):
    """Before: argparse read "-1,5" and "-1e-3" as unknown options: "argument --steps: expected one argument"."""
    with pytest.raises(UsageError) as e:
        parse_args([*TINY, *argv])
    assert str(e.value).startswith(said), e.value


def test_a_comma_list_starting_with_minus_reaches_compares_check():
    with pytest.raises(compare.UsageError, match=r"--ranks must be a comma list of world sizes .* got '-1,2'"):
        compare.parse_args(["--ranks", "-1,2"])


@pytest.mark.parametrize("argv,said", [
    (["--method", "full", "--lora-rank", "4", "--targets", "c_fc"],
     "--lora-rank, --targets only apply(ies) with --method lora or qlora (adapters); --method full trains every"),
    (["--method", "full", "--lora-alpha", "8"], "--lora-alpha only apply(ies) with --method lora or qlora"),
    (["--table", "--method", "lora"], "--table runs every method (full, lora, qlora) and ignores --method; got "
     "--method lora: give one of them")])
def test_finetune_flags_that_would_do_nothing_are_refused(tmp_path, capsys, argv, said):
    """Before: --method full with adapter flags trained every parameter without a word; --table ignored --method."""
    assert finetune.main(["--weights", str(tmp_path / "none.npz"), *argv]) == 2
    assert said in joined(capsys.readouterr().err)


@pytest.mark.parametrize("kind", ["diverge", "diverge_state", "kill_in_save"])
def test_finetune_refuses_a_fault_kind_its_loop_never_fires(tmp_path, capsys, monkeypatch, kind):
    """Before: accepted, then never fired (the fine-tune's loop has no step-end callbacks and no saves)."""
    monkeypatch.setenv("MINIZERO_FAULT", f"0:0:{kind}")
    assert finetune.main(["--weights", str(tmp_path / "none.npz")]) == 2
    assert (f"MINIZERO_FAULT='0:0:{kind}' never fires in a fine-tune; allowed KIND: raise, kill, inf, stop, slow"
            in joined(capsys.readouterr().err))


def test_an_output_file_where_a_run_makes_its_folder_is_refused_before_work(tmp_path, capsys):
    """--json (or --trace) naming the --out folder the run makes, or train's save dir: every step ran, the weights
    were written, then "could not write 'o': it is a directory" (exit 1)."""
    from minizero.args import UsageError, parse_args

    out, save = str(tmp_path / "o"), str(tmp_path / "o" / "checkpoints")
    for argv, said in [(["--json", out], f"--json {out!r} would overwrite --out, the folder the run writes into"),
                       (["--trace", out], f"--trace {out!r} would overwrite --out, the folder the run writes into"),
                       (["--save-every", "1", "--json", save],
                        f"--json {save!r} would overwrite --save-dir, the folder the checkpoints go to")]:
        with pytest.raises(UsageError, match="^" + re.escape(said)):
            parse_args(["--model", "tiny", "--out", out, *argv], world_size=1)
    parse_args(["--model", "tiny", "--out", out, "--no-save", "--trace", out], world_size=1)  # no OUT made
    assert finetune.main(["--weights", str(tmp_path / "none.npz"), "--out", out, "--json", out]) == 2
    assert joined(capsys.readouterr().err) == (f"python -m minizero.finetune: error: --json {out!r} would overwrite "
                                               f"--out {out!r}; give another file")
    assert list(tmp_path.iterdir()) == []


def test_finetune_out_that_cannot_be_made_is_refused_before_training(tmp_path, capsys):
    """Before: --out under a file (or on a read-only file system) trained, then ended in a makedirs traceback."""
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "ft")
    assert finetune.main(["--weights", str(tmp_path / "none.npz"), "--out", out]) == 2
    err = joined(capsys.readouterr().err)
    assert f"--out {out!r} cannot be written (" in err and "is not a directory" in err, err


@pytest.mark.parametrize("name", ["model.npz", "model.json"])
@pytest.mark.parametrize("kind", ["note", "folder"])
def test_finetune_out_replaces_only_earlier_weights_and_config(tmp_path, capsys, name, kind):
    """Before: --out DIR replaced the user's DIR/model.npz or model.json (a note, another tool's config), or trained,
    then failed on a folder of that name (model.npz written, model.json not). Earlier outputs are still replaced."""
    import numpy as np
    from minizero.nn import GPTConfig
    from minizero.saved_model import write_model_json

    out, weights = tmp_path / "ft", str(tmp_path / "none.npz")
    out.mkdir()
    mine = out / name
    mine.mkdir() if kind == "folder" else mine.write_text('{"mine": 1}\n')
    assert finetune.main(["--weights", weights, "--out", str(out)]) == 2
    said = "a model config" if name == "model.json" else "an .npz"
    assert joined(capsys.readouterr().err) == (
        f"python -m minizero.finetune: error: --out {str(out)!r}: {str(mine)!r} is there and is not {said} minizero "
        "wrote; it replaces only earlier weights and their config: move it away, or give another folder")
    assert [p.name for p in out.iterdir()] == [name] and (kind == "folder" or mine.read_text() == '{"mine": 1}\n')
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    np.savez(earlier / "model.npz", a=np.zeros(2))
    write_model_json(str(earlier), GPTConfig())
    finetune.check(finetune.build_parser().parse_args(["--weights", weights, "--out", str(earlier)]))


@pytest.mark.parametrize("tool,argv", [("quantize", ["--bits", "3"]), ("quantize", ["--block-size", "0"]),
                                       ("finetune", ["--bogus"]), ("plan", ["--gpus", "8"]), ("sample", ["--bogus"]),
                                       # these printed a usage block of 1 to 3 lines above the error:
                                       ("checkpoint", []), ("checkpoint", ["inspect"]), ("debug", ["hang"]),
                                       ("debug", ["parity", "--dp 1", "--dp 1", "--tol", "nan"])])
def test_a_refusal_is_one_line_without_the_usage_block(capsys, tool, argv):
    """quantize and finetune printed argparse's whole usage block (15 lines) above the error; every tool's is one
    line naming the value (a long one goes on over indented lines of <= 120 columns), exit status 2
    (numerals.OneLineParser)."""
    import importlib
    module = {"checkpoint": "checkpoint.cli", "debug": "debug.__main__"}.get(tool, tool)
    try:
        code = importlib.import_module(f"minizero.{module}").main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    prog = f"python -m minizero.{tool}" + (f" {argv[0]}" if tool in ("checkpoint", "debug") and argv else "")
    lines = err.splitlines()
    assert code == 2 and err.count("error:") == 1 and err.startswith(f"{prog}: error: "), err
    assert all(len(line) <= 120 for line in lines) and all(line.startswith("  ") for line in lines[1:]), err


def test_finetune_names_the_data_file_too_short_to_validate(tmp_path, capsys):
    """Before: '--data has 15 bytes; ...' without the file's name (quantize names it)."""
    weights = tmp_path / "w"
    subprocess.run([sys.executable, "-m", "minizero.train", "--model", "tiny", "--steps", "1", "--eval-batches", "1",
                    "--sample-tokens", "0", "--no-progress", "--out", str(weights)], check=True, capture_output=True,
                   timeout=120, env=mpi_env())
    short = tmp_path / "short.txt"
    short.write_text("short text here")
    assert finetune.main(["--weights", str(weights / "model.npz"), "--data", str(short)]) == 2
    assert (f"--data {str(short)!r} has 15 bytes; needs at least 180 (its last 10% validates and must hold "
            "block_size + 2 = 18 tokens)") in joined(capsys.readouterr().err)


@pytest.mark.parametrize("module,commands", [("checkpoint.cli", "{inspect,consolidate}"),
                                             ("debug.__main__", "{hang,trace,parity}")])
def test_a_missing_subcommand_is_named_with_its_choices(capsys, module, commands):
    """Before: "the following arguments are required: command", and no usage block (one line) to say which."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"minizero.{module}").main([])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(f"are required: {commands}\n")


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("module,tool,argv", [("sample", "sample", []), ("plan", "plan", ["--model", "tiny"]),
                                              ("checkpoint.cli", "checkpoint", ["consolidate", "ck"]),
                                              ("debug.__main__", "debug", ["hang", "out/flight"]),
                                              ("quantize", "quantize", ["--help"])])
def test_a_one_process_program_on_several_ranks_stops_before_any_work(monkeypatch, capsys, rank, module, tool, argv):
    """Before: each rank did the same work and printed it (two ranks of checkpoint consolidate raced on one
    model.npz); now every rank exits 2 before parsing, rank 0 with one line (quantize refused, on every rank)."""
    import importlib

    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", rank)
    import socket

    launcher, rank_end = socket.socketpair()  # MPICH's launcher's connection: a socket
    monkeypatch.setenv("PMI_FD", str(rank_end.fileno()))
    with launcher, rank_end, pytest.raises(SystemExit) as e:
        importlib.import_module(f"minizero.{module}").main(argv)
    out = capsys.readouterr()
    said = [] if rank == "1" else [f"python -m minizero.{tool}: error: runs in one process; mpiexec started 2 ranks: "
                                   "run it without mpirun (or with -n 1)"]
    assert e.value.code == 2 and out.out == "" and out.err.splitlines() == said, out


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("module,tool,argv", [("sample", "sample", []), ("plan", "plan", ["--model", "tiny"]),
                                              ("checkpoint.cli", "checkpoint", ["consolidate", "ck"]),
                                              ("debug.__main__", "debug", ["hang", "out/flight"]),
                                              ("quantize", "quantize", ["--help"])])
def test_a_stale_launcher_environment_is_named_on_every_rank(monkeypatch, capsys, rank, module, tool, argv):
    """PMI_SIZE=2 PMI_RANK=1 left in a shell, no launcher (no PMI_FD): before, "rank 1" exited 2 and said nothing."""
    import importlib

    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_FD", "PMI_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", rank)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"minizero.{module}").main(argv)
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "" and unwrapped(out.err) == [
        f"python -m minizero.{tool}: error: PMI_SIZE=2 PMI_RANK={rank} are set, but no MPI launcher started this "
        "process: unset PMI_SIZE PMI_RANK (this program runs in one process, without mpiexec)"], out


@pytest.mark.parametrize("env,named", [
    ({"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "2"}, "PMI_SIZE=2 PMI_RANK=1 are"),  # stderr: no launcher's socket
    ({"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "99999"}, "PMI_SIZE=2 PMI_RANK=1 are"),  # closed
    ({"PMI_SIZE": "2", "PMI_RANK": "1", "PMI_FD": "9" * 20}, "PMI_SIZE=2 PMI_RANK=1 are"),  # OverflowError before
    ({"PMI_SIZE": "2"}, "PMI_SIZE=2 is")])
def test_a_stale_pmi_fd_is_no_launcher(monkeypatch, capsys, env, named):
    """PMI_FD naming a descriptor that is no socket (a terminal, /dev/null): before, rank 1 exited 2 silently as
    under mpiexec; PMI_FD of 20 digits: an OverflowError traceback; PMI_SIZE alone: "PMI_SIZE=2 are set"."""
    from minizero import plan

    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_FD", "PMI_PORT", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "tiny", "--gpus", "2"])
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "" and unwrapped(out.err)[0].startswith(
        f"python -m minizero.plan: error: {named} set, but no MPI launcher started this process: unset"), out
    # every variable the advice leaves set would stop the next program: PMI_FD left, train refused it again
    assert unwrapped(out.err)[0].split("unset ")[1].split(" (")[0] == " ".join(env), out


@pytest.mark.parametrize("layouts, said", [
    (["--sequence-parallel", "--dp 1"], "layout '--sequence-parallel': --sequence-parallel splits the sequence"),
    (["--dp 1", "--bogus"], "layout '--bogus': unrecognized arguments: --bogus")])
def test_parity_reads_a_one_flag_layout_as_a_layout(capsys, layouts, said):
    """Before: a layout of one flag without a space was parity's unknown option: 'the following arguments are
    required: LAYOUT', which named neither the layout nor what was wrong with it."""
    from minizero.debug.__main__ import main as debug_main
    assert debug_main(["parity", *layouts, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert said in joined(err) and err.count("error:") == 1 and max(map(len, err.splitlines())) <= 120, err


@pytest.mark.parametrize("module, argv, said", [
    ("train", ["--loss-scale", "1024"], "unrecognized arguments: --loss-scale 1024"),  # set --loss-scale-window
    ("quantize", ["--out", "6"], "unrecognized arguments: --out 6"),  # set --outlier-threshold
    ("sample", ["--top", "5"], "unrecognized arguments: --top 5"),  # set --top-k
    ("checkpoint", ["consolidate", "missing", "--ou", "x.npz"], "unrecognized arguments: --ou x.npz")])  # --out
def test_a_flag_is_read_whole_not_as_the_start_of_another(capsys, module, argv, said):
    """Before: argparse's abbreviations took a flag of another tool ('--loss-scale', DeepSpeed's and Megatron's)
    for the one of ours it starts, with no word said."""
    if module == "train":
        with pytest.raises(UsageError, match=said):
            parse_args(argv, 1)
        return
    main = __import__(f"minizero.{module}" + (".cli" if module == "checkpoint" else ""), fromlist=["main"]).main
    with pytest.raises(SystemExit) as e:
        main(argv if module == "checkpoint" else ["--weights", "missing.npz", *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["--zer", "3"], "unrecognized arguments: --zer 3 (did you mean --zero?)"),
    (["--Micro_Batch_Size=4"], "(did you mean --micro-batch-size?)"),  # case and '_' ignored, '=VALUE' too
    (["--learning-rate", "1e-3"], "unrecognized arguments: --learning-rate 1e-3 (did you mean --lr?)"),  # a synonym
    (["--fp16", "--stpes", "3"], "(did you mean --precision fp16 for --fp16, --steps for --stpes?)"),
    (["--tensor-parallel", "2"], "(did you mean --tp?)"),  # difflib alone said --sequence-parallel
    (["--gradient-checkpointing"], "(did you mean --recompute full?)"),  # a switch: the value too (was --recompute)
    (["-n", "8"], "unrecognized arguments: -n 8; mpirun's -n (the number of ranks) goes before python: "
                  "mpirun -n RANKS python -m minizero.train [flags]"),  # the README's command, half-remembered
    (["-np", "4"], "unrecognized arguments: -np 4; mpirun's -np (the number of ranks) goes before python: "
                   "mpirun -np RANKS python -m minizero.train [flags]"),
    (["--bogus"], "unrecognized arguments: --bogus")])
def test_a_mistyped_flag_of_train_gets_a_did_you_mean(argv, hint):
    with pytest.raises(UsageError) as e:
        parse_args(argv, 1)
    assert str(e.value).endswith(hint), str(e.value)


@pytest.mark.parametrize("argv, hint", [
    (["--model", "gpt-2"], "invalid choice: 'gpt-2' (choose from 'deep', 'default', 'gpt2', 'small', 'tiny') "
                           "(did you mean 'gpt2'?)"),
    (["--schedule", "1f1"], "(did you mean '1f1b'?)"),
    (["--zero", "12"], "invalid choice: 12 (choose from 0, 1, 2, 3)"),  # a number: no guess by its letters
    (["--precision", "int4"], "invalid choice: 'int4' (choose from 'fp32', 'fp16', 'bf16', 'fp8')")])  # none close
def test_a_near_miss_of_a_choice_gets_a_did_you_mean(argv, hint):
    """Before: '--model gpt-2' got the list alone (numerals.FlagParser: every program's choices)."""
    with pytest.raises(UsageError) as e:
        parse_args(argv, 1)
    assert str(e.value).endswith(hint), str(e.value)


def test_a_mistyped_subcommand_gets_a_did_you_mean(capsys):
    from minizero.checkpoint.cli import main as checkpoint_main

    with pytest.raises(SystemExit) as e:
        checkpoint_main(["inspet", "x"])
    assert e.value.code == 2 and joined(capsys.readouterr().err).endswith("(did you mean 'inspect'?)")


def test_did_you_mean_in_sample_and_train_synonyms_name_real_flags(capsys):
    from minizero.flags import SYNONYMS, build_parser
    from minizero.sample import main as sample_main

    with pytest.raises(SystemExit) as e:
        sample_main(["--temprature", "0.5", "--tokens", "3"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "python -m minizero.sample: error: unrecognized arguments: --temprature 0.5 (did you mean --temperature?)\n")
    from minizero.sample import SYNONYMS as SAMPLE_SYNONYMS, build_parser as sample_parser
    for table, parser in ((SYNONYMS, build_parser()), (SAMPLE_SYNONYMS, sample_parser())):
        flags = parser._option_string_actions
        named = [(k, w.strip(",.;:")) for k, v in table.items() for w in v.split() if w.startswith("--")]
        assert named and all(w in flags and k not in flags for k, w in named), named
        assert all(v.startswith("--") or "minizero" in v for v in table.values())  # a flag, or a note


@pytest.mark.parametrize("argv, said", [
    (["--top-p", "0.9"], "--top-p 0.9; minizero has no nucleus (top-p) sampling; it has --top-k and --temperature"),
    (["--max-new-tokens", "5"], "--max-new-tokens 5 (did you mean --tokens?)")])
def test_sample_names_what_it_has_for_other_programs_sampling_flags(capsys, argv, said):
    """Before: --top-p was offered --top-k (another technique); --max-new-tokens got no hint."""
    from minizero.sample import main as sample_main
    with pytest.raises(SystemExit) as e:
        sample_main(argv)
    assert e.value.code == 2 and joined(capsys.readouterr().err).endswith(f"unrecognized arguments: {said}")


@pytest.mark.parametrize("argv, hint", [
    (["--num-epochs", "3"], "--num-epochs 3; minizero counts optimizer steps, not epochs: give --steps"),
    (["--eval-steps", "5"], "(did you mean --eval-every?)"),  # difflib said --eval-batches
    (["--save", "ck"], "(did you mean --save-dir?)"),  # difflib said --no-save
    (["--per_device_train_batch_size", "4"], "(did you mean --micro-batch-size?)"),
    (["--max-new-tokens", "9"], "(did you mean --sample-tokens?)"),
    # before: "... --save x (did you mean --save-dir?); minizero counts ...": which flag each part was for, unsaid
    (["--num-epochs", "3", "--save", "x"], "--num-epochs 3 --save x (did you mean --save-dir for --save?); "
                                           "--num-epochs: minizero counts optimizer steps, not epochs: give --steps"),
    (["--zer", "3", "--bogus"], "--zer 3 --bogus (did you mean --zero for --zer?)")])
def test_train_maps_other_programs_training_flags(argv, hint):
    with pytest.raises(UsageError) as e:
        parse_args(argv, 1)
    assert str(e.value).endswith(hint), str(e.value)


def test_an_output_folder_that_is_a_dangling_link_is_named(tmp_path, capsys):
    """Before: --out or --save-dir on a link to a missing folder passed the checks, then train and finetune said
    "could not write 'LINK/.lock': File exists" (makedirs on the link)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing" / "x")
    said = f"({str(link)!r} links to the missing {str(tmp_path / 'missing' / 'x')!r})"
    for argv in (["--out", str(link)], ["--out", str(tmp_path / "o"), "--save-every", "1", "--save-dir", str(link)]):
        with pytest.raises(UsageError) as e:
            parse_args([*TINY, *argv])
        assert said in str(e.value), e.value
    assert finetune.main(["--weights", str(tmp_path / "none.npz"), "--out", str(link / "sub")]) == 2
    assert said in joined(capsys.readouterr().err)


@pytest.mark.parametrize("ranks, argv", [
    (1, ["--tp", "3"]), (1, ["--dp", "2"]), (1, ["--cp", "2"]), (1, ["--dp-shard", "2"]),
    (2, ["--tp", "2", "--cp", "2"]),
    (2, ["--attention", "flash", "--cp", "2"]), (1, ["--comm", "nccl"]), (4, ["--dp-shard", "2"]),
    (1, ["--precision", "fp16", "--dtype", "float64"]), (1, ["--schedule", "zb"])])
def test_a_long_refusal_of_train_is_printed_in_lines_of_at_most_120_columns(tmp_path, ranks, argv):
    """Before: one line of up to 292 columns ('--tp 3' on one process: 182). The words stay the message's."""
    from minizero.numerals import error_lines
    with pytest.raises(UsageError) as e:
        parse_args([*TINY, "--out", str(tmp_path / "o"), *argv], ranks)
    printed = error_lines("python -m minizero.train", str(e.value))
    assert all(len(line) <= 120 for line in printed.splitlines()), printed
    assert printed.replace("\n  ", " ") == f"python -m minizero.train: error: {e.value}"
    assert all(line.startswith("  ") for line in printed.splitlines()[1:])


@pytest.mark.parametrize("module, argv, said", [
    ("checkpoint.cli", ["inspect", "ckpt", "--ot", "x"], "unrecognized arguments: --ot x\n"),
    ("checkpoint.cli", ["consolidate", "ckpt", "--outt", "x"], "--outt x (did you mean --out?)\n"),
    ("debug.__main__", ["hang", "flight", "--step", "3"], "unrecognized arguments: --step 3\n")])
def test_did_you_mean_names_only_a_flag_of_the_subcommand_given(capsys, module, argv, said):
    """Before: 'inspect --ot' was offered consolidate's --out, 'hang --step' parity's --steps (both refused there)."""
    main = __import__(f"minizero.{module}", fromlist=["main"]).main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.endswith(said)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("prog, width", [("", 1), ("p", 1), ("", 2), ("p", 3), ("p", 6)])
def test_error_lines_ends_and_keeps_the_words_at_any_width(prog, width):
    """Before: an empty prog at width 1 looped forever (a cut inside the 2-column indent shortened nothing)."""
    from minizero.numerals import error_lines
    printed = error_lines(prog, "a b; c: d, e f", width)
    assert " ".join(printed.split()) == " ".join(f"{prog}: error: a b; c: d, e f".split())


@pytest.mark.timeout(10)
def test_error_lines_puts_a_word_longer_than_the_width_on_a_line_of_its_own():
    """Before: a 150-column path after 'error: ' left the whole message on one line, its rest unwrapped too."""
    from minizero.numerals import error_lines
    path = "/" + "x" * 150
    message = f"{path} is missing; " + "give another path " * 10
    printed = error_lines("python -m minizero.train", message)
    lines = printed.splitlines()
    assert lines[:2] == ["python -m minizero.train: error:", f"  {path}"], printed
    assert all(len(line) <= 120 for line in lines[2:]) and len(lines) > 3, printed
    assert printed.replace("\n  ", " ") == f"python -m minizero.train: error: {message}"


def test_parity_refuses_an_unknown_model_as_its_own_flag(capsys):
    """Before: the check ran train's parser on the first layout, so the error blamed it ("layout '--dp 1': argument
    --model: invalid choice"), a flag that layout never gave."""
    from minizero.debug.__main__ import main as debug_main

    with pytest.raises(SystemExit) as e:
        debug_main(["parity", "--dp 1", "--dp 1", "--model", "nosuch"])
    err = joined(capsys.readouterr().err)
    assert e.value.code == 2 and "argument --model: invalid choice: 'nosuch'" in err and "layout" not in err, err


def test_hang_given_one_flight_file_names_its_folder(tmp_path, capsys):
    """Before: "'.../rank_0.json' holds no rank_R.json flight files", as if the file were an empty folder."""
    from minizero.debug.__main__ import main as debug_main

    record = tmp_path / "flight" / "rank_0.json"
    record.parent.mkdir()
    record.write_text("{}")
    assert debug_main(["hang", str(record)]) == 2
    err = joined(capsys.readouterr().err)
    assert f"{str(record)!r} is a file; give the folder of every rank's rank_R.json, here {str(record.parent)!r}" in err
    assert debug_main(["hang", str(tmp_path / "nope")]) == 2
    assert f"{str(tmp_path / 'nope')!r}: no such folder" in joined(capsys.readouterr().err)
    os.mkfifo(tmp_path / "pipe")  # it said "no such folder" of a FIFO that is there
    assert debug_main(["hang", str(tmp_path / "pipe")]) == 2
    assert f"{str(tmp_path / 'pipe')!r}: not a folder (a failing job" in joined(capsys.readouterr().err)


@pytest.mark.parametrize("module, argv", [  # each printed one line of 125 to 339 columns before
    ("plan", ["--model", "nosuch", "--gpus", "8"]),
    ("sample", ["--device", "no-such-device-here"]),
    ("quantize", ["--table", "--bits", "4", "--granularity", "row"]),
    ("debug.__main__", ["nosuch"]), ("debug.__main__", ["parity", "--dp 1", "--dp 1", "--model", "nosuch"]),
    ("checkpoint.cli", ["nosuch"]),
    ("finetune", ["--weights", "none.npz", "--table", "--method", "lora"]),
    ("compare", ["--ranks", ",".join(["x"] * 30)])])
def test_a_long_refusal_of_every_program_is_printed_in_lines_of_at_most_120_columns(capsys, module, argv):
    """train's refusals were wrapped (numerals.error_lines); the other programs' went on one line."""
    import importlib
    try:
        code = importlib.import_module(f"minizero.{module}").main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2 and len(lines) > 1 and max(map(len, lines)) <= 120, err
    assert err.count("error:") == 1 and all(line.startswith("  ") for line in lines[1:]), err


def test_wrapped_lines_are_read_whole_again():
    """What compare and parity read in a failed run's stderr: each long line whole (numerals.unwrapped)."""
    from minizero.numerals import unwrapped, wrapped
    line = "[rank 1] minizero.train failed: " + "; ".join(f"cause {i}" for i in range(40))
    printed = wrapped(line) + "\nTraceback (most recent call last):\n    x = 1\n  File y\n  " + "z " * 70
    assert max(map(len, wrapped(line).splitlines())) <= 120 and unwrapped(printed)[0] == line
    assert unwrapped(printed)[1:] == printed.splitlines()[-4:]  # a traceback's lines, deeper or not, kept
    assert wrapped("    " + line).splitlines()[1].startswith("      cause")  # 2 more than the line's own indent


def test_a_wrapped_list_is_cut_between_items_and_keeps_its_last_one():
    """Before: plan's unknown --model cut its list after 'minizero-tiny,' and put the last model, mixtral-8x7b, on
    the line of the parenthesis after the list: a parenthesis after the list is as good a cut as a comma."""
    from minizero.numerals import wrapped
    names = ", ".join(f"name-{i:02d}" for i in range(22))
    lines = wrapped(f"prog: error: unknown 'x'; allowed: {names} (or a short name that another program takes: a, b, "
                    "c)").splitlines()
    assert lines[1].endswith(", name-21") and lines[2] == "  (or a short name that another program takes: a, b, c)"


@pytest.mark.parametrize("pad", range(0, 19, 3))
def test_a_wrapped_list_keeps_each_item_with_its_own_note(pad):
    """Before: "item-04 (note 4)" (or "item-03 (note 3)") was cut before its parenthesis: the cut before the last ' ('
    meant for a note after the whole list."""
    from minizero.numerals import wrapped
    items = ", ".join(f"item-{i:02d} (note {i})" for i in range(12))
    lines = wrapped(f"prog: error: unknown 'x'; allowed: {'y' * pad}{items}").splitlines()
    assert all(line.endswith("),") for line in lines[:-1]) and lines[-1].endswith("item-11 (note 11)"), lines


def test_a_note_with_no_list_cut_before_it_is_not_cut_itself():
    """Where no ', ' is past half the line, the cut stays before ' (', not at a space inside the parenthesis."""
    from minizero.numerals import wrapped
    line = "bench_header.py: error: argument --sizes: '0': allowed: comma-separated byte counts in 1..25,276,194,816"
    assert wrapped(line + " (this machine's memory), e.g. 4096").splitlines() == [
        line, "  (this machine's memory), e.g. 4096"]


@pytest.mark.parametrize("pad", range(60, 75))
def test_a_wrapped_line_keeps_a_shape_whole(pad):
    """Before: the replica check's error read "parameter 'transformer.wte.weight' (256," then "  16) differs"."""
    from minizero.numerals import unwrapped, wrapped
    line = f"after step 3: {'x' * pad} 'transformer.wte.weight' (256, 16) differs across the data ranks: rank 1"
    printed = wrapped(line)
    assert any("(256, 16)" in part for part in printed.splitlines()) and unwrapped(printed) == [line], printed


def test_a_wrapped_line_cuts_a_long_tuple_and_keeps_a_nul():
    """Before: every tuple of whole numbers stayed whole (a 60-item tuple made a 302-column line), "(16,)" was not
    matched as the comment said, and a NUL in the text came back as a space (the kept spaces' stand-in was NUL)."""
    from minizero.numerals import SHAPE, SHAPE_WHOLE, wrapped
    long = str(tuple(range(100, 160)))
    printed = wrapped(f"error: the ids {long} are unknown")
    assert max(map(len, printed.splitlines())) <= 120, printed
    assert " ".join(printed.split()) == f"error: the ids {long} are unknown"
    assert SHAPE.fullmatch("(16,)") and SHAPE.fullmatch("(256, 16)") and not SHAPE.search("(16) (a, 1)")
    shape = str((10, 11, 12, 13, 14, 15, 1234))  # 30 characters: the longest kept whole
    assert len(shape) == SHAPE_WHOLE
    for pad in range(60, 120, 7):
        assert any(shape in part for part in wrapped(f"{'x' * pad} {shape} differs").splitlines())
    assert wrapped("a\0b (256, 16)") == "a\0b (256, 16)" and wrapped("a\0b " * 40).count("\0") == 40

# --------------------------------------------------------------------------- a Python without the dependencies
@pytest.mark.parametrize("tool", ["minizero.train", "minizero.checkpoint"])
def test_a_tool_run_outside_the_environment_says_to_activate_it(tmp_path, tool):
    """In a new shell without ``. .venv/bin/activate``, ``python -m minizero.train`` is the system Python: it printed
    a 10-line traceback ending in "No module named 'safetensors'". Now one line names the module, the Python that
    lacks it and the fix. A stub package that fails to import stands in for the missing dependency."""
    (tmp_path / "safetensors").mkdir()
    (tmp_path / "safetensors" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'safetensors'\", name='safetensors')\n")
    env = mpi_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", tool, "--help"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = joined(proc.stderr)
    assert f"python -m {tool}: error: no module named 'safetensors' in {sys.executable}" in said, said
    assert ". .venv/bin/activate" in said and "pip install ." in said, said
    assert all(len(line) <= 120 for line in proc.stderr.splitlines()), proc.stderr


def test_the_dependency_hook_knows_every_importable_dependency_of_pyproject():
    """minizero._DEPENDENCIES is a copy of pyproject's dependencies (less the mpich wheel, which has no module)."""
    import minizero
    text = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    listed = re.findall(r'^    "([a-z0-9_]+)', text.split("dependencies = [")[1].split("]")[0], re.M)
    assert minizero._DEPENDENCIES == {name.replace("-", "_") for name in listed} - {"mpich"}


def test_a_broken_dependency_keeps_its_traceback():
    """The hook speaks only for a missing package: numpy present but its submodule missing (a broken or too-old
    install) keeps Python's own traceback (the reviewer: 'numpy.foo' said "activate the environment")."""
    import minizero
    seen = []
    error = ModuleNotFoundError("No module named 'numpy.foo'", name="numpy.foo")
    minizero._missing_dependency_hook(ModuleNotFoundError, error, None, _default=lambda *a: seen.append(a[1]))
    assert seen == [error]


@pytest.mark.parametrize("tool", ["minizero.train", "minizero.finetune"])
@pytest.mark.parametrize("fd", ["2", "9" * 20])
def test_a_stale_pmi_fd_is_named_before_mpi_starts(tool, fd):
    """PMI_FD left in a shell (a terminal's descriptor, or 20 digits): before, MPI_Init aborted with MPICH's error
    stack ('PMI_Init returned -1', its 'cmd=init' written onto stderr), exit 15."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "PMIX"))}
    proc = subprocess.run([sys.executable, "-m", tool, "--model", "tiny", "--steps", "1", "--no-save"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=dict(env, PMI_FD=fd, PMI_SIZE="2", PMI_RANK="1"))
    assert proc.returncode == 2 and proc.stdout == "" and unwrapped(proc.stderr) == [
        f"python -m {tool}: error: PMI_FD={fd} is set, but names no MPI launcher's socket (mpiexec sets it): "
        "unset PMI_FD PMI_SIZE PMI_RANK, or start this under mpiexec"], proc.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("argv", [["-m", "minizero.compare", "--model", "tiny", "--out", "OUT"],
                                  ["bench/bench_heldout.py", "--model", "tiny", "--steps", "2"]])
def test_compare_and_bench_heldout_on_several_ranks_stop_before_any_work(tmp_path, rank, argv):
    """``mpiexec -n 2 python -m minizero.compare``: both ranks ran every job and wrote the same OUT/compare.*;
    bench_heldout.py: both trained and printed the table. Now exit 2 before any work, rank 0 says why."""
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "PMIX"))}
    launcher, rank_end = socket.socketpair()  # as mpiexec's connection
    with launcher, rank_end:
        proc = subprocess.run([sys.executable, *[str(tmp_path) if a == "OUT" else a for a in argv]], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120, pass_fds=[rank_end.fileno()],
                              env=dict(env, PMI_SIZE="2", PMI_RANK=rank, PMI_FD=str(rank_end.fileno())))
    said = "" if rank == "1" else "error: runs in one process; mpiexec started 2 ranks: run it without mpirun"
    assert proc.returncode == 2 and proc.stdout == "" and said in proc.stderr and (said or not proc.stderr), proc
    assert os.listdir(tmp_path) == []


# PMI_RANK / PMI_SIZE beside a PMIx server's or Open MPI's URI (no PMI_FD / PMI_PORT) start one MPICH process: stale
# variables (tests/test_launcher.py::test_pmi_variables_beside_a_pmix_server_are_stale)
@pytest.mark.parametrize("var", ["PALS_RANKID", "PMI_CONTROL_PORT"])
def test_other_launchers_count_as_launchers(monkeypatch, capsys, var):
    """HPE Cray PALS sets PMI_RANK / PMI_SIZE with PMI_CONTROL_* and PALS_*, not MPICH's PMI_FD: before, every rank of
    its launch was told to unset variables its launcher had set (a reviewer's find)."""
    from minizero import plan

    for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_FD", "PMI_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv(var, "1")
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "tiny", "--gpus", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "runs in one process; mpiexec started 2 ranks" in err and "unset" not in err, err
