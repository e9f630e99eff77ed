"""``python -m minizero.compare``: every memory technique, measured, beside the estimator's prediction.

For each world size and strategy of :data:`STRATEGIES` it runs ``mpiexec -n N python -m minizero.train ...
--json PATH``, then writes to ``OUT/compare.md`` a table of rank 0's ledger peak bytes by category beside the
estimator's prediction (``accounting="minizero"``), the tracemalloc peak, tokens/s, and measured vs predicted step
time on a hardware profile measured first (:mod:`minizero.hardware`). The terminal shows in 120 columns the totals,
the speed and the file's name (compare_report.terminal says why these). Also writes ``OUT/compare.png`` and the
JSON (bytes), each through a temporary name. A failed run is reported with its cause and the rest continue (exit
status 1); bad arguments exit with status 2 and one line naming the value. MiB = 2**20 bytes."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from minizero import backend, hardware, jsons
from minizero.memory.estimator import ModelShape, Strategy, activation_bytes, estimate_memory, precision_for_dtype
from minizero.plan_search import step_time
from minizero.compare_report import (SHOWN, deviations, hardware_line, hardware_lines,  # noqa: F401 (API)
                                     markdown, plot, progress, terminal)
from minizero.files import WriteError, atomic_write, check_writable_file, mpiexec_path
from minizero.overwrite import check_output, checkpoint_holding
from minizero.temporaries import check_writable_folder, unwritable
from minizero.debug.parity import MAX_RANKS  # the ranks one run may start, as parity's
from minizero.interrupts import WHOLE, interruptible, refuse_several_ranks, run_group  # __main__: | head -1 quiet
from minizero.nn.gpt import PRESETS, preset_sizes
from minizero.output_checks import existing_folder
from minizero.pngs import MARKED, SIGNATURE, is_marked
from minizero.numerals import (DefaultsOnce, FlagParser, description, error_lines, integer, is_count,
                               negative_values_reach_checks, real, unwrapped, wrapped)

#: name -> (flags of ``python -m minizero.train``, what it adds). Each adds one technique to the data-parallel FP32
#: baseline; "combined" switches them all on. Offload "cpu" only relabels bytes on NumPy (host memory *is* device
#: memory) but would move them off a GPU; "nvme" really lowers the process peak (the bytes sit in files).
STRATEGIES = {
    "baseline": ([], "data parallel, FP32, AdamW"),
    "recompute": (["--recompute", "full"], "+ full activation recompute"),
    "fp16": (["--precision", "fp16"], "+ FP16 mixed precision (2 + 2 + 12 bytes/param)"),
    "zero1": (["--zero", "1"], "+ ZeRO-1: optimizer state sharded"),
    "zero2": (["--zero", "2"], "+ ZeRO-2: optimizer state and gradients sharded"),
    "zero3": (["--zero", "3"], "+ ZeRO-3: optimizer state, gradients, parameters sharded"),
    "offload": (["--offload-optimizer", "cpu", "--offload-activations", "cpu"],
                "+ optimizer state and saved activations in host memory"),
    "offload-nvme": (["--offload-optimizer", "nvme", "--offload-activations", "nvme"],
                     "+ optimizer state and saved activations in files"),
    "combined": (["--precision", "fp16", "--recompute", "full", "--zero", "3", "--offload-optimizer", "cpu",
             "--offload-activations", "cpu"], "FP16 + recompute + ZeRO-3 + offload (cpu)"),
}
#: the categories the estimator must match within 5% (the issue's check), then the others shown
CHECKED = ("parameters", "gradients", "optimizer_state", "activations")
TOLERANCE = 0.05


class UsageError(ValueError):
    """A bad command-line value; the message names it and what is allowed."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (raised by the handler :func:`main` installs); ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    # a second signal during the cleanup must not interrupt it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


class _Parser(FlagParser):
    quiet = False  # a launched rank other than 0 (refuse_several_ranks): exit 2, rank 0 says why

    def error(self, message):
        if self.quiet:
            raise SystemExit(2)
        raise UsageError(message)


# ---- one strategy: the train flags, the estimate --------------------------------------------------
def train_argv(name: str, model: str, steps: int, micro_batch_size: int) -> list[str]:
    """The ``python -m minizero.train`` arguments of strategy ``name`` (no --out/--json). ``--no-overlap``: the
    estimator counts the blocking path's buffers (ZeRO-3 gathers one unit at a time; its prefetch holds two)."""
    return ["--model", model, "--steps", str(steps), "--micro-batch-size", str(micro_batch_size), "--eval-every", "0",
            "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--tracemalloc", "--no-overlap",
            *STRATEGIES[name][0]]


