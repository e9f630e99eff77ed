"""Run under ``mpiexec -n 2``: messages that must fail with a clear error, results to OUTDIR.

Usage: mpiexec -n 2 python tests/mpi_scripts/comm_faults.py OUTDIR MODE

MODE ``dtypes``: rank 0 all-reduces float32 [1,2,3,4], rank 1 int32 [1,2,3,4]; then
float32 x 8 against float64 x 4. ``stall``: rank 1 stays silent while rank 0 waits for it
with a 1 s timeout. ``native``: rank 0 passes 10 float32, rank 1 nine, to each native collective.
``kinds``: rank 0 sends, rank 1 receives into a buffer of another size, across
the one-message / two-message boundary (``PACK_MAX_BYTES``) both ways, then of the right size. Each rank writes ``OUTDIR/rank{r}.json``: the errors it saw (type,
message), CPU and wall seconds of the wait. The test (tests/test_collectives.py) checks them.
"""
import json
import os
import resource
import sys
import time

import numpy as np

from minizero.comm import all_reduce, world


def attempt(fn):
    try:
        return {"result": np.asarray(fn()).tolist()}
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return {"error": type(e).__name__, "message": str(e)}


def main(outdir, mode):
    comm = world()
    r = comm.rank
    out = {}
    if mode == "dtypes":
        x = np.array([1, 2, 3, 4], dtype=np.float32 if r == 0 else np.int32)
        out["same_size"] = attempt(lambda: all_reduce(comm, x))
        comm.barrier()
        y = np.arange(8, dtype=np.float32) if r == 0 else np.arange(4, dtype=np.float64)
        out["same_bytes"] = attempt(lambda: all_reduce(comm, y))
        out["payload_bytes"] = comm.traffic.bytes_sent
    elif mode == "native":  # rank 0 passes 10 float32 elements, rank 1 nine, to each library collective
        x = np.arange(10 - r, dtype=np.float32)
        out["allreduce"] = attempt(lambda: comm.native_allreduce(x))
        out["reduce_scatter"] = attempt(lambda: comm.native_reduce_scatter(x))
        out["allgather"] = attempt(lambda: comm.native_allgather(x[:5 - r], 10 - r))
        out["bcast"] = attempt(lambda: comm.native_bcast(x))
        out["after"] = attempt(lambda: comm.native_allreduce(np.ones(3)))  # the communicator still works
    elif mode == "kinds":
        from minizero.comm.mpi import PACK_MAX_BYTES

        big = PACK_MAX_BYTES // 4 + 10
        for sent, room in [(16, big), (big, 16), (big, big + 5), (big + 5, big), (16, 8), (big, big), (16, 16)]:
            if r == 0:
                out[f"{sent}->{room}"] = attempt(lambda: comm.send(np.arange(sent, dtype=np.float32), 1, tag=9))
            else:
                y = np.zeros(room, dtype=np.float32)
                out[f"{sent}->{room}"] = attempt(lambda: comm.recv(y, 0, tag=9)[-1])
            comm.barrier()  # every sender finished: a mismatched message was taken off the wire
    elif mode == "stall":
        comm.timeout = 1.0
        waited = os.path.join(outdir, "waited")
        if r == 1:  # sends nothing until rank 0's wait has ended (a fixed 3 s could end first on a loaded machine)
            deadline = time.monotonic() + 60
            while not os.path.exists(waited) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            t0, c0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
            out["recv"] = attempt(lambda: comm.recv(np.empty(4), source=1, tag=7))
            out["wall_s"] = time.monotonic() - t0
            out["cpu_s"] = resource.getrusage(resource.RUSAGE_SELF).ru_utime - c0
            open(waited, "w").close()
    with open(os.path.join(outdir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
