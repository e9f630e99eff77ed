"""Argparse ``type=`` checks the benchmark scripts share: counts, comma lists of counts, finite numbers.

Each raises :class:`argparse.ArgumentTypeError` naming the text and what is allowed, so argparse answers
``error: argument --ranks: ...`` (exit 2) before any run is launched. Numbers are read by
:mod:`minizero.numerals` (ASCII digits only); :func:`parser` lets "-5" reach these checks.
"""
from __future__ import annotations

import argparse
import math

from minizero.numerals import integer, negative_values_reach_checks, real


def parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser whose flags see "-5" or "-1,2" as their value (checked here), not as an option."""
    return negative_values_reach_checks(argparse.ArgumentParser(prog=prog, description=description))


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


def counts(text) -> list[int]:
    """``type=``: a comma list of integers >= 1 ("2,4"); an empty member ("2,,4", "2,") is refused."""
    try:
        values = [integer(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: comma-separated integers >= 1, e.g. 2,4")
    return values


def positive_real(text) -> float:
    """``type=``: a finite number > 0 (not nan, not inf)."""
    x = real(text)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a finite number > 0, e.g. 0.5")
    return x
