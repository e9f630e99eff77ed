"""Shared by the tensor-, pipeline- and 3D-parallel tests: a few float64 steps, and the comparison.

``run_parallel`` trains on a dp x tp x pp mesh (in threads or under MPI) and returns every
rank's named gradient shards of step 0 and parameter shards after the last step; ``run_single``
trains one process on the same global batches (micro-batch dp*b, M accumulation steps);
``assert_matches`` compares every rank's shards with the matching slices of the reference.
"""
import contextlib
import json
import os
import subprocess
import sys

import numpy as np

from minizero.parallel.tensor_parallel import shard_array
from minizero.train import parse_args, train
from tests.conftest import REPO_ROOT, mpi_env

STEPS, CLIP = 3, 0.05  # CLIP is far below the gradient norm, so clipping (and the global norm) is exercised
GRAD_RTOL, PARAM_RTOL = 1e-12, 2e-12  # measured <= 1.4e-13 of the largest apart (float64)
LOSS_RTOL = 1e-13  # the README (tests/test_readme.py) and lessons 06 and 10 quote these


def base_argv(model, micro_batch, extra=()):
    return ["--model", model, "--dtype", "float64", "--steps", str(STEPS), "--micro-batch-size", str(micro_batch),
            "--grad-clip", str(CLIP), "--eval-every", "0", "--eval-batches", "1", "--lr", "1e-2",
            "--no-progress", "--seed", "7", "--block-size", "16", *extra]


def run_single(comm, model, micro_batch, m, extra=()):
    """One process, micro-batch ``micro_batch``, ``m`` accumulation steps: named grads (step 0) and params."""
    args = parse_args(base_argv(model, micro_batch, extra) + ["--grad-accum", str(m)], 1)
    grads0 = {}

    def after_grads(step, params, opt=None):
        if step == 0:
            grads0.update({id(p): p.grad.copy() for p in params})

    res = train(args, comm, log=lambda s: None, after_grads=after_grads)
    named = list(res["model"].named_parameters())
    return {"grads0": {n: grads0[id(p)] for n, p in named}, "params": {n: p.data.copy() for n, p in named},
            "losses": np.array(res["train_losses"]), "val": res["val_history"][-1][1]}


def run_single_dp(comm, model, micro_batch, m, extra=()):
    """Plain data parallelism over ``comm`` (any --zero in ``extra`` applies): final parameters and losses."""
    args = parse_args(base_argv(model, micro_batch, extra) + ["--grad-accum", str(m)], comm.world_size)
    res = train(args, comm, log=lambda s: None)
    with res["opt"].full_parameters() if hasattr(res["opt"], "full_parameters") else contextlib.nullcontext():
        params = {n: p.data.copy() for n, p in res["model"].named_parameters()}
    return {"params": params, "losses": np.array(res["train_losses"])}


def run_parallel(comm, model, micro_batch, dp, tp, pp, m, schedule="1f1b", extra=()):
    """Train on the mesh (tp x pp > 1); this rank's named shards, their split (dim, stride) and coordinates."""
    args = parse_args(base_argv(model, micro_batch, extra) + ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
                                                              "--micro-batches", str(m), "--schedule", schedule],
                      comm.world_size)
    grads0 = {}

    def after_grads(step, params, opt=None):
        if step != 0:
            return
        if not hasattr(opt, "grad_shards"):
            grads0.update({id(p): p.grad.copy() for p in params})
        else:  # ZeRO: the owned shard of each unit, as flat pieces
            shards = opt.grad_shards()
            grads0["zero"] = [(pc.param, pc.lo, pc.hi, shards[pc.unit][pc.shard_lo:pc.shard_lo + pc.hi - pc.lo].copy())
                              for pc in opt.shard_map.pieces(opt.comm.rank)]

    res = train(args, comm, log=lambda s: None, after_grads=after_grads)  # tp x pp > 1: the 3D loop
    topo, named = res["topo"], list(res["stage"].named_parameters())
    with res["opt"].full_parameters() if hasattr(res["opt"], "full_parameters") else contextlib.nullcontext():
        params = {n: p.data.copy() for n, p in named}
    split = {n: (p.partition_dim, p.partition_stride) if getattr(p, "tensor_model_parallel", False) else None
             for n, p in named}
    out = {"coords": (topo.dp_rank, topo.tp_rank, topo.pp_rank), "tp": tp, "split": split,
           "params": params, "losses": np.array(res["train_losses"]),
           "val": res["val_history"][-1][1], "traffic": res["traffic"],
           "full": None if res["model"] is None else {n: p.data.copy() for n, p in res["model"].named_parameters()}}
    if "zero" in grads0:
        out["zero_grads0"] = grads0["zero"]
    else:
        out["grads0"] = {n: grads0[id(p)] for n, p in named}
    return out


