"""Shared by the data-parallel tests and their MPI script: run a few float64 steps, return what to compare."""
import numpy as np

from minizero.train import parse_args, train

STEPS, ACCUM, CLIP = 3, 2, 0.05  # CLIP is far below the tiny model's gradient norm, so clipping is active


def run(comm, micro_batch, model="tiny", dropout=None):
    """Train ``STEPS`` steps; return step-0 averaged gradients, final parameters and grad norms."""
    argv = ["--model", model, "--dtype", "float64", "--steps", str(STEPS), "--micro-batch-size", str(micro_batch),
            "--grad-accum", str(ACCUM), "--grad-clip", str(CLIP), "--eval-every", "0", "--eval-batches", "1",
            "--lr", "1e-2", "--no-progress", "--seed", "7"]
    if dropout is not None:
        argv += ["--dropout", str(dropout)]
    args = parse_args(argv, comm.world_size)
    grads0 = {}

    def after_grads(step, params, opt=None):
        if step == 0:
            for i, p in enumerate(params):
                grads0[i] = p.grad.copy()

    result = train(args, comm, log=lambda s: None, after_grads=after_grads)
    params = [p.data.copy() for p in result["model"].parameters()]
    return {"grads0": [grads0[i] for i in range(len(params))], "params": params,
            "grad_norms": np.array(result["grad_norms"]), "train_losses": np.array(result["train_losses"])}
