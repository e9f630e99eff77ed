"""The ZeRO reference run: a few steps of train() at a given stage; also runnable under mpiexec.

usage: mpiexec -n N python tests/mpi_scripts/zero_check.py OUT_DIR STAGE MICRO_BATCH [TRAIN FLAGS...]
writes OUT_DIR/rank{r}.npz (owned gradient shards at step 0, full parameters after the
run, grad norms) and OUT_DIR/rank{r}.json (figures), compared by tests/test_zero.py.
"""
import contextlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minizero.ledger import get_ledger  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402

STEPS, ACCUM, CLIP = 3, 2, 0.05  # CLIP is far below the tiny model's gradient norm, so clipping is active


def run(comm, stage, micro_batch, dtype="float64", steps=STEPS, accum=ACCUM, clip=CLIP, model="tiny", lr=1e-2,
        extra=()):
    """Train ``steps`` steps with ``--zero stage`` (and the flags in ``extra``); return what the tests compare.

    Keys: ``grads0`` (stage 0: the full averaged gradient of every parameter, by name;
    stages 1-3: this rank's owned gradient shard of every unit, step 0, before clipping),
    ``params`` (name -> full parameter after the run), ``grad_norms``, ``train_losses``,
    ``state_bytes`` (ledger at the first optimizer step), ``step_bytes`` (per step, by
    phase; stage 0: the gradient all-reduce), ``peak`` (ledger peaks over the run,
    evaluation included), ``num_params``.
    """
    argv = ["--model", model, "--dtype", dtype, "--steps", str(steps), "--micro-batch-size", str(micro_batch),
            "--grad-accum", str(accum), "--grad-clip", str(clip), "--eval-every", "0", "--eval-batches", "1",
            "--lr", str(lr), "--no-progress", "--seed", "7", "--zero", str(stage), *extra]
    args = parse_args(argv, comm.world_size)
    grads0 = {}

    def after_grads(step, params, opt=None):
        if step == 0:
            if not hasattr(opt, "grad_shards"):  # stage 0: every rank holds the full averaged gradients
                grads0.update({i: p.grad.copy() for i, p in enumerate(params)})
            else:
                grads0.update({f"unit{i}": g.copy() for i, g in enumerate(opt.grad_shards())})

    result = train(args, comm, log=lambda s: None, after_grads=after_grads)
    model, opt, dp = result["model"], result["opt"], result["dp"]
    model = model if model is not None else result["strategy"].stage  # cp: the whole model on rank 0 only
    peak = dict(get_ledger().peak)  # before full_parameters() gathers the whole model
    names = [n for n, _ in model.named_parameters()]  # the order of model.parameters()
    if dp is not None:
        grads0 = {names[i]: g for i, g in grads0.items()}
    with opt.full_parameters() if dp is None else contextlib.nullcontext():
        params = {n: p.data.copy() for n, p in model.named_parameters()}
    return {"grads0": grads0, "params": params, "grad_norms": np.array(result["grad_norms"]),
            "train_losses": np.array(result["train_losses"]), "state_bytes": result["state_bytes"],
            "step_bytes": opt.step_bytes if dp is None  # stage 0: the synchroniser that ran (overlapped or not)
            else [{"all_reduce": result["strategy"].sync.bytes_per_step(steps)}] * steps,
            "peak": peak, "num_params": model.num_parameters()}


if __name__ == "__main__":
    from minizero.comm import world

    out_dir, stage, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    comm = world()
    res = run(comm, stage, micro, extra=tuple(sys.argv[4:]))
    arrays = {f"g:{k}": v for k, v in res["grads0"].items()}
    arrays.update({f"p:{k}": v for k, v in res["params"].items()})
    arrays["grad_norms"] = res["grad_norms"]
    np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"world_size": comm.world_size, "state_bytes": res["state_bytes"], "step_bytes": res["step_bytes"],
                   "peak": res["peak"]}, f)
