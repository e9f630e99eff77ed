"""``python -m minizero.debug parity``: two layouts that must agree do (float64), a real difference is located."""
import subprocess
import sys

import numpy as np
import pytest

from minizero.debug.parity import compare, ranks_of
from tests.conftest import mpi_env


def test_ranks_of_a_layout():
    assert ranks_of(["--dp", "2", "--tp", "2"]) == (4, ["--dp", "2", "--tp", "2"])
    assert ranks_of(["-n", "3", "--zero", "1"]) == (3, ["--zero", "1"])
    assert ranks_of([]) == (1, [])
    # before: 1 rank each, so train refused "--cp 2 must ... divide the world size 1" and "--dp 2 ... world 1"
    assert ranks_of(["--ulysses", "2"]) == (2, ["--ulysses", "2"])
    assert ranks_of(["--dp=2", "--tp=2"]) == (4, ["--dp=2", "--tp=2"])
    with pytest.raises(ValueError, match="-n needs a number of ranks"):
        ranks_of(["-n", "x"])
    # the bounds are inclusive, and --model is parity's own flag, not one that writes (round-3 mutants)
    assert ranks_of(["-n", "64"]) == (64, []) and ranks_of(["--dp", "8", "--tp", "8"])[0] == 64
    with pytest.raises(ValueError, match="--model is parity's own flag"):
        ranks_of(["--model", "tiny"])


def test_compare_names_the_first_step_and_the_first_parameter():
    w = np.arange(6.0).reshape(2, 3)
    a = {"loss": [2.0, 1.5, 1.2], "norm": [1.0, 0.9, 0.8], "params": {"a.w": w, "b.w": w + 1}}
    b = {"loss": [2.0, 1.5 + 1e-6, 1.3], "norm": [1.0, 0.9, 0.8], "params": {"a.w": w + 1e-17, "b.w": w + 1}}
    b["params"]["b.w"][1, 2] += 1e-3
    lines = compare(a, b, names=("X", "Y"))
    assert lines[0].startswith("differ: first at step 2: training loss 1.5 (X) vs 1.500001 (Y)"), lines
    assert lines[1] == ("differ: after 3 steps the first parameter beyond 1e-10 is 'b.w' (2, 3): relative "
                        "difference 0.000167 at index (1, 2)"), lines
    assert compare(a, a)[0].startswith("same: 3 steps")
    assert compare(a, a)[0].endswith("(largest parameter difference 0, 'a.w')")  # it named None when all were equal
    one = dict(a, loss=[2.0], norm=[1.0])
    assert compare(one, one)[0].startswith("same: 1 step, every loss")  # it said "1 steps"
    assert compare(a, a, tol=0.0)[0].startswith("same: 3 steps")  # --tol 0: equal is within it (round-3 mutant: >=)
    nan = dict(a, params={"a.w": np.where(w > 2, np.nan, w), "b.w": w + 1})  # NaN in both runs: alike (round 3)
    assert compare(nan, nan)[0].startswith("same: 3 steps"), compare(nan, nan)
    other = dict(a, params={"a.w": w.T, "b.w": w + 1})  # another shape: said, not broadcast (round-3 mutant)
    assert "differ: parameter 'a.w' is (2, 3) in A, (3, 2) in B" in compare(a, other), compare(a, other)


def _parity(*argv):
    return subprocess.run([sys.executable, "-m", "minizero.debug", "parity", *argv, "--steps", "3"], env=mpi_env(),
                          capture_output=True, text=True, timeout=200)


# "--dp 2" against "--tp 2" (exit 0, "same: 3 steps ...") and against "--dp 2 --seed 1" (exit 1, "differ: first at
# step 1: ..."), four 2-rank jobs, run in notebooks/13_debugging.ipynb section 9 with the same checks (its exit
# statuses asserted, its verdict lines compared with lessons/values/13_debugging.json): the suite runs them once.
@pytest.mark.timeout(300)
def test_a_layout_the_main_job_refuses_ends_parity_with_status_2_before_any_run():
    bad = _parity("--dp 2", "--dp 3")  # 2 x micro-batch 2 does not divide the global batch of 8 with 3 ranks
    assert bad.returncode == 2 and "layout '--dp 3': --batch-size 8 is not divisible" in " ".join(bad.stderr.split()), bad.stderr


@pytest.mark.parametrize("layout_b, said", [("--tp 0", "--tp must be an integer >= 1, got 0"),
                                            ("--dp 2 --bogus 1", "unrecognized arguments: --bogus 1")])
