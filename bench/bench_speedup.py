"""The main job before and after a change, alternated: tokens/s of two source trees, and FP16 / FP32.

    python bench/bench_speedup.py --base e016dca --ranks 8 --steps 30 --repeats 3
    python bench/bench_speedup.py --precision --ranks 1 --micro-batch-size 8
    python bench/bench_speedup.py --malloc --ranks 1,2,8

``--base REV``: runs ``mpiexec -n RANKS python -m minizero.train`` with its defaults (only
``--steps``, ``--sample-tokens 0`` and the output folder set) from this checkout and from
``git archive REV`` unpacked in a temporary folder, alternating A, B, A, B, ... so that a noisy
machine slows both alike, and prints each run's tokens/s (the training loop's, from the JSON
summary), the medians and their ratio. ``--precision``: the same with ``--precision fp16``
against fp32 on this checkout (with ``--base``: both trees in fp16). ``--malloc``: the main job as it runs
(freed memory kept for reuse, ``backend.keep_freed_memory``) against ``--default-malloc`` (glibc's own
settings). ``--micro-batch-size N``: passed to every run (default: the main job's). ``--ranks`` takes a
comma-separated list: one table row per count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from _args import check_revision, check_train_flags, count, parser, world_sizes  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing


def mpiexec() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return path if os.path.exists(path) else "mpiexec"


def run(tree: str, ranks: int, steps: int, extra: list[str]) -> float:
    """tokens/s of one main-job run from source tree ``tree``."""
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "s.json")
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "minizero.train", "--steps", str(steps),
               "--sample-tokens", "0", "--out", d, "--json", js, *extra]
        env = dict(os.environ, PYTHONPATH=tree)
        from minizero.interrupts import run_group  # SIGTERM, Ctrl-C: mpiexec and its ranks killed

        run_group(cmd, check=True, env=env, cwd=d, timeout=1800)
        with open(js) as f:
            return float(json.load(f)["tokens_per_s"])


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--base", help="git revision to compare this checkout against")
    p.add_argument("--precision", action="store_true", help="compare --precision fp16 with fp32 instead")
    p.add_argument("--malloc", action="store_true", help="compare the main job with and without --default-malloc")
    p.add_argument("--ranks", type=world_sizes, default=[8], help="rank counts, comma-separated (one row each)")
    p.add_argument("--steps", type=count, default=30)
    p.add_argument("--repeats", type=count, default=3)
    p.add_argument("--micro-batch-size", type=count, default=None,
                   help="passed to every run (default: the main job's)")
    args = p.parse_args()
    if args.malloc and (args.base or args.precision):
        p.error("--malloc compares the main job with --default-malloc on this checkout; not with --base or --precision")
    if not (args.base or args.precision or args.malloc):
        p.error("give --base REV, --precision or --malloc")
    if args.base:
        args.base = check_revision(p, "--base", args.base, REPO_ROOT)  # its commit id in the table
    mb = ["--micro-batch-size", str(args.micro_batch_size)] if args.micro_batch_size else []
    for extra in (["--precision", "fp16"] if args.precision else [], ["--default-malloc"] if args.malloc else []):
        check_train_flags(p, ["--steps", str(args.steps), "--sample-tokens", "0", *extra, *mb], args.ranks)
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    with tempfile.TemporaryDirectory() as base_tree:
        if args.base:
            archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", args.base], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", base_tree], input=archive.stdout, check=True)
            fp16 = ["--precision", "fp16"] if args.precision else []
            sides = {args.base: (base_tree, fp16), "this checkout": (REPO_ROOT, fp16)}
        elif args.precision:
            sides = {"fp32": (REPO_ROOT, []), "fp16": (REPO_ROOT, ["--precision", "fp16"])}
        else:  # --malloc
            sides = {"glibc default": (REPO_ROOT, ["--default-malloc"]), "memory kept": (REPO_ROOT, [])}
        rows = []
        for ranks in args.ranks:
            got = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, (tree, extra) in sides.items():
                    got[name].append(run(tree, ranks, args.steps, extra + mb))
                    print(f"{ranks} rank(s), {name}: {got[name][-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
            rows.append((ranks, got))
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}; micro-batch "
          f"{args.micro_batch_size or 'default'}")
    a, b = sides
    print(f"| ranks | steps | {a} tokens/s | {b} tokens/s | {b} / {a} |")
    print("|---:|---:|---:|---:|---:|")
    for ranks, got in rows:
        ta, tb = (float(np.median(got[n])) for n in (a, b))
        print(f"| {ranks} | {args.steps} | {ta:,.0f} ({', '.join(f'{x:,.0f}' for x in got[a])}) | "
              f"{tb:,.0f} ({', '.join(f'{x:,.0f}' for x in got[b])}) | {tb / ta:.2f}x |")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
