"""Checkpoint, resume and reshard: stop anywhere, continue anywhere, on any layout.

Every rank writes what it holds to its own safetensors file; a JSON manifest names every piece in logical coordinates
(:mod:`.layout`). Mirrors: DeepSpeed's universal checkpoint, Megatron-LM ``dist_checkpointing``, PyTorch DCP.
"""
from __future__ import annotations

import dataclasses

from safetensors import SafetensorError

from minizero.checkpoint.format import (CheckpointError, checkpoint_digest, checkpoint_holding, clean_partial,
                                        read_manifest, resolve, verify)
from minizero.checkpoint.load import ShardReader, full_tensor, restore
from minizero.checkpoint.save import save_checkpoint
from minizero.ledger import wrap

__all__ = ["Checkpointer", "CheckpointError", "ShardReader", "checkpoint_holding", "full_tensor", "manifest_state",
           "checkpoint_digest", "read_manifest", "resolve", "restore", "save_checkpoint", "verify", "run_layout"]


def run_layout(args) -> dict:
    """What a checkpoint must agree on with the run resuming it: optimizer, precision, dtype (and MoE's shape)."""
    out = {"optimizer": args.optimizer, "precision": args.precision, "dtype": args.dtype,
           "moe_experts": args.moe_experts}
    if args.moe_experts:  # --ep may change: expert slices reshard as tensor-parallel shards do
        out.update({k: vars(args)[k] for k in ("moe_top_k", "moe_every", "moe_capacity_factor")})
    return out


def manifest_state(args, cfg, applied: int, scaler=None, text: str | None = None) -> dict:
    """Rank 0's manifest fields besides the pieces: model, layout, schedule, data, loss scaler.

    ``applied``: optimizer steps taken (Adam's t; the schedule runs on it, skipped FP16 steps excluded); ``text``:
    the training text's bytes and SHA-256 (:func:`minizero.data.text_digest`).
    """
    layout = dict(run_layout(args), world_size=args.world_size, dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp,
                  zero=args.zero,
                  dp_shard=args.dp_shard, offload_optimizer=args.offload_optimizer,
                  adam8bit_block_size=args.adam8bit_block_size, adam8bit_code="dynamic",
                  micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum)
    train = {k: vars(args)[k] for k in ("seed", "lr", "min_lr", "warmup", "steps", "weight_decay", "grad_clip",
                                           "batch_size", "documents", "moe_aux_loss", "moe_z_loss", "moe_bias_update")}
    return {"model": dataclasses.asdict(cfg), "layout": layout, "applied": applied, "train": train,
            "data": {"seed": args.seed, "global_batch": args.batch_size, "block_size": cfg.block_size, "text": text},
            "scaler": None if scaler is None else scaler.state_dict()}


def _as_typed(key: str, value, flag: bool = True) -> str:
    """A train field's ``value`` as the command line gives it: ``--lr 0.001`` (``flag=False``: ``0.001``); the field
    ``documents`` is a switch per value, ``--pack`` or ``--pad``, with or without ``flag``."""
    if key == "documents":
        return f"--{value}"
    return f"--{key.replace('_', '-')} {value}" if flag else f"{value}"


def _derived(args, key: str) -> str:
    """A field the user did not give, as parse_args derived it: ``global batch 2 (micro-batch size 2 x 1 data
    rank(s) x grad-accum 1, --batch-size not given)``; ``key``: batch_size, warmup or min_lr."""
    a = args
    value, source = {"batch_size": ("global batch", f"micro-batch size {a.micro_batch_size} x {a.dp} data rank(s) x "
                                                    f"grad-accum {a.grad_accum}"),
                     "warmup": ("warmup", f"--steps {a.steps} / 10, at least 10 and at most --steps"),
                     "min_lr": ("min-lr", f"--lr {a.lr} / 10")}[key]
    n = vars(args)[key]
    return f"{value} {f'{n:,}' if key == 'batch_size' else n} ({source}, --{key.replace('_', '-')} not given)"


