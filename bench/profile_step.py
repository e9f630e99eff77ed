"""Where minizero's training step spends its time, beside PyTorch's whole step (what limits the ratio).

    python bench/profile_step.py --batch 8,32

The step of ``bench/bench_vs_torch.py`` (default model, float32, AdamW), run ``--steps`` times under
``cProfile`` after a warm-up; each function's own time is put in one of four parts:

    matmul        minizero/backend.py's BLAS call (NumPy's ``matmul`` on OpenBLAS)
    elementwise   NumPy's ufuncs, reductions, copies and casts, and the own time of the kernels in
                  minizero/autograd/ (kernels.py, functional.py, ops.py): cProfile does not see ``a + b``
                  on arrays as a call, so a kernel's array arithmetic is its own time
    optimizer     AdamW's update (its NumPy calls are counted here, not under elementwise)
    python        everything else: the tape, modules, hooks, argument checks

Printed per batch: seconds per step of each part, minizero's step without the profiler, PyTorch's step
(when installed) and the ratio PyTorch would need minizero's matmuls alone to beat. cProfile slows the
Python part, so the parts are shares of the profiled step, scaled to the unprofiled step time.

    python bench/profile_step.py --precision fp32,fp16 --batch 8

profiles the main job's loop instead (``minizero.loop.train`` with its default callbacks, one process,
micro-batch ``--batch``, the steps after ``--warmup``) in each precision, with one part more:

    casts         float16 <-> float32 conversions: everything below ``backend.widen`` and ``backend.narrow``
                  (the share of a function's own time below them follows cProfile's callers, level by level)

    python bench/profile_step.py --precision fp16,fp32 --device cuda --model gpt2

does the same on the GPU: the step time from an unprofiled run (the device synchronized at the loop's end),
the parts from a second run in a child process with ``CUDA_LAUNCH_BLOCKING=1``, so that each kernel's time
is the own time of the Python call that launched it (matmul: minizero's cuBLAS calls; elementwise: CuPy's
kernels, its Python-level functions included; python: everything else, host time that the unprofiled
run may overlap with the GPU's work). The parts are shares of that serialized run, scaled to the step.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _args  # noqa: E402
import _machine  # noqa: E402
from bench_vs_torch import MinizeroSide, import_torch, torch_side  # noqa: E402

from minizero.nn import get_config  # noqa: E402

PARTS = ("matmul", "elementwise", "optimizer", "python")
MAX_STEPS = 10_000  #: --steps and --warmup at most this many
CAST_PARTS = ("matmul", "casts", "elementwise", "optimizer", "python")


def part_of(filename: str, name: str, under_adamw: bool) -> str:
    """The part a profiled function's own time belongs to."""
    if (filename.endswith("minizero/backend.py") and name in ("_blas_matmul", "_cupy_matmul")) or (
            filename == "~" and "cublas" in name):
        return "matmul"
    if under_adamw:
        return "optimizer"
    if filename == "~" and ("numpy" in name or "ufunc" in name or "ndarray" in name or "cupy" in name):
        return "elementwise"
    if "/cupy/" in filename:  # CuPy's functions written in Python (where, zeros, concatenate): their kernels
        return "elementwise"
    if any(filename.endswith(f"minizero/autograd/{k}.py") for k in ("kernels", "functional", "ops")):
        return "elementwise"
    return "python"


def share_below(stats: dict, roots: set) -> dict:
    """{function: share of its own time spent in calls below one of ``roots`` (1.0 for a root)}.

    cProfile keeps one level of callers with the own time each gave: a function's share is its callers' shares,
    weighted by that time (by the cumulative time where its own is 0), propagated until it settles. An
    approximation: a caller's calls below a root are taken to be its own time's share."""
    share = {key: float(key in roots) for key in stats}
    for _ in range(50):
        for key, (_, _, own, _, callers) in stats.items():
            weights = {who: c[2] if own > 0 else c[3] for who, c in callers.items()}
            total = sum(weights.values())
            if key not in roots and total > 0:
                share[key] = min(1.0, sum(w * share.get(who, 0.0) for who, w in weights.items()) / total)
    return share


