"""INT8 on the wire: quantized reduce-scatter and all-gather (ZeRO++) against the FP32 ring.

    mpirun -n 4 python mpi_examples/quantized_collectives.py

Every rank holds a gradient-like array. The FP32 ring reduce-scatter sends (N-1)/N of it at 4
bytes per element; the quantized one (minizero/comm/quantized.py) sends each other rank its
chunk as INT8 codes plus one FP32 scale per 256 elements, and the receiver sums in full
precision (Wang et al. 2023, ZeRO++, arXiv:2306.10209, sections 3.1 and 3.3). The all-gather
then brings every rank the INT8 version of every shard. Bytes come from each rank's traffic
ledger; errors are checked against the bound: half a scale per quantization.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.comm import all_gather, reduce_scatter, shard_range, world  # noqa: E402
from minizero.comm.quantized import quantized_all_gather, quantized_reduce_scatter  # noqa: E402
from minizero.quantization import element_scale, quantize  # noqa: E402
from _common import require_ranks  # noqa: E402  (mpi_examples/_common.py)

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
comm = world()
require_ranks(comm, comm.world_size >= 2, "at least 2", "quantized_collectives.py")  # 1 rank: nothing to send
N, rank = comm.world_size, comm.rank
n, block = 1_000_003, 256
rng = np.random.default_rng(rank)
grad = (rng.standard_normal(n) * np.exp(rng.uniform(-4, 0, n)) * 1e-3).astype(np.float32)
off, size = shard_range(n, N, rank)


def sent(fn):
    """Run ``fn()``; return its result and the bytes this rank sent meanwhile."""
    before = comm.traffic.bytes_sent
    out = fn()
    return out, comm.traffic.bytes_sent - before


# 1. reduce-scatter: exact (float64 ring) vs INT8 all-to-all
exact, _ = sent(lambda: reduce_scatter(comm, grad.astype(np.float64)))
fp32, b_fp32 = sent(lambda: reduce_scatter(comm, grad))
q8, b_q8 = sent(lambda: quantized_reduce_scatter(comm, grad, block_size=block))
# the bound: what each other rank sent me was off by at most half its block's scale
everyone = all_gather(comm, grad).reshape(N, n)
bound = sum(element_scale(quantize(everyone[j, off:off + size], 8, "block", block)[1], (size,), "block", block) / 2
            for j in range(N) if j != rank)
err = np.abs(q8 - exact)
ok = bool((err <= bound + 1e-6 * np.abs(exact)).all())

# 2. all-gather of the (FP32) shard: exact vs INT8
full32, g_fp32 = sent(lambda: all_gather(comm, fp32, n))
full8, g_q8 = sent(lambda: quantized_all_gather(comm, fp32, n, block_size=block))
gerr = np.abs(full8 - full32).max() / np.abs(full32).max()

stats = all_gather(comm, np.array([b_fp32, b_q8, g_fp32, g_q8, err.max() / np.abs(exact).max(), ok, gerr],
                                  dtype=np.float64)).reshape(N, -1)
if rank == 0:
    print(f"{N} ranks, {n:,} float32 elements per rank, one FP32 scale per {block} elements")
    print(f"{'collective':<16}{'rank':>5}{'FP32 bytes':>14}{'INT8 bytes':>14}{'ratio':>8}{'err/max|x|':>13}")
    for r, (bf, bq, gf, gq, e, good, ge) in enumerate(stats):
        print(f"{'reduce-scatter':<16}{r:>5}{int(bf):>14,}{int(bq):>14,}{bq / bf:>8.3f}{e:>13.2e}")
        print(f"{'all-gather':<16}{r:>5}{int(gf):>14,}{int(gq):>14,}{gq / gf:>8.3f}{ge:>13.2e}")
    assert stats[:, 5].all(), "a quantized reduce-scatter exceeded its error bound"
    print(f"every reduce-scatter element within the bound (sum of the other ranks' scale/2); "
          f"INT8 sends {stats[:, 1].sum() / stats[:, 0].sum():.3f} of the FP32 bytes")
