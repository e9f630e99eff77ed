"""ZeRO stages 0-3 side by side: model-state bytes per rank and bytes sent per step, measured.

    mpirun -n 4 python mpi_examples/zero_stages.py [--model small] [--grad-accum 1]

For each stage the main job's own loop (``minizero.train.train``) runs two optimizer steps, with
``--no-overlap`` (blocking gathers: stage 3 holds one gathered block, where the default prefetch holds two).
The memory ledger is read at the first optimizer step (parameters, gradients, optimizer
state: what lives between steps) and its peaks give the transient buffers; the traffic
ledger gives the bytes each rank sends per step for model states. Beside each measured
figure ("formula") is the ZeRO paper's formula for Ψ parameters over N ranks (Rajbhandari et
al. 2020) instantiated for what this script trains, FP32 + Adam (4 + 4 + 8 bytes per parameter):
16, 4 + 4 + 8/N, 4 + 12/N and 16/N bytes per parameter. These are not the paper's own numbers:
its Figure 1 row is mixed-precision Adam, 2 + 2 + 12 bytes per parameter: 16, 4 + 12/N,
2 + 14/N and 16/N; the two agree unsharded (16) and fully sharded (16/N) only because both
layouts happen to total 16. Bytes sent: 2(N-1)/N, 2(N-1)/N, (M+1)(N-1)/N and 3M(N-1)/N of the
gradient bytes with M micro-batches per step; for M = 1 these are the paper's section 7
volumes (7.1: all-reduce 2Ψ; 7.2.1: 2Ψ for P_os+g; 7.2.2: 3Ψ for P_os+g+p), and the factor M
is minizero's count (stage 2 reduce-scatters once per micro-batch, stage 3 gathers twice and
reduce-scatters once per micro-batch). The measured bytes exceed the formula only by the
padding (each flat unit is padded to a multiple of N).
"""
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from threadpoolctl import threadpool_limits  # noqa: E402

from minizero.comm import world  # noqa: E402
from _common import example_parser, require_ranks, train_args  # noqa: E402  (mpi_examples/_common.py)
from minizero.ledger import get_ledger  # noqa: E402
from minizero.numerals import integer  # noqa: E402
from minizero.zero import ShardMap, gather_figures, model_state_formula, traffic_formula  # noqa: E402
from minizero.nn import GPT  # noqa: E402
from minizero.train import model_config, train  # noqa: E402


def stage_argv(stage: int, model: str, accum: int, steps: int = 2) -> list[str]:
    """The main job's flags that train ``steps`` steps at ``--zero stage``."""
    return ["--model", model, "--steps", str(steps), "--grad-accum", str(accum), "--eval-batches", "1",
            "--eval-every", "0", "--no-progress", "--zero", str(stage), "--no-overlap"]  # blocking gathers: ZeRO-3's
    # prefetch would hold two units


def measure(comm, args) -> list[dict]:
    """Train as ``args`` (checked: :func:`stage_argv` through ``train_args``) say; every rank's figures (bytes)."""
    gc.collect()  # the previous stage's model and optimizer (reference cycles through hooks)
    get_ledger().reset_peaks()
    result = train(args, comm, log=lambda s: None)
    sent = result.strategy.model_state_bytes_per_step(args.steps)  # whichever synchroniser ran (DP, overlap, ZeRO)
    peak = get_ledger().peak
    return gather_figures(comm, dict(result["state_bytes"], sent_per_step=sent, gathered_peak=peak["gathered"],
                                     buckets_peak=peak["comm_buffers"]))


def main():
    parser = example_parser(__doc__)
    parser.add_argument("--model", default="small", help="model preset (tiny, small, default, ...)")
    parser.add_argument("--grad-accum", type=integer, default=1, help="micro-batches per optimizer step (M)")
    opts = parser.parse_args()
    threadpool_limits(limits=1)  # many ranks on few cores: one BLAS thread each
    comm = world()
    require_ranks(comm, comm.world_size >= 2, "at least 2", "zero_stages.py")  # one rank shards nothing
    n, kib = comm.world_size, 1024
    stages = [train_args(comm, stage_argv(stage, opts.model, opts.grad_accum), "zero_stages.py") for stage in range(4)]
    cfg = model_config(stages[0])
    sm = ShardMap.from_model(GPT(cfg), n)
    psi = sm.numel
    rows = []
    for stage, args in enumerate(stages):
        figs = measure(comm, args)
        if any(f != figs[0] for f in figs):  # padded shards: every rank holds and sends the same
            raise AssertionError(f"stage {stage}: ranks differ: {figs}")
        rows.append(figs[0])
    if comm.rank:
        return
    print(f"ZeRO on N = {n} ranks: model {opts.model!r}, Ψ = {psi:,} parameters in {len(sm.units)} flat units "
          f"({sm.padded - psi} padding elements),\nfloat32 + Adam, M = {opts.grad_accum} micro-batch(es) per step")
    print("per rank, KiB (1 KiB = 1024 bytes); 'formula' = the ZeRO paper's formulas (Rajbhandari et al. 2020)\n"
          "for FP32 + Adam, 4 + 4 + 8 bytes per parameter, not its Figure 1 row (mixed precision, 2 + 2 + 12);\n"
          "bytes sent: its section 7 volumes, times M micro-batches where a stage pays per micro-batch\n")
    print(f"{'stage':>5} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9} {'formula':>9} {'B/param':>8} "
          f"{'gathered':>9} {'buckets':>9} {'sent/step':>10} {'formula':>9} {'x grads':>8}")
    for stage, f in enumerate(rows):
        total = f["parameters"] + f["gradients"] + f["optimizer_state"]
        formula = model_state_formula(stage, psi, n)["total"]
        sent_formula = traffic_formula(stage, psi, n, 4, opts.grad_accum)
        print(f"{stage:>5} {f['parameters'] / kib:>9.1f} {f['gradients'] / kib:>9.1f} "
              f"{f['optimizer_state'] / kib:>9.1f} {total / kib:>9.1f} {formula / kib:>9.1f} {total / psi:>8.2f} "
              f"{f['gathered_peak'] / kib:>9.1f} {f['buckets_peak'] / kib:>9.1f} {f['sent_per_step'] / kib:>10.1f} "
              f"{sent_formula / kib:>9.1f} {f['sent_per_step'] / (4 * psi):>8.3f}")
    print("\ngathered: peak of stage-3 all-gathered parameters; buckets: peak of gradient communication buffers")
    print("(stage 0: DataParallel's persistent all-reduce buckets; stages 2-3: one unit's bucket during its backward)."
          f"\nOne block is {max(u.padded for u in sm.units if '.h.' in u.name) * 4 / kib:.1f} KiB, the tied "
          f"embedding {next(u.padded for u in sm.units if u.name == 'transformer.wte') * 4 / kib:.1f} KiB.\n"
          "This script runs with --no-overlap (blocking gathers): stage 3 holds at most one block plus the embedding;\n"
          "the main job's default (prefetch: the next block's all-gather runs while one block computes) holds two\n"
          "blocks plus the embedding (lesson 02, section 7).")


if __name__ == "__main__":
    main()
