"""The device check of the GPU path: equality with NumPy, MPI and NCCL, then throughput.

    python bench/gpu_check.py [--json gpu_check.json] [--peak-tflops 989.5,66.9] [--budget-s 450]

One run, one GPU, under 8 minutes (each part has a time limit; what the budget leaves out is
reported "not run"). It runs the training command line (``python -m minizero.train``) and
compares its outputs (``--json`` summary, ``model.npz``):

0. minizero's float16 products (cuBLAS half GEMMs) equal float32 products of the same values within
   float16's rounding of the result.
1. float64 training on CuPy equals NumPy: ``--device cuda`` against ``--device cpu``, 5 steps,
   the tiny and the default model, dropout 0.1 (the masks are integer arithmetic on the device, addressed by
   site and batch row: the same bits on any array module and any layout); every loss and every final weight
   within 1e-9.
2. ``mpiexec -n 2`` on one GPU with the MPI communicator (``--comm mpi``: device buffers stage
   through host memory) equals one process at the same global batch.
3. NCCL: training with ``--comm nccl`` at world size 1 equals ``--comm mpi``; the hand-written
   ring/recursive-doubling and NCCL's native collectives (``--native-comm``) equal NumPy at world
   size 1, and at 2 ranks when at least 2 GPUs exist (NCCL allows one rank per GPU; the table says
   plainly when there is only one).
4. Throughput of the gpt2 preset (124M parameters) at batch 8 x 1024, FP16 (mixed precision) and
   FP32: after one untimed 1-step warm-up run per precision (CuPy compiles its kernels on first use
   and caches them on disk), tokens/s from the difference of two runs' ``elapsed_s`` (K and K+S
   steps, so start-up and the closing evaluation cancel; a difference <= 0 is an error), and MFU = model FLOPs per step
   (Korthikanti et al. 2022, ``minizero.memory.estimator.model_flops_per_step``) / step time /
   the GPU's peak; beside PyTorch eager (bench/bench_vs_torch.py's nanoGPT model; autocast +
   GradScaler for FP16) on the same GPU when PyTorch with CUDA is installed, in its own process.

Every row runs in its own try, in its own process group (killed whole at its time limit), within
the budget. It prints a Markdown table and writes JSON (``--json``). Without CuPy and without a GPU
(no ``nvidia-smi`` listing one) it says so, marks every row "not run" and exits 0; where
``nvidia-smi`` lists a GPU but CuPy, its CUDA runtime or NCCL will not load, it prints one line and
exits 3 (a broken install is not "no GPU"); it exits 1 when a check ran and failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing
from minizero import jsons  # noqa: E402
from minizero.files import atomic_write, check_writable_file  # noqa: E402
from minizero.overwrite import refuse_blocking, refuse_foreign, refuse_read_back, refuse_slash_or_dangling  # noqa: E402
from minizero.temporaries import unwritable  # noqa: E402
from minizero.streams import check_stream, stream_fd  # noqa: E402
from minizero.interrupts import run_group, start_mpi  # noqa: E402
from minizero.numerals import integer, real  # noqa: E402

sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
import _args  # noqa: E402  (the parser every bench script has)
import _machine  # noqa: E402  (the source line every benchmark prints)

#: dense peak FLOP/s (FP16/BF16 tensor cores, FP32 without tensor cores) from the vendors' data sheets,
#: keyed by a substring of the device name; --peak-tflops overrides
PEAKS = {"H200": (989.5e12, 66.9e12), "H100": (989.5e12, 66.9e12), "A100": (312e12, 19.5e12),
         "V100": (125e12, 15.7e12)}
TOL = 1e-9
SHORT = ["--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--dropout", "0"]
#: the equality runs (rows 1-3): float64, 5 steps, with dropout (the generator's uint64 arithmetic on CuPy)
EQUAL = ["--dtype", "float64", "--steps", "5", *SHORT, "--dropout", "0.1"]
CHECKS = ["float16 matmul == float32 matmul", "cupy == numpy, tiny", "cupy == numpy, default",
          "mpiexec -n 2 (--comm mpi) == 1 process",
          "--comm nccl == --comm mpi, 1 rank", "NCCL collectives, 1 rank", "NCCL collectives, 2 ranks",
          "gpt2 8x1024 fp16", "gpt2 8x1024 fp32"]


INSTALL = 'pip install -e ".[gpu]" (CUDA 12) or ".[gpu-cuda13]"; see docs/gpu.md'


def gpus_listed() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (0 without nvidia-smi, or when it fails: no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def probe() -> tuple[dict | None, str]:
    """``({"name", "count", "cupy", "cuda_runtime", "nccl"}, "")`` of GPU 0, or ``(None, why not)``.

    Raises:
        SystemExit: ``nvidia-smi`` lists a GPU but CuPy, its CUDA runtime or NCCL will not load (one line).
    """
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            raise RuntimeError("CuPy sees no CUDA device")
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            raise ImportError("CuPy is installed without NCCL (cupy.cuda.nccl.available is False)")
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return {"name": name, "count": count, "cupy": cupy.__version__, "nccl": nccl.get_version(),
                "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()}, ""
    except Exception as e:  # ImportError (no CuPy, no NCCL), CUDARuntimeError (no driver, no device)
        detail = f"{type(e).__name__}: {first_line(e)}"
    listed = gpus_listed()
    if listed:
        raise SystemExit(f"gpu_check: nvidia-smi lists {listed} GPU(s) but CuPy or NCCL will not load "
                         f"({detail}); {INSTALL}")
    what = "CuPy not installed" if detail.startswith(("ImportError", "ModuleNotFoundError")) else "CuPy sees none"
    return None, f"no GPU: nvidia-smi lists none and {what} ({detail}); on a machine with one, {INSTALL}"


def versions() -> dict:
    """{package: version} of Python, NumPy and, where installed, CuPy, mpi4py and PyTorch."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for name, dist in (("cupy", None), ("mpi4py", "mpi4py"), ("torch", "torch")):
        try:
            if dist is None:  # CuPy's distribution is named for its CUDA version (cupy-cuda12x, ...)
                import cupy
                out[name] = cupy.__version__
            else:
                out[name] = md.version(dist)
        except Exception:  # not installed, or will not load: left out
            pass
    return out


