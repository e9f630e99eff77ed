"""Every flag of ``python -m minizero.train``: the argparse parser (checked by :mod:`minizero.args`).

The parser raises :class:`UsageError` instead of exiting, so the caller decides which rank
prints; ``--help`` prints once (ranks other than 0 are quiet). Mirrors argparse's own
conventions; the values' checks live in :func:`minizero.args.parse_args`.
"""
from __future__ import annotations

import argparse

from minizero.comm.base import DEFAULT_TIMEOUT_S
from minizero.comm.flight import DEFAULT_CAPACITY
from minizero.comm.recursive_doubling import THRESHOLD_ENV, threshold_from_env
from minizero.memory.offload import OFFLOADS
from minizero.memory.precision import PRECISIONS
from minizero.memory.sparsity import SCOPES
from minizero.nn.gpt import PRESETS, preset_sizes
from minizero.nn.flash_attention import ATTENTIONS
from minizero.parallel.expert_parallel import MOE_EVERY
from minizero.numerals import DefaultsOnce, OneLineParser, integer, negative_values_reach_checks, real
from minizero.optim import OPTIMIZERS
from minizero.optim.adam8bit import MAX_BLOCK_SIZE
from minizero.progress import MODES as PROGRESS_MODES
from minizero.zero.collectives import DEBUG_COLLECTIVES_ENV, debug_collectives


class UsageError(ValueError):
    """A bad command-line value; the message names the value and what is allowed."""


class _Parser(OneLineParser):  # a mistyped flag: "did you mean"; ranks other than 0 print no --help (quiet)
    def error(self, message):  # raise instead of exiting, so only rank 0 prints
        raise UsageError(message)


#: other programs' names of train's flags (docs/techniques.md: Megatron-LM's, DeepSpeed's, Hugging Face's) -> what a
#: mistyped flag's "did you mean" names, or a note on what minizero has instead (minizero.numerals.unrecognized;
#: close spellings are found without this table)
SYNONYMS = {"--learning-rate": "--lr", "--tensor-model-parallel-size": "--tp", "--tensor-parallel": "--tp",
            "--pipeline-model-parallel-size": "--pp", "--pipeline-parallel": "--pp", "--data-parallel": "--dp",
            "--context-parallel-size": "--cp", "--global-batch-size": "--batch-size", "--train-iters": "--steps",
            "--gradient-accumulation-steps": "--grad-accum", "--zero-stage": "--zero", "--seq-length": "--block-size",
            "--seq-len": "--block-size", "--max-seq-length": "--block-size", "--sequence-length": "--block-size",
            "--fp16": "--precision fp16", "--bf16": "--precision bf16", "--fp8": "--precision fp8",
            "--clip-grad": "--grad-clip", "--max-grad-norm": "--grad-clip", "--gradient-clipping": "--grad-clip",
            "--recompute-granularity": "--recompute", "--gradient-checkpointing": "--recompute full",
            "--checkpoint-activations": "--recompute full", "--use-distributed-optimizer": "--zero 1",
            "--use-flash-attn": "--attention flash", "--warmup-steps": "--warmup", "--lr-warmup-iters": "--warmup",
            "--load": "--resume", "--resume-from-checkpoint": "--resume", "--save": "--save-dir",
            "--output-dir": "--out", "--data-path": "--data", "--save-interval": "--save-every",
            "--save-steps": "--save-every", "--log-interval": "--log-every", "--logging-steps": "--log-every",
            "--eval-interval": "--eval-every", "--eval-steps": "--eval-every",
            "--per-device-train-batch-size": "--micro-batch-size",
            "--train-micro-batch-size-per-gpu": "--micro-batch-size", "--expert-model-parallel-size": "--ep",
            "--moe-router-topk": "--moe-top-k", "--max-new-tokens": "--sample-tokens",
            "--tokens-to-generate": "--sample-tokens", "--loss-scale": "--initial-loss-scale",
            **dict.fromkeys(("--num-epochs", "--num-train-epochs", "--epochs"),
                            "minizero counts optimizer steps, not epochs: give --steps"),
            **{f: f"mpirun's {f} (the number of ranks) goes before python: mpirun {f} RANKS python -m minizero.train "
               "[flags]" for f in ("-n", "-np")}}


