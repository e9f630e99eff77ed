"""Training-step throughput: minizero against a nanoGPT-style PyTorch CPU model of the same shape.

    python bench/bench_vs_torch.py --batch 8,32 --threads 2 --steps 4 --rounds 5

Both sides run the same step -- forward, mean cross-entropy, backward, AdamW (lr 1e-3,
betas (0.9, 0.95), weight decay 0.1 on 2-D tensors), zero grads -- on the same (B, 128) byte
batches, in the same dtype (float32), with the same BLAS/intra-op thread count, and they
alternate in one process, so a noisy machine slows both alike: ``--rounds`` rounds, each a
block of ``--steps`` steps of one side then of the other (the first step of every block is
dropped: the previous side's BLAS/OpenMP threads still spin-wait on the cores for a while
after its last step, and step-by-step alternation on 2 cores measured both sides 2-3x slower
than alone). Both sides first run ``--warmup`` steps (PyTorch's first ~4 steps are slow: its
allocator and kernels warm up). Printed per batch: tokens/s of each (median step over all
rounds), the median over rounds of the per-round ratio, its range, and MFU = model FLOPs per
step (Korthikanti et al. 2022, ``minizero.memory.estimator.model_flops_per_step``) / step
time / the sgemm peak measured here (float32 1024^3 matmuls with the same threads, before and after the runs, the
higher; the table is printed at the end).

``--main-job`` adds a third side, the main job's path: ``minizero.loop.train`` as ``python -m
minizero.train`` runs it on one process (its default instruments: memory monitor, no replica check at one
data rank, progress off, no evaluation), ``--steps`` steps a round at micro-batch = batch; its time per step is
the loop's own (``elapsed_s`` / steps, set-up excluded), against PyTorch's mean step of the same round.

PyTorch is optional (never a dependency of minizero): without it the script says how to get it
(the CPU wheel: ``pip install torch --index-url https://download.pytorch.org/whl/cpu``) and prints
minizero's side alone.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402
import _args  # noqa: E402

from minizero.memory.estimator import model_flops_per_step  # noqa: E402
from minizero.nn import GPT, get_config  # noqa: E402
from minizero.optim.adamw import AdamW  # noqa: E402


def import_torch():
    """PyTorch, or None where it is not installed (optional). Imported once the flags are checked: it takes
    seconds, and a bad flag is refused at once."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def sgemm_peak(seconds: float = 1.0) -> float:
    """FLOP/s of float32 (1024, 1024) @ (1024, 1024) on this machine, best of repeated runs."""
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ a
        best = max(best, 2 * 1024**3 / (time.perf_counter() - t))
    return best


class MinizeroSide:
    """minizero's GPT + AdamW; ``step(idx, tg)`` runs one training step."""

    def __init__(self, cfg):
        self.model = GPT(cfg, seed=0)
        self.opt = AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(self, idx, tg):
        _, loss = self.model(idx, tg)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def main_job_seconds(batch: int, steps: int) -> float:
    """Seconds per step of the main job's training loop on one process, micro-batch ``batch``, ``steps`` steps."""
    from minizero.comm import run_in_threads
    from minizero.loop import train
    from minizero.train import parse_args

    argv = ["--model", "default", "--steps", str(steps), "--micro-batch-size", str(batch), "--eval-every", "0",
            "--eval-batches", "1", "--no-progress", "--no-save", "--sample-tokens", "0", "--warmup", "0"]

    def run(comm):
        out = train(parse_args(argv, 1), comm, log=lambda line: None)
        return out.elapsed_s / steps
    return run_in_threads(1, run)[0]


