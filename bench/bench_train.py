"""Training throughput of the main job: tokens/s of the default model at 1 process and at N ranks.

Launches ``mpiexec -n N python -m minizero.train`` for each world size with the
same per-rank micro-batch, reads the JSON summary, and prints a Markdown table.
Tokens/s counts every token of every rank's micro-batches (global batch x
context) divided by the wall-clock time of the training loop (evaluation,
start-up and the final sample excluded).

With ``--against REV`` (a git revision of this repository) the tree at REV is unpacked into a
temporary folder and the two trees are run alternately, ``--rounds`` times each, on the same
command line; the table gives each tree's median tokens/s (min-max), the ratio, and every ledger
figure (rank 0's peak bytes per category, set-up peak, bytes sent) that changed, with its change in bytes.

usage: python bench/bench_train.py [--ranks 1,8] [--steps 30] [--model default] [--against REV --rounds 3]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.files import mpiexec_path  # noqa: E402
from minizero.interrupts import run_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from _args import check_revision, check_train_flags, count, parser, preset, world_sizes  # noqa: E402


def mpiexec() -> str:
    """``mpiexec`` beside this Python (the mpich wheel), else on PATH; exits with a hint when missing."""
    path = mpiexec_path()
    if path is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    return path

def run(n: int, args, tree: str | None = None) -> dict:
    """Run the main job on ``n`` ranks (from the code in ``tree``, else this checkout); return its JSON summary."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "summary.json")
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "minizero.train", *train_flags(args),
               "--out", d, "--json", js]
        run_group(cmd, check=True, env=env, cwd=tree)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
        with open(js) as f:
            return json.load(f)


def train_flags(args) -> list[str]:
    """The trainer's flags of every run, less ``--out`` and ``--json``."""
    return ["--model", args.model, "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
            "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--no-tracemalloc"]


LEDGER_KEYS = ("ledger_peak_bytes", "ledger_setup_peak_bytes", "bytes_sent")


def unpack(rev: str, into: str) -> str:
    """Write the tree at git revision ``rev`` of this repository into ``into``; return ``into``."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        tarfile.open(fileobj=f).extractall(into, filter="data")
    return into


def changes(new, old, path="") -> dict:
    """``{path: new - old}`` for every number that differs between two summaries' ledger figures (rank 0's
    row when per-rank lists)."""
    if isinstance(new, list):
        return changes(new[0], old[0], path) if new and old else {}
    if isinstance(new, dict):
        out = {}
        for k in new:
            out.update(changes(new[k], old.get(k, 0), f"{path}.{k}" if path else k))
        return out
    return {} if new == old else {path: new - old}


def against(args) -> None:
    """Alternate this checkout and the tree at ``args.against``; print tokens/s and the ledger check."""
    print(f"| ranks | tokens/s this tree | tokens/s at {args.against} | ratio | ledger figures |  "
          f"({args.model}, {args.steps} steps, {args.rounds} alternated rounds, median (min-max))")
    print("|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as before:
        unpack(args.against, before)
        for n in args.ranks:
            runs = {"new": [], "old": []}
            for _ in range(args.rounds):
                runs["new"].append(run(n, args))
                runs["old"].append(run(n, args, before))
            tps = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
            new, old = runs["new"][-1], runs["old"][-1]
            diff = {}
            for k in LEDGER_KEYS:
                diff.update(changes(new[k], old[k], k))
            ledger = ", ".join(f"{k} {d:+,} B" for k, d in diff.items()) or "unchanged"
            cell = {k: f"{statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})" for k, v in tps.items()}
            ratio = statistics.median(tps["new"]) / statistics.median(tps["old"])
            print(f"| {n} | {cell['new']} | {cell['old']} | {ratio:.2f} | {ledger} |", flush=True)


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=world_sizes, default=[1, 8], help="comma-separated world sizes")
    p.add_argument("--steps", type=count, default=30)
    p.add_argument("--micro-batch-size", type=count, default=2)
    p.add_argument("--model", type=preset, default="default")
    p.add_argument("--against", metavar="REV", help="git revision to alternate with (the tree before a change)")
    p.add_argument("--rounds", type=count, default=3, help="alternated runs per tree with --against")
    args = p.parse_args()
    if args.against:
        args.against = check_revision(p, "--against", args.against,  # its commit id in the table
                                      os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    check_train_flags(p, train_flags(args), args.ranks)
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    if args.against:
        return against(args)
    print(f"| ranks | global batch (seqs) | tokens/s | s/step | BLAS threads/rank |  "
          f"({args.model}, {args.steps} steps, {_machine.cores()} cores)")
    print("|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        s = run(n, args)
        step_s = s["elapsed_s"] / args.steps
        print(f"| {n} | {s['config']['train']['batch_size']} | {s['tokens_per_s']:,.0f} | {step_s:.3f} | "
              f"{s['blas_threads_per_rank']} |", flush=True)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
