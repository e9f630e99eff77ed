"""Run under mpiexec: the tensor/pipeline/3D reference run on MPI, one pickle per rank in OUT_DIR.

usage: mpiexec -n N python tests/mpi_scripts/mp_check.py OUT_DIR MODEL MICRO_BATCH DP TP PP M SCHEDULE
Each rank writes OUT_DIR/rank{r}.pkl: what ``tests.mp_reference.run_parallel`` returns
(named gradient and parameter shards, coordinates, traffic per group); tests/test_3d.py compares.
"""
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.comm import world  # noqa: E402
from tests import mp_reference  # noqa: E402

out_dir, model, micro, dp, tp, pp, m, schedule = sys.argv[1:9]
comm = world()
res = mp_reference.run_parallel(comm, model, int(micro), int(dp), int(tp), int(pp), int(m), schedule)
with open(os.path.join(out_dir, f"rank{comm.rank}.pkl"), "wb") as f:
    pickle.dump(res, f)
