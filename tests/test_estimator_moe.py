"""MoE in the estimator's "minizero" accounting against the trainer's own ledgers: the MoE layer replicated in
the tensor group (tp, tp x ep) and ZeRO with --ep (ExpertZero's two optimizers: buckets and scratch)."""
import pytest

from minizero.callbacks import Callback
from minizero.comm import run_in_threads
from minizero.ledger import MemoryLedger, get_ledger, set_ledger
from minizero.loop import train
from minizero.memory.estimator import (CATEGORIES, ModelShape, Strategy, comm_bytes_per_step, estimate_memory,
                                       stage_expert_parameters, stage_parameters)
from minizero.nn import get_config
from minizero.parallel.expert_parallel import MoEConfig
from minizero.train import parse_args

#: capacity factor 0.25: every expert fills its C slots on every rank (the routed rows are then exact)
MOE = ["--model", "tiny", "--dtype", "float64", "--eval-batches", "1", "--eval-every", "0", "--progress", "none",
       "--seed", "3", "--no-save", "--sample-tokens", "0", "--micro-batch-size", "2", "--moe-experts", "4",
       "--moe-top-k", "2", "--moe-capacity-factor", "0.25"]
STATES = ("parameters", "gradients", "optimizer_state")


def _run(comm, flags, steps=2):
    """The ledger's model states after the second step's gradients, its peaks over the steps, and the bytes sent
    in the last step (the dp and tp groups' totals at its end minus those at the step before's end)."""
    set_ledger(MemoryLedger())
    args = parse_args([*MOE, "--steps", str(steps), *flags], comm.world_size)
    seen, sent = {}, []

    class Peaks(Callback):
        def on_train_start(self, run):
            get_ledger().reset_peaks()

        def on_step_end(self, run, step, record):  # no validation between steps (--eval-every 0)
            traffic = run.strategy.traffic()
            sent.append({g: traffic[g]["bytes_sent"] for g in ("dp", "tp")})

        def on_train_end(self, run):
            seen.update({c: v for c, v in get_ledger().peak.items() if c not in STATES})

    def after_grads(step, params, opt):
        if step == 1:
            seen.update({c: get_ledger().current[c] for c in STATES})
    train(args, comm, log=lambda s: None, after_grads=after_grads, callbacks=[Peaks()])
    return args, comm.rank // (comm.world_size // args.pp), seen, {g: sent[-1][g] - sent[-2][g] for g in sent[-1]}


#: the cases both tests below check: (n, flags) -> the results of one 3-step run with the order check off
SHARED = [(4, ["--tp", "2"]), (4, ["--tp", "2", "--ep", "2", "--moe-every", "2", "--grad-accum", "2"]),
          (8, ["--tp", "2", "--dp", "4", "--ep", "2", "--zero", "2"])]
_SHARED = {}


def _runs(n, flags, steps):
    """``run_in_threads(n, _run, flags, steps)``; a case both tests below check runs once (3 steps: the second
    step's states are the same, the peaks a steady state's)."""
    if (n, flags) not in SHARED:
        return run_in_threads(n, _run, flags, steps, timeout=100)
    key = (n, *flags)
    if key not in _SHARED:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")  # ZeRO's order check would add its headers' bytes
            _SHARED[key] = run_in_threads(n, _run, flags, 3, timeout=100)
    return _SHARED[key]


def _shape_and_strategy(args):
    moe = MoEConfig(args.moe_experts, args.moe_top_k, args.moe_capacity_factor, args.moe_every)
    st = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, zero=args.zero, precision="fp64",
                  micro_batch=args.micro_batch_size, micro_batches=args.grad_accum, recompute=args.recompute,
                  overlap=args.overlap, dp_shard=args.dp_shard)
    return ModelShape.from_gpt_config(get_config("tiny"), moe=moe), st


def _exact_but_scratch(results):
    for args, stage, seen, _ in results:
        seen = dict(seen)  # (a shared run's: left as it was)
        shape, st = _shape_and_strategy(args)
        est = estimate_memory(shape, st, accounting="minizero", stage=stage).as_dict()
        assert 0 < seen.pop("comm_scratch") <= est.pop("comm_scratch")  # a bound under tp (estimator/scratch.py)
        assert {c: seen.get(c, 0) for c in CATEGORIES if c in est} == est


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,flags", [
    *SHARED[:2],  # (--tp 2 with a data group of 2: its plain DP buckets too)
    (4, ["--tp", "2", "--ep", "2", "--recompute", "full"]),
    (4, ["--tp", "2", "--ep", "2", "--zero", "1"]),
    (4, ["--tp", "2", "--ep", "2", "--zero", "2"]),
    SHARED[2],
    (8, ["--tp", "2", "--dp", "4", "--ep", "2", "--zero", "2", "--no-overlap", "--moe-every", "2"]),
    (8, ["--tp", "2", "--dp", "2", "--pp", "2", "--ep", "2", "--zero", "1"]),
    (8, ["--tp", "2", "--dp", "4", "--ep", "2", "--zero", "3"]),
])
def test_moe_under_tp_equals_the_trainers_ledger(n, flags):
    """The trainer keeps each MoE layer whole in the tensor group: the estimate's parameters, gradients, Adam's
    state, routed activations, DP and ZeRO buckets per rank and stage equal the ledger's (the paper accounting
    splits the experts by t, as Megatron-Core does); the collectives' scratch is a bound under tp, as for dense
    models."""
    _exact_but_scratch(_runs(n, flags, 2))
    shape, st = _shape_and_strategy(parse_args([*MOE, *flags], n))
    paper, mine = (stage_parameters(shape, st, accounting=a) for a in ("paper", "minizero"))
    assert mine - paper == stage_expert_parameters(shape, st, accounting="minizero") // 2 > 0  # t = 2: half each


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,flags", [*SHARED,  # (the second with 2 micro-batches a step)
                                     (8, ["--tp", "2", "--dp", "4", "--ep", "2", "--zero", "1", "--moe-every", "2"])])