def step_seconds(fn, batches, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``fn`` on the batches in turn."""
    times = []
    for s in range(steps):
        t = time.perf_counter()
        fn(*batches[s % len(batches)])
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def profile(batch: int, steps: int) -> dict:
    cfg = get_config("default")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (batch, cfg.block_size)), rng.integers(0, 256, (batch, cfg.block_size)))
               for _ in range(4)]
    side = MinizeroSide(cfg)
    for s in range(3):  # warm-up
        side.step(*batches[s % 4])
    plain = step_seconds(side.step, batches, steps)
    pr = cProfile.Profile()
    pr.enable()
    for s in range(steps):
        side.step(*batches[s % 4])
    pr.disable()
    stats = pstats.Stats(pr).stats
    adamw = {key for key in stats if key[0].endswith("minizero/optim/adamw.py")}
    parts = dict.fromkeys(PARTS, 0.0)
    for key, (_, _, own, _, callers) in stats.items():
        under = key in adamw or any(c in adamw for c in callers)
        parts[part_of(key[0], key[2], under)] += own
    total = sum(parts.values())
    out = {p: plain * v / total for p, v in parts.items()}  # shares of the profiled step, scaled to the plain one
    out["minizero"] = plain
    tstep = torch_side(cfg)
    if tstep is not None:
        for s in range(6):  # PyTorch's first steps warm its allocator and kernels
            tstep(*batches[s % 4])
        out["pytorch"] = step_seconds(tstep, batches, steps)
    return out


def split_parts(stats: dict, parts: tuple, scale: float) -> dict:
    """Own times of ``stats`` summed into ``parts`` (casts first, then AdamW, then :func:`part_of`), scaled so
    they add up to ``scale`` seconds."""
    def named(file_end, *names):
        return {k for k in stats if k[0].endswith(file_end) and (not names or k[2] in names)}
    below_casts = share_below(stats, named("minizero/backend.py", "widen", "narrow"))
    below_adamw = share_below(stats, named("minizero/optim/adamw.py"))
    out = dict.fromkeys(parts, 0.0)
    for key, (_, _, own, _, _) in stats.items():
        cast = own * below_casts[key] if "casts" in parts else 0.0
        adamw = (own - cast) * below_adamw[key]
        if cast:
            out["casts"] += cast
        out["optimizer"] += adamw
        out[part_of(key[0], key[2], False)] += own - cast - adamw
    total = sum(out.values())
    return {p: scale * v / total for p, v in out.items()}


class ProfiledSteps:
    """The main job's default callbacks, with the steps after ``warmup`` run under ``profiler`` and timed
    (``seconds``: from the first of them to the loop's end, before its final validation)."""

    def __init__(self, profiler, warmup: int):
        self.profiler, self.warmup, self.seen, self.callbacks = profiler, warmup, 0, None
        self.started = self.seconds = None

    def __getattr__(self, point):  # every other callback point goes to the default callbacks
        return getattr(self.callbacks, point)

    def setup(self, run):
        from minizero.callbacks import CallbackList
        from minizero.instrumentation import default_callbacks

        self.callbacks = CallbackList(default_callbacks(run))
        self.callbacks.setup(run)

    def on_step_start(self, run, step):
        self.callbacks.on_step_start(run, step)
        self.seen += 1
        if self.seen == self.warmup + 1:
            self.started = time.perf_counter()
            self.profiler.enable()

    def on_step_end(self, run, step, record):
        self.callbacks.on_step_end(run, step, record)

    def on_train_end(self, run):  # the steps are over: the final validation and the report are not timed
        from minizero import backend

        backend.synchronize()
        self.profiler.disable()
        self.seconds = time.perf_counter() - self.started
        self.callbacks.on_train_end(run)


def main_job_argv(precision: str, batch: int, steps: int, warmup: int, device: str, model: str) -> list:
    """The main job's command line that :func:`profile_main_job` runs (one process, no evaluation or saving)."""
    return ["--model", model, "--device", device, "--steps", str(warmup + steps), "--micro-batch-size", str(batch),
            "--precision", precision, "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--no-save",
            "--sample-tokens", "0", "--warmup", "0", "--dropout", "0"]


class NoProfiler:
    """Stands in for cProfile in the timed run: ``enable``/``disable`` do nothing."""

    def enable(self):
        pass

    def disable(self):
        pass


def run_main_job(argv: list, warmup: int, profiler=None) -> tuple[float, cProfile.Profile]:
    """(seconds from the first step after ``warmup`` to the loop's end, the profiler) of one main-job run;
    ``profiler`` None: timed without one."""
    from minizero.comm import run_in_threads
    from minizero.loop import train
    from minizero.train import parse_args

    def run(comm):  # in the communicator's thread, which CuPy's current device belongs to
        from minizero import backend

        args = parse_args(argv, 1)
        backend.set_device(args.device)  # as python -m minizero.train does before the loop
        hook = ProfiledSteps(profiler or NoProfiler(), warmup)
        try:
            train(args, comm, log=lambda line: None, callbacks=[hook])
        finally:
            backend.set_device("cpu")
        return hook.seconds, hook.profiler
    return run_in_threads(1, run)[0]


CHILD_TIMEOUT_S = 1800  #: the profiled child's limit (a hung GPU run must not hang the benchmark)


def profile_main_job(precision: str, batch: int, steps: int, warmup: int, device: str = "cpu",
                     model: str = "default", threads: int | None = None, default_malloc: bool = False) -> dict:
    """{part: seconds per step} of the main job's loop in ``precision`` (one process, micro-batch ``batch``).

    ``device`` "cuda" (and "strict", which stands in for it in the tests): the profiled run is a child process
    with ``CUDA_LAUNCH_BLOCKING=1`` (set before CUDA starts), which writes its profile to a file; it runs
    under this process's BLAS ``threads`` and malloc setting (``default_malloc``).
    Raises RuntimeError: the child failed or ran past :data:`CHILD_TIMEOUT_S`."""
    import json
    import subprocess
    import tempfile

    argv = main_job_argv(precision, batch, steps, warmup, device, model)
    plain = run_main_job(argv, warmup)[0] / steps
    if device == "cpu":
        stats = pstats.Stats(run_main_job(argv, warmup, cProfile.Profile())[1]).stats
    else:
        if device == "cuda":  # the child needs the GPU memory this process's pool still holds
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "steps.prof")
            spec = json.dumps([argv, warmup, path, threads, default_malloc])
            try:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--profile-worker", spec],
                                      capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                                      env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the profiled run took over {CHILD_TIMEOUT_S} s and was stopped") from None
            if done.returncode:
                raise RuntimeError(f"the profiled run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
            stats = pstats.Stats(path).stats
    out = split_parts(stats, CAST_PARTS, plain)
    out["minizero"] = plain
    return out


def profile_worker(spec: str) -> None:
    """The child of :func:`profile_main_job` on CUDA: runs the main job under cProfile, dumps the stats."""
    import json

    argv, warmup, path, threads, default_malloc = json.loads(spec)
    _machine.set_malloc(default_malloc)
    with threadpool_limits(threads):
        run_main_job(argv, warmup, cProfile.Profile())[1].dump_stats(path)


def gpu_name() -> str:
    """GPU 0's name as CuPy reports it, with CuPy's version."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return f"{name.decode() if isinstance(name, bytes) else name}, CuPy {cupy.__version__}"


def main_precision(precisions: list, batch: int, steps: int, warmup: int, device: str = "cpu",
                   model: str = "default", threads: int | None = None, default_malloc: bool = False) -> None:
    rows = [(p, profile_main_job(p, batch, steps, warmup, device, model, threads, default_malloc))
            for p in precisions]
    where = f" | {gpu_name()}, CUDA_LAUNCH_BLOCKING=1 in the profiled run" if device == "cuda" else ""
    print(_machine.header() + where + f" | --model {model}, micro-batch {batch}, {steps} steps after {warmup} | "
          "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("| precision | " + " | ".join(f"{k}, s" for k in CAST_PARTS) + " | step, s | step / first row's |")
    print("|---|" + "---:|" * (len(CAST_PARTS) + 2))
    for p, r in rows:
        print(f"| {p} | " + " | ".join(f"{r[k]:.3f}" for k in CAST_PARTS) + f" | {r['minizero']:.3f} | "
              f"{r['minizero'] / rows[0][1]['minizero']:.2f} |")


def main() -> None:
    p = _args.parser(__doc__)
    p.add_argument("--batch", type=_args.micro_batches, default=None, help="comma-separated batch sizes (sequences "
                   "of 128 bytes), each once; default 8,32 (--precision: 8)")
    p.add_argument("--steps", type=_args.between(1, MAX_STEPS), default=6,
                   help="profiled steps (and timed steps of each side)")
    p.add_argument("--threads", type=_args.threads, default=_machine.cores(), help="BLAS / torch intra-op threads")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (default: keep freed memory, as the main job does)")
    p.add_argument("--precision", default=None, help="comma-separated precisions (fp32, fp16): profile the "
                   "main job's loop in each, with casts as a part, instead of the library step against PyTorch")
    p.add_argument("--warmup", type=_args.between(0, MAX_STEPS), default=2,
                   help="--precision: steps run before the profiled ones")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "strict"],
                   help="--precision: where the main job runs (cuda: CuPy on GPU 0)")
    p.add_argument("--model", type=_args.preset, default="default",
                   help="(read by --precision; e.g. gpt2 on a GPU)")
    p.add_argument("--profile-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.precision is None and (args.device != "cpu" or args.model != "default"):
        p.error("--device and --model profile the main job's loop: give --precision too")
    batches = args.batch or ([8] if args.precision else [8, 32])
    twice = [b for i, b in enumerate(batches) if b in batches[:i]]
    if twice:
        p.error(f"--batch gives {twice[0]} twice; allowed: each batch size once")
    if args.precision is not None:
        precisions = args.precision.split(",")
        if not set(precisions) <= {"fp32", "fp16"} or len(set(precisions)) != len(precisions):
            p.error(f"--precision takes fp32 and fp16, each once, separated by commas, got {args.precision!r}")
        if len(batches) > 1:
            p.error(f"--precision profiles one --batch, got {','.join(map(str, batches))!r}")
    if args.profile_worker:  # profile_main_job's child on CUDA: its flags are checked first, as the others are
        profile_worker(args.profile_worker)
        return
    if args.precision is not None and args.device == "cuda":
        from minizero import backend
        try:
            backend.cuda_device_count()
        except backend.DeviceError as e:
            p.error(str(e))
    malloc = _machine.set_malloc(args.default_malloc)  # every flag checked: set-up and work from here
    if args.precision is not None:
        with threadpool_limits(args.threads):
            main_precision(precisions, batches[0], args.steps, args.warmup, args.device, args.model,
                           args.threads, args.default_malloc)
        print(malloc)
        return
    torch = import_torch()
    if torch is not None:
        torch.set_num_threads(args.threads)
    with threadpool_limits(args.threads):
        rows = [(b, profile(b, args.steps)) for b in batches]
        print(_machine.header() + " | " + malloc)
    print("| batch | matmul, s | elementwise, s | optimizer, s | python, s | minizero step, s | PyTorch step, s | "
          "matmul / PyTorch step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for b, r in rows:
        torch_cell = f"{r['pytorch']:.3f}" if "pytorch" in r else "-"
        ratio = f"{r['matmul'] / r['pytorch']:.2f}" if "pytorch" in r else "-"
        print(f"| {b} | " + " | ".join(f"{r[k]:.3f}" for k in PARTS) + f" | {r['minizero']:.3f} | {torch_cell} | "
              f"{ratio} |")
    if torch is None:  # before: dashes without a word why
        print("PyTorch is not installed here: its columns are '-' (pip install torch, the CPU wheel)")


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
