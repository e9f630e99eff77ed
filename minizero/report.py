"""What the main job shows and writes at the end: memory summary; weights, summary.json, plots, sample.

Every rank's ledger figures are gathered with the hand-written all-gather (:func:`gather_stats`); rank 0 prints them
with :func:`minizero.ledger.memory_summary`, saves the weights (nanoGPT's state_dict names) and the JSON summary, each
written to a temporary name and renamed (:func:`minizero.files.atomic_write`).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import textwrap

import numpy as np

from minizero import jsons
from minizero.comm.collectives import all_gather
from minizero.files import atomic_write
from minizero.header import run_techniques
from minizero.ledger import CATEGORIES, format_bytes, get_ledger, memory_summary, per_rank_text, wrap
from minizero.memory.monitor import draw_memory, report_memory
from minizero.memory.plots import INSTALL_HINT, PLOTS_OFF, plots_on
from minizero.memory.recompute import recomputed_blocks
from minizero.numerals import counted, significant, thousands, wrapped
from minizero.parallel.strategy import TRAFFIC_KINDS
from minizero.plots import MISSING, plot_losses, steps_drawn
from minizero.sample import printable, sample_text
from minizero.saved_model import SIDECAR, save_model
from minizero.streams import stream_fd
from minizero.zero import shards_parameters

#: the main job's sampling temperature (``python -m minizero.sample`` defaults to the same)
SAMPLE_TEMPERATURE = 0.8
#: how the report names each traffic kind (summary.json keeps the keys of TRAFFIC_KINDS)
KIND_LABELS = {"gradient_reduction": "gradient reduction",
               "parameter_gathers": "parameter gathers and broadcasts",
               "pipeline_activations": "pipeline activations",
               "tensor_parallel_activations": "tensor parallel activations",
               "context_parallel_attention":
                   "context parallel ring attention (K, V, their gradients) or Ulysses all-to-alls",
               "expert_all_to_all": "expert all-to-all (MoE dispatch, combine and their counts)",
               "validation": "validation (the forward passes of the held-out batches, every group)",
               "other": "other (loss, norm, flags, metrics, replica digests)"}
#: one line when neither plot could be drawn
NO_PLOTS = "matplotlib is not installed, so neither loss.png nor memory.png was drawn (pip install matplotlib)"


PIPELINE_NOTE = textwrap.fill(
    "(pipeline: a stage's modules hold the saves of every micro-batch it has in flight at once, the header's "
    "'micro-batches in flight per stage': under 1F1B the first stage's modules show the most bytes)", 100,
    initial_indent="  ", subsequent_indent="    ")


def recompute_note(mode: str, every: int, n_blocks: int) -> str:
    """The hotspots' footnote under ``--recompute`` (memory/recompute.py wraps blocks 0, K, 2K, ... of a stage's
    ``n_blocks``: those named, never one past the last; it said "blocks 0, 7, 14, ..." of 2)."""
    what = "each block's saves" if mode == "full" else "the attention cores' scores"
    if every > 1:
        what = (f"the {'saves' if mode == 'full' else 'attention scores'} of {recomputed_blocks(n_blocks, every)} "
                f"(--recompute-every {every}; the other blocks keep theirs)")
    return textwrap.fill(f"(--recompute {mode}: {what} exist only while backward recomputes them, one at a time)",
                         100, initial_indent="  ", subsequent_indent="    ")


def gather_stats(comm, process_peak: int, by_kind: dict) -> list[dict]:
    """Collective: every rank's ledger snapshot, process peak and bytes sent, via the hand-written all-gather.

    ``by_kind``: this rank's bytes sent by purpose (``Strategy.traffic_by_kind``), in the order of
    :data:`~minizero.parallel.strategy.TRAFFIC_KINDS`. Returns one dict per rank (bytes).
    """
    snap = get_ledger().snapshot()
    traffic = comm.traffic.snapshot()
    vec = np.array([snap["current"][c] for c in CATEGORIES] + [snap["peak"][c] for c in CATEGORIES]
                   + [snap["peak_total"], process_peak, traffic["bytes_sent"]] + [by_kind[k] for k in TRAFFIC_KINDS],
                   dtype=np.float64)
    k = len(CATEGORIES)
    with comm.traffic.op("metrics"):
        allv = all_gather(comm, vec).reshape(comm.world_size, -1)
    out = []
    for row in allv:
        row = [int(v) for v in row]
        kinds = dict(zip(TRAFFIC_KINDS, row[2 * k + 3:]))
        out.append({"current": dict(zip(CATEGORIES, row[:k])), "peak": dict(zip(CATEGORIES, row[k:2 * k])),
                    "peak_total": row[2 * k], "process_peak": row[2 * k + 1], "bytes_sent": row[2 * k + 2],
                    "bytes_sent_by_kind": kinds, "bytes_sent_grad_allreduce": kinds["gradient_reduction"]})
    return out


#: sequences (steps x global batch) after which the default model is told the built-in text's end is easier:
#: bench/bench_heldout.py (global batch 16) puts the end's loss above every trained-on slice's at --steps 20, below
#: them from 30; 50 steps of 16 leave a margin
EASIER_END_FROM_SEQUENCES = 50 * 16


def validation_lines(args, result) -> list[str]:
    """The report's validation loss line (cut at 120 columns), then why it sits below the training loss, wrapped at
    100 columns, when it does. A resumed run's time and tokens/s are this run's steps only, and it says so."""
    val0, val = result["val_history"][0][1], result["val_history"][-1][1]
    ran = len(result["train_losses"])
    timing = f"{result['elapsed_s']:.1f} s, {result['tokens_per_s']:,.0f} tokens/s"
    steps = counted(args.steps, "step")
    lines = wrap(f"validation loss: {val:.4f} nats/byte (start {val0:.4f}; ln 256 = {math.log(256):.4f}) after "
                 f"{steps}" + (f" ({thousands(ran)} in this run, {timing})" if result.start_step else f", {timing}"),
                 width=120)  # one line up to 120 columns (a resumed run of 400 steps at 2,226 tokens/s took 123)
    recent = [x for i, x in enumerate(result["train_losses"]) if result.start_step + i >= args.warmup][-20:]
    if not recent or val >= statistics.median(recent):  # the median: a spike in the window does not move it
        return lines
    median = statistics.median(recent)
    half = len(recent) // 2  # the median lags a falling loss by about how far it fell from one half to the other
    fell = statistics.median(recent[:half]) - statistics.median(recent[half:]) if half else 0.0
    said = f"  below the training loss ({median:.4f}, median of the last {len(recent)} steps after warmup)"
    if val >= median - fell:
        said += (f": the loss fell {significant(fell)} over those steps (their first half's median to their "
                 "second's), so their median lags the model validated after the last one")
    elif args.data:  # the user's text: nothing is known about its end
        said += ("; the held-out slice is the last 10% of --data's file: an end easier to predict than the rest, "
                 "or passages repeated from the part trained on, would put it there")
    else:  # the built-in corpus: a falling loss does not explain the gap; its end is easier once the model has learnt
        where = "the end of the text (its last 10%; the Python language reference that ships with CPython)"
        sample = f"{args.eval_batches} batches of 16 sequences sample part of it"
        said += (f": the held-out slice is {where}, easier to predict than the rest, and {sample}; not a leak"
                 if args.model == "default" and args.steps * (args.batch_size or 0) >= EASIER_END_FROM_SEQUENCES else
                 f": the held-out slice is {where}, and {sample}, whose loss need not be the whole end's; not a leak")
    return lines + wrap(said)


def _json_safe(x):
    """``x`` with NaN/inf floats as None, so the summary is strict JSON (a skipped FP16 step has no norm)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _expert_replicas(args) -> bool:
    """True where each expert is held by several ranks (an expert-data group of more than one: dp / ep > 1)."""
    return args.moe_experts > 0 and args.ep > 1 and args.dp // args.ep > 1


