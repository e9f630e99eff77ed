"""Hosts on one machine: Linux network namespaces on a bridge, reached by MPICH's hydra as if by ssh.

::

                      bridge {prefix}br  (root namespace, no address)
           ┌──────────────────┼──────────────────┬──────────────────┐
     veth {prefix}v0     veth {prefix}v1     ...          veth {prefix}vL
     ns {prefix}h0       ns {prefix}h1                    ns {prefix}hL  (the launcher)
     10.231.0.1          10.231.0.2                       10.231.0.(n+1)
     ranks 0..k-1        ranks k..2k-1                    mpirun -localhost 10.231.0.(n+1)

Every namespace has its own network stack (addresses, loopback, TCP ports), so MPI sees
n hosts and its ranks on different hosts talk over TCP through the bridge; MPI's
shared-memory split (``MPI_COMM_TYPE_SHARED``) puts the ranks of one proxy (one host)
on one node. hydra starts a proxy per host with its ssh launcher, but through
``-launcher-exec SCRIPT``: the script drops ssh's options, maps the host address to its
namespace and runs the proxy command under ``ip netns exec``. ``mpirun`` itself runs
in a namespace of its own on the bridge (``-localhost``), or the proxies could not
connect back to it.

Everything created is named with a unique prefix and removed on exit, also after a
failure or a timeout: processes still in the namespaces are killed first (they are the
ones this object started), then the namespaces (which takes their veth ends along) and
the bridge. Needs root (CAP_NET_ADMIN) and iproute2's ``ip``; :func:`unavailable`
says why not, for a test to skip with.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

SUBNET = "10.231.0"  #: private addresses, only ever assigned inside this object's own namespaces

#: The namespaces share one kernel, so UCX (the mpich wheel's default network module) would find
#: its peers on the same machine and use shared memory between "hosts"; these make every message
#: between hosts a TCP message through the bridge (OFI's provider too, should MPICH pick OFI).
#: Ranks on one host still use MPICH's shared memory, as on real machines.
TCP_ENV = {"UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp"}

LAUNCHER = """#!/bin/sh
# hydra's ssh launcher calls: SCRIPT [ssh options] HOST COMMAND...; run COMMAND inside HOST's namespace
while [ $# -gt 0 ]; do
  case "$1" in -*) shift ;; *) break ;; esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "netns launcher: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a sentence), or None when they probably can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the test suite as root to test across hosts"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


class NetnsHosts:
    """``n_hosts`` namespaces as hosts plus one for ``mpirun``, joined by a bridge (a context manager).

    Args:
        n_hosts: how many hosts (1..250).
        slots: MPI ranks per host (the hostfile's ``address:slots``).
    Attributes (inside the ``with``):
        prefix: the unique name prefix (``mz<pid><counter>``, at most 15 characters with suffixes).
        addresses: host addresses, in hostfile order. launcher_ns, launcher_address: mpirun's.
        hostfile, launcher_script: paths in a private temporary folder.
    Raises:
        OSError: a namespace, veth or bridge could not be made (everything made so far is
            removed first).
    """

    _count = 0

    def __init__(self, n_hosts: int, slots: int):
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts={n_hosts}; allowed: 1..250")
        NetnsHosts._count += 1
        self.prefix = f"mz{os.getpid() % 10 ** 7}{NetnsHosts._count % 10}"[:11]
        self.n_hosts, self.slots = n_hosts, slots
        self.namespaces = [f"{self.prefix}h{i}" for i in range(n_hosts + 1)]  # the last: the launcher
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n_hosts)]
        self.launcher_ns, self.launcher_address = self.namespaces[-1], f"{SUBNET}.{n_hosts + 1}"
        self.bridge = f"{self.prefix}br"
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._dir = None

    def __enter__(self) -> NetnsHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            veth, peer = f"{self.prefix}v{i}", f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made.append(("link", veth))
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self._dir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self.hostfile = os.path.join(self._dir, "hosts")
        with open(self.hostfile, "w") as f:
            f.writelines(f"{a}:{self.slots}\n" for a in self.addresses)
        cases = "\n".join(f"  {a}) ns={ns} ;;" for a, ns in zip(self.addresses, self.namespaces))
        self.launcher_script = os.path.join(self._dir, "launch.sh")
        with open(self.launcher_script, "w") as f:
            f.write(LAUNCHER.format(cases=cases))
        os.chmod(self.launcher_script, 0o755)

    def mpirun_command(self, mpiexec: str, n: int, program: list[str]) -> list[str]:
        """The command that runs ``program`` on ``n`` ranks over the hosts (ranks fill hosts in order)."""
        return ["ip", "netns", "exec", self.launcher_ns, mpiexec, "-launcher", "ssh",
                "-launcher-exec", self.launcher_script, "-localhost", self.launcher_address,
                "-f", self.hostfile, "-n", str(n), *program]

    def env(self, base: dict) -> dict:
        """``base`` plus :data:`TCP_ENV` (hydra passes mpirun's environment on to every rank)."""
        return dict(base, **TCP_ENV)

    def bytes_into_bridge(self) -> list[int]:
        """Bytes each host has sent into the bridge so far (its veth's receive counter, root side)."""
        counts = []
        for i in range(self.n_hosts):
            with open(f"/sys/class/net/{self.prefix}v{i}/statistics/rx_bytes") as f:
                counts.append(int(f.read()))
        return counts

    def pids(self) -> list[int]:
        """Processes running in this object's namespaces now."""
        found = []
        for ns in self.namespaces:
            if ("netns", ns) in self._made:
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
                found += [int(p) for p in out.stdout.split()]
        return found

    def close(self) -> None:
        """Kill what still runs in the namespaces, then remove namespaces, veths, bridge and files."""
        errors = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        # the veths first (deleting one end deletes its pair at once; a namespace's own removal
        # frees its end only later, asynchronously), then the bridge, then the namespaces
        made = [m for m in reversed(self._made) if m[0] == "link"] + [m for m in self._made if m[0] == "netns"]
        for kind, name in made:
            try:
                if kind == "netns":
                    _ip("netns", "del", name)
                elif os.path.exists(f"/sys/class/net/{name}"):
                    _ip("link", "del", name)
            except OSError as e:
                errors.append(str(e))
        self._made = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if errors:
            raise OSError("could not remove: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """Names with this prefix that still exist (namespaces, links): [] after ``close``."""
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = os.listdir("/sys/class/net")
        return [w for w in ns.split() if w.startswith(self.prefix)] + [x for x in links if x.startswith(self.prefix)]
