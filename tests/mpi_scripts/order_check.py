"""Ranks that produce gradients in different orders (issue 11, item 1); also runnable under mpiexec.

usage: mpiexec -n N python tests/mpi_scripts/order_check.py OUT_DIR CASE
CASE: ``swap`` (rank r runs the two blocks in order [0, 1] or [1, 0] by the parity of r +
micro-batch) or ``skip`` (rank 1 runs only block 0 in micro-batch 0). Writes OUT_DIR/rank{r}.npz
(DataParallel's averaged gradients and the owned shard of every unit for ZeRO 1 and 2) and
OUT_DIR/rank{r}.json (ZeRO-3's error message), compared by tests/test_faults.py.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.zero import ZeroOrderError, zero_optimizer  # noqa: E402
from minizero.nn.module import Linear, Module, ModuleList  # noqa: E402
from minizero.parallel.data_parallel import DataParallel  # noqa: E402

MICRO_BATCHES = 2


class Block(Module):
    """tanh(W x + b), W (4, 4): one ZeRO unit."""

    def __init__(self, seed):
        super().__init__()
        self.fc = Linear(4, 4, dtype="float64", rng=np.random.default_rng(seed), std=0.5)

    def forward(self, x):
        return self.fc(x).tanh()


class TwoBlocks(Module):
    """Two equal blocks (two units of the same size) run in the order given to forward; loss mean(y^2)."""

    def __init__(self):
        super().__init__()
        self.h = ModuleList([Block(1), Block(2)])

    def forward(self, x, order):
        for i in order:
            x = self.h[i](x)
        return (x * x).mean()


def order(case, rank, mb):
    """The blocks rank ``rank`` runs in micro-batch ``mb``."""
    if case == "swap":
        return [0, 1] if (rank + mb) % 2 == 0 else [1, 0]
    return [0] if (rank == 1 and mb == 0) else [0, 1]


def forward_backward(model, comm, case):
    from minizero.autograd import Tensor
    for mb in range(MICRO_BATCHES):
        x = Tensor(np.random.default_rng(100 * comm.rank + mb).normal(size=(3, 4)))
        (model(x, order(case, comm.rank, mb)) * (1.0 / MICRO_BATCHES)).backward()


def run(comm, case, stage):
    """Stage 0: DataParallel's averaged gradients by parameter name; 1-2: owned shards; 3: the error text."""
    model = TwoBlocks()
    if stage == 0:
        dp = DataParallel(model.parameters(), comm)
        forward_backward(model, comm, case)
        dp.allreduce_gradients()
        return {n: p.grad.copy() if p.grad is not None else np.zeros(p.shape) for n, p in model.named_parameters()}
    opt = zero_optimizer(model, comm, stage)
    try:
        forward_backward(model, comm, case)
        opt.reduce_gradients()
    except ZeroOrderError as exc:
        return str(exc)
    return {"shards": [g.copy() for g in opt.grad_shards()], "map": opt.shard_map}


def expected_shards(dp_grads, shard_map, rank):
    """The slices of DataParallel's averaged gradients that ``rank`` owns, unit by unit."""
    out = []
    for i in range(len(shard_map.units)):
        lo, size = shard_map.shard(i, rank)
        out.append(shard_map.flatten(i, dp_grads)[lo:lo + size])
    return out


if __name__ == "__main__":
    from minizero.comm.communicator import world
    out_dir, case = sys.argv[1], sys.argv[2]
    comm = world()
    dp = run(comm, case, 0)
    arrays = {f"dp:{k}": v for k, v in dp.items()}
    for stage in (1, 2):
        got = run(comm, case, stage)
        if isinstance(got, str):
            raise SystemExit(f"stage {stage}: {got}")
        for i, (g, w) in enumerate(zip(got["shards"], expected_shards(dp, got["map"], comm.rank))):
            arrays[f"z{stage}:{i}"], arrays[f"want:{i}"] = g, w
    np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **arrays)
    err = run(comm, case, 3)
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"stage3": err if isinstance(err, str) else None}, f)
