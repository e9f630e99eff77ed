"""Soak test of the main job's failure paths: faults at random steps end cleanly.

    python -m tests.soak [--runs 20] [--seed 0]

Each run trains the tiny model on 2 ranks into one OUT folder, with a fault injected at
a random step: ``MINIZERO_FAULT`` raise / kill / stop (SIGSTOP: a stalled rank, found by
``--comm-timeout 3``), or SIGINT / SIGTERM sent to ``mpiexec`` after a random delay.
Every run must end within 30 s, leave no process of its own behind (found by a marker
in the environment), no temporary file in OUT, and OUT's previous ``model.npz`` and
``summary.json`` loadable. Prints one line per run; exit status 1 if any run broke a rule.
tests/test_reliability.py runs a short version; the full one is run by hand (slow).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from minizero.files import mpiexec_path
from tests.conftest import mpi_env

KINDS = ("raise", "kill", "stop", "sigint", "sigterm")
DEADLINE_S = 30.0
STEPS = 400
ARGS = ["--model", "tiny", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "8", "--no-progress",
        "--comm-timeout", "3"]  # as tests/test_flight.py's stopped rank: each stop run waits it out


def own_processes(token: str) -> list[int]:
    """PIDs whose environment holds ``MINIZERO_SOAK=token`` (our ranks, proxies and mpiexec)."""
    needle = f"MINIZERO_SOAK={token}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                pass
    return found


def launch(mpiexec: str, out: str, steps: int, token: str, fault: str | None = None, ranks: int = 2):
    env = dict(mpi_env(), MINIZERO_SOAK=token)
    if fault:
        env["MINIZERO_FAULT"] = fault
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "minizero.train", *ARGS, "--steps", str(steps),
           "--out", out]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def check_outputs(out: str) -> list[str]:
    """Problems with OUT: temporary files, or a model.npz / summary.json that does not load."""
    problems = [f"temporary file left: {f}" for f in os.listdir(out) if f.endswith(".tmp")]
    try:
        with np.load(os.path.join(out, "model.npz")) as z:
            assert len(z.files) > 0
        with open(os.path.join(out, "summary.json")) as f:
            json.load(f)
    except Exception as e:  # noqa: BLE001 (reported)
        problems.append(f"previous outputs not loadable: {type(e).__name__}: {e}")
    return problems


def one_run(mpiexec: str, out: str, kind: str, rng: random.Random, last_step: int = 59) -> dict:
    """One faulty run (the fault at a step in 1..``last_step``); returns {kind, fault (spec or delay), rank (the
    faulty one; None for a signal), rc, elapsed_s, problems, stdout, stderr}."""
    token = uuid.uuid4().hex
    rank, step = rng.randrange(2), rng.randrange(1, last_step + 1)
    fault = f"{rank}:{step}:{kind}" if kind in ("raise", "kill", "stop") else None
    t0 = time.monotonic()
    proc = launch(mpiexec, out, STEPS, token, fault)
    what = fault or ""
    if fault is None:
        delay = rng.uniform(1.0, 4.0)
        what = f"{kind} after {delay:.1f} s"
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT if kind == "sigint" else signal.SIGTERM)
    problems = []
    try:
        out_text, err = proc.communicate(timeout=max(1.0, DEADLINE_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out_text, err = proc.communicate()
        problems.append(f"did not end within {DEADLINE_S:.0f} s")
    elapsed = time.monotonic() - t0
    if proc.returncode == 0 and fault:
        problems.append("exit status 0 despite the fault")
    if "Bus error" in err or "Traceback" in err and kind != "raise":
        problems.append(f"unexpected stderr: {err[-300:]}")
    for _ in range(20):  # the launcher reaps its children a moment after it exits
        left = own_processes(token)
        if not left:
            break
        time.sleep(0.25)
    if left:
        problems.append(f"processes left: {left}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    problems += check_outputs(out)
    return dict(kind=kind, fault=what, rank=rank if fault else None, rc=proc.returncode, elapsed_s=elapsed,
                problems=problems, stdout=out_text, stderr=err)


def soak(runs: int, seed: int = 0, out: str | None = None, log=print, last_step: int = 59) -> list[dict]:
    """A good run into OUT (one rank: it only leaves the outputs that must stay loadable), then ``runs`` faulty runs
    (kinds in turn, steps in 1..``last_step`` and delays from ``seed``)."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found (pip install mpich)")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() if out is None else _nullctx(out) as d:
        good = launch(mpiexec, d, 2, uuid.uuid4().hex, ranks=1)
        _, err = good.communicate(timeout=120)
        if good.returncode != 0:
            raise RuntimeError(f"the first (good) run failed: {err}")
        results = []
        for i in range(runs):
            r = one_run(mpiexec, d, KINDS[i % len(KINDS)], rng, last_step)
            log(f"run {i + 1:2d}: {r['kind']:8s} {r['fault']:18s} rc {r['rc']:4d}  {r['elapsed_s']:5.1f} s  "
                + ("ok" if not r["problems"] else "; ".join(r["problems"])))
            results.append(r)
        return results


class _nullctx:
    def __init__(self, v):
        self.v = v

    def __enter__(self):
        return self.v

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    """Command line: run the soak, print a line per run and a verdict; exit 1 on any problem."""
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    results = soak(a.runs, a.seed)
    bad = [r for r in results if r["problems"]]
    print(f"{len(results) - len(bad)} of {len(results)} runs clean; slowest {max(r['elapsed_s'] for r in results):.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
