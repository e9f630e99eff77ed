"""The lessons: generated ones equal their build, none sets hidden switches, "Where to look" names real code.

How a lesson is built and checked: lessons/build.py (its docstring). Executing the notebooks is nbmake's
job (each generated lesson's notebook ends by comparing what it measured with lessons/values/*.json);
these tests only render and read files, so they cost well under a second.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lessons_build", ROOT / "lessons" / "build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

GENERATED = build.lessons()


def test_some_lessons_are_generated():
    assert GENERATED, "no lesson template in lessons/templates"
    for name in GENERATED:
        assert (ROOT / "notebooks" / f"{name}.ipynb").exists(), f"template {name}.md has no notebook"


def test_build_refuses_a_lesson_named_twice(monkeypatch, capsys):  # it executed the notebook twice (minutes)
    monkeypatch.setattr(build, "execute", lambda name: pytest.fail(f"executed {name}"))
    with pytest.raises(SystemExit) as e:
        build.main([GENERATED[0], GENERATED[0]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"named more than once: {GENERATED[0]}; give each lesson once" in err


def test_build_without_jinja2_names_the_extra_in_one_line(monkeypatch, capsys):  # a traceback after `pip install .`
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 raises ModuleNotFoundError
    fresh = importlib.util.module_from_spec(spec)
    with pytest.raises(SystemExit) as e:
        spec.loader.exec_module(fresh)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and 'needs jinja2' in err and 'pip install -e ".[test]"' in err


@pytest.mark.parametrize("name", GENERATED)
def test_committed_lesson_is_its_build(name):
    committed = (ROOT / "lessons" / f"{name}.md").read_text()
    assert committed == build.render(name), (
        f"lessons/{name}.md differs from its template filled with lessons/values/{name}.json: edit "
        f"lessons/templates/{name}.md (not the generated file) and run `python lessons/build.py {name}`")


@pytest.mark.parametrize("name", GENERATED)
def test_every_recorded_figure_is_quoted_and_every_field_recorded(name):
    values = set(json.loads((ROOT / "lessons" / "values" / f"{name}.json").read_text()))
    used = build.fields(name)
    assert used <= values, f"fields without a recorded figure: {sorted(used - values)}"
    assert values <= used, f"figures recorded but quoted nowhere: {sorted(values - used)}"


@pytest.mark.parametrize("name", GENERATED)
def test_notebook_checks_its_lesson(name):
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert f'finish("{name}")' in code[-1], f"the last cell of notebooks/{name}.ipynb must call finish({name!r})"


def test_source_constant_quotes_a_tests_tolerance_as_typed():  # lessons 02 and 06 quote test tolerances through it
    spec_lv = importlib.util.spec_from_file_location("lesson_values", ROOT / "notebooks" / "lesson_values.py")
    lesson_values = importlib.util.module_from_spec(spec_lv)
    spec_lv.loader.exec_module(lesson_values)
    assert lesson_values.source_constant("tests/mp_reference.py", "PARAM_RTOL") == "2e-12"  # `A, B = 1e-12, 2e-12`
    assert lesson_values.source_constant("tests/mp_reference.py", "STEPS") == "3"
    with pytest.raises(LookupError, match=r"assigns no module-level constant TOL; it assigns .*GRAD_RTOL"):
        lesson_values.source_constant("tests/mp_reference.py", "TOL")


QUOTED = re.compile(r'record\("(\w+)", source_constant\("([^"]+)", "(\w+)"\)\)')


@pytest.mark.parametrize("name", GENERATED)
def test_quoted_test_tolerances_are_the_tests_constants_now(name):
    """A figure a notebook quotes from a test file (``record(f, source_constant(path, NAME))``) equals that
    constant as it stands: tighten a test and this fails, without executing a notebook, until the lesson is rebuilt
    (``python lessons/build.py NAME --no-execute`` after setting the JSON, or a full build)."""
    spec_lv = importlib.util.spec_from_file_location("lesson_values", ROOT / "notebooks" / "lesson_values.py")
    lesson_values = importlib.util.module_from_spec(spec_lv)
    spec_lv.loader.exec_module(lesson_values)
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    values = json.loads((ROOT / "lessons" / "values" / f"{name}.json").read_text())
    for field, path, constant in QUOTED.findall(code):
        assert values[field] == lesson_values.source_constant(path, constant), (
            f"lessons/values/{name}.json has {field} = {values[field]!r}, but {path} now holds {constant} = "
            f"{lesson_values.source_constant(path, constant)}: rebuild lesson {name}")


ENV_WRITE = re.compile(r"os\.environ\s*\[[^\]]*\]\s*=|os\.environ\.(setdefault|update)|os\.putenv|^\s*%env", re.M)


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_notebook_sets_environment_variables(path):
    """A switch a lesson needs is shown where it is used, not set silently in the environment (issue 28)."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            assert not ENV_WRITE.search("".join(cell["source"])), "".join(cell["source"])[:300]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_stored_output_names_a_figure_by_an_absolute_path(path):
    """A reader sees lessons/img/NAME.png, not the folders of the machine that built the lesson (lesson_values.shown)."""
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            assert not re.search(r"/\S*/lessons/img/", text), text[:300]


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_stored_output_names_a_temporary_folder(path):
    """A temporary folder is printed as $NAME (lesson_values.shown(text, NAME=folder)), not as /tmp/tmpab12cd/."""
    folders = re.compile("|".join(re.escape(f"{t}{os.sep}") for t in {"/tmp", tempfile.gettempdir()}))
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            assert not folders.search(text), text[:300]