def first_line(e) -> str:
    """The first non-empty line of an exception's message (or of a text); never raises, never empty."""
    text = str(e) if not isinstance(e, BaseException) else (str(e) or repr(e))
    return next((line for line in text.splitlines() if line.strip()), "") or "(no message)"


class Runner:
    """Runs commands under one time budget; a command past its share is killed and reported."""

    def __init__(self, budget_s: float, workdir: str):
        self.deadline, self.workdir, self.count = time.monotonic() + budget_s, workdir, 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def train(self, args: list[str], ranks: int = 1, limit_s: float = 180, weights: bool = True) -> dict:
        """One ``minizero.train`` run: its summary, plus ``weights`` (name -> array) when asked. Raises RuntimeError."""
        self.count += 1
        out = os.path.join(self.workdir, f"run{self.count}")
        cmd = [sys.executable, "-m", "minizero.train", *args, "--out", out, "--json", out + ".json"]
        if ranks > 1:
            cmd = [mpiexec(), "-n", str(ranks), *cmd]
        self.run(cmd, limit_s)
        with open(out + ".json") as f:
            summary = json.load(f)
        if weights:
            with np.load(os.path.join(out, "model.npz")) as z:
                summary["weights"] = {k: z[k] for k in z.files}
        shutil.rmtree(out, ignore_errors=True)
        return summary

    def run(self, cmd: list[str], limit_s: float) -> str:
        limit = min(limit_s, self.left())
        if limit < 5:
            raise TimeoutError("not run: the time budget (--budget-s) is spent")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH")] if p))
        try:  # its own session: a timeout, SIGTERM or Ctrl-C kills mpiexec's ranks too, not only mpiexec
            proc = run_group(cmd, timeout=limit, env=env, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {limit:.0f} s (process group killed): {' '.join(cmd[-12:])}") from None
        if proc.returncode:
            raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-1500:]}")
        return proc.stdout


