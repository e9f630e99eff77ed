"""This machine, measured, as the planner's hardware model: sgemm FLOP/s, copy bandwidth, all-reduce busbw.

:func:`measure` fills :class:`minizero.plan_search.Hardware` for ``python -m minizero.compare``:
``sgemm_flops`` -> ``flops`` (float32 matmuls of the model's shapes, 2 FLOPs per multiply-add, median of passes);
``copy_bw`` -> ``pcie_bw`` (``np.copyto`` of 64 MiB); ``allreduce_busbw`` -> ``intra_node_bw`` and
``inter_node_bw`` (:func:`minizero.comm.all_reduce` of the gradient size in launched ranks, busbw = S/t x
2(N-1)/N as nccl-tests' doc/PERFORMANCE.md); ``latency`` (one float32's all-reduce / its message steps) ->
``latency``; ``adam_params_per_s`` -> ``cpu_adam``. Units: FLOP/s, bytes/s,
parameters/s; short measurements, rough on a loaded machine.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from minizero import backend
from minizero.files import mpiexec_path
from minizero.numerals import OneLineParser, description, integer, negative_values_reach_checks, real
from minizero.plan_search import Hardware
from minizero.memory.estimator.messages import collective_steps
from minizero.interrupts import (NOTHING, interruptible, launched_rank, launcher_connected, mpi_start_guarded,
                                 run_group)
from minizero.launcher import refuse_stale_launcher

COPY_BYTES = 64 * 2 ** 20  #: size of the array :func:`copy_bandwidth` copies
#: the all-reduce job's array (4 GiB: float32 gradients of a 1B-parameter model, two arrays per rank) and timed runs
MAX_ALLREDUCE_BYTES, MAX_RUNS = 2 ** 32, 1000


def _median_rate(work: float, run, seconds: float, min_runs: int = 3) -> float:
    """``work`` / the median time of ``run()`` over repeated calls for about ``seconds`` (one untimed first)."""
    run()
    times, end = [], time.perf_counter() + seconds
    while len(times) < min_runs or time.perf_counter() < end:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return work / float(np.median(times))


def model_matmuls(cfg, micro_batch: int) -> list[tuple[tuple, tuple]]:
    """The (a.shape, b.shape) of one layer's forward matmuls and the head's, for ``micro_batch`` sequences.

    ``cfg``: a :class:`minizero.nn.gpt.GPTConfig` (n_embd C, n_head H, block_size T, vocab_size V).
    Rows = micro_batch x T tokens; attention runs (b H, T, C/H) @ (b H, C/H, T) and (b H, T, T) @ (b H, T, C/H).
    """
    c, h, t, v = cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size
    rows, bh, hd = micro_batch * t, micro_batch * h, c // h
    return [((rows, c), (c, 3 * c)), ((rows, c), (c, c)), ((rows, c), (c, 4 * c)), ((rows, 4 * c), (4 * c, c)),
            ((bh, t, hd), (bh, hd, t)), ((bh, t, t), (bh, t, hd)), ((rows, c), (c, v))]


def sgemm_flops(cfg, micro_batch: int, threads: int, seconds: float = 0.3) -> float:
    """FLOP/s of float32 matmuls at the model's shapes (:func:`model_matmuls`) with ``threads`` BLAS threads."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal(a).astype(np.float32), rng.standard_normal(b).astype(np.float32))
             for a, b in model_matmuls(cfg, micro_batch)]
    flops = sum(2 * a.size * b.shape[-1] for a, b in pairs)  # (.., m, k) @ (.., k, n): 2 m k n per batch

    def run():
        for a, b in pairs:
            np.matmul(a, b)

    with threadpool_limits(limits=threads):
        return _median_rate(flops, run, seconds)


