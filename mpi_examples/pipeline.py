"""Pipeline parallelism by hand: 4 stages, micro-batches streamed through GPipe and 1F1B.

    mpirun -n 4 python mpi_examples/pipeline.py [--micro-batches 8] [--verbose]

Rank s holds block s of the default GPT (4 layers; the embedding on stage 0, ln_f and the
tied LM head on stage 3; minizero/parallel/pipeline.py). One optimizer step's micro-batches
run through each schedule; every activation goes one stage forward and every gradient one
stage back, each a point-to-point message (``--verbose`` prints them as arrows). Printed:
the schedule as a timeline with its bubble beside (p-1)/(m+p-1), the micro-batches each
stage held at once and its peak activation bytes (memory ledger), the bytes each rank sent,
and the loss against the whole model's (Huang et al. 2019; Narayanan et al. 2021).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.args import MAX_GRAD_ACCUM  # noqa: E402
from minizero.comm import world  # noqa: E402
from minizero.ledger import format_bytes, get_ledger  # noqa: E402
from minizero.nn import GPT, get_config  # noqa: E402
from minizero.numerals import integer  # noqa: E402
from minizero.parallel.pipeline import PipelineEngine, allreduce_tied_embedding_grads  # noqa: E402
from minizero.parallel.schedule import ascii_timeline, bubble_formula, bubble_fraction, make_schedule, simulate  # noqa
from minizero.parallel.three_d import build_stage, scratch_ledger  # noqa: E402
from minizero.parallel.topology import Topology  # noqa: E402
from _common import example_parser, print_in_rank_order, require_ranks  # noqa: E402  (mpi_examples/_common.py)

parser = example_parser(__doc__)
parser.add_argument("--micro-batches", type=integer, default=8, help="micro-batches per optimizer step (m)")
parser.add_argument("--verbose", action="store_true", help="print every message as an arrow")
opts = parser.parse_args()
if not 1 <= opts.micro_batches <= MAX_GRAD_ACCUM:  # the main job's bound: each one is a batch made up front
    parser.error(f"--micro-batches must be in 1..{MAX_GRAD_ACCUM:,} (as the main job's --grad-accum), "
                 f"got {opts.micro_batches:,}")
comm = world()
cfg = get_config("default", block_size=64)
# one stage per rank, each with the same number of blocks: the rank count divides the layers, and >= 2
require_ranks(comm, comm.world_size in (2, 4), f"2 or {cfg.n_layer}", "pipeline.py")
p, s, m = comm.world_size, comm.rank, opts.micro_batches
rng = np.random.default_rng(0)
batches = [(rng.integers(0, 256, (2, cfg.block_size)), rng.integers(0, 256, (2, cfg.block_size))) for _ in range(m)]
topo = Topology(comm, 1, 1, p)
stage = build_stage(cfg, 0, topo)


def say(text):
    """Rank 0 prints ``text``; every rank's own line is gathered in rank order by ``each``."""
    if s == 0:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def each(text):
    print_in_rank_order(comm, text)


if s == 0:
    with scratch_ledger():
        whole = GPT(cfg, seed=0)
        ref = sum(whole(x, y)[1].item() for x, y in batches) / m
say(f"{p} stages x {m} micro-batches of 2 x {cfg.block_size} tokens")
each(f"  rank {s}: stage {s}, blocks {list(stage.layers)}" + (" + wte, wpe" if stage.is_first else "")
     + (" + ln_f, lm_head (a copy of wte, tied)" if stage.is_last else "")
     + f", parameters {format_bytes(get_ledger().current['parameters'])}")
for name in ("gpipe", "1f1b"):
    engine = PipelineEngine(stage, topo.pp_comm, name, verbose=opts.verbose,
                            log=lambda t: (sys.stdout.write(f"[rank {s}] {t}\n"), sys.stdout.flush()))
    timeline = simulate(make_schedule(name, p, m))
    say(f"\n{name}: bubble {bubble_fraction(timeline):.3f} from the timeline, (p-1)/(m+p-1) = "
        f"{bubble_formula(p, m):.3f}  (F = 1 slot, B = 2 slots)\n" + ascii_timeline(timeline))
    comm.barrier()  # the schedule's name and timeline before any rank's --verbose arrows of its run
    stage.zero_grad()
    before = comm.traffic.snapshot()
    get_ledger().reset_peaks()
    loss = engine.forward_backward(batches)
    allreduce_tied_embedding_grads(stage, topo.embed_comm)
    after = comm.traffic.snapshot()
    sent = {k: after["by_op"].get(k, 0) - before["by_op"].get(k, 0) for k in ("pp_activation", "pp_gradient")}
    calls = {k: after["calls"].get(k, 0) - before["calls"].get(k, 0) for k in sent}
    each(f"  rank {s}: {engine.peak_in_flight} micro-batch(es) in flight, peak activations "
         f"{format_bytes(get_ledger().peak['activations'])};\n    sent {calls['pp_activation']} activations "
         f"({format_bytes(sent['pp_activation'])}), {calls['pp_gradient']} gradients "
         f"({format_bytes(sent['pp_gradient'])})")
    if s == p - 1:
        comm.send(np.array([loss / m]), 0)
    if s == 0:
        got = comm.recv(np.empty(1), p - 1)[0]
        print(f"  mean loss {got:.6f}, whole model {ref:.6f}", flush=True)
        assert abs(got - ref) < 1e-5