def test_shown_names_a_temporary_folder_by_its_name(tmp_path):
    spec_lv = importlib.util.spec_from_file_location("lesson_values", ROOT / "notebooks" / "lesson_values.py")
    lesson_values = importlib.util.module_from_spec(spec_lv)
    spec_lv.loader.exec_module(lesson_values)
    line = f"checkpoint {tmp_path}/zero1 and {ROOT}/lessons/img/a.png"
    assert lesson_values.shown(line, WORK=tmp_path) == "checkpoint $WORK/zero1 and lessons/img/a.png"
    assert lesson_values.shown(os.path.realpath(tmp_path) + "/f", WORK=tmp_path) == "$WORK/f"  # as /proc names it


# --- "Where to look": every name a lesson points at exists ------------------------------------------

COMMANDS = {"mpiexec", "mpirun"}


def _defined_names() -> set[str]:
    """Every module, class, function, argument, and assigned name or attribute in the project's code."""
    names: set[str] = set()
    for folder in ("minizero", "tests", "mpi_examples", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return names


def where_to_look() -> list[tuple[str, str]]:
    """``(lesson, name)`` for every backticked name in the "Where to look" sections of lessons/*.md."""
    found = []
    for path in sorted((ROOT / "lessons").glob("*.md")):
        section = re.search(r"^## Where to look\n(.*?)(?=^## |\Z)", path.read_text(), re.M | re.S)
        if section:
            found += [(path.stem, name) for name in re.findall(r"`([^`\n]+)`", section.group(1))]
    return found


def _missing(name: str, defined: set[str], sources: str) -> str | None:
    """Why ``name`` names nothing in the code, or None."""
    if name.startswith("--"):
        flag = name.split()[0]
        return None if f'"{flag}"' in sources else f"no flag {flag} in minizero/"
    if name.startswith("python -m "):
        module = name.split()[2]
        path = ROOT / pathlib.Path(*module.split("."))
        return None if path.with_suffix(".py").exists() or path.is_dir() else f"no module {module}"
    if name in COMMANDS:
        return None
    if "/" in name or name.endswith(".py"):
        if "/" in name:
            return None if (ROOT / name).exists() else f"no file {name}"
        return None if any(ROOT.joinpath("minizero").rglob(name)) else f"no file {name} under minizero/"
    identifier = re.sub(r"\(.*\)", "", name)
    missing = [part for part in identifier.split(".") if part not in defined]
    return f"not defined in the code: {', '.join(missing)}" if missing else None


def test_where_to_look_names_exist():
    defined = _defined_names()
    sources = "\n".join(p.read_text() for p in (ROOT / "minizero").rglob("*.py"))
    names = where_to_look()
    assert len(names) > 100
    problems = [f"lessons/{lesson}.md: `{name}`: {why}" for lesson, name in names
                if (why := _missing(name, defined, sources))]
    assert not problems, "\n".join(problems)


# --- the main job's and the planner's command lines a lesson prints parse as printed -----------------

COMMAND = re.compile(r"^(?:(?:mpirun|mpiexec) -n (\d+) )?python -m minizero\.(train|plan) (.+)$")
PLACEHOLDER = re.compile(r"\.\.\.|[{}]|\b(PATH|DIR|N)\b")


def printed_spans() -> list[tuple[str, str]]:
    """``(lesson, text)`` for each inline code span and each line of a shell block in lessons/*.md, comments cut."""
    found = []
    for path in sorted((ROOT / "lessons").glob("*.md")):
        text = path.read_text()
        spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", text)
        spans += [line for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S) for line in block.splitlines()]
        found += [(path.stem, " ".join(s.split()).split(" #")[0]) for s in spans]
    return found


