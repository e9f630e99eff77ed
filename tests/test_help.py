"""Every program's --help says each option's default once, and never as a value one cannot type."""
import argparse
import re

import pytest

from minizero import compare, finetune, flags, plan, quantize, sample
from minizero.debug import __main__ as debug_main


@pytest.mark.parametrize("module", [flags, plan, quantize, sample, finetune, compare], ids=lambda m: m.__name__)
def test_help_says_each_default_once_and_never_none(module):
    """Before: quantize's "--model ... (default: model.json beside the weights, ...) (default: None)", sample's
    "--top-k ...; None: all 256 (default: None)" (--top-k None is refused)."""
    _check_once(module.build_parser().format_help())


def _check_once(text):
    for block in re.split(r"\n  (?=-)", text.split("options:")[1]):
        assert block.count("default:") + block.count("default the") <= 1, block
        assert "default: None" not in block and "default: False" not in block and "None:" not in block, block


@pytest.mark.parametrize("module", [flags, finetune], ids=lambda m: m.__name__)
def test_a_default_of_zero_is_said(module):
    """0 == False in Python: a check with ``default in (None, False)`` hid "--seed ... (default: 0)"."""
    parser = module.build_parser()
    zeros = [a for a in parser._actions if a.default == 0 and a.default is not False and "default" not in a.help]
    assert zeros
    blocks = re.split(r"\n  (?=-)", parser.format_help().split("options:")[1])
    for action in zeros:
        block = " ".join(b for b in blocks if b.startswith(action.option_strings[-1] + " ")).split()
        assert "(default:" in block and block[block.index("(default:") + 1].startswith("0"), (action.dest, block)


@pytest.mark.parametrize("module", [flags, plan, quantize, sample, finetune, compare], ids=lambda m: m.__name__)
def test_every_option_with_a_default_says_it(module):
    """Before: --comm-timeout's help named PyTorch's default ("PyTorch's NCCL default: 600"), so the formatter took
    the word "default" for minizero's own and never printed it."""
    parser = module.build_parser()
    blocks = re.split(r"\n  (?=-)", parser.format_help().split("options:")[1])
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            block = next(b for b in blocks if b.startswith(action.option_strings[-1] + " ")
                         or b.startswith(", ".join(action.option_strings)))
            assert "(default" in " ".join(block.split()), (action.dest, block)


def test_train_help_groups_the_flags_by_technique():
    """Before: 72 flags in one list in definition order (only the MoE flags had a group of their own)."""
    text = flags.build_parser().format_help().split("options:")[1]
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert len(titles) >= 8, titles
    assert text.index("--zero {0,1,2,3}") > text.index("memory: ZeRO") > text.index("--tp TP")
    assert "world size (the ranks mpirun starts) = dp x cp x tp x" in text


def test_train_help_gives_each_model_presets_size(monkeypatch):
    """Before: --model named the presets only. The sizes are read from PRESETS (a new preset is shown too)."""
    from minizero.nn import gpt

    monkeypatch.setitem(gpt.PRESETS, "wide", gpt.GPTConfig(n_layer=3, n_head=8, n_embd=2048, block_size=4096))
    text = " ".join(flags.build_parser().format_help().split())
    assert "model preset: layers x heads x width, context T (parameters): tiny 2x2x16 T=16 (10,944), " in text
    assert "gpt2 12x12x768 T=1,024 (124,475,904), wide 3x8x2048 T=4,096 (" in text


def _parity_help(capsys) -> str:
    with pytest.raises(SystemExit):
        debug_main.main(["parity", "--help"])
    return capsys.readouterr().out


MODEL_HELP = {"compare": lambda capsys: compare.build_parser().format_help(), "debug parity": _parity_help,
              "quantize": lambda capsys: quantize.build_parser().format_help()}


@pytest.mark.parametrize("tool", MODEL_HELP)
def test_every_model_flag_gives_each_presets_size_as_train_does(monkeypatch, capsys, tool):
    """Before: compare's --model named the presets only, quantize's and debug parity's not even that (bench's:
    tests/test_bench_args.py). One text, nn.gpt.preset_sizes, from PRESETS when the parser is built."""
    from minizero.nn import gpt

    monkeypatch.setitem(gpt.PRESETS, "wide", gpt.GPTConfig(n_layer=3, n_head=8, n_embd=2048, block_size=4096))
    text = " ".join(MODEL_HELP[tool](capsys).split())
    assert "model preset: layers x heads x width, context T (parameters): tiny 2x2x16 T=16 (10,944), " in text
    assert "gpt2 12x12x768 T=1,024 (124,475,904), wide 3x8x2048 T=4,096 (" in text