def test_the_second_layouts_bad_flags_are_refused_before_the_first_runs(monkeypatch, layout_b, said):
    from minizero.debug import parity

    monkeypatch.setattr(parity, "run", lambda *a: pytest.fail("a layout ran before both were checked"))
    with pytest.raises(ValueError, match=f"layout '{layout_b}': {said}"):
        parity.main("--dp 2", layout_b, ["--model", "tiny", "--steps", "2", "--batch-size", "8"], 1e-10)


@pytest.mark.parametrize("flag, value, said", [("--steps", "-1,5", "invalid int value: '-1,5'; allowed"),
                                               ("--batch-size", "-8", "got 5, -8 and 1e-10"),
                                               ("--tol", "-1e-3", "got 5, 8 and -0.001"),
                                               ("--tol", "inf", "--tol a finite number > 0, got 5, 8 and inf")])
def test_a_bad_number_is_refused_by_the_parity_parser_before_any_run(capsys, flag, value, said):
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["parity", "--dp 2", "--tp 2", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in " ".join(err.split()) and "python -m minizero.debug parity: error" in err, err


def test_stray_words_after_two_layouts_are_named_as_typed(capsys):
    """Before: 'unrecognized arguments: --bogus  --x ' (the space that lets a one-flag layout be a LAYOUT)."""
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["parity", "--sequence-parallel", "--tracemalloc", "--bogus", "1", "--x", "2"])
    assert e.value.code == 2 and "got '--bogus 1 --x 2' outside the quotes; give parity \"--sequence-parallel\" " \
        '"--tracemalloc --bogus 1 --x 2"' in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv, loose, quoted", [
    (["--dp 2", "--tp", "2"], "--tp 2", '"--dp 2" "--tp 2"'),  # it said "unrecognized arguments: 2"
    (["--dp 2", "--tp 2", "--pp", "2"], "--pp 2", '"--dp 2" "--tp 2 --pp 2"'),  # "unrecognized arguments: --pp 2"
    (["--dp", "2", "--tp", "2"], "--dp 2 --tp 2", '"--dp 2" "--tp 2"')])  # "unrecognized arguments: --tp 2"
def test_a_layout_typed_outside_its_quotes_is_shown_quoted(capsys, argv, loose, quoted):
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["parity", *argv])
    assert e.value.code == 2 and " ".join(capsys.readouterr().err.split()) == (
        f"python -m minizero.debug parity: error: parity takes each layout as one quoted word, got {loose!r} outside "
        f"the quotes; give parity {quoted} (its own options, --model, --steps, --batch-size, --tol, go outside them)")


@pytest.mark.parametrize("argv, layouts", [
    (["--dp 2", "--tp 2", "--sequence-parallel"], "got 3: '--dp 2', '--tp 2', '--sequence-parallel'"),
    (["--dp 2", "--sequence-parallel", "--zero"], "got 3: '--dp 2', '--sequence-parallel', '--zero'"),
    (["--sequence-parallel", "--tracemalloc", "--bogus", "--x"],
     "got 4: '--sequence-parallel', '--tracemalloc', '--bogus', '--x'")])
def test_a_third_layout_of_one_flag_is_refused_saying_what_parity_takes(capsys, argv, layouts):
    """Before: 'python -m minizero.debug: error: unrecognized arguments: --sequence-parallel', as if it were no flag
    (a flag meant for the second layout, typed outside its quotes)."""
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["parity", *argv])
    assert e.value.code == 2 and " ".join(capsys.readouterr().err.split()) == (
        f"python -m minizero.debug parity: error: compares two layouts, each one quoted word, {layouts}; quote a "
        'flag with its layout ("--tp 2 --sequence-parallel"), or run it once per pair')


def test_a_stray_flag_before_two_quoted_layouts_is_named(capsys):
    """Before: 'unrecognized arguments: --tp 1 --tp 1' (the layouts, not --bogus)."""
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit):
        main(["parity", "--bogus", "3", "--tp 1", "--tp 1"])
    assert capsys.readouterr().err == "python -m minizero.debug: error: unrecognized arguments: --bogus 3\n"


def test_three_quoted_layouts_are_refused_as_one_too_many(capsys):
    """Before: 'python -m minizero.debug: error: unrecognized arguments: --pp 2', as if --pp were no flag."""
    from minizero.debug.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["parity", "--dp 2", "--tp 2", "--pp 2"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "python -m minizero.debug parity: error: compares two layouts, got 3: '--dp 2', '--tp 2', '--pp 2'; run it "
        "once per pair\n")


@pytest.mark.parametrize("flag, said", [("--steps", "--steps must be <= 1,000,000,000, got 10,000,000,000"),
                                        ("--batch-size", "--batch-size must be <= 65,536, got 10,000,000,000")])
