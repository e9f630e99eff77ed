"""The README's two commands are what users and CI run: keep them and .ci/run in step."""
import os

from tests.conftest import REPO_ROOT

INSTALL_AND_RUN = ("python3 -m venv .venv && . .venv/bin/activate && pip install . && "
                   "mpirun -n 8 python -m minizero.train")
TEST = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest'


def test_readme_shows_both_commands():
    readme = open(os.path.join(REPO_ROOT, "README.md")).read()
    assert INSTALL_AND_RUN in readme
    assert TEST in readme


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(REPO_ROOT, ".ci", "run")).read().splitlines()
    assert TEST in ci, ".ci/run must run exactly the README's test command"


def test_relative_links_in_docs_point_to_files():
    import glob
    import re

    docs = [os.path.join(REPO_ROOT, "README.md"), os.path.join(REPO_ROOT, "ARCHITECTURE.md")]
    docs += glob.glob(os.path.join(REPO_ROOT, "lessons", "*.md"))
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)", open(doc).read()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(os.path.dirname(doc), target)):
                broken.append(f"{os.path.relpath(doc, REPO_ROOT)} -> {target}")
    assert not broken, broken