def copy_bandwidth(nbytes: int = COPY_BYTES, seconds: float = 0.2) -> float:
    """Bytes copied per second by ``np.copyto`` between two float32 arrays of ``nbytes``."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return _median_rate(src.nbytes, lambda: np.copyto(dst, src), seconds)


def adam_rate(num_params: int, seconds: float = 0.2) -> float:
    """Parameters per second of one :func:`minizero.optim.adamw.adamw_update` on flat float32 arrays."""
    from minizero.optim.adamw import adamw_update

    p, g, m, v = (np.full(num_params, 0.5, dtype=np.float32) for _ in range(4))
    return _median_rate(num_params, lambda: adamw_update(p, g, m, v, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1), seconds)


def allreduce_busbw(nbytes: int, ranks: int, mpiexec: str | None = None, runs: int = 5,
                    timeout: float = 120.0) -> dict:
    """{"busbw": bytes/s, "latency": s} of :func:`minizero.comm.all_reduce` on ``nbytes`` of float32 over ``ranks``
    launched ranks, latency per message step of a one-element all-reduce (alpha, :func:`collective_steps`).

    Launches ``mpiexec -n ranks python -m minizero.hardware --allreduce nbytes``. ``ranks`` 1: inf and 0
    (nothing to send). Raises RuntimeError naming the command and its error when the job fails.
    """
    if ranks == 1:
        return {"busbw": math.inf, "latency": 0.0}
    mpiexec = mpiexec or mpiexec_path()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found beside this Python or on PATH (pip install mpich, or a system MPI)")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "minizero.hardware", "--allreduce", str(nbytes),
           "--runs", str(runs)]
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p))
    env.pop("MINIZERO_FAULT", None)  # the trainer's fault hook is not for this job
    proc = run_group(cmd, env=env, timeout=timeout)  # Ctrl-C or the timeout: mpiexec and its ranks killed
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit status {proc.returncode}): {proc.stderr.strip()[-300:]}")
    return {k: float(v) for k, v in json.loads(lines[-1]).items()}


def _allreduce_job(nbytes: int, runs: int, timeout_s: float = 600.0) -> None:
    """Under mpiexec: time :func:`minizero.comm.all_reduce`; rank 0 prints {"busbw": bytes/s, "latency": s}."""
    from minizero.comm import all_reduce
    from minizero.comm.mpi import world

    with mpi_start_guarded("python -m minizero.hardware", timeout_s=timeout_s):  # SIGTERM or time ends MPI_Init
        comm = world()
    n = comm.world_size
    median, elements = {}, max(1, nbytes // 4)
    for size in (elements, 1):  # the gradient, then one element: latency alone
        x = np.ones(size, dtype=np.float32)
        out, times = np.empty_like(x), []
        for i in range(2 + runs):  # two warm-up runs
            comm.barrier()
            t = time.perf_counter()
            all_reduce(comm, x, out=out)
            slowest = comm.mpi_comm.allreduce(time.perf_counter() - t, op=_max_op())
            if i >= 2:
                times.append(slowest)
        median[size] = float(np.median(times))
    steps = collective_steps("all_reduce", 4, n)  # 0 on one rank (run without mpiexec): no latency to divide
    if comm.rank == 0:
        print(json.dumps({"busbw": 4 * elements / median[elements] * 2 * (n - 1) / n,
                          "latency": median[1] / steps if steps else 0.0}), flush=True)


def _max_op():
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.MAX


@dataclasses.dataclass(frozen=True)
class Profile:
    """This machine, measured for one model and micro-batch (see the module docstring).

    Fields: ``sgemm_flops`` {BLAS threads: FLOP/s}, ``copy_bw`` bytes/s, ``allreduce_busbw`` {world size: bytes/s} (inf
    at 1 rank), ``adam_params_per_s``, ``gradient_bytes`` (the all-reduce's size), ``cores``,
    ``latency`` {world size: s per message step}.
    """

    sgemm_flops: dict
    copy_bw: float
    allreduce_busbw: dict
    adam_params_per_s: float
    gradient_bytes: int
    cores: int
    latency: dict = dataclasses.field(default_factory=dict)

    def threads(self, ranks: int) -> int:
        """BLAS threads per rank at ``ranks`` ranks on this machine: cores / ranks, at least 1 (as the trainer)."""
        return max(1, self.cores // max(1, ranks))

    def hardware(self, ranks: int) -> Hardware:
        """The planner's :class:`Hardware` for a job of ``ranks`` ranks on this one machine."""
        bw = self.allreduce_busbw[ranks]
        return Hardware(flops=self.sgemm_flops[self.threads(ranks)], efficiency=1.0, intra_node_bw=bw,
                        inter_node_bw=bw, pcie_bw=self.copy_bw, gpus_per_node=max(ranks, 1),
                        cpu_adam=self.adam_params_per_s, latency=self.latency.get(ranks, 0.0))

    def as_dict(self) -> dict:
        """JSON-ready (inf written as null)."""
        d = dataclasses.asdict(self)
        d["allreduce_busbw"] = {str(k): (None if math.isinf(v) else v) for k, v in self.allreduce_busbw.items()}
        d["sgemm_flops"] = {str(k): v for k, v in self.sgemm_flops.items()}
        d["latency"] = {str(k): v for k, v in self.latency.items()}
        return d


def measure(cfg, micro_batch: int, world_sizes, mpiexec: str | None = None) -> Profile:
    """Measure this machine for ``cfg`` (a GPTConfig) at ``micro_batch`` and each world size in ``world_sizes``.

    Raises RuntimeError when a launched all-reduce job fails.
    """
    cores = backend.usable_cores()
    nparams = cfg.num_parameters()
    threads = sorted({max(1, cores // n) for n in world_sizes})
    comm = {n: allreduce_busbw(4 * nparams, n, mpiexec) for n in world_sizes}
    return Profile(sgemm_flops={t: sgemm_flops(cfg, micro_batch, t) for t in threads}, copy_bw=copy_bandwidth(),
                   allreduce_busbw={n: c["busbw"] for n, c in comm.items()}, adam_params_per_s=adam_rate(nparams),
                   gradient_bytes=4 * nparams, cores=cores, latency={n: c["latency"] for n, c in comm.items()})


def main(argv=None) -> None:
    """``mpiexec -n N python -m minizero.hardware --allreduce BYTES``: the all-reduce timing job."""
    refuse_stale_launcher("python -m minizero.hardware")  # MPI_Init: MPICH's abort and error stack before
    p = negative_values_reach_checks(OneLineParser(prog="python -m minizero.hardware",
                                                   description=description(__doc__)))
    p.add_argument("--allreduce", type=integer, required=True, help="bytes of the float32 array to all-reduce (>= 4)")
    p.add_argument("--runs", type=integer, default=5, help="timed runs (>= 1); the median is reported")
    p.add_argument("--comm-timeout", type=real, default=600.0, help="seconds MPI's start may take (>= 1)")
    p.quiet = launched_rank() != 0 and launcher_connected()  # --help, an error: once, by rank 0 (as train's)
    args = p.parse_args(argv)
    if not (4 <= args.allreduce <= MAX_ALLREDUCE_BYTES and args.allreduce % 4 == 0):
        p.error(f"--allreduce {args.allreduce}: allowed: a multiple of 4 bytes (float32) in "
                f"[4, {MAX_ALLREDUCE_BYTES:,}]")
    if not 1 <= args.runs <= MAX_RUNS:
        p.error(f"--runs {args.runs}: allowed: 1..{MAX_RUNS}")
    if not 1 <= args.comm_timeout < 600_000:
        p.error(f"--comm-timeout {args.comm_timeout:g}: allowed: seconds in [1, 600000)")
    _allreduce_job(args.allreduce, args.runs, args.comm_timeout)


if __name__ == "__main__":
    sys.exit(interruptible("minizero.hardware", NOTHING, main))