def mpiexec() -> str:
    """``mpiexec`` next to this Python (the venv's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


def max_difference(a: dict, b: dict) -> float:
    """Largest absolute difference over the losses and every weight of two runs."""
    diff = float(np.max(np.abs(np.subtract(a["train_loss"], b["train_loss"]))))
    for k, w in a["weights"].items():
        diff = max(diff, float(np.max(np.abs(w.astype(np.float64) - b["weights"][k]), initial=0.0)))
    return diff


def equal_runs(runner, first: list[str], second: list[str], ranks=(1, 1)) -> tuple[str, str]:
    d = max_difference(runner.train(first, ranks[0]), runner.train(second, ranks[1]))
    return ("pass" if d <= TOL else "FAIL"), f"max |difference| of losses and weights {d:.1e} (tolerance {TOL:g})"


def half_gemms(backend_name: str) -> tuple[str, str]:
    """``backend.matmul`` on float16 operands (a 2-D GEMM with a transposed operand, a (B, T, K) stack, an
    attention batch and its transposed-operand forms) against the float32 product of the same values: every
    element within float16's rounding of the result (relative 2^-11, 2^-10 allowed for the accumulation order),
    dtype float16; and shapes that do not multiply raise ValueError, an empty operand gives an empty product.
    ``backend_name``: "cupy" on the GPU (CuPy's ``@`` would widen batches to float32; minizero calls cuBLAS's
    half GEMMs), "numpy" in the tests. The results only: a slow path that computes them passes too."""
    from minizero import backend

    before = backend.name
    backend.set_backend(backend_name)
    try:
        xp, worst, rng = backend.xp, 0.0, np.random.default_rng(0)
        half = lambda *shape: xp.asarray(rng.standard_normal(shape).astype(np.float16))  # noqa: E731
        cases = [(half(64, 96), half(80, 96).T), (half(4, 33, 96), half(96, 80)),
                 (half(2, 3, 33, 64), xp.swapaxes(half(2, 3, 40, 64), -1, -2)),
                 (xp.swapaxes(half(2, 3, 64, 33), -1, -2), half(2, 3, 64, 40))]
        for a, b in cases:
            got = backend.matmul(a, b)
            want = backend.to_host(a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
            if got.dtype != np.float16 or got.shape != want.shape:
                return "FAIL", f"{got.dtype} {got.shape} for {a.shape} @ {b.shape}, not float16 {want.shape}"
            err = np.abs(backend.to_host(got).astype(np.float64) - want) / (np.abs(want) + 1e-2)
            worst = max(worst, float(err.max()))
        empty = backend.matmul(half(2, 3, 4, 5), half(2, 3, 5, 0))
        if empty.shape != (2, 3, 4, 0):
            return "FAIL", f"an empty operand's product has shape {empty.shape}, not (2, 3, 4, 0)"
        try:
            backend.matmul(half(2, 3, 4, 5), half(2, 3, 6, 7))
            return "FAIL", "(2, 3, 4, 5) @ (2, 3, 6, 7) did not raise: K = 5 against 6"
        except ValueError:
            pass
    finally:
        backend.set_backend(before)
    return ("pass" if worst <= 2 ** -10 else "FAIL"), (f"2-D, (B, T, K) @ (K, N) and batched, transposed operands: "
                                                       f"max relative |difference| {worst:.1e} (2^-10)")


# --------------------------------------------------------------------------- NCCL collectives (worker)
def nccl_worker(path: str, nccl=None, cuda=None) -> None:
    """Under mpiexec: the hand-written and native collectives on NCCL against NumPy; rank 0 writes ``path``.

    ``nccl``/``cuda``: stand-ins for ``cupy.cuda.nccl``/``cupy.cuda`` (tests/fake_nccl.py, on strict device
    arrays, as it takes no NumPy); None: the real ones, on GPU ``rank``.
    """
    from minizero import backend
    from minizero.comm import all_gather, all_reduce, broadcast, reduce_scatter, shard_range
    from minizero.comm.mpi import MPICommunicator
    from minizero.comm.nccl import NcclCommunicator, use_local_device

    mpi = MPICommunicator()
    if nccl is None:
        device = use_local_device(mpi.rank)  # one node: the world rank is the local rank
        set_device = getattr(backend, "set_device", None)
        set_device("cuda", device) if set_device else backend.set_backend("cupy")
    else:
        backend.set_backend("strict")  # the fake takes device arrays only (host arrays would bypass it)
    comm, N, r, worst, sent = NcclCommunicator(mpi, nccl=nccl, cuda=cuda), mpi.world_size, mpi.rank, 0.0, {}
    for n in (1, N + 1, 1000, 2 ** 16 + 3, 2 ** 20):
        xs = [np.random.default_rng([q, n]).standard_normal(n) for q in range(N)]
        total, (off, size) = np.sum(xs, axis=0), shard_range(n, N, r)
        gathered = np.concatenate([xs[q][slice(shard_range(n, N, q)[0], sum(shard_range(n, N, q)))]
                                   for q in range(N)])
        x = backend.xp.asarray(xs[r])
        for native in (False, True):
            comm.traffic.reset()
            got = [all_reduce(comm, x, native=native), reduce_scatter(comm, x, native=native),
                   all_gather(comm, x[off:off + size].copy(), n, native=native),
                   broadcast(comm, x.copy(), root=N - 1, native=native)]
            sent[native] = comm.traffic.snapshot()["bytes_sent"]
            want = [total, total[off:off + size], gathered, xs[N - 1]]
            worst = max([worst] + [float(np.max(np.abs(backend.to_host(g) - w), initial=0.0))
                                   for g, w in zip(got, want)])
        if sent[False] != sent[True]:
            worst = float("inf")
    errors = mpi.mpi_comm.gather(worst, root=0)
    if r == 0:
        with open(path, "w") as f:
            json.dump({"max_error": max(errors), "world_size": N}, f)


def nccl_collectives(runner, ranks: int) -> tuple[str, str]:
    path = os.path.join(runner.workdir, f"nccl{ranks}.json")
    runner.run([mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--nccl-worker", path], 120)
    with open(path) as f:
        err = json.load(f)["max_error"]
    ok = err <= 1e-12
    note = (f"ring, recursive doubling and native all-reduce / reduce-scatter / all-gather / "
            f"broadcast, float64, max |error| {err:.1e} (1e-12); ledgers equal" if ok else
            f"max |error| {err:.1e} or ring and native ledgers differ")
    return ("pass" if ok else "FAIL"), note


# --------------------------------------------------------------------------- throughput
def throughput(runner, precision: str, peak: float | None, steps: tuple[int, int]) -> tuple[str, str, dict]:
    """minizero's tokens/s and MFU for gpt2 at 8 x 1024 in ``precision``, and PyTorch eager's beside it."""
    from minizero.memory.estimator import model_flops_per_step
    from minizero.nn import get_config

    cfg, batch = get_config("gpt2"), 8
    base = ["--device", "cuda", "--model", "gpt2", "--micro-batch-size", str(batch), "--precision", precision,
            *SHORT, "--no-overlap"]
    runner.train(base + ["--steps", "1"], limit_s=240, weights=False)  # untimed warm-up: CuPy compiles kernels
    runs = [runner.train(base + ["--steps", str(k)], limit_s=150, weights=False) for k in steps]
    step_s = (runs[1]["elapsed_s"] - runs[0]["elapsed_s"]) / (steps[1] - steps[0])
    if not step_s > 0:
        raise RuntimeError(f"step time {step_s:.3g} s <= 0 ({steps[1]} steps took {runs[1]['elapsed_s']:.2f} s, "
                           f"{steps[0]} took {runs[0]['elapsed_s']:.2f} s): the runs' difference is noise; "
                           "raise --steps")
    flops, tokens = model_flops_per_step(cfg, batch), batch * cfg.block_size
    row = {"precision": precision, "minizero_tokens_per_s": tokens / step_s,
           "minizero_mfu": flops / step_s / peak if peak else None, "peak_flops": peak}
    try:  # the PyTorch side: its own try, its own process, within the budget
        torch_s, torch_note = torch_step_s(precision, runner), "PyTorch with CUDA not installed"
    except Exception as e:
        torch_s, torch_note = None, "PyTorch side " + ("not run (the time budget is spent)"
                                                       if isinstance(e, TimeoutError)
                                                       else f"failed ({type(e).__name__}: {first_line(e)})")
    if torch_s is not None:
        row.update(pytorch_tokens_per_s=tokens / torch_s, pytorch_mfu=flops / torch_s / peak if peak else None)
    mfu = "MFU -" if not peak else f"MFU {row['minizero_mfu']:.1%}"
    text = f"minizero {row['minizero_tokens_per_s']:,.0f} tokens/s, {mfu}"
    if torch_s is not None:
        text += (f"; PyTorch eager {row['pytorch_tokens_per_s']:,.0f} tokens/s"
                 + (f", MFU {row['pytorch_mfu']:.1%}" if peak else ""))
    else:
        text += "; " + torch_note
    return "measured", text, row


def torch_step_s(precision: str, runner) -> float | None:
    """Median seconds of a PyTorch eager gpt2 step at 8 x 1024 on the GPU (a child process, killed at its
    limit), or None without torch + CUDA. Raises RuntimeError (the child failed or timed out)."""
    if runner.left() < 30:
        raise TimeoutError("not run: the time budget (--budget-s) is spent")
    out = runner.run([sys.executable, os.path.abspath(__file__), "--torch-worker", precision], 120)
    step_s = json.loads(out.strip().splitlines()[-1])["step_s"]
    if step_s is not None and not step_s > 0:
        raise RuntimeError(f"PyTorch step time {step_s} s <= 0")
    return step_s


def torch_worker(precision: str, steps: int = 10) -> None:
    """Prints ``{"step_s": median seconds}`` of PyTorch eager steps (``null`` without torch + CUDA)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(json.dumps({"step_s": None}))
        return
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    from bench_vs_torch import torch_side
    from minizero.nn import get_config

    cfg, batch = get_config("gpt2"), 8
    step = torch_side(cfg, device="cuda", fp16=precision == "fp16")
    rng = np.random.default_rng(0)
    idx, tg = (rng.integers(0, 256, (batch, cfg.block_size)) for _ in range(2))
    times = []
    for s in range(steps + 2):  # two untimed warm-up steps
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(idx, tg)
        torch.cuda.synchronize()
        if s >= 2:
            times.append(time.perf_counter() - t)
    print(json.dumps({"step_s": float(np.median(times))}))


