"""Memory of the main job under the memory-compression techniques: ledger peaks and measured process peak.

Runs ``python -m minizero.train`` (under ``mpiexec -n RANKS``) for a few steps
once per configuration and prints, for rank 0: the ledger's peak bytes per
category and the process peak measured by tracemalloc (every NumPy allocation,
temporaries included; memory-mapped files are not allocations and do not count,
which is the point of NVMe offload), plus tokens/s.

usage: python bench/bench_memory.py [--model default] [--ranks 1] [--steps 5] [--configs all]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.files import mpiexec_path  # noqa: E402
from minizero.interrupts import run_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from _args import check_train_flags, count, parser, preset, world_size  # noqa: E402

CONFIGS = {
    "baseline": [],
    "recompute full": ["--recompute", "full"],
    "recompute selective": ["--recompute", "selective"],
    "offload act cpu": ["--offload-activations", "cpu"],
    "offload act nvme": ["--offload-activations", "nvme"],
    "offload opt cpu": ["--offload-optimizer", "cpu"],
    "offload opt nvme": ["--offload-optimizer", "nvme"],
    "fp16": ["--precision", "fp16"],
    "fp16 + full + act nvme + opt nvme": ["--precision", "fp16", "--recompute", "full",
                                          "--offload-activations", "nvme", "--offload-optimizer", "nvme"],
}


def mpiexec() -> str:
    """``mpiexec`` beside this Python (the mpich wheel), else on PATH; exits with a hint when missing."""
    path = mpiexec_path()
    if path is None:
        sys.exit("mpiexec not found: pip install mpich (or install a system MPI)")
    return path

def run(flags, args) -> dict:
    """One training run; returns its JSON summary."""
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "s.json")
        cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "minizero.train", *train_flags(flags, args),
               "--out", d, "--json", js]
        run_group(cmd, check=True)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
        with open(js) as f:
            return json.load(f)


def train_flags(flags, args) -> list[str]:
    """The trainer's flags of one configuration's run, less ``--out`` and ``--json``."""
    return ["--model", args.model, "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
            "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--tracemalloc",
            *flags]


def mib(n) -> str:
    return f"{n / 2 ** 20:.2f}"


def main():
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", type=preset, default="default")
    p.add_argument("--ranks", type=world_size, default=1)
    p.add_argument("--steps", type=count, default=5)
    p.add_argument("--micro-batch-size", type=count, default=4)
    p.add_argument("--configs", default="all", help="comma-separated names from: " + ", ".join(CONFIGS))
    args = p.parse_args()
    names = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",")]
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: unknown config {n!r}; allowed: {', '.join(CONFIGS)} (or all)")
    for n in names:
        check_train_flags(p, train_flags(CONFIGS[n], args), [args.ranks])
    print(_machine.header(_machine.RANK_THREADS), flush=True)  # date, CPU, BLAS library, kernel; the ranks' threads
    print(f"model {args.model}, {args.ranks} rank(s), micro-batch {args.micro_batch_size}, {args.steps} steps; "
          "MiB (2^20 bytes) on rank 0")
    print("| config | parameters | gradients | optimizer | activations | offloaded | ledger peak total | "
          "process peak (tracemalloc) | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        s = run(CONFIGS[n], args)
        pk = s["ledger_peak_bytes"][0]
        print(f"| {n} | {mib(pk['parameters'])} | {mib(pk['gradients'])} | {mib(pk['optimizer_state'])} | "
              f"{mib(pk['activations'])} | {mib(pk['offloaded'])} | {mib(s['ledger_peak_total_bytes'][0])} | "
              f"{mib(s['process_peak_bytes'][0])} | {s['tokens_per_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
