"""Run under ``mpiexec -n N``: hand-written vs native vs NumPy collectives, results to OUTDIR.

Usage: mpiexec -n N python tests/mpi_scripts/collectives_check.py OUTDIR

Every rank builds every rank's input from a seed, so it can compute the NumPy
reference itself. Rank r writes ``OUTDIR/rank{r}.npz`` (arrays keyed
``"<op>:<impl>:<dtype>:<n>"`` with impl in ring/native/ref) and ``OUTDIR/rank{r}.json``
(bytes sent per call, and the expected counts from ``bytes_sent``). The test
(tests/test_collectives.py) compares them; this script asserts nothing itself.
"""
import json
import os
import sys

import numpy as np

from minizero.comm import all_gather, all_reduce, broadcast, bytes_sent, reduce_scatter, shard_range, world


def inputs(n, dtype, world_size):
    """Every rank's input, (world_size, n), rounded to ``dtype``."""
    return np.stack([np.random.default_rng([r, n]).standard_normal(n) for r in range(world_size)]).astype(dtype)


def main(outdir):
    comm = world()
    N, r = comm.world_size, comm.rank
    arrays, traffic = {}, {}

    def run(key, fn, *args, **kwargs):
        comm.traffic.reset()
        arrays[key] = np.array(fn(comm, *args, **kwargs))
        traffic[key] = comm.traffic.bytes_sent

    for dtype in ["float64", "float32", "float16"]:
        for n in sorted({0, 1, N - 1, N + 1, 1000, 12345}):
            xs = inputs(n, dtype, N)
            total = xs.astype(np.float64).sum(axis=0)
            off, size = shard_range(n, N, r)
            root = N - 1
            tag = f"{dtype}:{n}"
            for impl, native in [("ring", False), ("native", True)]:
                run(f"all_reduce:{impl}:{tag}", all_reduce, xs[r].copy(), native=native)
                run(f"reduce_scatter:{impl}:{tag}", reduce_scatter, xs[r].copy(), native=native)
                run(f"all_gather:{impl}:{tag}", all_gather, xs[r][off:off + size].copy(), n, native=native)
                run(f"broadcast:{impl}:{tag}", broadcast, xs[r].copy(), root=root, native=native)
            arrays[f"all_reduce:ref:{tag}"] = total
            arrays[f"reduce_scatter:ref:{tag}"] = total[off:off + size]
            spans = [shard_range(n, N, q) for q in range(N)]
            arrays[f"all_gather:ref:{tag}"] = np.concatenate([xs[q][o:o + s] for q, (o, s) in enumerate(spans)])
            arrays[f"broadcast:ref:{tag}"] = xs[root]
            itemsize = np.dtype(dtype).itemsize
            for op in ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]:
                traffic[f"{op}:expected:{tag}"] = bytes_sent(op, n, itemsize, N, r, root=root)

    # Split into even and odd ranks (new ranks in reverse order); all-reduce inside each group.
    comm.traffic.reset()
    sub = comm.split(color=r % 2, key=-r)
    members = [q for q in range(N) if q % 2 == r % 2]
    x = inputs(1000, "float64", N)
    arrays["split:ring"] = all_reduce(sub, x[r].copy())
    arrays["split:ref"] = x[members].sum(axis=0)
    meta = {"rank": r, "world_size": N, "sub_rank": sub.rank, "sub_world_size": sub.world_size,
            "sub_expected_rank": sorted(members, reverse=True).index(r),
            "sub_bytes": sub.traffic.bytes_sent, "world_bytes_after_split": comm.traffic.bytes_sent}

    np.savez(os.path.join(outdir, f"rank{r}.npz"), **arrays)
    with open(os.path.join(outdir, f"rank{r}.json"), "w") as f:
        json.dump({"traffic": traffic, "meta": meta}, f)
    comm.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