def startup_tree(args) -> str:
    """How the start-up broadcast of the parameters runs, for the per-rank traffic line ('' under --native-comm).

    One tree from rank 0 only where the data group is the world; with tp or pp each data group (one per stage and
    tensor rank), and with ep each expert-data group for the experts, broadcasts from its own first rank."""
    if args.native_comm:
        return ""
    experts = _expert_replicas(args)
    if args.tp == 1 and args.pp == 1 and not experts:
        return ": a binomial tree from rank 0, whose leaves send nothing"
    groups = "each data group" + (" (the experts: each expert-data group)" if experts else "")
    return f": a binomial tree in {groups} from its first rank, whose leaves send nothing"


def report(args, result, stats, threads, local_ranks, cores, zero) -> None:
    """Rank 0: print the final report; write ``OUT/model.npz``, the JSON summary, the plots, then the sample's text
    into the summary (cheap and precious first).

    ``stats``: :func:`gather_stats` of every rank; ``threads``, ``local_ranks``, ``cores``: BLAS threads per rank, ranks
    and cores on this node; ``zero``: every rank's model-state figures (:func:`minizero.zero.gather_figures`).
    Raises:
        FloatingPointError: a weight is inf/NaN (nothing is written; the previous file stays).
    """
    model, cfg = result["model"], result["config"]
    val = result["val_history"][-1][1]
    def say(text):  # prose, wrapped at 100 columns
        print("\n".join(wrap(text)))
    print()
    print("\n".join(validation_lines(args, result)))
    if args.precision == "fp16":
        scales = result["loss_scales"]
        say(f"fp16: loss scale {scales[-1]:g} used at the last step (started {scales[0]:g}, lowest {min(scales):g}); "
            f"{result['skipped_steps']} step(s) skipped for inf/NaN gradients"
            + (f" (at step {', '.join(str(k + 1) for k in result['skipped_at'][:10])}"  # 1-based, as progress
               f"{', ...' if len(result['skipped_at']) > 10 else ''})" if result["skipped_at"] else ""))
    if result.moe is not None:
        say(f"MoE: {args.moe_experts} experts, top-{args.moe_top_k}, ep {args.ep}: routing choices per expert over "
            f"the run (top-{args.moe_top_k} per token, summed over the {len(result.moe['layers'])} MoE layers) "
            f"{', '.join(f'{n:,}' for n in result.moe['tokens_per_expert'])} "
            f"(shares {', '.join(f'{x:.1%}' for x in result.moe['load_share'])}), "
            f"{result.moe['drop_rate']:.2%} of the choices dropped past capacity")
    capped = threads < max(1, cores // max(1, local_ranks))  # the user's OPENBLAS/OMP/MKL_NUM_THREADS
    notes = [f"BLAS threads per rank: {threads} ({local_ranks} rank(s) on this node, {cores} core(s)"
             + ("; capped by the environment's OPENBLAS_NUM_THREADS, OMP_NUM_THREADS or MKL_NUM_THREADS)" if capped
                else ")"),
             "bytes sent per rank: " + per_rank_text([format_bytes(s["bytes_sent"]) for s in stats])]
    copy = args.tp > 1 or args.pp > 1 or (args.moe_experts > 0 and args.ep > 1)  # the model below: a gathered copy
    tree = startup_tree(args)
    params_sharded = shards_parameters(args.zero)  # the model needs a final gather
    gathers = [w for w, here in ((f"the start-up broadcast{tree}", not args.zero and args.dp * args.cp > 1),
                                 ("ZeRO's gathers, its start-up all-gather of the shards included",
                                  args.zero and not params_sharded),
                                 ("ZeRO's gathers, its final gather for the model's copy included",
                                  params_sharded and copy),
                                 ("ZeRO's gathers; the final gather for the weights and the sample, one forward's "
                                  "gathers more, comes after these figures", params_sharded and not copy),
                                 ("the final gather of the experts", args.moe_experts > 0 and args.ep > 1),
                                 ("the model's final gather onto rank 0", args.tp > 1 or args.pp > 1)) if here]
    reductions = [w for w, here in (("data parallel", args.dp * args.cp > 1),
                                    ("the experts' over their expert-data groups, the traffic table's edp row",
                                     _expert_replicas(args)),
                                    ("the tied embedding between the first and last stage", args.pp > 1)) if here]
    labels = dict(KIND_LABELS, parameter_gathers=KIND_LABELS["parameter_gathers"] + (f" ({'; '.join(gathers)})"
                                                                                    if gathers else ""),
                  gradient_reduction=KIND_LABELS["gradient_reduction"] + (f" ({'; '.join(reductions)})"
                                                                        if reductions else ""))
    for kind in TRAFFIC_KINDS:
        if any(s["bytes_sent_by_kind"][kind] for s in stats):
            notes.append(f"  {labels.get(kind, kind.replace('_', ' '))}: " + per_rank_text(
                [format_bytes(s["bytes_sent_by_kind"][kind]) for s in stats]))
    split = [w for w, here in (("its tensor-parallel shard", args.tp > 1), ("its pipeline stage", args.pp > 1),
                               ("its experts", args.moe_experts > 0 and args.ep > 1)) if here]
    holds = (f"split over the ranks: each holds {', '.join(split)}" if split else "every rank holds them all"
             + (": context parallelism splits the sequence, not the model" if args.cp > 1 else ""))
    notes.append((f"ZeRO stage {args.zero}: model states per rank at the optimizer step: " if args.zero else
                  f"model states per rank at the optimizer step ({holds}): ")
                 + per_rank_text(
        [format_bytes(z["parameters"] + z["gradients"] + z["optimizer_state"]) for z in zero]))
    if result.setup_peaks:
        notes.append("peaks above: the training steps only; set-up (building the model, then copying it into its "
                     "flat buffers or shards) peaked at " + per_rank_text(
            [format_bytes(sp["peak_total"]) for sp in result["setup_peaks"]]))
    if result.pruner is not None:
        rep = result["pruner"].report()
        notes.append(f"pruned {rep['pruned']:,} of {rep['total']:,} linear weights ({rep['sparsity']:.1%}, "
                     f"{args.prune_scope}): stored dense {format_bytes(rep['dense'])} (NumPy keeps the zeros); "
                     f"would be CSR {format_bytes(rep['csr'])}, bitmap {format_bytes(rep['bitmap'])}; the keep-masks "
                     f"(one bit per weight) add {format_bytes(rep['mask_bytes'])} to parameters")
    if result.device_pool:
        notes.append("CuPy memory pool high-water at step ends (used / held): " + per_rank_text(
            [f"{format_bytes(p['used'])} / {format_bytes(p['total'])}" for p in result["device_pool"]]))
    run = f"{args.model} model, {args.world_size} rank(s): {run_techniques(args)}"  # the plots' titles
    source = "tracemalloc" if args.tracemalloc and not args.no_tracemalloc else "rss"
    print(memory_summary(stats, [s["process_peak"] for s in stats], notes, process_peak_source=source))
    mem_lines, mem_summary = ([], {}) if result.module_peaks is None else report_memory(
        result["memory_timeline"], result["module_peaks"])
    print("\n".join(mem_lines))
    if mem_lines and args.recompute != "none":  # the hotspots' bytes exist only inside backward, one unit at a time
        print(recompute_note(args.recompute, args.recompute_every, cfg.n_layer // args.pp))
    if mem_lines and args.pp > 1:  # stage 0's hotspots were twice stage 1's under 1F1B, without a word
        print(PIPELINE_NOTE)
    if args.no_save:
        _print_sample(args, sample_text(model, args.prompt, args.sample_tokens, SAMPLE_TEMPERATURE, seed=args.seed))
        return
    # cheap and precious first, so that a signal or a full disk costs the least: the weights, summary.json, the
    # pictures (drawn again from summary.json), last the sample (one forward per byte; python -m minizero.sample
    # draws it again from the weights), which then completes summary.json
    state = model.state_dict()
    bad = [k for k, v in state.items() if not np.isfinite(v).all()]
    if bad:
        raise FloatingPointError(f"not saving: {len(bad)} tensor(s) hold inf/NaN (first: {bad[0]}); "
                                 f"the previous {os.path.join(args.out, 'model.npz')} is left as it was")
    save_model(args.out, state, cfg)  # model.npz, then model.json (the head count: in no array's shape)
    schedule = args.schedule if args.pp > 1 else None
    summary = {
        "world_size": args.world_size,
        "dp": args.dp, "tp": args.tp, "pp": args.pp, "micro_batches": args.micro_batches,
        "schedule": schedule,  # null without pipeline stages
        "config": {"model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},  # the flags, resolved:
                   "train": dict(vars(args), block_size=cfg.block_size, dropout=cfg.dropout, schedule=schedule)},
        "num_parameters": model.num_parameters(),
        "train_loss": result["train_losses"],
        "grad_norm": result["grad_norms"],
        "val_loss": val,
        "val_history": result["val_history"],
        "elapsed_s": result["elapsed_s"],
        "tokens_per_s": result["tokens_per_s"],
        "blas_threads_per_rank": threads,
        "ledger_peak_bytes": [s["peak"] for s in stats],
        "ledger_peak_total_bytes": [s["peak_total"] for s in stats],
        "ledger_setup_peak_bytes": result.setup_peaks,
        "process_peak_bytes": [s["process_peak"] for s in stats],
        "device_pool_peak_bytes": result.device_pool,  # CuPy pool {used, total} high-water per rank
        "bytes_sent": [s["bytes_sent"] for s in stats],
        "bytes_sent_grad_allreduce": [s["bytes_sent_grad_allreduce"] for s in stats],  # = gradient_reduction
        "bytes_sent_by_kind": {k: [s["bytes_sent_by_kind"][k] for s in stats] for k in TRAFFIC_KINDS},
        "zero": {"stage": args.zero, "dp_shard": args.dp_shard if args.zero else None, "per_rank": zero},
        "precision": args.precision,
        "loss_scale": result["loss_scales"],
        "skipped_steps": result["skipped_steps"],
        "start_step": result.start_step,  # the step a resumed run started from (0: a fresh run); per-step lists
        # (train_loss, grad_norm, loss_scale) hold this run's steps only: entry i is the progress log's step
        # start_step + i + 1
        "skipped_at": result["skipped_at"],  # 0-based: k is the progress log's "step k+1", list index k - start_step
        "loss_spikes": result.loss_spikes,
        "time_per_rank": result.time_per_rank,
        "optimizer": args.optimizer, "quantized_comm": args.quantized_comm,
        "pruning": None if result.pruner is None else {
            k: v for k, v in result["pruner"].report().items() if k != "layers"},
        "moe": None if result.moe is None else dict(result.moe, experts=args.moe_experts, top_k=args.moe_top_k,
                                                     ep=args.ep, capacity_factor=args.moe_capacity_factor),
        "sample": None,  # written last (null in a summary.json whose run stopped before it)
        **mem_summary,  # activation_peaks_by_module (per rank), memory_timeline_peak_bytes, memory_plot
    }
    _write_summary(args.json, summary, final=False)
    pictures, memory_plot = _draw_pictures(args, result, stats, run)
    if mem_summary:
        summary["memory_plot"] = memory_plot
    summary["sample"] = sample_text(model, args.prompt, args.sample_tokens, SAMPLE_TEMPERATURE, seed=args.seed)
    _print_sample(args, summary["sample"])
    _write_summary(args.json, summary, final=True)
    print(f"wrote {os.path.join(args.out, 'model.npz')}, {os.path.join(args.out, SIDECAR)} and {args.json}")
    print("\n".join(pictures))


def _print_sample(args, text: str) -> None:
    if args.sample_tokens:  # --sample-tokens 0: the prompt alone, not printed
        shown = printable(text, width=120)  # a long line wrapped, as the rest of the report; the text is unchanged
        kept = "" if args.no_save else " (the summary's 'sample')"  # true even if writing the summary then fails
        note = f" (lines past 120 columns wrapped for display only; the text{kept} has no such breaks)"
        print("\n" + wrapped(f"sample:{note if shown.count(chr(10)) > text.count(chr(10)) else ''}") + f"\n{shown}\n")


def _write_summary(path: str, summary: dict, final: bool) -> None:
    """``--json``, whole; a device or FIFO (``--json /dev/stdout``) takes one document, the final one."""
    if final or stream_fd(path) is None and (not os.path.exists(path) or os.path.isfile(path)):
        text = json.dumps(_json_safe(jsons.summary(summary)), indent=1, allow_nan=False)
        atomic_write(path, lambda f: f.write(text), mode="w")


def _draw_pictures(args, result, stats, run: str) -> tuple[list[str], str | None]:
    """``OUT/memory.png`` then ``OUT/loss.png``: the lines to print once everything is written, memory.png's path."""
    if not plots_on():
        return [PLOTS_OFF], None
    memory, path = None, None
    if result.module_peaks is not None:
        memory, path = draw_memory(args.out, result["memory_timeline"], ledgers=stats, first_step=result.start_step,
                                   title=textwrap.fill(run, 110))
    steps = steps_drawn(result.start_step, len(result["train_losses"]), args.steps)  # a resumed run's own steps
    loss = plot_losses(os.path.join(args.out, "loss.png"), result["train_losses"], result["val_history"],
                       result["skipped_at"], textwrap.fill(f"{run}; {steps}, global batch {args.batch_size}", 100),
                       first_step=result.start_step)
    if loss == MISSING and memory == INSTALL_HINT:
        return [NO_PLOTS], path
    return [loss] + ([memory] if memory else []), path
