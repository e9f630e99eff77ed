"""bench/profile_step.py's attribution of own time to parts (what docs/benchmarks.md's profiles rest on)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
profile_step = pytest.importorskip("profile_step")

WIDEN = ("/x/minizero/backend.py", 1, "widen")
TAKE = ("~", 0, "<method 'take' of 'numpy.ndarray' objects>")
KERNEL = ("/x/minizero/autograd/functional.py", 9, "forward")
HELPER = ("/x/numpy/_core/fromnumeric.py", 5, "clip")


def _stats():
    """cProfile's layout: key -> (calls, primitive calls, own s, cumulative s, {caller: (.., .., own s, ..)})."""
    return {
        KERNEL: (1, 1, 2.0, 6.0, {}),
        WIDEN: (2, 2, 1.0, 3.0, {KERNEL: (2, 2, 1.0, 3.0)}),
        TAKE: (3, 3, 1.5, 1.5, {WIDEN: (2, 2, 1.0, 1.0), KERNEL: (1, 1, 0.5, 0.5)}),
        HELPER: (2, 2, 1.0, 1.0, {TAKE: (1, 1, 0.4, 0.4), KERNEL: (1, 1, 0.6, 0.6)}),
    }


def test_share_below_follows_each_callers_own_time():
    share = profile_step.share_below(_stats(), {WIDEN})
    assert share[WIDEN] == 1.0 and share[KERNEL] == 0.0
    assert share[TAKE] == pytest.approx(1.0 / 1.5)  # 1.0 s of its 1.5 s came from widen
    assert share[HELPER] == pytest.approx(0.4 * (1.0 / 1.5) / 1.0)  # two levels down, through take's share


def test_split_parts_puts_the_time_below_casts_in_casts_and_keeps_the_total():
    parts = profile_step.split_parts(_stats(), profile_step.CAST_PARTS, scale=5.5)
    below = 1.0 + 1.0 + 0.4 * (1.0 / 1.5)
    assert parts["casts"] == pytest.approx(below)
    assert sum(parts.values()) == pytest.approx(5.5)  # own times add up to the step: nothing lost or counted twice
    assert parts["elementwise"] == pytest.approx(2.0 + 0.5)  # the kernel's own time and take's other half