# --------------------------------------------------------------------------- main
def parse_peak(text: str | None, name: str) -> tuple[float | None, float | None]:
    """(FP16, FP32) peak FLOP/s: ``--peak-tflops X`` (both) or ``X,Y``, else :data:`PEAKS` by name."""
    if text:
        try:
            vals = [real(v) * 1e12 for v in text.split(",")]  # ASCII only: not '１' nor '1_0'
        except ValueError:
            vals = []
        if len(vals) not in (1, 2) or not all(0 < v < float("inf") for v in vals):
            raise SystemExit(f"--peak-tflops {text!r}: give one or two positive finite numbers, FP16[,FP32]")
        return vals[0], vals[-1]
    return next((p for key, p in PEAKS.items() if key in name), (None, None))


def check_flags(parser, args) -> tuple[int, int]:
    """Every flag, before the probe and any run (``parser.error``: one line, exit 2); returns ``--steps`` (K, K+S)."""
    try:
        parse_peak(args.peak_tflops, "")
    except SystemExit as e:
        parser.error(str(e))
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        parser.error(f"--budget-s must be a number of seconds in (0, {MAX_BUDGET_S}], got {args.budget_s}")
    try:
        steps = tuple(integer(s) for s in args.steps.split(","))
    except ValueError:
        steps = ()
    if len(steps) != 2 or not 1 <= steps[0] < steps[1] <= MAX_STEPS:
        parser.error(f"--steps {args.steps!r}: give K,K+S, two integers with 1 <= K < K+S <= {MAX_STEPS} (e.g. 3,8)")
    why = args.json is not None and json_target_problem(args.json)
    if why:
        parser.error(why)
    return steps