def test_moe_traffic_under_tp_equals_the_trainers(n, flags, monkeypatch):
    """Bytes per step and rank (the third step's, as _run counts them): the tensor group's exactly (the attention's
    all-reduces only in an MoE block), the data group's (its expert groups' all-to-alls included) within the few
    bytes of its per-step bookkeeping (the experts' gradients whole on each tensor rank; ZeRO, whose rings the
    formula counts: plain DP's small all-reduces are recursive doubling, more bytes at N = 4)."""
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")  # ZeRO's order check would add its headers' bytes
    for args, _, _, step in _runs(n, flags, 3):
        shape, st = _shape_and_strategy(args)
        est = comm_bytes_per_step(shape, st, accounting="minizero")
        assert step["tp"] == est["tp"], (step, est)
        # the expert groups split the data group: its ledger holds their bytes, and both optimizers' bookkeeping
        assert 0 <= step["dp"] - est["dp"] - est["ep"] <= 16, (step, est)


@pytest.mark.usefixtures("ring_all_reduce")  # the replica hop by the ring, as the formula counts
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--ep", "2", "--zero", "1", "--dp-shard", "2"],
                                   ["--ep", "2", "--zero", "3", "--dp-shard", "2"]])
def test_moe_traffic_under_hybrid_sharding_equals_the_trainers(flags, monkeypatch):
    """4 ranks, 2 shard groups of 2: both optimizers' reduce-scatters and gathers inside a shard group (the experts'
    over its 1 rank that holds them: none) and each shard's all-reduce across the 2 replicas, per step and rank."""
    monkeypatch.setenv("MINIZERO_DEBUG_COLLECTIVES", "0")
    for args, _, _, step in run_in_threads(4, _run, flags, 3, timeout=100):
        shape, st = _shape_and_strategy(args)
        est = comm_bytes_per_step(shape, st, accounting="minizero")
        assert est["dp"] > 0 and 0 <= step["dp"] - est["dp"] - est["ep"] <= 16, (step, est)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--ep", "2", "--zero", "2"], ["--ep", "2", "--zero", "2", "--moe-every", "2"],
                                   ["--ep", "2", "--zero", "2", "--no-overlap"], ["--ep", "2", "--zero", "1"],
                                   ["--ep", "2"], ["--ep", "4"],
                                   ["--ep", "2", "--moe-every", "2", "--grad-accum", "2"],
                                   ["--ep", "2", "--zero", "3"], ["--ep", "2", "--zero", "3", "--no-overlap"],
                                   ["--ep", "4", "--zero", "3", "--recompute", "full"],
                                   ["--zero", "3"], ["--zero", "3", "--no-overlap", "--moe-every", "2"],
                                   ["--zero", "3", "--recompute", "full"],
                                   ["--ep", "2", "--zero", "2", "--dp-shard", "2"],
                                   ["--ep", "2", "--zero", "3", "--dp-shard", "2", "--no-overlap"]])
def test_dp_and_zero_with_moe_equal_the_ledger(flags):
    """4 ranks: with --ep, ExpertZero reduces the dense units over the 4 data ranks and each MoE layer's experts over
    its 4/ep expert-data ranks, two optimizers with their own buckets and, overlapped, their own in-flight receive
    chunks (a dense and an expert chunk alive together) and prefetches; ExpertDataParallel two sets of buckets
    (none over one expert-data rank). ZeRO-3 (any ep): each MoE unit's forward gather stays alive to its backward
    (the expert products save slices of it). Every category, the scratch included, to the byte."""
    for args, _, seen, _ in run_in_threads(4, _run, flags, timeout=100):
        shape, st = _shape_and_strategy(args)
        est = estimate_memory(shape, st, accounting="minizero").as_dict()
        if "--dp-shard" in flags:  # hybrid sharding: the replicas' all-reduce scratch a bound (test_zero_hybrid.py)
            assert 0 < seen.pop("comm_scratch") <= est.pop("comm_scratch")
        assert {c: seen.get(c, 0) for c in CATEGORIES if c in est} == est
