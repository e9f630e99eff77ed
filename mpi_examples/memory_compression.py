"""Memory compression side by side: recompute, FP16 and offload, per rank, measured.

    mpirun -n 2 python mpi_examples/memory_compression.py [--model small] [--steps 3]

For each configuration the main job's own loop (``minizero.train.train``, data parallel over
every rank) trains a few steps from the same seed. Each rank then reports the peaks of its
memory ledger by category, the ledger's peak total, the process peak measured by tracemalloc,
and the bytes it sent (all messages: the parameter broadcast, the gradient all-reduces, the
loss and validation all-reduces). Lessons 03-05 explain each row:

* recompute full (lesson 03): activations fall to one block input per block plus one block;
* fp16 (lesson 04): parameters and gradients take 2 bytes, the optimizer 12 (FP32 master, m, v),
  and the gradient all-reduce sends half the bytes;
* offload cpu (lesson 05): activations and optimizer state move to the ``offloaded`` category.
  On NumPy host memory is device memory, so the process peak does not fall;
* offload nvme (lesson 05): the same bytes go to anonymous files; the process peak falls.
"""
import gc
import os
import sys
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from threadpoolctl import threadpool_limits  # noqa: E402

from minizero.comm import world  # noqa: E402
from _common import example_parser, require_ranks, train_args  # noqa: E402  (mpi_examples/_common.py)
from minizero.ledger import MemoryLedger, set_ledger  # noqa: E402
from minizero.numerals import integer  # noqa: E402
from minizero.zero import gather_figures  # noqa: E402
from minizero.train import parse_args, train  # noqa: E402

CONFIGS = {
    "none": [],
    "recompute full": ["--recompute", "full"],
    "fp16": ["--precision", "fp16"],
    "offload cpu": ["--offload-activations", "cpu", "--offload-optimizer", "cpu"],
    "offload nvme": ["--offload-activations", "nvme", "--offload-optimizer", "nvme"],
}
COLUMNS = ["parameters", "gradients", "optimizer_state", "activations", "offloaded", "comm_buffers"]


def config_argv(flags: list[str], model: str, steps: int) -> list[str]:
    """The main job's flags of one configuration: ``steps`` steps of ``model`` with ``flags``."""
    return ["--model", model, "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1", "--no-progress",
            *flags]


def measure(comm, argv: list[str]) -> list[dict]:
    """Train as ``argv`` (:func:`config_argv`, checked by ``train_args``) says, on a fresh ledger; every rank's
    figures (bytes), by rank."""
    gc.collect()  # the previous configuration's model and optimizer
    ledger = set_ledger(MemoryLedger())  # fresh per configuration: peaks start from zero
    tracemalloc.reset_peak()
    sent_before = comm.traffic.bytes_sent
    train(parse_args(argv, comm.world_size), comm, log=lambda s: None)
    figures = {c: ledger.peak[c] for c in COLUMNS}
    figures.update(peak_total=ledger.peak_total, process_peak=tracemalloc.get_traced_memory()[1],
                   sent=comm.traffic.bytes_sent - sent_before)
    return gather_figures(comm, figures)


def main():
    parser = example_parser(__doc__)
    parser.add_argument("--model", default="small", help="model preset (tiny, small, default, ...)")
    parser.add_argument("--steps", type=integer, default=3, help="optimizer steps per configuration")
    opts = parser.parse_args()
    threadpool_limits(limits=1)  # several ranks on few cores: one BLAS thread each
    tracemalloc.start()
    comm = world()
    # the table compares what data-parallel ranks hold and send; one rank sends nothing
    require_ranks(comm, comm.world_size >= 2, "at least 2", "memory_compression.py")
    configs = {name: config_argv(flags, opts.model, opts.steps) for name, flags in CONFIGS.items()}
    for argv in configs.values():  # every configuration checked before the first trains (the parsed flags are
        train_args(comm, argv, "memory_compression.py")  # dropped: they would count in the process peak)
    rows = {name: measure(comm, argv) for name, argv in configs.items()}
    if comm.rank:
        return
    kib = 1024
    print(f"model {opts.model!r}, {comm.world_size} rank(s) data parallel, {opts.steps} steps, float32 unless fp16; "
          "peaks per rank in KiB (1 KiB = 1024 bytes)\n")
    print(f"{'configuration':15s} {'rank':>4s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'activ.':>8s} "
          f"{'offload':>8s} {'buckets':>8s} {'ledger':>8s} {'process':>8s} {'sent':>8s}")
    for name, per_rank in rows.items():
        for r, f in enumerate(per_rank):
            print(f"{name if r == 0 else '':15s} {r:4d} " + " ".join(f"{f[c] / kib:8.1f}" for c in COLUMNS)
                  + f" {f['peak_total'] / kib:8.1f} {f['process_peak'] / kib:8.1f} {f['sent'] / kib:8.1f}")
    print("\nledger: highest sum over the categories at any one moment; process: tracemalloc peak (every NumPy "
          "allocation,\nincl. temporaries and the corpus; memory-mapped and offloaded files are not allocations); "
          "buckets: the\ndata-parallel gradient buffers; sent: every byte this rank sent during the run.")


if __name__ == "__main__":
    main()
