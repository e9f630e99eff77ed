"""The README is what a newcomer reads first: its commands are what users and CI run, its excerpt comes from a
real run of the current defaults, it stays short, and its measured tables live in docs/ beside their scripts."""
import glob
import os
import re

from tests.conftest import REPO_ROOT

INSTALL_AND_RUN = ("python3 -m venv .venv && . .venv/bin/activate && pip install . && "
                   "mpirun -n 8 python -m minizero.train")
TEST = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest'


def _read(*path):
    return open(os.path.join(REPO_ROOT, *path)).read()


def test_readme_shows_both_commands():
    readme = _read("README.md")
    assert INSTALL_AND_RUN in readme
    assert TEST in readme
    assert "In a new shell, activate the environment first:** `. .venv/bin/activate`" in readme


def test_ci_runs_the_readme_test_command():
    ci = _read(".ci", "run").splitlines()
    assert TEST in ci, ".ci/run must run exactly the README's test command"


def test_readme_is_short_and_keeps_measurements_and_history_in_docs():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 200
    assert not re.search(r"^\|.*\|$", readme, re.M), "tables belong in docs/ (benchmarks.md, techniques.md)"
    assert not re.search(r"\bissue \d+|\(#\d+\)|`[0-9a-f]{7,40}`", readme), "history belongs in the git log"
    for page in ("techniques.md", "benchmarks.md", "multihost.md", "gpu.md"):
        assert f"(docs/{page}" in readme, page


def test_readme_excerpt_is_a_real_run_of_the_current_defaults():
    """The block docs/build_readme_excerpt.py writes: the default model, the default step count; rerun the
    script when a default changes."""
    from minizero.flags import build_parser
    from minizero.nn import get_config

    block = _read("README.md").split("<!-- main-job: begin -->")[1].split("<!-- main-job: end -->")[0]
    defaults = build_parser().parse_args([])
    assert f"model '{defaults.model}' ({get_config(defaults.model).num_parameters():,} parameters" in block
    steps = {int(n) for n in re.findall(r"^step +\d+/(\d+) +loss", block, re.M)}
    assert steps == {defaults.steps}, (steps, defaults.steps)
    assert re.search(r"^validation loss: [\d.]+ nats/byte", block, re.M)
    assert "python docs/build_readme_excerpt.py" in block and "kernel" in block
    if "below the training loss" in block:  # the note says which text's end is held out (a newcomer asked)
        assert "the Python language reference that ships with CPython" in " ".join(block.split())


def test_benchmark_sections_name_the_script_that_made_them():
    text = _read("docs", "benchmarks.md")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 5
    for s in sections:
        assert re.search(r"`(nice )?(python|mpirun|sudo python)[^`]*`", s), s.splitlines()[0]


def test_outputs_measured_elsewhere_are_quoted_whole():
    """No hand-typed number: each output committed under docs/measured/xeon* (a machine this one is not)
    stands in docs/benchmarks.md line for line, and the page links it."""
    text = _read("docs", "benchmarks.md")
    outputs = sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "measured", "xeon*.md")))
    assert len(outputs) >= 7
    for path in outputs:
        printed = open(path).read().rstrip("\n")
        assert printed in text and "measured/" + os.path.basename(path) in text, path


def test_relative_links_in_docs_point_to_files():
    docs = [os.path.join(REPO_ROOT, "README.md"), os.path.join(REPO_ROOT, "ARCHITECTURE.md")]
    docs += glob.glob(os.path.join(REPO_ROOT, "lessons", "*.md")) + glob.glob(os.path.join(REPO_ROOT, "docs", "*.md"))
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)", open(doc).read()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(os.path.dirname(doc), target)):
                broken.append(f"{os.path.relpath(doc, REPO_ROOT)} -> {target}")
    assert not broken, broken


