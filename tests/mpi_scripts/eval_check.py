"""Run under mpiexec -n 4: dp 2 x tp 2 with ZeRO-3 evaluates a 1-row batch (data rank 1 has no row).

usage: mpiexec -n 4 python tests/mpi_scripts/eval_check.py OUT_DIR — each rank writes OUT_DIR/rank{r}.txt.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.comm import world  # noqa: E402
from tests.test_loop import _eval_one_row  # noqa: E402

comm = world()
loss = _eval_one_row(comm, ["--dp", "2", "--tp", "2", "--zero", "3"])
with open(os.path.join(sys.argv[1], f"rank{comm.rank}.txt"), "w") as f:
    f.write(repr(loss))
