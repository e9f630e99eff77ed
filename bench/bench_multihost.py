"""Traffic inside vs across nodes, per rank: the flat ring vs the hierarchical all-reduce.

    sudo "$(which python)" bench/bench_multihost.py        # 2 namespace hosts x 2 ranks, over TCP
    sudo "$(which python)" bench/bench_multihost.py --hosts 2 --slots 4 --mib 16
    (the venv's python by its path: sudo resets PATH)
    mpiexec -f hostfile -n 8 python bench/bench_multihost.py --rank   # real machines

As root it builds network-namespace hosts on a bridge (tests/netns.py: hydra's ssh
launcher into the namespaces, every message between hosts a TCP message) and runs
itself on them with ``--rank``. Each rank wraps the world in a
``NodeTrafficCommunicator`` (nodes found with ``MPI_COMM_TYPE_SHARED``), all-reduces a
float32 buffer of ``--mib`` MiB with each algorithm, checks both give the same sum, and
reports per rank the bytes it sent inside its node and across nodes, and the slowest
rank's median time. Below the table: across-node bytes per node against the formulas,
2(N-1)/N * S for the flat ring (each node's one boundary link) and 2(n-1)/n * S for the
hierarchical one (NCCL/Horovod), n nodes, N ranks, S the buffer.

The namespaces share one machine's cores and memory bus: times show the algorithms'
message counts and sizes through the kernel's TCP stack, not a real network's speed.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _args  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing


def rank_main(mib: float, repeats: int) -> None:
    """Under MPI: measure both algorithms, print the table on rank 0."""
    from mpi4py import MPI

    from minizero.comm import MPICommunicator, all_reduce
    from minizero.comm.hierarchical import HierarchicalAllReduce, cross_node_bytes
    from minizero.comm.nodes import NodeTrafficCommunicator

    comm = NodeTrafficCommunicator(MPICommunicator(MPI.COMM_WORLD))
    nodes, N = comm.nodes, comm.world_size
    hier = HierarchicalAllReduce(comm)
    x = np.random.default_rng(comm.rank).integers(-1000, 1000, int(mib * 2 ** 20) // 4).astype(np.float32)
    algorithms = {"ring": lambda: all_reduce(comm, x), "hierarchical": lambda: hier(x)}
    rows, results = {}, {}
    for name, run in algorithms.items():
        results[name] = run()  # warm-up, and the result to compare
        sent0, cross0, times = comm.traffic.bytes_sent, comm.cross_node.bytes_sent, []
        for _ in range(repeats):
            comm.barrier()
            t = time.perf_counter()
            run()
            times.append(comm.mpi_comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        sent = (comm.traffic.bytes_sent - sent0) / repeats
        cross = (comm.cross_node.bytes_sent - cross0) / repeats
        rows[name] = comm.mpi_comm.gather((sent - cross, cross, float(np.median(times))), root=0)
    assert np.array_equal(results["ring"], results["hierarchical"]), "integer-valued sums must agree bitwise"
    if comm.rank != 0:
        return
    S = x.nbytes
    n = nodes.n_nodes
    print(f"{N} ranks on {nodes.describe()} (node of each rank {list(nodes.node_of)}), "
          f"all-reduce of {S / 2 ** 20:g} MiB float32, median of {repeats}\n")
    print("| algorithm | rank | node | sent inside node | sent across nodes |")
    print("|---|---|---|---|---|")
    for name, per_rank in rows.items():
        for r, (inside, across, _) in enumerate(per_rank):
            print(f"| {name} | {r} | {nodes.node_of[r]} | {inside / 2 ** 20:.3f} MiB | {across / 2 ** 20:.3f} MiB |")
    print()
    for name, per_rank in rows.items():
        across = sum(a for _, a, _ in per_rank)
        formula = cross_node_bytes(x.size, x.itemsize, nodes, name)
        print(f"{name:12s}: across nodes {across / n / 2 ** 20:.3f} MiB per node (formula "
              f"{formula / n / 2 ** 20:.3f} MiB = {formula / n / S:.3f} x S), slowest rank "
              f"{per_rank[0][2] * 1e3:.1f} ms")


def launch(hosts: int, slots: int, mib: float, repeats: int) -> int:
    """As root: make the namespace hosts, run this file on them with ``--rank``, clean up."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    from netns import NetnsHosts, unavailable

    from minizero.files import mpiexec_path
    from minizero.interrupts import run_group

    why = unavailable()
    if why:
        print(f"bench_multihost: {why}", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [REPO_ROOT, os.environ.get("PYTHONPATH")] if p))
    program = [sys.executable, os.path.abspath(__file__), "--rank", "--mib", str(mib), "--repeats", str(repeats)]
    with NetnsHosts(hosts, slots) as h:
        proc = run_group(h.mpirun_command(mpiexec_path(), hosts * slots, program), env=h.env(env), timeout=600,
                         cwd=REPO_ROOT, capture_output=False)  # SIGTERM, Ctrl-C: mpiexec and its ranks killed
        wire = sum(h.bytes_into_bridge())
    print(f"\nbytes the hosts sent into the bridge (TCP, headers and launcher included): {wire / 2 ** 20:.1f} MiB")
    return proc.returncode


def main(argv=None) -> int:
    p = _args.parser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=_args.count, default=2, help="namespace hosts (default 2)")
    p.add_argument("--slots", type=_args.count, default=2, help="ranks per host (default 2)")
    p.add_argument("--mib", type=_args.positive_real, default=4.0, help="buffer size in MiB (default 4)")
    p.add_argument("--repeats", type=_args.count, default=5, help="timed all-reduces per algorithm (default 5)")
    p.add_argument("--rank", action="store_true", help="run as one MPI rank (under mpiexec)")
    a = p.parse_args(argv)
    if a.mib * 2 ** 20 > _args.memory_bytes():  # each rank's buffer: a MemoryError in every rank
        p.error(f"--mib {a.mib:g} is above this machine's memory; allowed: up to "
                f"{_args.memory_bytes() / 2 ** 20:,.0f} MiB")
    if a.mib * 2 ** 20 < 4:  # before: an empty buffer, both algorithms run, then a ZeroDivisionError in the table
        p.error(f"--mib {a.mib:g} is below one float32 (4 bytes); allowed: at least {4 / 2 ** 20:.4g} MiB")
    if not a.rank and a.hosts * a.slots > _args.MAX_RANKS:  # before: as root, that many hosts and ranks started
        p.error(f"--hosts {a.hosts} x --slots {a.slots} is {a.hosts * a.slots:,} ranks; allowed: at most "
                f"{_args.MAX_RANKS}")
    if a.rank:
        from minizero.interrupts import start_mpi

        start_mpi()  # a stale launcher: one line, not MPICH's error stack; SIGTERM or time ends a stalled MPI_Init
        rank_main(a.mib, a.repeats)
        return 0
    print(_machine.header(), flush=True)  # date, CPU, BLAS library, kernel, threads
    return launch(a.hosts, a.slots, a.mib, a.repeats)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
