"""Every program's --help says each option's default once, and never as a value one cannot type."""
import re

import pytest

from minizero import compare, finetune, flags, plan, quantize, sample


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