#: flags parsed as None, so "given" is "not None" even for the default's value (refused idle: --cp-attention ring
#: at --cp 1, --moe-top-k 2 without experts; --ulysses N with an explicit ring; check_moe's "the default"), and the
#: value parse_args gives them after those checks (--help and TrainConfig show it). Kept, not a plain
#: `value or default`: those refusals need to know what was given
LATE_DEFAULTS = {"cp_attention": "ring", "moe_top_k": 2}


def flag_defaults() -> dict:
    """Every flag's default as a run sees it: the parser's, or :data:`LATE_DEFAULTS`' for a flag parsed as None."""
    return {a.dest: a.default for a in build_parser()._actions if a.dest != "help"} | LATE_DEFAULTS


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m minizero.train``."""
    p = negative_values_reach_checks(_Parser(
        prog="python -m minizero.train", formatter_class=DefaultsOnce,
        description="Train a small GPT on real text across MPI ranks, with the techniques the flags choose.",
        epilog="docs/techniques.md groups these flags by technique, with DeepSpeed's and Megatron-LM's names."))
    p.synonyms = SYNONYMS
    # the groups follow docs/techniques.md's table; --help lists each group's flags together
    run = p.add_argument_group("model, data and optimizer (AdamW, warmup + cosine learning rate)")
    layout = p.add_argument_group("batch and rank layout", "world size (the ranks mpirun starts) = dp x cp x tp x "
                                  "pp; global batch = micro-batch-size x dp x grad-accum sequences")
    comm = p.add_argument_group("communication")
    memory = p.add_argument_group("memory: ZeRO, activation recompute, attention core, offload")
    numerics = p.add_argument_group("precision, 8-bit Adam, pruning")
    moe = p.add_argument_group("mixture of experts (Switch / GShard routing, parallel/moe.py)")
    debug = p.add_argument_group("debugging and measuring (lesson 13)")
    output = p.add_argument_group("validation, progress, output files, checkpoints")
    run.add_argument("--model", default="default", choices=sorted(PRESETS),
                     help=preset_sizes() + " (default: %(default)s)")
    run.add_argument("--block-size", type=integer, default=None, help="context length T (default: the preset's)")
    run.add_argument("--dropout", type=real, default=None, help="dropout probability (default: the preset's)")
    run.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameter/compute dtype")
    run.add_argument("--device", default="cpu", choices=["cpu", "cuda", "strict"],
                     help="cpu: NumPy; cuda: CuPy, rank r on GPU (its rank on the node) %% (GPUs on the node); "
                          "strict: NumPy arrays that refuse implicit host transfers (the CPU proof of the cuda path)")
    run.add_argument("--steps", type=integer, default=300, help="optimizer steps")
    layout.add_argument("--micro-batch-size", type=integer, default=2, help="sequences per rank per micro-step")
    layout.add_argument("--grad-accum", type=integer, default=None,
                        help="micro-steps per optimizer step (default: pp, 1 without a pipeline; derived from "
                             "--batch-size when that is given)")
    layout.add_argument("--batch-size", type=integer, default=None,
                        help="global sequences per optimizer step (default: micro-batch-size x dp x grad-accum); "
                             "given, it must equal that product, and grad-accum is derived from it when not given")
    layout.add_argument("--dp", type=integer, default=None,
                        help="data-parallel size (default: world size / (cp x tp x pp))")
    layout.add_argument("--tp", type=integer, default=None,
                        help="tensor-parallel size: every block's matrices split (default: 1; with --dp and --pp "
                             "given, world size / (cp x dp x pp))")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: layer norms, dropouts and residuals on 1/tp of the sequence "
                             "(Korthikanti 2022)")
    layout.add_argument("--cp", type=integer, default=1,
                        help="context-parallel size: the sequence split, ring attention")
    layout.add_argument("--cp-attention", default=None, choices=["ring", "ulysses"],  # None: not given
                        help="with --cp: ring attention (k, v blocks around the ring) or DeepSpeed-Ulysses (all-to-all "
                             "from sequence shards to head shards and back) "
                             f"(default: {LATE_DEFAULTS['cp_attention']})")
    layout.add_argument("--ulysses", type=integer, default=None, metavar="N",
                        help="DeepSpeed-Ulysses over N ranks: the same as --cp N --cp-attention ulysses")
    layout.add_argument("--pp", type=integer, default=None,
                        help="pipeline stages: the layers split (default: 1; with --dp and --tp given, "
                             "world size / (cp x dp x tp))")
    layout.add_argument("--micro-batches", type=integer, default=None,
                        help="pipeline micro-batches per optimizer step per data rank, the same number as --grad-accum "
                             "(default: pp, 1 without a pipeline; tensor parallelism never changes the batch)")
    layout.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"],
                        help="pipeline schedule (zb-h1: zero bubble, backward split into B and W; "
                             "zb-v: the same with two chunks per rank in a V, needs 2 x pp layers)")
    layout.add_argument("--virtual-stages", type=integer, default=1,
                        help="model chunks per pipeline rank (--schedule interleaved)")
    layout.add_argument("--pp-verbose", action="store_true",
                        help="print every message of one pipeline (data rank 0, tensor rank 0) as an arrow")
    run.add_argument("--lr", type=real, default=3e-3, help="peak learning rate")
    run.add_argument("--min-lr", type=real, default=None, help="final learning rate (default: lr/10)")
    run.add_argument("--warmup", type=integer, default=None,
                     help="warmup steps (default: steps/10, at least 10, at most steps)")
    run.add_argument("--weight-decay", type=real, default=0.1, help="AdamW decoupled weight decay (2-D weights)")
    run.add_argument("--grad-clip", type=real, default=1.0, help="global-norm clipping threshold (0 disables)")
    run.add_argument("--seed", type=integer, default=0, help="seed of the init, data and dropout generators")
    run.add_argument("--data", default=None,
                     help="UTF-8 text file to train on (default: the embedded corpus); the byte 0x03 (ASCII ETX, "
                          "'end of text') ends a document, e.g. printf 'one\\x03two\\x03' > docs.txt")
    docs = run.add_mutually_exclusive_group()
    docs.add_argument("--pack", dest="documents", action="store_const", const="pack", default="pack",
                      help="windows run across documents, the separator a token like any other (default)")
    docs.add_argument("--pad", dest="documents", action="store_const", const="pad",
                      help="each window stops at its document's separator; the rest is padding whose targets "
                           "(-100) the loss ignores, normalised by the real targets of the global batch")
    output.add_argument("--eval-every", type=integer, default=100,
                        help="validate every N steps (0: only before the first step and at the end)")
    output.add_argument("--eval-batches", type=integer, default=4, help="validation batches of 16 sequences each")
    comm.add_argument("--bucket-mb", type=real, default=1.0, help="data-parallel all-reduce bucket size (MiB)")
    comm.add_argument("--no-overlap", dest="overlap", action="store_false",
                      help="communicate blocking, after the work that needs it (default: data parallelism's bucket "
                           "all-reduces and ZeRO 2-3's reduce-scatters start as soon as a bucket's last gradient is "
                           "ready and run during the rest of backward; ZeRO-3 prefetches the next unit's all-gather; "
                           "pipeline sends are non-blocking)")
    debug.add_argument("--trace", default=None, metavar="PATH",
                       help="write a per-rank timeline (Chrome trace-event JSON; opens in Perfetto) to PATH")
    comm.add_argument("--native-comm", action="store_true",
                      help="use the library's own collectives (MPI_Allreduce..., or NCCL's with --comm nccl) "
                           "instead of the hand-written ones (ring, recursive doubling)")
    # -- communicator (issue #15: NCCL) ------------------------------------------------------------
    comm.add_argument("--comm", default=None, choices=["mpi", "nccl"],
                      help="transport of every message: mpi (mpi4py), or nccl (cupy.cuda.nccl, one GPU per rank, "
                           "set up through MPI); default nccl with --device cuda, else mpi")
    debug.add_argument("--comm-timeout", type=real, default=DEFAULT_TIMEOUT_S,
                       help="seconds (at least 1) any one send, receive or collective may wait for a peer before "
                            "the job is aborted with the operation and the rank waited on (600 s is PyTorch's NCCL "
                            "timeout too)")
    debug.add_argument("--flight-records", type=integer, default=DEFAULT_CAPACITY, metavar="N",
                       help="collectives each rank's flight recorder keeps, written to OUT/flight/rank_R.json when the "
                            "job fails or on SIGUSR1, unless --no-save (python -m minizero.debug hang OUT/flight names "
                            "who hung where; 0: off)")
    debug.add_argument("--debug-collectives", action="store_true",
                       help="before every collective its ranks agree on (operation, sequence number, shape, dtype); "
                            "a mismatch stops the job naming both sides (one small all-gather per collective)")
    debug.add_argument("--detect-anomaly", action="store_true",
                       help="check every module's output and every gradient for inf/NaN; the first module (forward) or "
                            "parameter (backward) that made one is named with rank, step and value ranges (slow)")
    debug.add_argument("--loss-spike", type=real, default=0.0, metavar="K",
                       help="a step whose loss exceeds K x the running mean records every parameter's gradient norm "
                            "(rank 0's, in summary.json loss_spikes; 0: off, else K > 1)")
    debug.add_argument("--check-replicas", type=integer, default=None, metavar="N",
                       help="hash every parameter and the optimizer state and compare across the replicas at every "
                            "checkpoint and after the last step (the default wherever a rank's parameters have a "
                            "replica: 2+ data ranks, --ep and hybrid --dp-shard included, not plain ZeRO-3, whose "
                            "shards are each held once), N: also every N steps; a difference stops the job naming "
                            "parameter or state, ranks, step (0: off)")
    comm.add_argument("--allreduce", default="ring", choices=["ring", "hierarchical"],
                      help="data-parallel gradient all-reduce: one flat ring, or inside each node, across nodes, "
                           "inside each node again (NCCL/Horovod hierarchical)")
    memory.add_argument("--zero", type=integer, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 + gradients, 3 + parameters")
    memory.add_argument("--dp-shard", type=integer, default=None, metavar="N",
                        help="hybrid sharding: ZeRO shards over groups of N consecutive data ranks and replicates "
                             "across the dp/N groups (FSDP HYBRID_SHARD, MiCS); N divides dp, N x cp a multiple of "
                             "--ep (default dp)")
    memory.add_argument("--show-shards", action="store_true", help="print the ZeRO shard map (needs --zero 1-3)")
    numerics.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                          help="fp16: FP16 parameters/activations/gradients, FP32 master weights and Adam state, "
                               "dynamic loss scaling; bf16: bfloat16 matmuls (inputs, outputs and their gradients "
                               "rounded to bf16, FP32 accumulation), FP32 weights and Adam state, no loss scale; "
                               "fp8: E4M3 inputs and weights, E5M2 gradients, per-tensor scales, FP32 accumulation")
    numerics.add_argument("--fp8-scaling", default="delayed", choices=["delayed", "current"],
                          help="fp8: scale from the largest amax of the last 16 casts (Transformer Engine's delayed "
                               "scaling) or from the tensor's own amax")
    numerics.add_argument("--initial-loss-scale", type=real, default=2.0 ** 16, help="fp16: starting loss scale")
    numerics.add_argument("--loss-scale-window", type=integer, default=2000,
                          help="fp16: clean steps before the scale doubles (PyTorch 2000, DeepSpeed 1000)")
    numerics.add_argument("--hysteresis", type=integer, default=1,
                          help="fp16: overflows before the scale halves (PyTorch 1, DeepSpeed 2)")
    numerics.add_argument("--min-loss-scale", type=real, default=1.0, help="fp16: the scale never goes below this")
    memory.add_argument("--recompute", default="none", choices=["none", "full", "selective"],
                        help="activation recompute: every K-th block (full) or its attention core (selective)")
    memory.add_argument("--recompute-every", type=integer, default=1, help="K: recompute every K-th block")
    memory.add_argument("--attention", default="dense", choices=list(ATTENTIONS),
                        help="attention core: dense (keeps the (T, T) probabilities) or flash (FlashAttention's "
                             "blockwise online softmax: keeps the output and the row log-sum-exp)")
    memory.add_argument("--attention-block", type=integer, default=64, help="flash: rows per query and key/value block")
    memory.add_argument("--offload-activations", default="none", choices=list(OFFLOADS),
                        help="move saved activations to host memory or to files until backward")
    memory.add_argument("--offload-optimizer", default="none", choices=list(OFFLOADS),
                        help="keep master weights and Adam state (and run the update) on the host or on disk "
                             "(ZeRO-Offload / ZeRO-Infinity)")
    memory.add_argument("--offload-dir", default=None, help="directory of the anonymous offload files "
                                                             "(default: the system temp directory)")
    numerics.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                          help="adam8bit: m and v as 8-bit codes + one FP32 absmax per block (Dettmers et al. 2022)")
    numerics.add_argument("--adam8bit-block-size", type=integer, default=256,
                          help="elements per absmax of 8-bit Adam's state")
    comm.add_argument("--quantized-comm", action="store_true",
                      help="INT8 on the wire for the gradient all-reduce (--zero 0), ZeRO's gradient "
                           "reduce-scatters and ZeRO-3's gathers (ZeRO++)")
    moe.add_argument("--moe-experts", type=integer, default=0, metavar="E",
                     help="experts per MoE layer, replacing the blocks' MLPs (0: dense MLPs)")
    moe.add_argument("--moe-top-k", type=integer, default=None, metavar="K",  # None: not given
                     help=f"experts each token is routed to (default: {LATE_DEFAULTS['moe_top_k']})")
    moe.add_argument("--moe-capacity-factor", type=real, default=1.25, metavar="F",
                     help="slots per expert = ceil(F x tokens x K / E) per micro-batch; choices past it are dropped")
    moe.add_argument("--moe-every", type=integer, default=1, choices=list(MOE_EVERY),
                     help="an MoE layer in every block (1) or every other block (2: blocks 1, 3, ...)")
    moe.add_argument("--moe-aux-loss", type=real, default=0.01, metavar="COEF",
                     help="coefficient of the Switch load-balancing loss (Fedus et al. 2021; 0: off)")
    moe.add_argument("--moe-z-loss", type=real, default=0.001, metavar="COEF",
                     help="coefficient of the router z-loss (ST-MoE, Zoph et al. 2022; 0: off)")
    moe.add_argument("--moe-bias-update", type=real, default=0.0, metavar="RATE",
                     help="DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's routing "
                          "bias moves by RATE x sign(mean load - its load) (0: off)")
    moe.add_argument("--ep", type=integer, default=1,
                     help="expert-parallel size: the experts split over groups of EP data ranks, tokens sent to "
                          "their experts by all-to-all")
    numerics.add_argument("--prune-sparsity", type=real, default=0.0,
                          help="fraction of the linear weights pruned by magnitude and kept at zero (0: dense)")
    numerics.add_argument("--prune-scope", default="layer", choices=list(SCOPES),
                          help="rank weights per layer or globally")
    numerics.add_argument("--prune-step", type=integer, default=0,
                          help="steps trained dense before the masks are made (0: from the start; K: before step K+1)")
    output.add_argument("--out", default="out", help="directory of the files the run writes (model.npz, "
                                                      "model.json, summary.json, the plots, flight/)")
    output.add_argument("--json", default=None, help="path of the JSON summary (default: OUT/summary.json)")
    output.add_argument("--sample-tokens", type=integer, default=200, help="bytes of text to generate at the end")
    output.add_argument("--prompt", default="The ", help="text the closing sample continues (at least one character; "
                                                          "python -m minizero.sample takes the same)")
    output.add_argument("--progress", default="auto", choices=list(PROGRESS_MODES),
                        help="rank 0's live progress: a tqdm bar, a log line every K steps, or nothing; auto: the bar "
                             "when stdout is a terminal, else log lines (under mpirun stdout is never a terminal)")
    output.add_argument("--log-every", type=integer, default=None,
                        help="K: steps between progress log lines (default: about 15 lines per run)")
    output.add_argument("--no-progress", action="store_true", help="the same as --progress none")
    output.add_argument("--no-save", action="store_true", help="write none of the files --out holds (model.npz, "
                        "model.json, summary.json, the plots, flight/); --save-every's checkpoints are still written")
    debug.add_argument("--tracemalloc", action="store_true",
                       help="measure the process peak with tracemalloc (every NumPy allocation over the training "
                            "steps; slower: every allocation is traced); default: peak RSS from getrusage, free")
    debug.add_argument("--no-tracemalloc", action="store_true",
                       help="tracemalloc off (the default; kept so older command lines run; wins over --tracemalloc)")
    debug.add_argument("--default-malloc", action="store_true",
                       help="leave glibc's malloc as it is (default: keep freed memory for reuse, mallopt; "
                            "docs/benchmarks.md, Memory allocation)")
    output.add_argument("--save-every", type=integer, default=0,
                        help="write a sharded checkpoint every N optimizer steps and after the last (0: none)")
    output.add_argument("--save-dir", default=None, help="checkpoint folder (default: OUT/checkpoints)")
    output.add_argument("--keep", type=integer, default=2,
                        help="complete checkpoints kept (older ones removed after a save)")
    output.add_argument("--resume", default=None,
                        help="continue from a checkpoint folder, or from a save dir's latest complete checkpoint "
                             "(any layout: the state is resharded on load)")
    return p


#: upper limits that keep a typo from becoming an out-of-memory kill minutes later
MAX_MICRO_BATCH, MAX_SAMPLE_TOKENS, MAX_ADAM8BIT_BLOCK = 4096, 100_000, MAX_BLOCK_SIZE
MAX_FLIGHT_RECORDS = 1_000_000  #: flight-recorder entries kept per rank (500x the default)


#: flags that act only with another setting: (flags, is that setting on, what it is, what the run has); given
#: without it (a value other than the parser's default: any, for :data:`LATE_DEFAULTS`) they are refused, not
#: ignored (a setting that does nothing would mislead the reader). Read after --dp/--tp/--pp are resolved (the
#: pipeline row needs the resolved pp)
DEPENDENT_FLAGS = (
    (("initial_loss_scale", "loss_scale_window", "min_loss_scale", "hysteresis"), lambda a: a.precision == "fp16",
     "--precision fp16 (loss scaling)", lambda a: f"--precision {a.precision}"),
    (("fp8_scaling",), lambda a: a.precision == "fp8", "--precision fp8", lambda a: f"--precision {a.precision}"),
    (("moe_top_k", "moe_capacity_factor", "moe_every", "moe_aux_loss", "moe_z_loss", "moe_bias_update"),
     lambda a: a.moe_experts > 0, "--moe-experts > 0 (a mixture of experts)", lambda a: "--moe-experts 0"),
    (("keep", "save_dir"), lambda a: a.save_every > 0, "--save-every N > 0 (checkpoints)",
     lambda a: f"--save-every {a.save_every}"),
    (("recompute_every",), lambda a: a.recompute != "none", "--recompute full or selective",
     lambda a: "--recompute none"),
    (("attention_block",), lambda a: a.attention == "flash", "--attention flash",
     lambda a: f"--attention {a.attention}"),
    (("adam8bit_block_size",), lambda a: a.optimizer == "adam8bit", "--optimizer adam8bit",
     lambda a: f"--optimizer {a.optimizer}"),
    (("prune_scope", "prune_step"), lambda a: a.prune_sparsity > 0, "--prune-sparsity > 0 (pruning)",
     lambda a: "--prune-sparsity 0"),
    (("schedule", "pp_verbose"), lambda a: a.pp > 1, "--pp > 1 (a pipeline)", lambda a: f"--pp {a.pp}"),
    (("prompt",), lambda a: a.sample_tokens > 0, "--sample-tokens > 0 (the closing sample)",
     lambda a: "--sample-tokens 0"),
    (("cp_attention",), lambda a: a.cp > 1, "--cp > 1 (context parallelism)", lambda a: f"--cp {a.cp}"),
)


def refuse_idle_flags(args) -> None:
    """UsageError naming a flag of :data:`DEPENDENT_FLAGS` given without its setting, and --json with --no-save.
    Before parse_args fills :data:`LATE_DEFAULTS` (their parser default None: any value given counts)."""
    defaults = {a.dest: a.default for a in build_parser()._actions}
    for names, on, what, got in DEPENDENT_FLAGS:
        given = [f"--{k.replace('_', '-')}" for k in names if vars(args)[k] != defaults[k]]
        if given and not on(args):
            raise UsageError(f"{', '.join(given)} only apply(ies) with {what}; got {got(args)}")
    if args.json is not None and args.no_save:
        raise UsageError(f"--json {args.json!r} with --no-save: --no-save writes no summary; drop one of them")


def job_environment() -> dict:
    """The environment settings every rank must share, by variable: the all-reduce size rule (ranks that disagree
    run different algorithms and wait on each other until --comm-timeout) and ZeRO's order check (an extra
    collective), as a refusal shows them (the switch as the 0 or 1 it is set to). Raises ValueError as
    :func:`threshold_from_env` and :func:`debug_collectives`."""
    return {THRESHOLD_ENV: threshold_from_env(), DEBUG_COLLECTIVES_ENV: int(debug_collectives())}


def differing_flags(every_flags, shown: int = 3) -> list[str]:
    """``"--tp: 2 on rank 0, 1 on rank 1"`` for each setting whose value differs between ranks: the flags as
    given first, then the settings parse_args derives from them, then :func:`job_environment`; at most ``shown``.
    ``every_flags``: each rank's ``(parsed flags, dataclasses.asdict of its TrainConfig, job_environment())``.
    Ranks that train with different layouts, precisions or step counts agree on nothing: a wrong loss, a hang or
    a mismatched message."""
    names = []
    for part in range(len(every_flags[0])):
        for name in every_flags[0][part]:
            values = [repr(f[part].get(name)) for f in every_flags]  # repr: a NaN equals a NaN
            if len(set(values)) > 1 and name != "derived" and name not in (n for n, _ in names):  # derived: a note
                names.append((name, values))
    out = []
    for name, values in names:
        groups = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        out.append((name if name.isupper() else f"--{name.replace('_', '-')}") + ": " + ", ".join(
            f"{'not given' if value == 'None' else value} on rank{'s' if len(ranks) > 1 else ''} {_rank_list(ranks)}"
            for value, ranks in groups.items()))
    return out[:shown] + ([f"and {len(out) - shown} more"] if len(out) > shown else [])


def flags_refusal(every_flags) -> str | None:
    """The refusal of a job whose ranks were started with different flags (:func:`differing_flags`), or None."""
    differ = differing_flags(every_flags)
    return ("the ranks were started with different flags: " + "; ".join(differ)
            + "; start every rank with the same command") if differ else None


def inputs_refusal(every_inputs) -> str | None:
    """The refusal of a job whose ranks read different bytes under one name (each rank's ``{what: digest}``, e.g.
    :func:`minizero.data.data_digest`: a --data file that differs between nodes trains each data rank on its own
    text, silently), or None."""
    for what in every_inputs[0]:
        groups = {}
        for r, inputs in enumerate(every_inputs):
            groups.setdefault(inputs.get(what), []).append(r)
        if len(groups) > 1:
            return (f"{what} differs between the ranks: " + "; ".join(
                f"{digest} on rank{'s' if len(ranks) > 1 else ''} {_rank_list(ranks)}" for digest, ranks in
                groups.items()) + "; every rank must read the same bytes")
    return None


def _rank_list(ranks: list[int]) -> str:
    """``0`` / ``0-3`` / ``0, 2, 5``: a list of ranks, runs of consecutive ranks as a range."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ", ".join(map(str, ranks))
