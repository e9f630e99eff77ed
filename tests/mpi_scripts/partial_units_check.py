"""ZeRO with units used only partly in some micro-batches (issue 26, case 1); also runnable under mpiexec.

A model of blocks (one ZeRO unit each: lin1, lin2); per micro-batch and block a *use* says how
much of the block runs: 0 skips it, 1 runs lin1 only, 2 runs lin1 then lin2. Every rank runs
the same pattern (rank-dependent control flow is tests/test_unused_parameters.py's).

usage: mpiexec -n N python tests/mpi_scripts/partial_units_check.py OUT_DIR
writes OUT_DIR/rank{r}.npz: for every case ``pattern:order:stage:overlap``, the rank's owned
gradient shards after ``reduce_gradients`` (``g:`` + case) and the full parameters after one
AdamW step (``p:`` + case + ``:`` + name), compared by tests/test_zero_partial_units.py.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.autograd import Tensor  # noqa: E402
from minizero.zero import ShardMap, zero_optimizer  # noqa: E402
from minizero.nn import Linear, Module, ModuleList  # noqa: E402
from minizero.optim import AdamW  # noqa: E402

WIDTH, ROWS, LR, DECAY = 6, 3, 1e-2, 0.1

#: per micro-batch, per block: 0 block skipped, 1 lin1 only, 2 lin1 and lin2
PATTERNS = {
    "lin2_unused_then_used": [(1,), (2,)],  # the minimal case
    "lin2_used_then_unused": [(2,), (1,)],
    "lin2_unused_in_one_of_four": [(2, 2), (1, 2), (2, 2), (2, 1)],  # the case: four micro-batches
    "block_unused_in_a_whole_micro_batch": [(2, 2, 2), (2, 0, 2), (2, 2, 2)],
    "block_unused_in_the_last": [(2, 2), (2, 0)],
    "block_unused_in_the_first": [(0, 2), (2, 2)],
    "lin2_unused_in_every": [(1, 1), (1, 1)],
}
#: how the micro-batches' forwards and backwards interleave
ORDERS = {
    "forward_backward": "forward, backward, forward, backward, ... (the training loop's)",
    "forwards_first": "every micro-batch's forward, then their backwards in the same order",
    "two_backwards": "each micro-batch's loss in two parts, two backward passes of one forward (retain_graph)",
}


class Block(Module):
    def __init__(self, rng):
        super().__init__()
        self.lin1 = Linear(WIDTH, WIDTH, dtype="float64", rng=rng, std=0.5)
        self.lin2 = Linear(WIDTH, WIDTH, dtype="float64", rng=rng, std=0.5)

    def forward(self, x, use):
        h = self.lin1(x).tanh()
        return self.lin2(h).tanh() if use == 2 else h


class Blocks(Module):
    def __init__(self, n):
        super().__init__()
        rng = np.random.default_rng(0)
        self.h = ModuleList([Block(rng) for _ in range(n)])

    def forward(self, x, uses):
        for block, use in zip(self.h, uses):
            if use:
                x = block(x, use)
        return x


def _inputs(rank, micro_batches):
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal((ROWS, WIDTH)) for _ in range(micro_batches)]


def _accumulate(model, xs, pattern, order, scale):
    """Forward and backward of every micro-batch (loss = sum(out^2) + sum(out), times ``scale``)."""
    def parts(out):
        return (out * out).sum() * scale, out.sum() * scale

    if order == "forwards_first":
        outs = [model(Tensor(x), uses) for x, uses in zip(xs, pattern)]
        for out in outs:
            a, b = parts(out)
            (a + b).backward()
        return
    for x, uses in zip(xs, pattern):
        a, b = parts(model(Tensor(x), uses))
        if order == "two_backwards":
            a.backward(retain_graph=True)
            b.backward()
        else:
            (a + b).backward()


def run(comm, stage, pattern, order, overlap):
    """One step at ZeRO ``stage``: (owned gradient shards concatenated, {name: parameter after one AdamW step})."""
    pattern = PATTERNS[pattern]
    model = Blocks(len(pattern[0]))
    opt = zero_optimizer(model, comm, stage, lr=LR, weight_decay=DECAY, overlap_reduce=overlap)
    _accumulate(model, _inputs(comm.rank, len(pattern)), pattern, order, 1.0 / len(pattern))
    opt.reduce_gradients()
    shards = np.concatenate([np.asarray(g).ravel() for g in opt.grad_shards()])
    opt.step()
    with opt.full_parameters():
        return shards, {k: np.array(p.data) for k, p in model.named_parameters()}


def reference(world_size, pattern, order):
    """One process: the mean over ranks of each rank's accumulated gradients, then one AdamW step.

    Returns (each rank's owned slice of the gradients, as ``run`` returns them; {name: parameter}).
    """
    pattern = PATTERNS[pattern]
    model = Blocks(len(pattern[0]))
    for r in range(world_size):
        _accumulate(model, _inputs(r, len(pattern)), pattern, order, 1.0 / (len(pattern) * world_size))
    grads = {k: (p.grad if p.grad is not None else np.zeros(p.shape)) for k, p in model.named_parameters()}
    sm = ShardMap.from_model(model, world_size)
    shards = []
    for r in range(world_size):
        mine = []
        for i in range(len(sm.units)):
            off, size = sm.shard(i, r)
            mine.append(sm.flatten(i, grads)[off:off + size])
        shards.append(np.concatenate(mine))
    AdamW(model.parameters(), lr=LR, weight_decay=DECAY).step()
    return shards, {k: p.data.copy() for k, p in model.named_parameters()}


CASES = [(p, o, s, v) for p in PATTERNS for o in ORDERS for s in (1, 2, 3) for v in (False, True) if s > 1 or not v]

if __name__ == "__main__":
    from minizero.comm import world

    out_dir = sys.argv[1]
    comm = world()
    arrays = {}
    for pattern, order, stage, overlap in CASES:
        case = f"{pattern}:{order}:{stage}:{int(overlap)}"
        arrays["g:" + case], params = run(comm, stage, pattern, order, overlap)
        arrays.update({f"p:{case}:{k}": v for k, v in params.items()})
    np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **arrays)
