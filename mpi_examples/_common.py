"""What every example shares: its flag parser, the rank-count check and printing whole lines in rank order.

Not an example itself (the leading underscore keeps it out of ``mpi_examples/*.py`` runs).
"""
import sys

import numpy as np


def example_parser(doc: str):
    """The example's argparse parser: its refusals are one ``EXAMPLE: error: ...`` line (status 2), and ``--help``
    and the refusals are printed by launched rank 0 alone (every rank parses the same flags and exits alike; under
    mpirun each rank printed its own usage block and error). MPI need not be started yet."""
    from minizero.launcher import launched_rank, launcher_connected
    from minizero.numerals import OneLineParser
    parser = OneLineParser(description=doc.split("\n\n")[0])
    parser.quiet = launched_rank() != 0 and launcher_connected()  # a stale PMI_RANK in a shell: not quiet
    return parser


def require_ranks(comm, ok: bool, need: str, example: str) -> None:
    """Exit at once with status 2 unless ``ok``; rank 0 prints one line saying how many ranks are needed.

    ``need``: the allowed counts in words (``"2 or 4"``, ``"at least 2"``); ``example``: the
    file name, used in the suggested command. Every rank knows the world size, so every rank
    exits without sending a message (no rank is left waiting for a peer).
    """
    if ok:
        return
    if comm.rank == 0:
        sys.stderr.write(f"{example}: needs {need} ranks, got {comm.world_size}; "
                         f"run it as: mpirun -n {need.split()[-1]} python mpi_examples/{example}\n")
        sys.stderr.flush()
    sys.exit(2)


def train_args(comm, argv: list, example: str):
    """The main job's ``parse_args(argv)`` at this world size, or exit at once with status 2, rank 0 printing the
    refusal as ``EXAMPLE: error: ...`` (one message, no traceback). Every rank parses the same flags and reaches
    the same verdict, so no rank is left waiting for a peer. Call it for every configuration before the first."""
    from minizero.train import UsageError, parse_args
    try:
        return parse_args(argv, comm.world_size)
    except UsageError as e:
        if comm.rank == 0:
            sys.stderr.write(f"{example}: error: {e}\n")
            sys.stderr.flush()
        sys.exit(2)


def say(comm, text: str) -> None:
    """Rank 0 prints ``text`` as one write (a line from another rank cannot cut into it)."""
    if comm.rank == 0:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def print_in_rank_order(comm, text: str) -> None:
    """Collective: rank 0 prints every rank's ``text``, rank 0's first, as one write.

    Each rank sends its text (UTF-8 bytes, length first) to rank 0 with point-to-point
    messages, so lines never interleave mid-line however the launcher forwards output.
    The messages are counted in the traffic ledger like any other (take ledger snapshots
    before calling this).
    """
    data = np.frombuffer(text.encode(), np.uint8)
    if comm.rank != 0:
        comm.send(np.array([data.size], np.int64), 0)
        if data.size:
            comm.send(data.copy(), 0)
        return
    parts = [text]
    for r in range(1, comm.world_size):
        n = int(comm.recv(np.empty(1, np.int64), r)[0])
        parts.append(bytes(comm.recv(np.empty(n, np.uint8), r)).decode() if n else "")
    say(comm, "\n".join(parts))