@pytest.mark.parametrize("module", [plan, quantize, sample, finetune, compare], ids=lambda m: m.__name__)
def test_help_shows_no_rest_markup(module):
    """Before: "``python -m minizero.plan``: will this model fit..." at the top of --help (the docstring's reST)."""
    assert "``" not in module.build_parser().format_help()


def test_debug_help_shows_no_rest_markup(capsys):
    from minizero.debug.__main__ import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "python -m minizero.debug hang OUT/flight:" in " ".join(out.split())


@pytest.mark.parametrize("module", [flags, finetune], ids=lambda m: m.__name__)
def test_the_seed_says_it_seeds_dropout(module):
    """Both programs seed their dropout masks from --seed (one generator on every rank, rng.batch_rows)."""
    seed = next(a for a in module.build_parser()._actions if a.dest == "seed")
    assert "dropout" in seed.help, seed.help


@pytest.mark.parametrize("program, command", [("checkpoint", "inspect"), ("checkpoint", "consolidate"),
                                              ("debug", "hang"), ("debug", "trace"), ("debug", "parity")])
def test_every_positional_argument_says_what_it_takes(program, command, capsys):
    """Before: ``python -m minizero.checkpoint consolidate --help`` listed ``path`` with no word on what it reads."""
    import importlib

    module = importlib.import_module(f"minizero.{program}.{'cli' if program == 'checkpoint' else '__main__'}")
    with pytest.raises(SystemExit):
        module.main([command, "--help"])
    block = capsys.readouterr().out.split("positional arguments:\n")[1].split("\n\n")[0]
    entries = re.split(r"\n  (?=\S)", block.strip("\n")[2:])
    assert entries and all(len(e.split()) > 1 for e in entries), block


def test_no_save_names_every_file_out_holds():
    """Before: "write neither model.npz nor the summary", while --no-save also leaves out the plots and flight/."""
    actions = {a.dest: a for a in flags.build_parser()._actions}
    listed = actions["out"].help.split("(")[1]
    assert listed in actions["no_save"].help, (listed, actions["no_save"].help)


def test_plan_help_says_whose_hardware_the_defaults_are():
    """Before: only the plan's output said --gpu-flops 312e12 and the bandwidths were an A100-80GB SXM's."""
    text = " ".join(plan.build_parser().format_help().split())
    hardware = text[text.index("hardware:"):]
    assert "A100-80GB SXM" in hardware and all(f in hardware for f in ("--gpu-flops", "--intra-node-bw", "--pcie-bw"))


def test_compare_shows_the_models_as_train_does():
    """Before: train's usage read --model {deep,default,gpt2,small,tiny}, compare's --model MODEL."""
    said = {m.__name__: re.search(r"--model (\S+)", m.build_parser().format_usage())[1] for m in (flags, compare)}
    assert said["minizero.compare"] == said["minizero.flags"] == "{deep,default,gpt2,small,tiny}]", said


@pytest.mark.parametrize("command, said", [
    ("hang", "exit status: 0 nothing found, 1 a finding (a hang, a mismatch or a missing rank: the analysis worked), "
             "2 bad input"),
    ("parity", "exit status: 0 the layouts agree, 1 they differ, 2 a run failed or bad input"),
    ("trace", "exit status: 0, or 2 for bad input")])
def test_debug_help_says_what_each_exit_status_means(capsys, command, said):
    """Before: hang exited 1 after an analysis that worked (it found a hang), and no help said why."""
    with pytest.raises(SystemExit):
        debug_main.main([command, "--help"])
    assert said in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv", [["--help"], ["hang", "--help"], ["trace", "--help"], ["parity", "--help"]])
def test_debug_help_names_the_interrupted_exit_statuses(capsys, argv):
    """Before: 0 / 1 / 2 only, while Ctrl-C ends every command with 130 and SIGTERM with 143 (interruptible)."""
    with pytest.raises(SystemExit):
        debug_main.main(argv)
    assert "130 for SIGINT/Ctrl-C, 143 for SIGTERM" in " ".join(capsys.readouterr().out.split())


def test_grad_accum_help_says_the_default_parse_args_gives():
    """Before: --grad-accum's help said "default: 1" while parse_args gives pp (as --micro-batches' help said)."""
    from minizero.args import parse_args
    action = next(a for a in flags.build_parser()._actions if a.dest == "grad_accum")
    assert parse_args(["--model", "tiny", "--pp", "2"], 2).grad_accum == 2
    assert "default: pp" in " ".join(action.help.split()), action.help
