"""Set-up memory per rank: build the strategy only (no training step) and measure its peaks.

Each rank (under ``mpiexec -n N``) parses the same flags as ``python -m minizero.train``,
runs ``build_strategy`` with tracemalloc on, and reports, in bytes: the ledger's peak of
``parameters`` and of all categories during set-up, what it keeps at the end (ledger
current), and the measured process peak and current (tracemalloc, every NumPy allocation).
Rank 0 prints one row per rank beside the whole model's parameter bytes.

``--check`` exits 1 unless, on every rank: the ledger never held more parameter bytes than
the rank keeps (its shard; nothing built that is not kept), the process peak exceeded what
the process keeps by less than the largest parameter, and (with ``--max-fraction F``) the
process peak of parameters stayed below F x the whole model.

usage: mpiexec -n 8 python bench/bench_setup_peak.py --model gpt2 --zero 3 [--check --max-fraction 0.25]
       mpiexec -n 8 python bench/bench_setup_peak.py --model gpt2 --tp 2 --pp 2 --dp 2 --check
"""
from __future__ import annotations

import json
import sys
import tracemalloc

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from minizero.args import model_config, parse_args
from minizero.comm import MPICommunicator
from minizero.ledger import MemoryLedger, set_ledger
from minizero.parallel.strategy import build_strategy


def measure(argv, comm) -> dict:
    """Build this rank's strategy for ``argv`` (train flags); its set-up figures in bytes."""
    args = parse_args(argv, comm.world_size, quiet=comm.rank != 0)
    cfg = model_config(args)
    ledger = MemoryLedger()
    set_ledger(ledger)
    tracemalloc.start()
    strategy = build_strategy(args, comm, cfg, log=lambda s: None)
    proc_cur, proc_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    itemsize = np.dtype(cfg.dtype).itemsize
    largest = max(cfg.vocab_size, 4 * cfg.n_embd) * cfg.n_embd * itemsize
    out = dict(rank=comm.rank, params_peak=ledger.peak["parameters"], params_kept=ledger.current["parameters"],
                ledger_peak=ledger.peak_total, ledger_kept=sum(ledger.current.values()),
                process_peak=proc_peak, process_kept=proc_cur,
                model_bytes=cfg.num_parameters() * itemsize, largest_param_bytes=largest)
    del strategy
    return out


def check(rows, max_fraction=None) -> list[str]:
    """The failed conditions (text), empty when all hold (see the module docstring)."""
    bad = []
    for r in rows:
        if r["params_peak"] > r["params_kept"]:
            bad.append(f"rank {r['rank']}: parameters peak {r['params_peak']} > kept {r['params_kept']}")
        if r["process_peak"] - r["process_kept"] >= r["largest_param_bytes"]:
            bad.append(f"rank {r['rank']}: process peak {r['process_peak']} exceeds kept {r['process_kept']} "
                       f"by a parameter or more ({r['largest_param_bytes']})")
        if max_fraction is not None and r["params_peak"] >= max_fraction * r["model_bytes"]:
            bad.append(f"rank {r['rank']}: parameters peak {r['params_peak']} >= {max_fraction} x model "
                       f"{r['model_bytes']}")
    return bad


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    do_check = "--check" in argv
    max_fraction, as_json = None, "--json" in argv
    if "--max-fraction" in argv:
        i = argv.index("--max-fraction")
        max_fraction = float(argv[i + 1])
        del argv[i:i + 2]
    argv = [a for a in argv if a not in ("--check", "--json")]
    threadpool_limits(limits=1)
    comm = MPICommunicator(MPI.COMM_WORLD)
    rows = MPI.COMM_WORLD.gather(measure(argv, comm), root=0)
    if comm.rank != 0:
        return 0
    if as_json:
        print(json.dumps(rows))
    else:
        mb = 2.0 ** 20
        print(f"whole model: {rows[0]['model_bytes'] / mb:.1f} MiB of parameters")
        print("rank  params peak  params kept  ledger peak  ledger kept  process peak  process kept  (MiB)")
        for r in rows:
            print(f"{r['rank']:>4}  {r['params_peak'] / mb:11.1f}  {r['params_kept'] / mb:11.1f}  "
                  f"{r['ledger_peak'] / mb:11.1f}  {r['ledger_kept'] / mb:11.1f}  {r['process_peak'] / mb:12.1f}  "
                  f"{r['process_kept'] / mb:12.1f}")
    bad = check(rows, max_fraction) if do_check else []
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
