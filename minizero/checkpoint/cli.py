"""``python -m minizero.checkpoint inspect PATH`` and ``consolidate PATH --out model.npz``.

``inspect``: layout, step, loss scale, bytes per rank by kind. ``consolidate``: every full parameter, one at a
time, into nanoGPT-named ``model.npz`` (DeepSpeed's ``zero_to_fp32.py``) and ``model.json`` beside it, as train
writes them (sample and quantize then need no ``--model``). A bad checkpoint: exit 2, one line; so is one in a
folder a running job locks (its next save may prune what is read, as train's ``--resume``).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys

import numpy as np
from safetensors import SafetensorError

from minizero.checkpoint.format import LATEST, CheckpointError, checkpoint_holding, refuse_pipes, verify
from minizero.checkpoint.layout import KINDS, TIED
from minizero.checkpoint.load import ShardReader, full_tensor
from minizero.files import PRUNED_MID_READ, WriteError, atomic_write, check_writable_file, live_job_holding, read_json
from minizero.overwrite import READ_BACK, refuse_slash_or_dangling
from minizero.streams import stream_fd
from minizero.temporaries import unwritable
from minizero.ledger import format_bytes
from minizero.nn import GPT, GPTConfig
from minizero.numerals import OneLineParser, error_lines
from minizero.parallel.expert_parallel import MoEConfig, use_moe
from minizero.saved_model import SIDECAR, write_model_json, write_npz
from minizero.interrupts import WHOLE, interruptible, refuse_several_ranks


TIED_HEAD = "lm_head.weight"  #: the LM head's own name: the same array as :data:`TIED` (weight tying)


def _moe(lay: dict, n_layer: int) -> str:
    """The model line's MoE clause ("" for a dense model): it was left out, so a MoE checkpoint read as dense."""
    if not lay.get("moe_experts"):
        return ""
    moe = MoEConfig(lay["moe_experts"], lay["moe_top_k"], lay["moe_capacity_factor"], lay["moe_every"])
    return (f"\n  MoE in blocks {moe.layers(n_layer)}: {moe.experts} experts, top-{moe.top_k}, capacity factor "
            f"{moe.capacity_factor:g}")