def to_strategy(name: str, ranks: int, micro_batch_size: int, dtype) -> Strategy:
    """The estimator's :class:`Strategy` for compare strategy ``name`` on ``ranks`` data-parallel ranks."""
    flags = STRATEGIES[name][0]

    def flag(f, default=None):
        return flags[flags.index(f) + 1] if f in flags else default

    tier = flag("--offload-optimizer") or flag("--offload-activations") or "cpu"
    return Strategy(dp=ranks, micro_batch=micro_batch_size, precision=precision_for_dtype(dtype),
                    recompute=flag("--recompute", "none"), zero=int(flag("--zero", 0)),
                    offload="optimizer" if flag("--offload-optimizer") else "none",
                    offload_activations=flag("--offload-activations") is not None, offload_tier=tier)


def estimate(name: str, model: str, ranks: int, micro_batch_size: int) -> dict:
    """The estimator's per-rank bytes for one run: {category: bytes, "total", "nvme", "nvme_optimizer"}.

    ``nvme_optimizer``: the part of ``nvme`` that is optimizer state (what the job reports as
    ``optimizer_disk_bytes``; it does not count activation files).
    """
    from minizero.train import model_config, parse_args

    cfg = model_config(parse_args(train_argv(name, model, 1, micro_batch_size), ranks))
    st = to_strategy(name, ranks, micro_batch_size, cfg.dtype)
    est = estimate_memory(cfg, st, accounting="minizero")
    act_files = activation_bytes(cfg, st, accounting="minizero")[1] if st.offload_activations and est.nvme else 0
    return dict(est.as_dict(), total=est.total, nvme=est.nvme, nvme_optimizer=est.nvme - act_files)


def predict_step_s(name: str, model: str, ranks: int, micro_batch_size: int, profile: hardware.Profile) -> float:
    """The planner's step time (s) for strategy ``name`` on ``ranks`` ranks of this machine (``profile``).

    :func:`minizero.plan_search.step_time` on the model's :class:`ModelShape`, the strategy of
    :func:`to_strategy` and ``profile.hardware(ranks)``, with ``overlap=False``: the runs are ``--no-overlap``.
    """
    from minizero.train import model_config, parse_args

    cfg = model_config(parse_args(train_argv(name, model, 1, micro_batch_size), ranks))
    st, shape = to_strategy(name, ranks, micro_batch_size, cfg.dtype), ModelShape.from_gpt_config(cfg)
    return step_time(shape, st, profile.hardware(ranks), cfg.block_size, overlap=False)["step"]


# ---- measuring: under MPI, or in-process threads ---------------------------------------------------
def _cause(stderr: str, rc: int) -> str:
    """The lines of a failed job's stderr that say why (the ``[rank r] ... failed`` line, or the last ones)."""
    lines = [ln for ln in unwrapped(stderr.strip()) if ln.strip()]  # a long line printed over several, whole
    said = [ln for ln in lines if "failed:" in ln or "error:" in ln]
    return "; ".join(said[:2]) if said else (" | ".join(lines[-3:]) if lines else f"exit status {rc}, no output")