MAX_BUDGET_S = 86_400  #: --budget-s at most a day
MAX_STEPS = 1000  #: --steps' longer run at most this many gpt2 steps


def json_target_problem(path: str) -> str | None:
    """The line refusing ``--json path`` (why, what to give), or None: it must be a new file, or a summary minizero
    wrote (minizero.jsons: nothing the user wrote is replaced), in a folder that exists and takes a file; a device
    that takes a write (/dev/null; not a FIFO); or /dev/stdout (minizero.streams)."""
    try:
        if path and stream_fd(path) is not None:
            return check_stream(path, "--json")
        if path and not os.path.isdir(path):  # 'x.json/.' wrote x.json; '/' is a directory
            refuse_slash_or_dangling(path, "--json")
            refuse_read_back(path, "--json")  # a run's summary.json, beside its weights
        why = _json_target_why(path)
    except ValueError as e:
        return str(e)
    except OSError as e:  # check_writable_file's
        return unwritable("--json", path, e)
    return f"--json {path!r}: {why}" if why else None


def _json_target_why(path: str) -> str | None:
    if not path:
        return "give a file path"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return (f"{folder!r} is not a directory" if os.path.exists(folder) else
                f"the folder {folder!r} does not exist") + "; give a path in an existing folder"
    if os.path.isdir(path):
        return "is a directory; give a file path"
    if os.path.lexists(path):
        if not os.path.isfile(path):  # a device such as /dev/null is written into (as train.py's --json)
            refuse_blocking(path, "--json")  # a FIFO would wait for a reader after the whole check
        else:
            refuse_foreign(path, "--json")  # a summary minizero wrote, judged without parsing a big file whole
    check_writable_file(path)  # a device too: /dev/full refuses even no bytes
    return None