def _ref_name(name):
    """The last stage's copy of the tied head is the reference's ``transformer.wte.weight``."""
    return "transformer.wte.weight" if name == "lm_head.weight" else name


def _reference_slice(ref, name, split, tp_rank, tp):
    full = ref[_ref_name(name)]
    if split is None:
        return full
    return shard_array(full, split[0], tp_rank, tp, split[1])


def assert_matches(ref, results, label):
    """Every rank's gradient and parameter shards equal the reference's slices; every name is covered."""
    covered = set()
    for got in results:
        _, t, _ = got["coords"]
        where = f"{label} rank coords (dp, tp, pp) = {got['coords']}"
        for name, g in got.get("grads0", {}).items():
            a = _reference_slice(ref["grads0"], name, got["split"][name], t, got["tp"])
            np.testing.assert_allclose(g, a, rtol=0, atol=GRAD_RTOL * np.abs(a).max(), err_msg=f"{where}: grad {name}")
        for name, lo, hi, g in got.get("zero_grads0", []):
            a = _reference_slice(ref["grads0"], name, got["split"][name], t, got["tp"]).reshape(-1)[lo:hi]
            scale = np.abs(ref["grads0"][_ref_name(name)]).max()
            np.testing.assert_allclose(g, a, rtol=0, atol=GRAD_RTOL * scale, err_msg=f"{where}: ZeRO grad {name}")
        for name, p in got["params"].items():
            a = _reference_slice(ref["params"], name, got["split"][name], t, got["tp"])
            np.testing.assert_allclose(p, a, rtol=PARAM_RTOL, atol=PARAM_RTOL * np.abs(a).max(),
                                       err_msg=f"{where}: param {name} after {STEPS} steps")
            covered.add(name)
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=LOSS_RTOL, err_msg=f"{where}: train losses")
        np.testing.assert_allclose(got["val"], ref["val"], rtol=LOSS_RTOL, err_msg=f"{where}: validation loss")
    assert covered >= set(ref["params"]), f"{label}: parameters held by no rank: {set(ref['params']) - covered}"
    full = [r["full"] for r in results if r["full"] is not None]
    assert len(full) == 1, "exactly one rank gathers the whole model"
    for name, a in ref["params"].items():
        np.testing.assert_allclose(full[0][name], a, rtol=PARAM_RTOL, atol=PARAM_RTOL * np.abs(a).max(),
                                   err_msg=f"{label}: gathered {name}")


def cli_runs(mpiexec, folder, base, par, one=(), ranks=2) -> dict:
    """``mpiexec -n ranks python -m minizero.train *base *par`` and ``-n 1 ... *base *one``, each ``--out`` a
    folder of ``folder`` (par/, one/), both asserted to exit 0. Returns {"par": its folder, "one": its folder}."""
    out = {}
    for label, n, flags in (("par", ranks, par), ("one", 1, one)):
        out[label] = os.path.join(folder, label)
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "minizero.train", *base, *flags, "--out", out[label]]
        proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def cli_summaries(mpiexec, folder, base, par, one=(), ranks=2) -> dict:
    """:func:`cli_runs`' two summary.json files, {"par": ..., "one": ...}."""
    return {k: json.loads(open(os.path.join(d, "summary.json")).read())
            for k, d in cli_runs(mpiexec, folder, base, par, one, ranks).items()}


def cli_matches_one_process(mpiexec, folder, base, par, one=(), ranks=2):
    """:func:`cli_runs`: both model.npz hold the same names with every weight within 1e-13 of max(1, its largest
    magnitude). Returns the (par, one) output folders."""
    out = {k: dict(np.load(os.path.join(d, "model.npz"))) for k, d in cli_runs(mpiexec, folder, base, par, one,
                                                                               ranks).items()}
    assert set(out["par"]) == set(out["one"])
    for name, a in out["one"].items():
        np.testing.assert_allclose(out["par"][name], a, rtol=0, atol=1e-13 * max(1.0, np.abs(a).max()), err_msg=name)
    return os.path.join(folder, "par"), os.path.join(folder, "one")
