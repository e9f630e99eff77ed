"""Fill the README's "what the main job prints" block from a real run (never typed by hand).

    python docs/build_readme_excerpt.py            # run the main job, rewrite the README's block
    python docs/build_readme_excerpt.py --suite    # also time the test suite (tens of minutes)
    python docs/build_readme_excerpt.py --suite-log ci.log   # the suite line from a run's log (CI's first pass)

Runs the README's command, ``mpirun -n 8 python -m minizero.train`` with no flags (its output
folder a temporary one), times it from launch to exit, and replaces the text between the
``<!-- main-job: begin -->`` / ``<!-- main-job: end -->`` markers of README.md with an excerpt of
what rank 0 printed (the header, a few progress lines, the validation loss, the memory table) and
one line on how it ran: the date, the CPU and cores, the BLAS library, its kernel and threads
(threadpoolctl, in this process), the load average, and the wall time. ``--suite`` also runs
``python -m pytest -q`` and rewrites the ``<!-- suite-time -->`` line with its wall time; ``--suite-log FILE``
takes that line from the first pytest summary in FILE (``.ci/run``'s output: its first pass is the whole suite),
with the time pytest measured.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
BEGIN, END = "<!-- main-job: begin -->", "<!-- main-job: end -->"
SUITE = re.compile(r"<!-- suite-time -->.*?<!-- /suite-time -->", re.S)


def machine() -> str:
    """Date, CPU, cores, BLAS library with its kernel and threads, OPENBLAS_CORETYPE, load average."""
    import numpy  # noqa: F401  (loads the BLAS that threadpoolctl reports)
    from threadpoolctl import threadpool_info

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = ", ".join(f"{i['internal_api']} {i['version']} ({i.get('architecture')} kernel)"
                     for i in threadpool_info() if i["user_api"] == "blas") or "no BLAS found"
    core = os.environ.get("OPENBLAS_CORETYPE")
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}, {cpu}, {os.cpu_count()} cores, {blas}"
            + (f", OPENBLAS_CORETYPE={core}" if core else "") + f", load average {os.getloadavg()[0]:.1f}")


def excerpt(out: str) -> list[str]:
    """The lines of rank 0's output a newcomer should see first (in order), '...' where lines were left out."""
    lines = out.splitlines()
    nodes = next((i for i, line in enumerate(lines) if line.startswith("nodes:")), 3)
    keep = set(range(nodes))  # the header (wrapped at 100 columns): layout and model, device, batch; not the nodes
    # line (which nodes, and the ranks' process ids: a run's detail, not what a newcomer reads first)
    progress = [i for i, line in enumerate(lines) if re.match(r"step +\d+/\d+ +loss", line)]
    shown_steps = set(progress[:2] + progress[len(progress) // 2:len(progress) // 2 + 1] + progress[-1:])
    for i, line in enumerate(lines):
        if i in shown_steps or line.startswith(("validation loss:", "  below the training loss",
                                                 "minizero memory summary", "category ", "peak total", "process peak",
                                                 "wrote ")) or re.match(
                                r"(parameters|gradients|optimizer_state|activations|comm_buffers) ", line):
            keep.add(i)
            indent = len(line) - len(line.lstrip())
            for j in range(i + 1, len(lines)):  # a wrapped line's continuation (indented deeper)
                if not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) <= indent:
                    break
                keep.add(j)
    shown, last = [], -1
    for i in sorted(keep):
        if i != last + 1:
            shown.append("...")
        shown.append(lines[i])
        last = i
    return shown


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        sys.exit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + block + "\n" + END + rest.split(END, 1)[1]


def suite_from_log(path: str) -> tuple[str, float]:
    """(pytest's summary, its seconds) of the first ``=== N passed ... in S.SSs ... ===`` line in the log ``path``;
    exits naming the file when it holds none or the run failed."""
    try:
        text = open(path, errors="replace").read()
    except OSError as e:
        sys.exit(f"--suite-log {path!r}: {e.strerror or e}")
    m = re.search(r"^=+ ((?:\d+ \w+, )*\d+ \w+ in ([\d.]+)s(?: \([\d:]+\))?) =+$", text, re.M)
    if m is None:
        sys.exit(f"--suite-log {path!r} holds no pytest summary line ('=== N passed ... in S.SSs ===')")
    if "failed" in m.group(1) or "error" in m.group(1):
        sys.exit(f"--suite-log {path!r}: the run did not pass ({m.group(1)})")
    return m.group(1), float(m.group(2))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="store_true", help="also time `python -m pytest -q` (tens of minutes)")
    p.add_argument("--suite-log", metavar="FILE", help="the suite line from the first pytest summary in FILE (a log "
                   "of .ci/run or python -m pytest), instead of running the suite")
    a = p.parse_args()
    if a.suite and a.suite_log:
        p.error("--suite runs the suite, --suite-log reads a run of it: give one")
    logged = suite_from_log(a.suite_log) if a.suite_log else None
    mpirun = shutil.which("mpirun") or sys.exit("mpirun not found: activate the virtual environment first")
    with tempfile.TemporaryDirectory() as tmp:
        how = machine()
        t = time.perf_counter()
        proc = subprocess.run([mpirun, "-n", "8", sys.executable, "-m", "minizero.train", "--out", tmp],
                              capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"the main job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    out = re.sub(re.escape(tmp), "out", proc.stdout)
    block = "\n".join(["```", *excerpt(out), "```", "",
                       f"(`python docs/build_readme_excerpt.py`, {how}: the job took {wall / 60:.1f} minutes "
                       "from launch to exit.)"])
    text = replace_block(open(README).read(), block)
    if a.suite:
        t = time.perf_counter()
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=REPO,
                               capture_output=True, text=True)
        summary = (suite.stdout.strip().splitlines() or ["?"])[-1].strip("= ")
        text = SUITE.sub(f"<!-- suite-time -->the suite took {(time.perf_counter() - t) / 60:.0f} minutes "
                         f"({summary}; {machine()})<!-- /suite-time -->", text)
    if logged:
        summary, seconds = logged
        how = re.sub(r", load average [\d.]+", "", machine())  # now's load, not the logged run's
        text = SUITE.sub(f"<!-- suite-time -->the suite took {seconds / 60:.0f} minutes ({summary}; {how}; "
                         "read from .ci/run's log)<!-- /suite-time -->", text)
    with open(README, "w") as f:
        f.write(text)
    print(block)


if __name__ == "__main__":
    main()
