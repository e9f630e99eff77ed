"""bench/bench_heldout.py (the source of the report's note on the held-out end) runs tiny and prints its table.

What is checked: the rows (each trained-on slice, their pool, the held-out end, the job's own validation batches),
their byte ranges (contiguous, the held-out end last), the sequences each drew and the flags echoed. Not the timing,
nor whether the held-out end comes out easier: a 3-step tiny model says nothing about that.
"""
import math
import os
import subprocess
import sys

from minizero.data import load_tokens, train_val_split
from tests.conftest import REPO_ROOT


def test_bench_heldout_prints_one_row_per_slice_then_the_held_out_end():
    proc = subprocess.run([sys.executable, os.path.join("bench", "bench_heldout.py"), "--model", "tiny", "--steps",
                           "3", "--slices", "3", "--batches", "2", "--seed", "5"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert " UTC | " in lines[0] and "OPENBLAS_CORETYPE=" in lines[0] and "load average" in lines[0], lines[0]
    assert lines[1].startswith("model tiny, 3 steps, global batch 16 x 16 as one process") and "seed 5" in lines[1]
    top = lines.index("| text | bytes | sequences | mean loss | s.e. | zlib |")
    assert lines[top + 1] == "|---|---:|---:|---:|---:|---:|"
    rows = []
    for line in lines[top + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert [r[0] for r in rows] == ["trained on: slice 1 of 3", "trained on: slice 2 of 3", "trained on: slice 3 of 3",
                                    "trained on: all 3 slices", "held out: the end (last 10%)",
                                    "the job's validation batches (4 x 16, seed 1)"]
    assert [int(r[2].replace(",", "")) for r in rows] == [32, 32, 32, 96, 32, 64]  # --batches 2 x 16; the job's 4
    spans = [tuple(int(x.replace(",", "")) for x in r[1].split("-")) for r in rows]
    n_train, n_val = map(len, train_val_split(load_tokens(None)))
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == spans[2][0] and spans[2][1] == n_train
    assert spans[3] == (0, n_train) and spans[4] == spans[5] == (n_train, n_train + n_val)
    assert all(math.isfinite(float(r[3])) and float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    said = "\n".join(lines[top + 2 + len(rows):])
    assert "held-out end minus all trained-on slices: " in said and " of 3" in said
    assert "the job's validation loss: " in said


def test_bench_heldout_one_batch_has_no_standard_error_and_huge_batches_are_refused_before_training():
    """--batches 1: each row's s.e. printed 'nan'; --batches 10**14 trained, then drew batches for ever (no bound:
    the trainer's --eval-batches allows 10,000)."""
    run = lambda *a: subprocess.run([sys.executable, os.path.join("bench", "bench_heldout.py"), "--model", "tiny", *a],
                                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)  # noqa: E731
    one = run("--steps", "2", "--slices", "2", "--batches", "1")
    rows = [line.split("|")[5].strip() for line in one.stdout.splitlines() if line.startswith("| trained on: slice")]
    assert one.returncode == 0 and rows == ["-", "-"] and "nan" not in one.stdout, one.stdout + one.stderr[-2000:]
    huge = run("--batches", "10" * 7)
    assert huge.returncode == 2 and huge.stdout == "" and huge.stderr.strip().endswith(
        "argument --batches: '10101010101010' is above 10,000; allowed: an integer in 1..10,000"), huge.stderr
