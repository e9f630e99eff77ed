"""Data parallelism and ZeRO when ranks run different graphs (issue 26, case 2); also runnable under mpiexec.

Two models, each trained ``STEPS`` AdamW steps (weight decay on) over 2 ranks:

* ``blocks``: tests/mpi_scripts/partial_units_check.py's blocks, 2 micro-batches a step, used as
  :func:`uses` says: block 1 by rank 0 only (rank 1 skips it), block 2's lin2 by rank 0 in one
  micro-batch of step 1 only (no rank touches it in steps 0 and 2), block 3's lin2 never;
* ``gpt``: the tiny GPT (float64) whose block 1 rank 1 skips in its forward (the issue's case).

The reference is one process that runs every rank's forwards with that rank's control flow,
each loss divided by the number of ranks and micro-batches: the average, a rank without a
gradient counting as zeros; a parameter that got no gradient is skipped by AdamW.

usage: mpiexec -n 2 python tests/mpi_scripts/rank_dependent_check.py OUT_DIR
writes OUT_DIR/rank{r}.npz (``CASE:name`` -> parameter after training; ``error:CASE`` -> the
ZeroOrderError message of stage 3), compared by tests/test_unused_parameters.py.
"""
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.autograd import Tensor  # noqa: E402
from minizero.zero import ZeroOrderError, zero_optimizer  # noqa: E402
from minizero.nn import GPT, Module, get_config  # noqa: E402
from minizero.optim import AdamW  # noqa: E402
from minizero.parallel.data_parallel import DataParallel  # noqa: E402
from minizero.parallel.overlap import OverlappedReducer  # noqa: E402
from tests.mpi_scripts.partial_units_check import ROWS, WIDTH, Blocks  # noqa: E402

STEPS, LR, DECAY = 3, 1e-2, 0.1
MICRO = {"blocks": 2, "gpt": 1}  # micro-batches per step
BUCKET = {"blocks": 300, "gpt": 4096}  # DataParallel bucket bytes: several buckets, so their order matters
#: (model, stage, overlap): stage 0 is DataParallel + AdamW (overlap: the OverlappedReducer)
CASES = [(m, s, o) for m in ("blocks", "gpt") for s, o in ((0, False), (0, True), (1, False), (2, False), (2, True))]


def uses(step, rank, k):
    """Per block of the ``blocks`` model in micro-batch ``k``: 0 skipped, 1 lin1 only, 2 lin1 and lin2."""
    return (2, 2 if rank == 0 else 0, 2 if (step, rank, k) == (1, 0, 1) else 1, 1)


class Skippable(Module):
    """Runs ``inner`` or, when ``skip`` is set, passes its input through: control flow a rank decides."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.skip = inner, False

    def forward(self, x):
        return x if self.skip else self.inner(x)


def build(kind):
    if kind == "blocks":
        return Blocks(4)
    model = GPT(get_config("tiny", dtype="float64"), seed=0)
    h = model.transformer["h"]
    setattr(h, "1", Skippable(h[1]))  # a child module, assigned (the model's code is unchanged)
    return model


def forward_backward(model, kind, step, rank, world_size, k, scale):
    """Rank ``rank``'s micro-batch ``k`` of ``step``, with that rank's control flow; loss times ``scale``."""
    if kind == "blocks":
        x = np.random.default_rng(1000 * step + 10 * rank + k).standard_normal((ROWS, WIDTH))
        out = model(Tensor(x), uses(step, rank, k))
        loss = (out * out).sum() + out.sum()
    else:
        tokens = np.random.default_rng(step).integers(0, 256, (2 * world_size, 17))
        rows = tokens[rank::world_size]
        model.transformer["h"][1].skip = rank == 1
        loss = model(rows[:, :-1], rows[:, 1:])[1]
    (loss * scale).backward()


def train(comm, kind, stage, overlap):
    """``STEPS`` steps on this rank; {name: parameter} after them (stage 3: the ZeroOrderError's message)."""
    model = build(kind)
    m, reducer = MICRO[kind], None
    if stage == 0:
        dp = DataParallel(model.parameters(), comm, bucket_bytes=BUCKET[kind])
        opt = AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        reducer = OverlappedReducer(dp) if overlap else None
        reduce = reducer.finish if overlap else dp.allreduce_gradients
    else:
        opt = zero_optimizer(model, comm, stage, lr=LR, weight_decay=DECAY, overlap_reduce=overlap,
                            prefetch=overlap)  # overlap: the CLI's default (stage 3 prefetches too)
        reduce = opt.reduce_gradients
    try:
        for step in range(STEPS):
            if reducer is not None:
                reducer.begin_step(m)
            for k in range(m):
                forward_backward(model, kind, step, comm.rank, comm.world_size, k, 1.0 / m)
            reduce()
            opt.step()
            opt.zero_grad() if stage else model.zero_grad()
    except ZeroOrderError as exc:
        return str(exc)
    with opt.full_parameters() if stage else contextlib.nullcontext():
        return {name: np.array(p.data) for name, p in model.named_parameters()}


def reference(kind, world_size=2):
    """One process: every rank's micro-batches, each loss / (ranks x micro-batches); {name: parameter}."""
    model = build(kind)
    opt = AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    m = MICRO[kind]
    for step in range(STEPS):
        for rank in range(world_size):
            for k in range(m):
                forward_backward(model, kind, step, rank, world_size, k, 1.0 / (m * world_size))
        opt.step()
        model.zero_grad()
    return {name: p.data.copy() for name, p in model.named_parameters()}


if __name__ == "__main__":
    from minizero.comm import world

    out_dir = sys.argv[1]
    comm = world()
    arrays = {}
    for kind, stage, overlap in CASES + [("blocks", 3, False), ("blocks", 3, True)]:
        case = f"{kind}:{stage}:{int(overlap)}"
        got = train(comm, kind, stage, overlap)
        if isinstance(got, str):
            arrays["error:" + case] = np.array(got)
        else:
            arrays.update({f"{case}:{name}": v for name, v in got.items()})
    np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **arrays)
