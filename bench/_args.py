"""Argparse ``type=`` checks the benchmark scripts share: counts, world sizes, finite numbers.

Each raises :class:`argparse.ArgumentTypeError` naming the text and what is allowed, so argparse answers
``error: argument --ranks: ...`` (exit 2) before any run is launched. Numbers are read by
:mod:`minizero.numerals` (ASCII digits only); :func:`parser` lets "-5" reach these checks.
"""
from __future__ import annotations

import argparse
import copy
import math
import os

from minizero.debug.parity import MAX_RANKS  # the ranks one run may start, as parity's and compare's
from minizero.numerals import DefaultsOnce, OneLineParser, integer, negative_values_reach_checks, real
from minizero.numerals import description as _description


class _Help(DefaultsOnce):
    """--help says every option's default once, an option without a help text too (``--steps STEPS (default:
    5)``, where argparse printed ``--steps STEPS`` alone)."""

    def _format_action(self, action):
        if action.option_strings and (not action.help or action.type is preset):
            action = copy.copy(action)
            if not action.help and not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
                action.help = "(default: %(default)s)"
            if action.type is preset:  # --model: each preset's size first, as train's --help gives them
                from minizero.nn.gpt import preset_sizes

                action.help = f"{preset_sizes()} {self._get_help_string(action) or ''}".rstrip()
        return super()._format_action(action)


def parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser whose flags see "-5" or "-1,2" as their value (checked here), not as an option; its
    --help shows each default and ``description`` without reST's double backquotes."""
    return negative_values_reach_checks(OneLineParser(prog=prog, description=_description(description),
                                                   formatter_class=_Help))


def at_least(low: int):
    """``type=``: an integer >= ``low``."""
    def check(text) -> int:
        n = integer(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"{text!r} is below {low}; allowed: an integer >= {low}")
        return n
    check.__name__ = f"integer >= {low}"
    return check


count = at_least(1)  #: ``type=``: an integer >= 1 (ranks, steps, repeats, runs)


def _bounded(text, low: int, high: int, allowed: str) -> int:
    """The integer ``text`` when in [low, high]; else ``ArgumentTypeError`` naming the bound it crossed."""
    n = integer(text)
    if not low <= n <= high:
        side, bound = ("below", low) if n < low else ("above", f"{high:,}")
        raise argparse.ArgumentTypeError(f"{text!r} is {side} {bound}; allowed: {allowed}")
    return n


def between(low: int, high: int):
    """``type=``: an integer in [low, high]."""
    def check(text) -> int:
        return _bounded(text, low, high, f"an integer in {low}..{high:,}")
    check.__name__ = f"integer in {low}..{high}"
    return check


def threads(text) -> int:
    """``type=``: a number of BLAS / torch threads, 1 to this machine's cores (``backend.usable_cores``: more
    only oversubscribe them)."""
    from minizero.backend import usable_cores

    cores = usable_cores()
    return _bounded(text, 1, cores, f"1..{cores} threads (this machine's cores)")


def check_window(parser: argparse.ArgumentParser, window: int, steps: int) -> None:
    """``parser.error`` unless ``--window`` (steps per row of the loss table) is at most ``--steps``: a larger one
    gives the one row that ``--window STEPS`` gives."""
    if window > steps:
        parser.error(f"--window {window} is above --steps {steps}; allowed: 1..{steps} (steps per row of the table)")


