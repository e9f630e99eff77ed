"""Run under mpiexec: the data-parallel reference run on MPI, one .npz per rank in OUT_DIR.

usage: mpiexec -n N python tests/mpi_scripts/dp_check.py OUT_DIR MICRO_BATCH
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.comm import world  # noqa: E402
from tests import dp_reference  # noqa: E402

out_dir, micro = sys.argv[1], int(sys.argv[2])
comm = world()
res = dp_reference.run(comm, micro)
arrays = {f"g{i}": g for i, g in enumerate(res["grads0"])}
arrays.update({f"p{i}": p for i, p in enumerate(res["params"])})
np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **arrays)
with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
    json.dump({"world_size": comm.world_size, "bytes_sent": comm.traffic.bytes_sent}, f)