class Checkpointer:
    """The training loop's view of checkpoints: ``resume(strategy, scaler)`` at the start,
    ``maybe_save`` after each step. ``text``: ``'465,123 bytes, SHA-256 0123456789ab'`` of the training text, from
    the tokens the loop loaded (:func:`minizero.data.text_digest`): saved in the manifest, compared on resume."""

    def __init__(self, args, comm, cfg, text: str, log=print):
        self.args, self.comm, self.cfg, self.text, self.log = args, comm, cfg, text, log
        self.every = args.save_every or 0
        self.resumed_from = None
        self.load_peak = 0
        self.saved = []

    def resume(self, strategy, scaler=None) -> tuple:
        """Load ``--resume`` into the built strategy (killed saves' ``.tmp-`` removed);
        ``(start_step, applied, pruner)``.

        Raises CheckpointError: as :func:`restore`, or a shard file or tensor the manifest names is missing.
        """
        path = self.args.resume
        if not path:
            return 0, 0, None
        if self.comm.rank == 0 and self.every:
            for gone in clean_partial(self.args.save_dir):
                self.log(f"checkpoint: removed the unfinished save {gone}")
        try:
            out = restore(path, strategy, self.comm, scaler)
        except (OSError, KeyError, SafetensorError) as e:  # a file or tensor the manifest names is not there
            raise CheckpointError(f"--resume {path}: the manifest names what its files do not hold "
                                  f"({type(e).__name__}: {e}); the checkpoint is damaged") from e
        self.resumed_from, self.load_peak = out["folder"], out["load_peak"]
        man = out["manifest"]
        lay = man["layout"]
        cp = f" x cp {lay['cp']}" if lay.get("cp", 1) > 1 else ""
        n = lay.get("dp_shard") or lay["dp"]  # hybrid sharding was left out: it read as plain ZeRO
        shard = f" over groups of {n} data rank{'s' * (n > 1)}" if n < lay["dp"] else ""
        lines = [f"resumed from {out['folder']} (saved after step {out['step']} on dp {lay['dp']}{cp} x tp "
                 f"{lay['tp']} x pp {lay['pp']}, ZeRO {lay['zero']}{shard}; {out['applied']} optimizer steps applied): "
                 f"continuing at step {out['step'] + 1}"]
        for key in ("steps", "lr", "min_lr", "warmup", "batch_size", "seed", "weight_decay", "grad_clip", "documents",
                    "moe_aux_loss", "moe_z_loss", "moe_bias_update"):
            now, was = vars(self.args)[key], man["train"].get(key)
            if key in man["train"] and was != now:  # absent in older manifests: unknown
                said = _derived(self.args, key) if key in self.args.derived else _as_typed(key, now)
                lines.append(f"note: {said} differs from the checkpoint's {_as_typed(key, was, False)}: "
                             "the continuation is not the uninterrupted run's" + (
                                 "; the learning rate follows the cosine over the new --steps from here, so it can "
                                 "rise again" if key == "steps" else ""))
        was = man["model"].get("dropout", 0.0)
        if self.cfg.dropout != was:  # --dropout, or the --model preset's when not given (it was silent)
            said = f"--dropout {self.cfg.dropout}" if self.args.dropout is not None else \
                f"dropout {self.cfg.dropout} (the {self.args.model!r} preset's, --dropout not given)"
            lines.append(f"note: {said} differs from the checkpoint's {was}: the continuation is not the "
                         "uninterrupted run's")
        was = man.get("data", {}).get("text")  # absent before it was written: nothing to compare
        if was is not None and was != self.text:
            said = f"--data {self.args.data!r}" if self.args.data else "the built-in corpus"
            lines.append(f"note: {said} ({self.text}) differs from the checkpoint's text ({was}): the continuation "
                         "is not the uninterrupted run's")
        for row in (w for line in lines + [f"note: {note}" for note in out["notes"]] for w in wrap(line)):
            self.log(row)  # at 100 columns, an indented continuation: as the header
        return out["step"], out["applied"], out["pruner"]

    def due(self, step: int) -> bool:
        """True after loop step ``step`` (0-based) when a save is due: every N steps and the last one."""
        return bool(self.every) and ((step + 1) % self.every == 0 or step + 1 == self.args.steps)

    def maybe_save(self, step: int, strategy, applied: int, scaler=None, pruner=None):
        """Collective: save after loop step ``step`` when :meth:`due`; returns the folder or None."""
        if not self.due(step):
            return None
        state = manifest_state(self.args, self.cfg, applied, scaler, self.text) if self.comm.rank == 0 else {}
        # a failed save ends the run (exit status 1) even when --out has room, by decision: the user asked for
        # checkpoints, and a run that went on without them could lose more later
        folder = save_checkpoint(strategy, self.comm, self.args.save_dir, step + 1, state, pruner=pruner,
                                 keep=self.args.keep, protect=self.resumed_from)
        if folder is None:
            self.log(f"checkpoint: not saving step {step + 1}: it would overwrite {self.resumed_from}, "
                     "the checkpoint this run resumed from")
        else:
            self.saved.append(folder)
            self.log(f"checkpoint: saved {folder} (step {step + 1})")
        return folder