def printed_commands() -> list[tuple[str, int, str, str]]:
    """``(lesson, ranks, module, command)`` for each `python -m minizero.train|plan ARGS` in lessons/*.md (a bare
    module name is a name, and a command with a placeholder is a pattern)."""
    return [(lesson, int(m.group(1) or 1), m.group(2), span) for lesson, span in printed_spans()
            if (m := COMMAND.match(span)) and not PLACEHOLDER.search(span)]


def test_printed_commands_parse():
    """A student copies them: `minizero.plan --strategy "..."` without --model and --gpus stopped at argparse."""
    import shlex

    from minizero import plan
    from minizero.args import parse_args
    from minizero.flags import UsageError
    commands = printed_commands()
    assert len(commands) > 10 and {c[2] for c in commands} == {"train", "plan"}
    for lesson, ranks, module, command in commands:
        argv = shlex.split(COMMAND.match(command).group(3))
        try:
            plan.build_parser().parse_args(argv) if module == "plan" else parse_args(argv, ranks, quiet=True)
        except UsageError as e:  # a folder an earlier command of the lesson writes (--resume) is not here
            assert "no such" in str(e), f"lessons/{lesson}.md prints `{command}`: {e}"
        except SystemExit:
            pytest.fail(f"lessons/{lesson}.md prints `{command}`, which stops at its argument check")


@pytest.mark.parametrize("name", GENERATED)
def test_every_exercise_answer_is_a_figure_its_notebook_asserts(name):
    """Each numbered solution quotes a recorded figure (none typed by hand), recorded by a notebook cell that
    asserts: nbmake then fails when the code stops giving the answer the lesson prints."""
    template = (build.TEMPLATES / f"{name}.md").read_text()
    exercises = re.search(r"^## Exercises\n(.*?)(?=^## )", template, re.M | re.S)
    assert exercises, f"lessons/templates/{name}.md has no '## Exercises' section"
    solutions = re.search(r"<details><summary>\w+</summary>(.*?)</details>", exercises.group(1), re.S)
    answers = [a for a in re.split(r"^(?=\d+\. )", solutions.group(1), flags=re.M) if re.match(r"\d+\. ", a)]
    questions = re.findall(r"^\d+\. ", exercises.group(1)[:solutions.start()], re.M)
    assert answers and len(answers) == len(questions), f"{name}: {len(questions)} exercises, {len(answers)} answers"
    cells = ["".join(c["source"]) for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]
    for answer in answers:
        fields = re.findall(r"\{\{\s*(\w+)\s*\}\}", answer)
        assert any(re.search(rf"record(_bound)?\(\s*[\"']{f}[\"']", c) and "assert" in c for f in fields for c in cells), (
            f"lessons/templates/{name}.md, answer {answer[:2]} quotes no figure that a notebook cell records and "
            f"asserts (fields: {fields})")