def test_the_suite_line_can_come_from_a_ci_log(tmp_path):
    """docs/build_readme_excerpt.py --suite-log reads .ci/run's first pytest summary (the whole suite), with the time
    pytest measured, and refuses a log whose run failed or that holds none."""
    import importlib.util

    import pytest
    spec = importlib.util.spec_from_file_location("excerpt", os.path.join(REPO_ROOT, "docs", "build_readme_excerpt.py"))
    excerpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(excerpt)
    log = tmp_path / "ci.log"
    log.write_text("pip ...\n====== 3248 passed, 4 skipped in 1060.59s (0:17:40) ======\nsecond pass\n"
                   "178 passed in 98.08s (0:01:38)\n")
    assert excerpt.suite_from_log(str(log)) == ("3248 passed, 4 skipped in 1060.59s (0:17:40)", 1060.59)
    for text, said in (("== 1 failed, 3 passed in 10.00s ==\n", "did not pass"), ("nothing\n", "no pytest summary")):
        log.write_text(text)
        with pytest.raises(SystemExit, match=said):
            excerpt.suite_from_log(str(log))


def test_the_excerpt_keeps_a_progress_lines_note_below_it():
    """The first progress line's memory note ("max over ranks") goes on a line below it, which the excerpt keeps."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("excerpt", os.path.join(REPO_ROOT, "docs", "build_readme_excerpt.py"))
    excerpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(excerpt)
    steps = [f"step {k:>3}/300  loss 3.0  mem 1 MiB, peak 2 MiB" for k in range(20, 301, 20)]
    out = "\n".join(["head", "nodes: x", steps[0], "              (mem and peak: max over ranks)", *steps[1:], "end"])
    shown = excerpt.excerpt(out)
    assert shown[:4] == ["head", "...", steps[0], "              (mem and peak: max over ranks)"]
    assert shown[4] == steps[1] and shown[-1] == steps[-1], shown


def test_readme_quotes_the_tolerances_the_equivalence_tests_hold():
    """'How close is "equal"' states what the float64 tests assert: each figure is the constant a test holds (read
    as typed, as lessons 02, 06, 07, 09, 10 quote theirs), and no other figure stands there: tighten a test, and
    this fails until the README says so."""
    import importlib.util
    path = os.path.join(REPO_ROOT, "notebooks", "lesson_values.py")
    spec = importlib.util.spec_from_file_location("lesson_values", path)
    lesson_values = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson_values)

    def held(names, *paths):  # the one value every file holds for each name
        values = [{lesson_values.source_constant(p, n) for p in paths} for n in names]
        assert all(len(v) == 1 for v in values), f"{paths} hold different {names}: {values}"
        return [v.pop() for v in values]

    dp_zero = ("tests/test_data_parallel.py", "tests/test_zero.py")
    (grad,) = held(["GRAD_RTOL"], *dp_zero, "tests/mp_reference.py")
    (param,) = held(["PARAM_RTOL"], *dp_zero)
    (steps,) = held(["STEPS"], "tests/dp_reference.py", "tests/mpi_scripts/zero_check.py", "tests/mp_reference.py")
    mp_param, mp_loss = held(["PARAM_RTOL", "LOSS_RTOL"], "tests/mp_reference.py")
    moe_param, moe_loss = held(["WEIGHT_RTOL", "LOSS_RTOL"], "tests/test_moe_train.py")
    section = " ".join(_read("README.md").split('## How close is "equal"')[1].split("\n## ")[0].split())
    for quote in (f"gradients to {grad} (relative to the tensor's largest entry), parameters after {steps} steps to "
                  f"{param} ({mp_param} with tensor or pipeline stages, whose losses agree to {mp_loss})",
                  f"MoE with expert parallelism (routed in the same groups, so with the same drops): parameters to "
                  f"{moe_param}, losses to {moe_loss}, per-expert counts exactly"):
        assert quote in section, f"README.md should say: {quote}"
    figures = set(re.findall(r"\d(?:\.\d+)?e-\d+", section))
    assert figures <= {grad, param, mp_param, mp_loss, moe_param, moe_loss}, figures