def run_mpi(name: str, model: str, ranks: int, steps: int, micro_batch_size: int, timeout: float,
            mpiexec: str, device: str = "cpu") -> dict:
    """Train strategy ``name`` under ``mpiexec -n ranks`` on ``device`` (``--device``); returns {"ok", "summary" or
    "error", "wall_s", "command"}."""
    with tempfile.TemporaryDirectory(prefix="minizero-compare-") as d:
        js = os.path.join(d, "summary.json")
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "minizero.train",
               *train_argv(name, model, steps, micro_batch_size), "--out", d, "--json", js,
               "--device", device]
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p))
        fault_rank = env.get("MINIZERO_FAULT", "").split(":")[0]
        if is_count(fault_rank) and int(fault_rank) >= ranks:  # the test hook names a rank this run lacks:
            del env["MINIZERO_FAULT"]  # nothing to inject (train refuses a spec naming a rank it does not have)
        t0 = time.perf_counter()
        try:  # its own session (a terminal's Ctrl-C reaches only us); Interrupted: the whole group killed, re-raised
            proc = run_group(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:  # mpiexec and every rank it started killed
            return dict(ok=False, error=f"timed out after {timeout:g} s (--timeout)", wall_s=timeout, command=cmd)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(js):
            return dict(ok=False, error=f"exit status {proc.returncode}: {_cause(proc.stderr, proc.returncode)}",
                        wall_s=wall, command=cmd)
        with open(js) as f:
            return dict(ok=True, summary=json.load(f), wall_s=wall, command=cmd)


def measure_threads(name: str, model: str = "tiny", ranks: int = 2, steps: int = 1, micro_batch_size: int = 2) -> list:
    """Train strategy ``name`` on ``ranks`` in-process rank threads (no MPI); per rank, the ledger's peaks.

    Returns a list by rank of {"peak": {category: bytes}, "optimizer_disk_bytes", "tokens_per_s"} --
    the same numbers the MPI job reports, fast enough for tests and notebooks. BLAS threads are
    limited to cores / ranks meanwhile, as the MPI job does (oversubscribed, they cost 8.5x).
    """
    from threadpoolctl import threadpool_limits

    from minizero.comm import run_in_threads
    from minizero.ledger import get_ledger
    from minizero.train import _blas_threads, parse_args, train

    def rank(comm):
        args = parse_args(train_argv(name, model, steps, micro_batch_size) + ["--no-save"], comm.world_size)
        result = train(args, comm, log=lambda s: None)
        store = getattr(result["opt"], "store", None)
        return {"peak": dict(get_ledger().peak), "optimizer_disk_bytes": getattr(store, "disk_bytes", 0),
                "tokens_per_s": result["tokens_per_s"]}

    with threadpool_limits(limits=_blas_threads(ranks)):
        return run_in_threads(ranks, rank, timeout=300)


# ---- the command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.compare``."""
    p = negative_values_reach_checks(_Parser(prog="python -m minizero.compare", description=description(__doc__),
                                             formatter_class=DefaultsOnce))
    p.add_argument("--model", default="default", metavar="{" + ",".join(sorted(PRESETS)) + "}",  # as train's usage
                   help=preset_sizes() + " (default: %(default)s)")
    p.add_argument("--ranks", default="2", help="comma list of world sizes, e.g. 1,2,4")
    p.add_argument("--steps", type=integer, default=3, help="optimizer steps per run")
    p.add_argument("--micro-batch-size", type=integer, default=2, help="sequences per rank per step")
    p.add_argument("--strategies", default="all", help=f"comma list from: {', '.join(STRATEGIES)}; or 'all'")
    p.add_argument("--out", default=os.path.join("out", "compare"), help="folder for compare.md and compare.png")
    p.add_argument("--json", default="OUT/compare.json", help="path of the JSON results (OUT: the --out folder)")
    p.add_argument("--timeout", type=real, default=900.0, help="seconds one training run may take")
    p.add_argument("--device", default="cpu", choices=list(backend.DEVICES), help="every run's --device: cpu "
                   "(NumPy), cuda (CuPy, GPU local rank %% count), strict (host leaks raise)")
    return p


def _int_list(text: str, flag: str, cap: int) -> list[int]:
    try:  # ASCII digits only (int() reads '٣' as 3); an empty item ("2,,3", "2,") is an error too
        vals = [integer(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or any(not 1 <= v <= cap for v in vals):
        raise UsageError(f"{flag} must be a comma list of world sizes (integers) in [1, {cap}], got {text!r}")
    return list(dict.fromkeys(vals))


def _earlier_output(path: str, head: bytes) -> bool:
    """Whether ``path`` is absent, or a regular file starting with ``head`` (an earlier run's; a PNG: one minizero
    marked, :mod:`minizero.pngs`)."""
    if not os.path.isfile(path):
        return not os.path.lexists(path)
    with open(path, "rb") as f:
        return f.read(len(head)) == head and (head != SIGNATURE or is_marked(path))


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check ``argv``. Raises :class:`UsageError` naming the bad value and what is allowed."""
    parser = build_parser()
    refuse_several_ranks(parser)  # each of mpiexec's ranks ran every job and wrote the same OUT/compare.*
    args = parser.parse_args(argv)
    if args.model not in PRESETS:
        raise UsageError(f"--model {args.model!r} is not a preset; allowed: {', '.join(sorted(PRESETS))}")
    args.ranks = _int_list(args.ranks, "--ranks", MAX_RANKS)
    for name in ("steps", "micro_batch_size"):
        if vars(args)[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {vars(args)[name]}")
    if not 0 < args.timeout <= 1e7:  # larger: subprocess's wait raises OverflowError (C time limits)
        raise UsageError(f"--timeout must be in (0, 1e7] seconds (about 4 months), got {args.timeout:g}")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    names = list(STRATEGIES) if names == ["all"] else names
    unknown = [s for s in names if s not in STRATEGIES]
    if not names or unknown:
        bad = f": unknown strategy {unknown[0]!r}" if unknown else f" names no strategy, got {args.strategies!r}"
        raise UsageError(f"--strategies{bad}; allowed: {', '.join(STRATEGIES)} (or all, alone)")
    args.strategies = list(dict.fromkeys(names))
    from minizero.train import UsageError as TrainUsageError, parse_args as train_args
    for n, name in ((n, name) for n in args.ranks for name in args.strategies):  # as the trainer checks, now
        try:
            train_args(train_argv(name, args.model, args.steps, args.micro_batch_size) + ["--no-save"], n)
        except TrainUsageError as e:
            raise UsageError(f"--strategies {name} at --ranks {n}: {e}") from None
    if not args.out or (os.path.exists(args.out) and not os.path.isdir(args.out)):  # '': train's refusal
        raise UsageError(f"--out {args.out!r} exists and is not a directory" if args.out else
                         "--out must name a directory, got ''")
    args.json = os.path.join(args.out, "compare.json") if args.json == "OUT/compare.json" else args.json  # default
    if os.path.abspath(args.json) in {os.path.abspath(os.path.join(args.out, f"compare.{e}")) for e in ("md", "png")}:
        raise UsageError(f"--json {args.json!r} is OUT/compare.md or .png; give another file path")
    if checkpoint_holding(os.path.realpath(os.path.join(args.out, "compare.md"))):
        raise UsageError(f"--out {args.out!r} is inside a checkpoint folder; give a folder outside every checkpoint")
    if os.path.realpath(args.json) == os.path.realpath(args.out):  # it failed after every run: 'it is a directory'
        raise UsageError(f"--json {args.json!r} would overwrite --out, the folder compare writes into; give a file")
    for name, head in (("compare.md", b"### minizero.compare"), ("compare.png", SIGNATURE)):  # OUT's own
        if not _earlier_output(path := os.path.join(args.out, name), head):  # a folder failed after every run
            raise UsageError(f"--out {args.out!r}: {path!r} is there and is not the {name} compare writes"
                             + (f", {MARKED}" if head == SIGNATURE else "") + "; it replaces only an earlier one: "
                             "move it away, or give another folder")
    folder = os.path.dirname(os.path.abspath(args.json))
    try:  # '', a directory, a full device, a file programs read back or in a checkpoint; a missing folder is not
        if folder != os.path.abspath(args.out) or os.path.isdir(folder):  # made (a typo), but OUT is, as train's
            existing_folder("--json", args.json, folder)
            check_output(args.json)
    except ValueError as e:  # train's UsageError too
        raise UsageError(str(e)) from None
    for flag, check, folder in (("--out", check_writable_folder, args.out), ("--json", check_writable_file, args.json)):
        try:  # the outputs are written after every run: a folder that takes no file (that name) is refused now
            check(folder)
        except OSError as e:
            raise UsageError(unwritable(flag, folder, e, "folder" if flag == "--out" else "file")) from None
    if args.device == "cuda":
        try:
            backend.cuda_device_count()
        except backend.DeviceError as e:
            raise UsageError(str(e)) from None
    return args


def main(argv=None) -> int:
    """Run the comparison; returns 0, 1 (some run failed), 2 (bad arguments, or no mpiexec) or 128 + the signal
    (130 for SIGINT/Ctrl-C, 143 for SIGTERM: the running job is killed, its temporary folder removed)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    except (Interrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"python -m minizero.compare: interrupted ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _main(argv=None) -> int:
    try:
        args = parse_args(argv)
        mpiexec = mpiexec_path()
        if mpiexec is None:
            raise UsageError("mpiexec not found beside this Python or on PATH (pip install mpich, or a system MPI)")
    except UsageError as e:
        print(error_lines("python -m minizero.compare", str(e)), file=sys.stderr)
        return 2
    cores = backend.usable_cores()
    if max(args.ranks) > cores:
        print(wrapped(f"python -m minizero.compare: note: --ranks {max(args.ranks)} exceeds the {cores} CPU core(s); "
                      "the ranks will be oversubscribed (slow, and tokens/s not comparable)"), file=sys.stderr)
    title = (f"minizero.compare: model {args.model!r}, {args.steps} step(s), "
             f"micro-batch {args.micro_batch_size} per rank")
    print(title, flush=True)
    from minizero.train import model_config, parse_args as train_args

    cfg = model_config(train_args(train_argv("baseline", args.model, 1, args.micro_batch_size) + ["--no-save"], 1))
    try:
        profile = hardware.measure(cfg, args.micro_batch_size, args.ranks, mpiexec)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # no prediction then; the memory comparison goes on
        profile = None
        print(wrapped(f"python -m minizero.compare: note: the hardware profile failed ({e}); no predicted step time"),
              file=sys.stderr, flush=True)
    if profile is not None:
        print(hardware_lines(profile), flush=True)
    runs, n_runs = [], len(args.ranks) * len(args.strategies)
    for n in args.ranks:
        for name in args.strategies:
            print(progress(len(runs) + 1, n_runs, dict(strategy=name, ranks=n)), flush=True)  # before minutes of work
            res = run_mpi(name, args.model, n, args.steps, args.micro_batch_size, args.timeout, mpiexec,
                          args.device)
            run = dict(strategy=name, ranks=n, flags=STRATEGIES[name][0], ok=res["ok"], wall_s=round(res["wall_s"], 2),
                       command=" ".join(res["command"]), estimate=estimate(name, args.model, n, args.micro_batch_size))
            if res["ok"]:
                s = res["summary"]
                per_rank = s["ledger_peak_bytes"]
                run["measured"] = dict(per_rank=per_rank, process_peak_bytes=s["process_peak_bytes"],
                                       optimizer_disk_bytes=[z.get("optimizer_disk_bytes", 0)
                                                             for z in s["zero"]["per_rank"]],
                                       setup_peak_bytes=s.get("ledger_setup_peak_bytes"),
                                       tokens_per_s=s["tokens_per_s"], bytes_sent=s["bytes_sent"])
                run["deviation"] = deviations(per_rank, run["estimate"])
                run["step_s"] = s["elapsed_s"] / args.steps
                if profile is not None:
                    run["predicted_step_s"] = predict_step_s(name, args.model, n, args.micro_batch_size, profile)
                run["within_tolerance"] = all(run["deviation"][c] <= TOLERANCE for c in CHECKED)
            else:
                run["error"] = res["error"]
            runs.append(run)  # as it ends, one short line (ok: to stdout; failed, with its cause: to stderr)
            print(progress(len(runs), n_runs, run), file=sys.stdout if run["ok"] else sys.stderr, flush=True)
    table = markdown(runs, f"### {title}", {n: d for n, (_, d) in STRATEGIES.items()},
                     hardware_line(profile) if profile is not None else None)
    print("\n" + terminal(runs), flush=True)
    md, png = os.path.join(args.out, "compare.md"), os.path.join(args.out, "compare.png")
    any_ok = any(r["ok"] for r in runs)
    result = dict(model=args.model, steps=args.steps, micro_batch_size=args.micro_batch_size, ranks=args.ranks,
                  strategies=args.strategies, tolerance=TOLERANCE, units="bytes", runs=runs,
                  hardware=None if profile is None else profile.as_dict())
    text = json.dumps(jsons.summary(result), indent=1)
    try:
        atomic_write(md, lambda f: f.write(table), mode="w")
        wrote_png = any_ok and plot(runs, png, title)
        atomic_write(args.json, lambda f: f.write(text), mode="w")
    except WriteError as e:  # a full disk, a read-only folder: the previous files are left as they were
        print(error_lines("python -m minizero.compare", str(e.strerror)), file=sys.stderr)
        return 1
    why = "no run succeeded" if not any_ok else "matplotlib is not installed; pip install matplotlib"
    print(wrapped(f"\nthe whole table (memory by category, measured / estimated; what each column means): {md}\n"
                  f"also wrote {args.json}" + (f", {png}" if wrote_png else f" (no PNG: {why})")))
    failed = [r for r in runs if not r["ok"]]
    off = [r for r in runs if r["ok"] and not r["within_tolerance"]]
    for r in off:
        bad = ", ".join(f"{c} {r['deviation'][c]:.1%}" for c in CHECKED if r["deviation"][c] > TOLERANCE)
        print(wrapped(f"note: {r['strategy']} at {r['ranks']} rank(s): the estimate is off by more than "
                      f"{TOLERANCE:.0%} ({bad})"), file=sys.stderr)
    if failed:
        print(wrapped(f"{len(failed)} of {len(runs)} run(s) failed: "
                      + ", ".join(f"{r['strategy']}@{r['ranks']}" for r in failed)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(interruptible("minizero.compare", WHOLE, main))
