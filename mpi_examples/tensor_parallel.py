"""Tensor parallelism by hand (Megatron-LM): every block's matrices split across the ranks.

    mpirun -n 2 python mpi_examples/tensor_parallel.py

Every rank builds the same GPT (default preset, 4 heads, width 128), keeps its shard of each
block (minizero/parallel/tensor_parallel.py: c_attn and mlp.c_fc split by output rows,
the two c_proj by input columns) and runs one forward and backward. Then:

1. the split model's loss and gradients equal the whole model's (every rank computes the
   whole model too, to compare);
2. each rank's parameter bytes (memory ledger) shrink as 1/tp for the split layers;
3. the traffic ledger shows 2 all-reduces of a (B, T, C) array per block in forward and 2
   in backward, each 2(tp-1)/tp * B*T*C*4 bytes (Shoeybi et al. 2019, section 3).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from minizero.comm import world  # noqa: E402
from minizero.ledger import format_bytes, get_ledger  # noqa: E402
from minizero.nn import GPT, get_config  # noqa: E402
from minizero.parallel.tensor_parallel import allreduce_bytes_per_block, shard_array, tensor_parallelize  # noqa: E402
from minizero.parallel.three_d import scratch_ledger  # noqa: E402
from _common import print_in_rank_order, require_ranks  # noqa: E402  (mpi_examples/_common.py)

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
comm = world()
tp, rank = comm.world_size, comm.rank
cfg = get_config("default", block_size=64)
# split across >= 2 ranks, each holding whole heads: the rank count divides n_head = 4
require_ranks(comm, tp > 1 and cfg.n_head % tp == 0, "2 or 4", "tensor_parallel.py")
B, T, C = 4, cfg.block_size, cfg.n_embd
x = np.random.default_rng(0).integers(0, 256, (B, T))

with scratch_ledger():  # the whole model, for comparison only: not counted in this rank's ledger
    whole = GPT(cfg, seed=0)
    _, ref_loss = whole(x, x)
    ref_loss.backward()
    ref = {n: p.grad for n, p in whole.named_parameters()}
    whole_bytes = sum(p.data.nbytes for p in whole.parameters())

model = GPT(cfg, seed=0)
tensor_parallelize(model, comm)
_, loss = model(x, x)
fwd = comm.traffic.snapshot()
loss.backward()
total = comm.traffic.snapshot()

err = 0.0
for name, p in model.named_parameters():
    want = ref[name]
    if getattr(p, "tensor_model_parallel", False):
        want = shard_array(want, p.partition_dim, rank, tp, p.partition_stride)
    err = max(err, float(np.abs(p.grad - want).max() / np.abs(want).max()))
expect = allreduce_bytes_per_block(B, T, C, 4, tp, rank)
held = get_ledger().current["parameters"]
w = model.transformer["h"][0].attn.c_attn.weight
first, last = rank * cfg.n_head // tp, (rank + 1) * cfg.n_head // tp - 1
heads = f"head {first}" if first == last else f"heads {first}..{last}"
lines = [f"rank {rank}/{tp}: loss {loss.item():.6f} (whole model {ref_loss.item():.6f}), "
         f"max relative gradient difference {err:.1e}",
         f"  h.0.attn.c_attn.weight: {w.shape} of (3C, C) = {(3 * C, C)} (Q, K, V of {heads})",
         f"  parameters held {format_bytes(held)} of {format_bytes(whole_bytes)} "
         f"(the split layers: 1/{tp}; embeddings, layer norms, second biases: whole)",
         f"  all-reduce forward  {fwd['calls']['all_reduce']:>2} calls {format_bytes(fwd['bytes_sent']):>10} "
         f"= {cfg.n_layer} blocks x 2 x {format_bytes(expect['forward'] // 2)}",
         f"  all-reduce backward {total['calls']['all_reduce'] - fwd['calls']['all_reduce']:>2} calls "
         f"{format_bytes(total['bytes_sent'] - fwd['bytes_sent']):>10} = {cfg.n_layer} blocks x 2 x "
         f"{format_bytes(expect['backward'] // 2)}"]
assert fwd["bytes_sent"] == cfg.n_layer * expect["forward"] and err < 1e-4
assert total["bytes_sent"] == cfg.n_layer * (expect["forward"] + expect["backward"])
print_in_rank_order(comm, "\n".join(lines))
