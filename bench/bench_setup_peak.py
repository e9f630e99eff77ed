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

import argparse
import json
import os
import sys
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from minizero.interrupts import start_mpi

MPI = start_mpi("bench_setup_peak.py")  # a stale launcher: one line, not MPICH's error stack; SIGTERM or time ends
# a stalled MPI_Init

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_machine.py
import _machine  # noqa: E402

from minizero.args import UsageError, model_config, parse_args  # noqa: E402
from minizero.comm import MPICommunicator  # noqa: E402
from minizero.ledger import MemoryLedger, set_ledger  # noqa: E402
from minizero.numerals import OneLineParser, negative_values_reach_checks, real  # noqa: E402
from minizero.parallel.strategy import build_strategy  # noqa: E402


def measure(args, comm) -> dict:
    """Build this rank's strategy for ``args`` (train flags, parsed); its set-up figures in bytes."""
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


class _Parser(OneLineParser):
    """Rank 0 alone prints help and errors (every rank parses the same flags and exits alike)."""

    def print_help(self, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().print_help(file)

    def error(self, message):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().error(message)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """This script's own flags; the rest go to ``python -m minizero.train``'s parser."""
    p = negative_values_reach_checks(_Parser(
        prog="bench_setup_peak.py", allow_abbrev=False,  # no prefix of ours takes a train flag
        usage="%(prog)s [--check] [--max-fraction F] [--json] [train flags]",
        description=__doc__.split("\n\n")[0], epilog="Every other flag is python -m minizero.train's "
        "(python -m minizero.train --help), e.g. --model gpt2 --zero 3."))
    p.add_argument("--check", action="store_true", help="exit 1 unless, on every rank, nothing was built "
                   "that is not kept and the process peak exceeded what it keeps by less than the largest parameter")
    p.add_argument("--max-fraction", type=fraction, metavar="F", default=None,
                   help="with --check: the parameters' peak must stay below F x the whole model, 0 < F <= 1")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    return p


def fraction(text) -> float:
    """``type=``: a number in (0, 1]."""
    x = real(text)
    if not 0 < x <= 1:  # nan too
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a number in (0, 1], e.g. 0.25")
    return x


def main(argv=None) -> int:
    parser = build_parser()
    ours, argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.max_fraction is not None and not ours.check:  # it did nothing: a check the user thinks ran
        parser.error(f"--max-fraction {ours.max_fraction:g} only applies with --check (the limit --check tests); "
                     "add --check or drop --max-fraction")
    comm = MPICommunicator(MPI.COMM_WORLD)
    try:  # every rank checks the train flags; all refuse together (a lone refusal would leave the rest waiting)
        args, refusal = parse_args(argv, comm.world_size, quiet=True), None
    except UsageError as e:
        args, refusal = None, str(e)
    refusals = [r for r in MPI.COMM_WORLD.allgather(refusal) if r]
    if refusals:
        parser.error(refusals[0])
    do_check, max_fraction, as_json = ours.check, ours.max_fraction, ours.json
    threadpool_limits(limits=1)
    rows = MPI.COMM_WORLD.gather(measure(args, comm), root=0)
    if comm.rank != 0:
        return 0
    if as_json:
        print(json.dumps(rows))
    else:
        unit = "MiB" if rows[0]["model_bytes"] >= 10 * 2 ** 20 else "KiB"  # a tiny model read 0.0 MiB throughout
        mb = 2.0 ** (20 if unit == "MiB" else 10)
        print(_machine.header())
        print(f"whole model: {rows[0]['model_bytes'] / mb:.1f} {unit} of parameters; process peak and kept: "
              "tracemalloc (on through set-up)")  # the header said nothing of how the process figures were measured
        print(f"rank  params peak  params kept  ledger peak  ledger kept  process peak  process kept  ({unit})")
        for r in rows:
            print(f"{r['rank']:>4}  {r['params_peak'] / mb:11.1f}  {r['params_kept'] / mb:11.1f}  "
                  f"{r['ledger_peak'] / mb:11.1f}  {r['ledger_kept'] / mb:11.1f}  {r['process_peak'] / mb:12.1f}  "
                  f"{r['process_kept'] / mb:12.1f}")
    bad = check(rows, max_fraction) if do_check else []
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