def test_parity_own_number_beyond_trains_bound_is_not_blamed_on_a_layout(monkeypatch, flag, said):
    """Before: "layout '--dp 1': --steps must be <= ...", a value given to parity, outside the layouts."""
    from minizero.debug import parity

    monkeypatch.setattr(parity, "run", lambda *a: pytest.fail("a layout ran"))
    common = dict(zip(["--model", "--steps", "--batch-size"], ["tiny", "2", "8"]), **{flag: "10000000000"})
    with pytest.raises(ValueError, match=f"^{said}$"):
        parity.main("--dp 1", "--dp 1", [w for kv in common.items() for w in kv], 1e-10)


def test_a_layout_with_a_flag_parity_sets_says_what_parity_does_with_it():
    with pytest.raises(ValueError, match="^layout '--steps 3': --steps is parity's own flag .one value for both runs.; "
                       "give it to parity, outside the layouts' quotes$"):
        ranks_of(["--steps", "3"])
    with pytest.raises(ValueError, match="--out sets what a run writes or reads; parity runs each layout in a "
                       "temporary folder of its own and removes it"):  # it said "--out is parity's own"
        ranks_of(["--dp", "2", "--out", "/tmp/x"])


def test_the_verdict_is_printed_in_lines_of_at_most_120_columns(monkeypatch, capsys):
    """Before: 'same: ...' was one line of 136-143 columns (a long parameter name)."""
    from minizero.debug import parity
    result = {"loss": [1.0], "norm": [2.0], "params": {"transformer.h.11.mlp.c_proj.weight_with_a_long_name": np.ones(2)}}
    monkeypatch.setattr(parity, "check", lambda *a: None)
    monkeypatch.setattr(parity, "run", lambda *a: result)
    assert parity.main("--dp 2", "--tp 2", [], 1e-10) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120 and " ".join(out.split()).startswith("same: 1 step, every loss"), out


def test_compare_reads_the_gradient_norm_nan_on_both_sides_small_values_and_the_first_of_two_parameters():
    w = np.ones(3)
    a = {"loss": [2.0, float("nan")], "norm": [1e-3, 0.5], "params": {"a.w": w, "b.w": w, "c.w": w}}
    same = dict(a, norm=[1e-3 + 1e-12, 0.5])  # 1e-12 apart: relative to max(1, |value|), not to 1e-3
    assert compare(a, same)[0].startswith("same: 2 steps"), compare(a, same)  # NaN in both runs: alike
    b = dict(a, norm=[1e-3, 0.5 + 1e-6], params={"a.w": w, "b.w": w + 1e-6, "c.w": w + 1e-3})
    assert compare(a, b) == [
        "differ: first at step 2: training loss nan (A) vs nan (B), gradient norm 0.5 vs 0.500001 (relative "
        "difference 1e-06 > 1e-10)",
        "differ: after 2 steps the first parameter beyond 1e-10 is 'b.w' (3,): relative difference 1e-06 at index (0,)"]


def test_a_run_that_diverged_to_nan_or_inf_differs_from_one_that_did_not():
    """Before: NaN - x is NaN and NaN > tol is False, so a layout whose loss, norm and weights went NaN was called
    "same" as one that trained on (and an inf loss against a finite one too)."""
    w = np.array([[1.0, 2.0], [3.0, 4.0]])
    good = {"loss": [2.0, 1.5], "norm": [1.0, 0.4], "params": {"a.w": w}}
    bad = {"loss": [2.0, float("nan")], "norm": [1.0, float("inf")], "params": {"a.w": np.where(w > 2, np.nan, w)}}
    assert compare(good, bad) == [
        "differ: first at step 2: training loss 1.5 (A) vs nan (B), gradient norm 0.4 vs inf (relative difference "
        "inf > 1e-10)",
        "differ: after 2 steps the first parameter beyond 1e-10 is 'a.w' (2, 2): relative difference inf at index "
        "(1, 0)"]
    assert compare(bad, good)[0].startswith("differ: first at step 2: training loss nan (A) vs 1.5 (B)")
    inf = dict(good, loss=[2.0, float("inf")], norm=[1.0, 0.4])
    assert compare(inf, inf)[0].startswith("same: 2 steps") and compare(good, inf)[0].startswith("differ: first at")


def test_an_inf_against_an_inf_of_the_other_sign_differs_without_a_numpy_warning():
    """Before the errstate: inf - inf printed NumPy's 'invalid value encountered in subtract' under the verdict."""
    import warnings

    import numpy as np

    from minizero.debug.parity import _difference

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _difference(np.array([np.inf, 1.0]), np.array([-np.inf, 1.0])) == (np.inf, (0,))
        assert _difference(np.array([np.inf, 1.0]), np.array([np.inf, 1.0]))[0] == 0.0
