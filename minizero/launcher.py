"""Which launcher started this process, read from the environment before MPI starts (MPICH's PMI_*, Open MPI's,
PMIx's, Cray PALS's), and a stale one named in one line before MPI_Init aborts with MPICH's error stack."""
from __future__ import annotations

import os
import socket
import stat
import sys

from minizero.numerals import error_lines


def launched_by_mpiexec() -> bool:
    """True in a rank that a launcher (MPICH's, Open MPI's, a PMIx one) started."""
    return any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"))


def pmix_names(names: tuple) -> tuple:
    # srun --mpi=pmix sets PMIX_RANK and no size (PMIx_server_setup_fork, openpmix src/server/pmix_server.c, sets
    # PMIX_NAMESPACE, PMIX_RANK, the server's URI); the size is Slurm's SLURM_STEP_NUM_TASKS (env_array_for_step,
    # slurm src/common/env.c; SLURM_NTASKS is the allocation's under --preserve-env): ``names``, read beside PMIX_RANK
    return names if "PMIX_RANK" in os.environ else ()


def launched_ranks() -> int:
    """The number of ranks the launcher started (``PMI_SIZE``, Open MPI's, Slurm's), 1 without one; MPI not started."""
    return _number(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE") + pmix_names(("SLURM_STEP_NUM_TASKS",)), 1)


def launcher_mismatch(world_size: int, library: str = "") -> str | None:
    """Why MPI's world of ``world_size`` (1) is not the :func:`launched_ranks` (> 1) the environment names, or None:
    each process would train alone. ``library``: the MPI mpi4py uses (MPI.Get_library_version()'s first line)."""
    n = launched_ranks()
    if world_size != 1 or n <= 1:  # a launcher MPI connected to: its world; any other mismatch is MPI's own
        return None
    said = " ".join(f"{k}={os.environ[k]}" for k in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                                                     "OMPI_COMM_WORLD_RANK", *pmix_names(("SLURM_STEP_NUM_TASKS",
                                                                                          "PMIX_RANK")))
                    if k in os.environ)
    if not launcher_connected():
        return (f"{said} say {n} ranks, but no MPI launcher started this process and MPI runs it alone (a world of "
                f"1): unset {' '.join(k.split('=')[0] for k in said.split())}, or start it with mpiexec -n {n}")
    return (f"{said} say the launcher started {n} ranks, but MPI sees a world of 1 in this process: a launcher "
            f"mismatch (mpiexec of another MPI than mpi4py's{': ' + library if library else ''}); start the job "
            "with the mpiexec of the same MPI")


def launched_rank() -> int:
    """This process's rank as the launcher numbered it (``PMI_RANK``, Open MPI's, PMIx's), 0 without one; MPI not
    started."""
    return _number(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"), 0)


def _number(names: tuple, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.isascii() and value.isdigit():  # not "²" (isdigit, which int() refuses) nor "٣"
            return int(value)
    return default


def launcher_connected() -> bool:
    """True where the launcher whose variables name this rank is connected: PMI_RANK / PMI_SIZE (MPICH's, Cray's)
    count only with MPICH's PMI_FD (an open socket), PMI_PORT (listened on) or HPE Cray PALS; else PMIx's server."""
    fd = os.environ.get("PMI_FD")
    pmi = _socket(fd or "") or (fd is None and _listened(os.environ.get("PMI_PORT"))) or any(
        k in os.environ for k in ("PMI_CONTROL_PORT", "PMI_CONTROL_FD", "PALS_RANKID"))  # Cray PALS: PMI_CONTROL_*
    if pmi or "PMI_RANK" in os.environ or "PMI_SIZE" in os.environ:  # MPICH reads PMI_PORT only without PMI_FD
        return pmi  # PMI_SIZE=2 PMI_RANK=1 beside a PMIx server's URI: MPICH starts one rank (a quiet rank 1 before)
    return _pmix_server() or any(k.startswith("OMPI_MCA_orte_hnp") for k in os.environ)


def _pmix_server() -> bool:
    return any(k.startswith("PMIX_SERVER_URI") for k in os.environ)


def _socket(fd: str) -> bool:
    try:  # the launcher's end is a socket: PMI_FD=0 or 2 (a terminal, /dev/null) counted as one before
        return fd.isascii() and fd.isdigit() and stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
    except (OSError, OverflowError):  # closed; 20 digits
        return False


def _listened(host_port) -> bool:
    # MPICH's simple PMI (PMIU_get_pmi_fd) splits PMI_PORT at the first colon and connects there in MPI_Init. A port of
    # this host is looked up, not connected to: hydra's proxy spins on a connection closed unused (a core for the job)
    host, _, port = (host_port or "").partition(":")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return False
    here = _listening_here(int(port)) if _this_host(host) else None
    if here is not None:
        return here
    try:  # another host's launcher (or no /proc): connect as MPI_Init would
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except (OSError, UnicodeError, ValueError):
        return False


def _this_host(host: str) -> bool:
    # a name or address of this machine: mpiexec -iface puts an interface's address in PMI_PORT, which binds here
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return False
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0, *address[2:]))  # IPv6: (host, port, flow info, scope id)
            return True
        except OSError:  # EADDRNOTAVAIL: another machine's
            continue
    return False


def _listening_here(port: int):
    found = None  # True / False: a TCP socket of this host listens on ``port`` (Linux); None: unknown
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        found = bool(found) or any(r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port for r in rows)  # LISTEN
    return found


def refuse_stale_launcher(prog: str | None = None) -> None:
    """Exit 2 with one line where MPI_Init would abort with MPICH's error stack: PMI_FD set but no socket, PMI_PORT
    (without PMI_FD) where no launcher listens, or PMIX_RANK / PMIX_NAMESPACE with no PMIx server and no PMI_FD /
    PMI_PORT (a server's URI: left to MPI, which may speak PMIx). ``prog``: the program's name (default: the
    script's). Call it before MPI starts."""
    fd, port = os.environ.get("PMI_FD"), os.environ.get("PMI_PORT")
    pmix = [f"{k}={os.environ[k]}" for k in ("PMIX_RANK", "PMIX_NAMESPACE") if k in os.environ]
    pmi_names, tail = ("PMI_FD", "PMI_PORT", "PMI_SIZE", "PMI_RANK"), "unset {}, or start this under mpiexec"
    if fd is not None and not _socket(fd):
        said = f"PMI_FD={fd} is set, but names no MPI launcher's socket (mpiexec sets it)"
    elif fd is None and port is not None and not _listened(port):
        said = f"PMI_PORT={port} is set, but no MPI launcher listens there (mpiexec sets it)"
    elif pmix and fd is None and port is None and not _pmix_server():  # MPICH: "unsupported PMI version PMIx"
        pmi_names = ()  # only without PMI_FD / PMI_PORT: MPICH reads those (a live mpiexec's) and ignores PMIx
        said = (f"{' '.join(pmix)} {'is' if len(pmix) == 1 else 'are'} set, but no PMIx server started this process "
                "(no PMIX_SERVER_URI* variable; srun --mpi=pmix sets them)")
    else:
        return
    names = [k for k in pmi_names if k in os.environ] or sorted(k for k in os.environ if k.startswith("PMIX_"))
    print(error_lines(prog or os.path.basename(sys.argv[0]), f"{said}: {tail.format(' '.join(names))}"),
          file=sys.stderr)
    raise SystemExit(2)

