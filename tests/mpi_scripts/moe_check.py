"""Run under ``mpiexec -n N``: one forward and backward of MoELayer with its experts over the N ranks.

Usage: mpiexec -n N python tests/mpi_scripts/moe_check.py OUTDIR TOP_K
Rank r runs on batch r of tests/test_moe.py's ``_batches`` (rebuilt here) and writes ``OUTDIR/rank{r}.npz``
(out, x_grad, aux, router_grad, w1_grad, w2_grad, counts, dropped); tests/test_moe.py compares with one process.
"""
import sys

import numpy as np

from minizero.autograd import Tensor
from minizero.comm import world
from minizero.parallel.moe import MoELayer


def main(outdir, k):
    comm = world()
    n, t, c = comm.world_size, 12, 6
    rng = np.random.default_rng(1)  # tests/test_moe.py: _batches(n, t, c)
    xs = [rng.normal(size=(t, c)) for _ in range(n)]
    ws = [rng.normal(size=(t, c)) for _ in range(n)]
    layer = MoELayer(n_embd=c, hidden=5, num_experts=4, top_k=k, capacity_factor=1.0, seed=3, comm=comm)
    xt = Tensor(xs[comm.rank], requires_grad=True)
    out = layer(xt)
    ((out * Tensor(ws[comm.rank])).sum() + layer.aux_loss).backward()
    np.savez(f"{outdir}/rank{comm.rank}.npz", out=out.data, x_grad=xt.grad, router_grad=layer.router.grad,
             w1_grad=layer.w1.grad, w2_grad=layer.w2.grad, counts=layer.expert_counts, dropped=layer.dropped,
             aux=layer.aux_loss.item())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