def torch_side(cfg, device: str = "cpu", fp16: bool = False):
    """A nanoGPT-style model (pre-LN blocks, tanh GELU, tied head) and AdamW, or None without torch.

    ``device``: where it runs ("cuda" from bench/gpu_check.py); ``fp16``: eager mixed precision
    (``torch.autocast`` float16 + ``GradScaler``, PyTorch's AMP recipe), CUDA only."""
    torch = import_torch()
    if torch is None:
        return None
    nn, F = torch.nn, torch.nn.functional
    c, h = cfg.n_embd, cfg.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, c), nn.Embedding(cfg.block_size, c)
            self.h = nn.ModuleList([Block() for _ in range(cfg.n_layer)])
            self.ln_f = nn.LayerNorm(c)
            self.lm_head = nn.Linear(c, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, tg):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.h:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), tg.view(-1))

    model = Model().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))

    scaler = torch.amp.GradScaler("cuda") if fp16 else None

    def step(idx, tg):  # numpy batches in, as minizero's side takes them (from_numpy shares the memory)
        idx, tg = torch.from_numpy(idx).to(device), torch.from_numpy(tg).to(device)
        if scaler is None:
            model(idx, tg).backward()
            opt.step()
        else:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(idx, tg)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def bench(batch: int, args) -> tuple:
    """Run the rounds at ``batch``; returns (batch, block size, model FLOPs per step, {side: median s}, ratios)."""
    cfg = get_config("default")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (batch, cfg.block_size)), rng.integers(0, 256, (batch, cfg.block_size)))
               for _ in range(4)]
    mz = MinizeroSide(cfg)
    sides = {"minizero": mz.step}
    tstep = torch_side(cfg)
    if tstep is not None:
        sides["pytorch"] = tstep
    for name, fn in sides.items():  # warm-up, not timed
        for s in range(args.warmup):
            fn(*batches[s % 4])
    times = {name: [] for name in sides}
    ratios, main_job, main_ratios = [], [], []
    for r in range(args.rounds):
        med_round, mean_torch = {}, None
        for name, fn in (sides.items() if r % 2 == 0 else reversed(sides.items())):  # alternate who goes first
            block = []
            for s in range(args.steps + 1):  # the first step of a block settles, not timed
                idx, tg = batches[s % 4]
                t = time.perf_counter()
                fn(idx, tg)
                if s:
                    block.append(time.perf_counter() - t)
            times[name] += block
            med_round[name] = float(np.median(block))
            if name == "pytorch":
                mean_torch = float(np.mean(block))
        if "pytorch" in med_round:
            ratios.append(med_round["pytorch"] / med_round["minizero"])
        if args.main_job:  # the loop's own mean step, beside PyTorch's mean step of this round
            main_job.append(main_job_seconds(batch, args.steps))
            if mean_torch is not None:
                main_ratios.append(mean_torch / main_job[-1])
    med = {name: float(np.median(t)) for name, t in times.items()}
    if main_job:
        med["main job"] = float(np.median(main_job))
    return batch, cfg.block_size, model_flops_per_step(cfg, batch), med, ratios, main_ratios


def row(batch, block, flops, med, ratios, main_ratios, peak, main_job: bool = False) -> str:
    """One Markdown row: tokens/s and MFU of each side, the median ratio of rounds and its range."""
    tokens = batch * block
    cells = [f"{batch} x {block}"]
    for name in ("minizero", "pytorch") + (("main job",) if main_job else ()):
        if name in med:
            cells += [f"{tokens / med[name]:,.0f}", f"{flops / med[name] / peak:.1%}"]
        else:
            cells += ["-", "-"]
    for rs in (ratios, main_ratios) if main_job else (ratios,):
        cells.append(f"{np.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})" if rs else "-")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = _args.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=_args.micro_batches, default="8,32",
                   help="comma-separated batch sizes (sequences of 128 bytes)")
    p.add_argument("--threads", type=_args.threads, default=_machine.cores(), help="BLAS / torch intra-op threads")
    p.add_argument("--steps", type=_args.count, default=4, help="timed steps per side per round")
    p.add_argument("--rounds", type=_args.count, default=5, help="alternated rounds (the ratio is their median)")
    p.add_argument("--warmup", type=_args.at_least(0), default=6, help="untimed steps per side before the rounds")
    p.add_argument("--main-job", action="store_true", help="also time the main job's training loop (one process)")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (default: keep freed memory, as the main job does)")
    args = p.parse_args()  # every flag checked by its type (_args), before PyTorch, malloc and timing
    malloc = _machine.set_malloc(args.default_malloc)
    torch = import_torch()
    if torch is None:
        print("PyTorch is not installed: minizero's side only. For the comparison install the CPU wheel:\n"
              "    pip install torch --index-url https://download.pytorch.org/whl/cpu\n")
    else:
        torch.set_num_threads(args.threads)
    with threadpool_limits(args.threads):
        first = sgemm_peak()
        results = [bench(b, args) for b in args.batch]
        peak = max(first, sgemm_peak())  # before and after: a busy moment at one end does not inflate MFU
        print(f"default model ({get_config('default').num_parameters():,} parameters), float32, AdamW, "
              f"{args.threads} thread(s); sgemm peak {peak / 1e9:.1f} GFLOP/s (the higher of before and after the "
              f"runs; {first / 1e9:.1f} before); {args.rounds} alternated rounds of {args.steps} steps per side; "
              "MFU = model FLOPs (Korthikanti et al. 2022) / time / sgemm peak\n")
        head = "| batch | minizero tokens/s | minizero MFU | PyTorch tokens/s | PyTorch MFU |"
        head += " main job tokens/s | main job MFU |" if args.main_job else ""
        head += " minizero / PyTorch (median of rounds, range) |"
        head += " main job / PyTorch (mean steps) |" if args.main_job else ""
        print(_machine.header() + " | " + malloc)  # date, CPU, BLAS library, kernel, threads (inside the limit)
        print(head)
        print("|---|" + "---:|" * (head.count("|") - 2))
        for r in results:
            print(row(*r, peak, main_job=args.main_job), flush=True)


if __name__ == "__main__":
    from minizero.interrupts import run_script  # | head -1, > /dev/full, >&-: as the tools
    sys.exit(run_script(main))
