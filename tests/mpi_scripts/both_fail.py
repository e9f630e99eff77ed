"""Run under ``mpiexec -n 2``: every rank's training raises at once (a bug, not a diagnosis).

The test (tests/test_reliability.py) checks that both tracebacks reach stderr whole.
"""
import sys

import minizero.train as T


def _deep(n, rank):
    if n == 0:
        raise RuntimeError(f"boom on rank {rank} " + "x" * 200)
    return _deep(n - 1, rank)


def _failing_train(args, comm, log=print):
    _deep(15, comm.rank)


T.train = _failing_train
sys.exit(T.main(sys.argv[1:]))