def _integers(text, low: int, high: float, allowed: str) -> list[int]:
    """A comma list of integers in [low, high]; an empty member ("8,,32", "8,") is refused."""
    try:
        values = [integer(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or not all(low <= v <= high for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: {allowed}")
    return values


def memory_bytes() -> int:
    """This machine's physical memory in bytes: no benchmark buffer can be larger."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def in_memory(text) -> int:
    """``type=``: a number of bytes >= 1 and at most :func:`memory_bytes`."""
    n = count(text)
    if n > memory_bytes():
        raise argparse.ArgumentTypeError(f"{text!r} is above this machine's memory; allowed: 1..{memory_bytes():,} "
                                         "bytes")
    return n


def byte_sizes(text) -> list[int]:
    """``type=``: a comma list of float32 message sizes, byte counts in 4..:func:`memory_bytes` that are multiples
    of 4 ("4096,65536")."""
    allowed = f"comma-separated byte counts in 4..{memory_bytes():,} (this machine's memory), multiples of 4 " \
              "(float32 messages), e.g. 4096,65536"
    sizes = _integers(text, 4, memory_bytes(), allowed)
    if any(n % 4 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: {allowed}")
    return sizes


def counts(text) -> list[int]:
    """``type=``: a comma list of integers >= 1 ("8,32")."""
    return _integers(text, 1, math.inf, "comma-separated integers >= 1, e.g. 8,32")


def micro_batches(text) -> list[int]:
    """``type=``: a comma list of micro-batch sizes in 1..4096, train's --micro-batch-size bound ("8,32")."""
    from minizero.flags import MAX_MICRO_BATCH

    return _integers(text, 1, MAX_MICRO_BATCH, f"comma-separated micro-batch sizes in 1..{MAX_MICRO_BATCH} (train's "
                     "--micro-batch-size bound)")


def micro_batch(text) -> int:
    """``type=``: a micro-batch size in 1..4096, train's --micro-batch-size bound."""
    from minizero.flags import MAX_MICRO_BATCH

    n = integer(text)
    if not 1 <= n <= MAX_MICRO_BATCH:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a micro-batch size in 1..{MAX_MICRO_BATCH} (train's "
                                         "--micro-batch-size bound)")
    return n


def stage(text) -> int:
    """``type=``: a ZeRO stage, 0, 1, 2 or 3."""
    n = integer(text)
    if n not in (0, 1, 2, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a ZeRO stage, 0, 1, 2 or 3")
    return n


def world_size(text) -> int:
    """``type=``: a number of ranks, an integer in [1, MAX_RANKS]."""
    n = integer(text)
    if not 1 <= n <= MAX_RANKS:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a number of ranks in [1, {MAX_RANKS}]")
    return n


def world_sizes(text) -> list[int]:
    """``type=``: a comma list of world sizes in [1, MAX_RANKS] ("2,4")."""
    return _integers(text, 1, MAX_RANKS, f"comma-separated numbers of ranks in [1, {MAX_RANKS}], e.g. 2,4")


def positive_real(text) -> float:
    """``type=``: a finite number > 0 (not nan, not inf)."""
    x = real(text)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a finite number > 0, e.g. 0.5")
    return x


def preset(text) -> str:
    """``type=``: a model preset of ``python -m minizero.train --model`` ("tiny", "default", ...)."""
    from minizero.nn import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a model preset, one of {', '.join(sorted(PRESETS))}")
    return text


def probability(text) -> float:
    """``type=``: a dropout probability in [0, 1)."""
    x = real(text)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a probability in [0, 1), e.g. 0.1")
    return x


def check_train_flags(parser: argparse.ArgumentParser, flags: list[str], world_sizes, out: str | None = None) -> None:
    """``parser.error`` (exit 2) with the refusal of ``python -m minizero.train`` when it would refuse ``flags``
    and ``--out out`` (None: a temporary folder) at any of ``world_sizes``; nothing is launched."""
    import tempfile

    from minizero.args import UsageError, parse_args

    with tempfile.TemporaryDirectory() as tmp:
        for n in world_sizes:
            try:
                parse_args([*flags, "--out", out or tmp], n, quiet=True)
            except UsageError as e:
                parser.error(f"python -m minizero.train refuses these flags at {n} rank(s): {e}")


def check_environment(parser: argparse.ArgumentParser) -> None:
    """``parser.error`` with train's refusal of a MINIZERO_ setting the collectives read (the all-reduce size rule,
    ZeRO's order check): a bad one was ignored, the default measured."""
    from minizero.flags import job_environment

    try:
        job_environment()
    except ValueError as e:
        parser.error(str(e))


def check_revision(parser: argparse.ArgumentParser, flag: str, rev: str, repo: str) -> str:
    """The short commit id ``rev`` names in the git repository ``repo`` (what the table prints: "HEAD~3" or a
    branch names another commit tomorrow); ``parser.error`` unless it names one."""
    import subprocess

    known = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", "--short", "--end-of-options",
                            rev + "^{commit}"], capture_output=True, text=True)
    if known.returncode != 0:
        parser.error(f"{flag} {rev!r} is not a known revision of {repo}; allowed: a commit, branch or tag")
    return known.stdout.strip()


def file_path(text) -> str:
    """``type=``: an output file's path; '' is refused (it was ignored: nothing written after all the work)."""
    if not text:
        raise argparse.ArgumentTypeError("'': expected a file path")
    return text


def check_output_path(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """``parser.error`` unless ``path`` can be written at the end without losing anything
    (:func:`minizero.overwrite.check_output`: not a directory, its folder exists, not a file programs read back)."""
    from minizero.overwrite import check_output

    try:
        check_output(path, flag)
    except (ValueError, OSError) as e:
        parser.error(str(e))
