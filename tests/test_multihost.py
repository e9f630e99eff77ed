"""Across hosts over real TCP: 2 network-namespace hosts x 2 ranks equal one process in float64.

Each case trains 3 float64 steps of the tiny model through hydra's ssh launcher into
namespaces (``tests/netns.py``), compares the saved ``model.npz`` with a single process
on the same global batches (B = micro-batch x dp x k, as tests/test_loop.py), and checks
that nothing (namespace, link, process) is left behind. Skipped, with the reason, when
not root or when namespaces cannot be made.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, mpi_env
from tests.netns import NetnsHosts, unavailable

BASE = ["--model", "tiny", "--dtype", "float64", "--steps", "3", "--eval-batches", "1", "--eval-every", "0",
        "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3"]
B = 2  # micro-batch per data rank

#: flags on 2 hosts x 2 ranks, and the single process's micro-batch (same global batch)
CASES = {
    "dp4": (["--dp", "4"], 4 * B),
    "dp2-tp2": (["--dp", "2", "--tp", "2"], 2 * B),
    "zero3": (["--zero", "3"], 4 * B),
    "dp4-hierarchical": (["--dp", "4", "--allreduce", "hierarchical"], 4 * B),
}


def _hosts_or_skip():
    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        return NetnsHosts(n_hosts=2, slots=2).__enter__()
    except OSError as e:
        pytest.skip(f"cannot create network namespaces here: {e}")


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (the run's private folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _single(mpiexec, flags, out):
    cmd = [mpiexec, "-n", "1", sys.executable, "-m", "minizero.train", *BASE, *flags, "--out", str(out)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(np.load(os.path.join(out, "model.npz")))


def _field(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the output:\n{text}"
    return m.group(1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_two_hosts_over_tcp_equal_one_process(mpiexec, tmp_path, case):
    flags, single_mb = CASES[case]
    hosts = _hosts_or_skip()
    out = tmp_path / "hosts"
    try:
        program = [sys.executable, "-m", "minizero.train", *BASE, "--micro-batch-size", str(B), *flags,
                   "--out", str(out)]
        proc = subprocess.run(hosts.mpirun_command(mpiexec, 4, program), env=hosts.env(mpi_env()),
                              capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        prefix, private = hosts.prefix, hosts.hostfile
        hosts.close()
    assert hosts.leftovers() == [], f"left behind: {hosts.leftovers()}"
    assert _processes_mentioning(str(out)) == [] and _processes_mentioning(private) == []
    stdout = proc.stdout
    # MPI's shared-memory split saw two hosts, and BLAS threads count the ranks of each host
    assert "nodes: 2 node(s) x 2 rank(s) per node, node of each rank [0, 0, 1, 1]" in " ".join(stdout.split()), stdout
    assert "(2 rank(s) on this node" in stdout
    got = dict(np.load(os.path.join(out, "model.npz")))
    ref = _single(mpiexec, ["--micro-batch-size", str(single_mb)], tmp_path / "one")
    assert set(got) == set(ref)
    for name, a in ref.items():
        np.testing.assert_allclose(got[name], a, rtol=0, atol=2e-13 * max(1.0, np.abs(a).max()), err_msg=name)
    assert prefix.startswith("mz")
    if "--allreduce" in flags:  # 2 nodes: 2(n-1)/n = 1 buffer per node across, the flat ring's 2(N-1)/N = 1.5
        measured = _field(r"all-reduce \(hierarchical\) across nodes per step: (\S+ \S+);", stdout)
        assert measured == _field(r"hierarchical (\S+ \S+) \(2 node", stdout)
        assert float(measured.split()[0]) < float(_field(r"flat ring (\S+) ", stdout))


@pytest.mark.timeout(300)
def test_tensor_groups_stay_on_a_host_and_only_gradients_cross(mpiexec, tmp_path):
    """dp 2 x tp 2 on 2 hosts x 2 ranks: tensor groups [0 1] [2 3] inside hosts; across hosts only the
    data group's gradient all-reduce (plus the 8-byte loss/norm sums), equal to the flat ring's formula."""
    hosts = _hosts_or_skip()
    try:
        program = [sys.executable, "-m", "minizero.train", *BASE, "--dp", "2", "--tp", "2", "--no-save"]
        proc = subprocess.run(hosts.mpirun_command(mpiexec, 4, program), env=hosts.env(mpi_env()),
                              capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
        wire = sum(hosts.bytes_into_bridge())
    finally:
        hosts.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    said = " ".join(out.split())  # the header is wrapped at 100 columns
    assert "each tensor-parallel group stays inside one node, a data-parallel group spans up to 2 nodes" in said, out
    assert "warning: tensor group" not in said, out
    assert "tensor group [0, 1]  on node 0" in out and "tensor group [2, 3]  on node 1" in out
    assert _field(r"tp +\(2 ranks each\): 1 node, +\S+ \S+, +(\S+ \S+)", out) == "0 B"
    dp_across = _field(r"dp +\(2 ranks each\): 2 nodes, +\S+ \S+, +(\S+ \S+)", out)
    dp_sent = _field(r"dp +\(2 ranks each\): 2 nodes, +(\S+ \S+),", out)
    assert dp_across == dp_sent != "0 B"  # every data-group byte crosses: one rank per host
    assert _field(r"across nodes = tp (\S+ \S+) \+", out) == "0 B"
    assert _field(r"\+ dp (\S+ \S+) \+", out) == dp_across
    value, unit = _field(r"\+ other (\S+ \S+)", out).split()
    # a few float64 sums per step and, once, the replica check's 8-byte digests (each parameter and optimizer state
    # tensor) and its verdict: nothing model-sized (the tiny model's float64 parameters are 85.5 KiB)
    assert 0 < float(value) * {"B": 1, "KiB": 1024}[unit] < 4096, out
    measured = _field(r"dp gradient all-reduce \(ring\) across nodes per step: (\S+ \S+);", out)
    assert measured == dp_across == _field(r"computed: flat ring (\S+ \S+),", out)
    # and those bytes really travelled over TCP through the bridge (payload plus headers and hydra's control)
    value, unit = _field(r"(\S+ \S+) across nodes =", out).split()
    assert unit == "KiB" and wire >= 3 * float(value) * 1024 * 0.999, (wire, value)