def test_printed_script_and_tool_flags_exist():
    """The flags of `python bench/X.py`, `python mpi_examples/X.py` and `python -m minizero.TOOL` a lesson prints
    are defined: in the script (or its folder's _*.py helpers), or for a tool, in minizero/."""
    tools = "\n".join(p.read_text() for p in (ROOT / "minizero").rglob("*.py"))
    pattern = re.compile(r"python (?:((?:bench|mpi_examples)/\w+\.py)|-m minizero\.(?!train\b|plan\b)\w+)((?: [^#]*)?)")
    checked, problems = 0, []
    for lesson, span in printed_spans():
        for m in pattern.finditer(span):
            script = ROOT / m.group(1) if m.group(1) else None
            source = (script.read_text() + "".join(p.read_text() for p in script.parent.glob("_*.py"))) if script \
                else tools
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2)):
                checked += 1
                if f'"{flag}"' not in source:
                    problems.append(f"lessons/{lesson}.md: `{span}`: no {flag} in {m.group(1) or 'minizero/'}")
    assert checked > 10 and not problems, "\n".join(problems)


def _questions(markdown: str) -> list[str]:
    """The numbered questions of a '## Exercises' section (up to its solutions), whitespace joined."""
    section = re.search(r"^## Exercises[^\n]*\n(.*?)(?=<details>|\Z)", markdown, re.M | re.S).group(1)
    return [" ".join(q.split()) for q in re.split(r"^\d+\. ", section, flags=re.M)[1:]]


@pytest.mark.parametrize("name", GENERATED)
def test_notebook_asks_the_lessons_exercises(name):
    """A student reads the exercises in the notebook: the same questions as the lesson (notebook 06 asked for the
    default model at tp 8, which its 4 heads refuse; notebook 05 for `offloaded` alone, which the answer is not)."""
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    asked = [text for text in markdown if "## Exercises" in text]
    assert len(asked) == 1, f"notebooks/{name}.ipynb has {len(asked)} '## Exercises' cells"
    assert _questions(asked[0]) == _questions((ROOT / "lessons" / f"{name}.md").read_text()), (
        f"notebooks/{name}.ipynb asks other exercises than lessons/{name}.md: copy the lesson's questions")


def test_lesson_08_names_every_flag_compare_adds_to_its_runs():
    """Lesson 08's table lists each strategy's flags; compare runs each with --no-overlap and --tracemalloc too,
    which change what the device holds (overlap keeps two buckets and two gathered units): the lesson must say so
    (an audit found it silent)."""
    from minizero.compare import STRATEGIES, train_argv

    plumbing = ("--model", "--steps", "--micro-batch-size", "--eval-every", "--eval-batches", "--sample-tokens",
                "--no-progress")  # the run's size and output, not what it holds
    added = [f for f in train_argv("baseline", "tiny", 1, 1)
             if f.startswith("--") and f not in STRATEGIES["baseline"][0] and f not in plumbing]
    text = (ROOT / "lessons" / "08_putting_it_together.md").read_text()
    assert added and all(f"`{f}`" in text for f in added), added


def test_build_refuses_an_unknown_lesson_in_lines_of_at_most_120_columns():
    """Before: plain argparse's usage block, then the list of every template on one line of about 400 columns."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "lessons" / "build.py"), "--no-execute", "99_nope"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and lines[0].startswith("build.py: error: no template for 99_nope; templates: 00_"), lines
    assert len(lines) > 1 and max(map(len, lines)) <= 120 and "usage:" not in proc.stderr, lines