def describe(reader: ShardReader) -> str:
    """The ``inspect`` text of a checkpoint (a few lines, then one line per rank)."""
    man = reader.manifest
    lay, cfg = man["layout"], man["model"]
    cp = f" x cp {lay['cp']}" if lay.get("cp", 1) > 1 else ""  # absent before cp was written: 1
    lines = [f"checkpoint {reader.folder}",
             f"  step {man['step']} (loop steps done = data position), {man['applied']} optimizer steps applied, "
             f"format version {man['version']}",
             f"  model: {cfg['n_layer']} layers, width {cfg['n_embd']}, {cfg['n_head']} heads, context "
             f"{cfg['block_size']}, vocabulary {cfg['vocab_size']}, {cfg['dtype']}" + _moe(lay, cfg['n_layer']),
             f"  layout: {lay['world_size']} rank(s) = dp {lay['dp']}{cp} x tp {lay['tp']} x pp {lay['pp']}, ZeRO "
             f"{lay['zero']}, {lay['precision']}, {lay['optimizer']}, optimizer offload {lay['offload_optimizer']}"]
    if man.get("scaler"):
        sc = man["scaler"]
        lines.append(f"  loss scale {sc['scale']:g} (clean steps {sc['good_steps']}, hysteresis left "
                     f"{sc['hysteresis_left']}, skipped {sc['skipped']})")
    per = collections.defaultdict(collections.Counter)
    for pc in man["pieces"]:
        n = pc["hi"] - pc["lo"]
        nbytes = n * np.dtype(pc["dtype"]).itemsize
        if pc["format"] == "8bit":
            b = pc["block_size"]
            nbytes += 4 * ((pc["lo"] % b + n + b - 1) // b)
        per[pc["rank"]][pc["kind"]] += nbytes
    n = lay.get("cp", 1)  # coords' data rank d is (dp rank, cp rank) = divmod(d, cp) (context_group)
    at = (lambda c: (*divmod(c[0], n), *c[1:])) if cp else tuple
    w = 14 if cp else 11
    lines.append(f"  {'rank':>4} {'(dp,cp,tp,pp)' if cp else '(dp,tp,pp)':>{w}} {'file bytes':>12}  "
                 + "  ".join(f"{k:>10}" for k in KINDS))
    for f in man["files"]:
        c = per[f["rank"]]
        lines.append(f"  {f['rank']:>4} {str(at(f['coords'])):>{w}} {f['bytes']:>12,}  "
                     + "  ".join(f"{format_bytes(c[k]) if c[k] else '-':>10}" for k in KINDS))
    empty = [f["rank"] for f in man["files"] if not per[f["rank"]]]
    if empty:  # replicas: save's _written_here puts each element in one rank's file
        lines.append(f"  rank{'s' * (len(empty) > 1)} {', '.join(map(str, empty))}: no arrays (a header only; "
                     "RNG states are in the manifest)")
        if lay["zero"] == 0:
            part = " of its tensor/pipeline part" if lay["tp"] > 1 or lay["pp"] > 1 else ""
            lines.append(f"    at ZeRO 0 every data-parallel rank holds a full replica{part}; the lowest data rank "
                         "writes it")
        elif (lay.get("dp_shard") or lay["dp"]) < lay["dp"]:  # hybrid sharding (zero/hybrid.py)
            lines.append(f"    hybrid sharding: ZeRO shards over groups of {lay['dp_shard']} data rank(s){cp}; the "
                         "first group writes, the others hold copies")
    if lay["tp"] > 1:  # why a rank's bytes above are fewer than its memory ledger's parameters
        lines.append("  what all tensor ranks hold whole (layer norms, row-parallel biases, wpe) tensor rank 0 writes")
    tied = f" ({TIED_HEAD} is tied to {TIED}: saved once)" if TIED in man["params"] else ""
    lines.append(f"  {len(man['pieces'])} pieces of {len(man['params'])} parameters{tied}"
                 + (f"; pruning masks at {man['pruning']['sparsity']:.0%}" if man.get("pruning") else ""))
    return "\n".join(lines)


def consolidate(path: str, out: str) -> dict:
    """Write ``out`` (.npz): every parameter whole, under every nanoGPT name; returns the arrays.

    Raises:
        CheckpointError: a piece is missing (see :meth:`ShardReader.gather`).
    """
    reader = ShardReader(path)
    cfg = GPTConfig(**reader.manifest["model"])
    model, lay = GPT(cfg, seed=0), reader.manifest["layout"]
    if lay.get("moe_experts"):  # the MoE layers' names and whole (E, ...) shapes
        use_moe(model, MoEConfig(lay["moe_experts"], lay["moe_top_k"], lay["moe_capacity_factor"], lay["moe_every"]), 0)
    first = {}  # id(Parameter) -> its first name (the logical one), as the checkpoint names it
    state = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        if first[id(p)] not in state:
            state[first[id(p)]] = full_tensor(reader, first[id(p)])
        state[name] = state[first[id(p)]]
    atomic_write(out, lambda f: write_npz(f, state, cfg))  # the config in model.npz: see minizero.saved_model
    return state


def tensor_count(state: dict) -> str:
    """``"53 tensors: 52 parameters, lm_head.weight tied to transformer.wte.weight"``: what :func:`consolidate`
    wrote, a tied name (one array under two names, ``inspect`` counts it once) said with the array it repeats."""
    first: dict = {}  # id(array) -> its first name
    tied = [f"{name} tied to {first[id(a)]}" for name, a in state.items() if first.setdefault(id(a), name) != name]
    return f"{len(state)} tensors" + (f": {len(state) - len(tied)} parameters, {', '.join(tied)}" if tied else "")


def check_out(out: str) -> None:
    """``consolidate --out``: a file outside every checkpoint folder, in a folder that takes it;
    checked before any read.

    Raises CheckpointError: naming ``out`` and why it would overwrite or lose something.
    """
    p = os.path.abspath(out) if out else ""
    if stream_fd(out) is not None:  # > log: the weights, then what is printed, went into the log
        raise CheckpointError(f"--out {out!r} names an open stream; consolidate writes a file (and {SIDECAR} beside "
                              "it): give a file path such as model.npz")
    if p and os.path.lexists(p) and not os.path.isdir(p) and not os.path.isfile(p):  # /dev/null: model.json in /dev
        raise CheckpointError(f"--out {out!r} exists and is not a regular file; give a new file path or an existing "
                              "file such as model.npz")
    if not p or os.path.isdir(out):  # as given: abspath('m.npz/..') is a directory, 'm.npz/..' is refused below
        raise CheckpointError(f"--out {out!r} is {'empty' if not p else 'a directory'}; give a file path "
                              "such as model.npz")
    try:  # 'cdir/' and 'nodir/.' wrote a file cdir, nodir; 'm.npz/.' failed after the work
        refuse_slash_or_dangling(out, "--out")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    folder = checkpoint_holding(p)
    if folder:
        raise CheckpointError(f"--out {out!r} is inside the checkpoint folder {folder!r} and would overwrite or add "
                              "to it; give a path outside every checkpoint")
    if os.path.basename(p) == LATEST and os.path.exists(p):
        raise CheckpointError(f"--out {out!r} would overwrite a save dir's pointer to its latest checkpoint")
    name = os.path.basename(p)  # an .npz may be replaced (consolidated again), a JSON file programs read back not
    if name in READ_BACK and not name.endswith(".npz"):
        raise CheckpointError(f"--out {out!r} is named as the {name} minizero's programs read back as JSON"
                              + (" (consolidate writes it beside the weights)" if name == SIDECAR else "")
                              + "; give an .npz file path such as model.npz")
    if os.path.isfile(p) and os.path.getsize(p):  # replaced only when it is earlier weights (an .npz: a zip archive)
        with open(p, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise CheckpointError(f"--out {out!r} exists and is not an .npz (a zip archive): consolidate replaces "
                                      "only earlier weights; give another file, or move that one away")
    try:
        check_writable_file(p)
    except OSError as e:
        raise CheckpointError(unwritable("--out", out, e)) from None


def sidecar_to_write(out: str, cfg: GPTConfig) -> str | None:
    """The ``model.json`` to write beside ``out`` (train's config file, see :func:`minizero.weights.model_config`),
    or None when one holding ``cfg`` is already there; checked before any tensor is read.

    Raises CheckpointError: another file of that name is there (:data:`minizero.overwrite.READ_BACK`: never
    overwritten; it may be another model's config, or the user's).
    """
    real = os.path.realpath(out) if os.path.islink(out) else os.path.abspath(out)  # a link: beside the weights
    path = os.path.join(os.path.dirname(real), SIDECAR)  # it wrote through, not beside the link (a stale pair there)
    if not os.path.lexists(path):
        return path
    try:
        if os.path.isfile(path) and read_json(path) == dataclasses.asdict(cfg):
            return None
    except (OSError, ValueError):
        pass
    raise CheckpointError(f"--out {out!r}: {path!r} exists beside it and says another model (or is not a file); "
                          f"consolidate writes the weights' {SIDECAR} there and never overwrites one; remove it or "
                          f"give --out in another folder")


def main(argv=None) -> int:
    """Entry point of ``python -m minizero.checkpoint``; returns the exit status (2: bad checkpoint)."""
    p = OneLineParser(prog="python -m minizero.checkpoint",  # its subcommands' parsers are OneLineParsers too
                      description="Inspect a sharded minizero checkpoint, or consolidate it into model.npz.",
                      allow_abbrev=False)  # a flag read whole, as every program's: "--ou" is not --out
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="layout, step, bytes per rank")
    ins.add_argument("path", help="a checkpoint folder, or a save dir (its latest complete checkpoint)")
    con = sub.add_parser("consolidate", help="the whole model as model.npz (nanoGPT names) and model.json beside it",
                         allow_abbrev=False)
    con.add_argument("path", help="a checkpoint folder, or a save dir (its latest complete checkpoint)")
    con.add_argument("--out", default=None, help="the .npz to write (default: model.npz, which must not exist yet); "
                     f"the model's config goes to {SIDECAR} in the same folder (one of another model there is "
                     "refused, never replaced), where sample, quantize and finetune --weights OUT read it")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # none given: the error names them (it said "command")
    refuse_several_ranks(p)
    args = p.parse_args(argv)
    try:
        if args.command == "consolidate":
            if args.out is None:  # the default: never over a model.npz already here (another run's weights)
                if os.path.exists("model.npz"):
                    raise CheckpointError("model.npz exists here (the weights of a run?); give --out PATH to write "
                                          "elsewhere, or to replace it")
                args.out = "model.npz"
            check_out(args.out)
        refuse_pipes(args.path)  # before live_job_holding opens a .lock
        held = live_job_holding(args.path)  # its next save may prune what we read: refused as train's --resume
        if held:
            raise CheckpointError(f"{args.path}: {held[0]!r} is in use by a running minizero job ({held[1]}), "
                                  + PRUNED_MID_READ)
        folder = verify(args.path)
        if args.command == "inspect":
            print(describe(ShardReader(folder)))
        else:
            cfg = GPTConfig(**ShardReader(folder).manifest["model"])
            sidecar = sidecar_to_write(args.out, cfg)  # before any tensor is read
            try:
                state = consolidate(folder, args.out)
            except (KeyError, SafetensorError) as e:  # a shard whose bytes match its hash but not the manifest
                raise CheckpointError(f"{folder}: the manifest names what its files do not hold "
                                      f"({type(e).__name__}: {e}); the checkpoint is damaged") from None
            if sidecar is not None:
                write_model_json(os.path.dirname(sidecar), cfg)
            shown = os.path.join(os.path.dirname(args.out), SIDECAR)  # as --out was given: relative stays relative
            shown = sidecar if os.path.islink(args.out) else shown  # beside the link's target, where it was written
            written = f"{args.out} and {shown}" if sidecar else args.out
            print(f"wrote {written} from {folder}\n  {tensor_count(state)}\n  config: {shown}, beside the weights"
                  f"{'' if sidecar else ' (already there: this model)'};\n  sample, quantize and finetune --weights "
                  f"{args.out} read it from there")  # two lines: one was 153 columns for out/consolidated.npz
    except CheckpointError as e:  # resolve() names the trainer's flag; here PATH is positional
        msg = str(e)[len("--resume "):] if str(e).startswith("--resume ") else str(e)
        # one line per problem (a damaged manifest may have several), a long one over indented lines
        print(error_lines("python -m minizero.checkpoint", msg), file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed by its reader: interruptible ends quietly
        raise
    except WriteError as e:  # a full disk: not a bad argument (exit 1, as quantize and finetune)
        print(error_lines("python -m minizero.checkpoint", f"{e.strerror}; {WHOLE}"), file=sys.stderr)
        return 1
    except OSError as e:
        print(error_lines("python -m minizero.checkpoint", str(e)), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(interruptible("minizero.checkpoint", WHOLE, main))