def main(argv=None) -> int:
    p = _args.parser(__doc__)
    p.add_argument("--json", default=None, help="where the results go (JSON; default: gpu_check.json)")
    p.add_argument("--peak-tflops", default=None,
                   help="GPU peak TFLOP/s for MFU: FP16[,FP32]; unset: by the GPU's name (PEAKS)")
    p.add_argument("--budget-s", type=real, default=450, help="time budget of the whole check (s)")
    p.add_argument("--steps", default="3,8", help="K,K+S: the two gpt2 run lengths whose difference is timed")
    # gpu_check's own children (nccl_collectives, torch_step_s): checked with every other flag, then run
    p.add_argument("--nccl-worker", type=_args.file_path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-worker", choices=["fp16", "fp32"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    worker = args.nccl_worker is not None or args.torch_worker is not None
    if args.json is None and not worker:  # a worker writes no --json: its default folder need not take one
        args.json = "gpu_check.json"
    steps = check_flags(p, args)
    if args.nccl_worker is not None and args.torch_worker is not None:
        p.error("--nccl-worker and --torch-worker: give one")
    if args.nccl_worker is not None:
        start_mpi()  # a stale launcher: one line, not MPICH's error stack; SIGTERM or time ends a stalled MPI_Init
        nccl_worker(args.nccl_worker)
        return 0
    if args.torch_worker is not None:
        torch_worker(args.torch_worker)
        return 0
    try:
        hw, why = probe()
    except SystemExit as e:  # a GPU is listed but CuPy or NCCL will not load: one line, non-zero
        print(e, file=sys.stderr)
        return 3
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows: dict[str, tuple[str, str]] = {name: ("not run", why) for name in CHECKS}
    result = {"date": stamp, "source": _machine.source(), "versions": versions(), "hardware": hw,
              "reason_not_run": why or None, "throughput": []}
    if hw is None:
        print(why)
    else:
        peaks = parse_peak(args.peak_tflops, hw["name"])
        print(f"{hw['name']} x {hw['count']}, CuPy {hw['cupy']}, CUDA runtime {hw['cuda_runtime']}, "
              f"NCCL {hw['nccl']}; {stamp}; {result['source']}; "
              + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
        with tempfile.TemporaryDirectory() as tmp:
            runner = Runner(args.budget_s, tmp)
            f64 = EQUAL
            plans = {
                "float16 matmul == float32 matmul": lambda: half_gemms("cupy"),
                "cupy == numpy, tiny": lambda: equal_runs(
                    runner, ["--model", "tiny", "--device", "cuda", "--comm", "mpi", *f64],
                    ["--model", "tiny", "--device", "cpu", *f64]),
                "cupy == numpy, default": lambda: equal_runs(
                    runner, ["--model", "default", "--device", "cuda", "--comm", "mpi", *f64],
                    ["--model", "default", "--device", "cpu", *f64]),
                "mpiexec -n 2 (--comm mpi) == 1 process": lambda: equal_runs(
                    runner, ["--model", "tiny", "--device", "cuda", "--comm", "mpi", "--batch-size", "4", *f64],
                    ["--model", "tiny", "--device", "cuda", "--comm", "mpi", "--batch-size", "4", *f64], ranks=(2, 1)),
                "--comm nccl == --comm mpi, 1 rank": lambda: equal_runs(
                    runner, ["--model", "tiny", "--device", "cuda", "--comm", "nccl", *f64],
                    ["--model", "tiny", "--device", "cuda", "--comm", "mpi", *f64]),
                "NCCL collectives, 1 rank": lambda: nccl_collectives(runner, 1),
                "NCCL collectives, 2 ranks": (lambda: nccl_collectives(runner, 2)) if hw["count"] >= 2 else None,
            }
            for name, plan in plans.items():
                rows[name] = run_one(name, plan, hw)
            for precision, peak in (("fp16", peaks[0]), ("fp32", peaks[1])):
                name = f"gpt2 8x1024 {precision}"
                try:
                    status, text, row = throughput(runner, precision, peak, steps)
                    result["throughput"].append(row)
                    rows[name] = (status, text)
                except Exception as e:
                    rows[name] = failure(e)
    result["checks"] = [{"check": k, "status": s, "detail": d} for k, (s, d) in rows.items()]
    print("\n" + "\n".join(table_lines(result["checks"], gpu=hw is not None)))
    text = json.dumps(jsons.summary(result), indent=1)
    atomic_write(args.json, lambda f: f.write(text), mode="w")  # a crash leaves the previous file whole
    print(f"\nwrote {args.json}")
    return 1 if any(s == "FAIL" for s, _ in rows.values()) else 0


def table_lines(checks: list, gpu: bool) -> list:
    """The Markdown table of ``checks`` (the JSON's list of {check, status, detail}), as printed: each detail's
    first line, its "|" escaped; without a GPU, the reason (printed above the table) is not repeated per row."""
    lines = ["| check | result | detail |", "|---|---|---|"]
    for c in checks:
        d = c["detail"] if gpu else "no GPU (first line above)"
        cell = first_line(d).replace("|", "\\|") if d else ""  # a |difference| must not split the cell
        lines.append(f"| {c['check']} | {c['status']} | {cell} |")
    return lines


def run_one(name, plan, hw) -> tuple[str, str]:
    if plan is None:
        return "not run", f"needs at least 2 GPUs (NCCL allows one rank per GPU); this machine has {hw['count']}"
    print(f"... {name}", flush=True)
    try:
        return plan()
    except Exception as e:
        return failure(e)


def failure(e: BaseException) -> tuple[str, str]:
    """A row's (status, detail) for the exception ``e``, whatever its message (empty, multi-line)."""
    if isinstance(e, TimeoutError):
        return "not run", first_line(e)
    print(f"    {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return "FAIL", f"{type(e).__name__}: {first_line(e)}"


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
