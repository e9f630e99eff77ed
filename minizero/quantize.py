"""``python -m minizero.quantize``: store a trained GPT's linear weights in INT8 or INT4 and measure the cost.

Loads ``OUT/model.npz`` (config by :func:`minizero.weights.model_config`'s rule, as sample), replaces every
:class:`~minizero.nn.Linear` by a :class:`QuantizedLinear` (weight-only, dequantized in forward; embeddings,
layer norms, biases and the tied head stay in the stored dtype: FP32, or float16 after an FP16 run) and prints
validation loss and bytes before and after;
``--table`` for every bits x granularity. ``--outlier-threshold T`` keeps FP32 the weight columns whose input
feature reaches T on two calibration batches (LLM.int8()'s criterion, arXiv:2208.07339, section 3.2). The layer
is in :mod:`minizero.quantized_model`, weight reading in :mod:`minizero.weights`. One process (several ranks under
mpirun are refused: each would write the same ``--json``); ``--json`` is locked for the run (``.NAME.lock`` beside it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from minizero import backend, jsons
from minizero.args import MAX_EVAL_BATCHES
from minizero.data import eval_batches, global_batch, load_tokens, min_data_bytes, train_val_split
from minizero.files import FolderLock, atomic_write, lock_outputs, release_all
from minizero.overwrite import check_output
from minizero.flags import MAX_ADAM8BIT_BLOCK
from minizero.ledger import wrap
from minizero.nn.gpt import PRESETS, preset_sizes
from minizero.numerals import (DefaultsOnce, OneLineParser, description, error_lines, integer,
                               negative_values_reach_checks, real, wrapped)
from minizero.quantization import GRANULARITIES
from minizero.streams import lockable
from minizero.quantized_model import (  # noqa: F401 (QuantizedLinear: tests and notebooks import it from here)
    QuantizedLinear, calibrate_input_absmax, evaluate_loss, model_nbytes, quantize_model)
from minizero.weights import SIDECAR, load_trained, read_weights, stored_dtype
from minizero.interrupts import WHOLE, interruptible, refuse_several_ranks

#: how the table labels the stored (unquantized) weights: an FP16 run's model.npz holds float16
DTYPE_LABELS = {"float16": "fp16", "float32": "fp32", "float64": "fp64"}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m minizero.quantize``."""
    p = negative_values_reach_checks(OneLineParser(
        prog="python -m minizero.quantize", description=description(__doc__),
        formatter_class=DefaultsOnce))
    p.add_argument("--weights", default=os.path.join("out", "model.npz"), help="model.npz written by minizero.train")
    p.add_argument("--model", default=None, choices=sorted(PRESETS),
                   help=preset_sizes() + " (default: model.json beside the weights, else summary.json's, else the "
                                         "preset of the arrays' shapes)")
    p.add_argument("--bits", type=integer, default=8, choices=[8, 4], help="bits per weight")
    p.add_argument("--granularity", default="row", choices=list(GRANULARITIES), help="one scale per tensor/row/block")
    p.add_argument("--block-size", type=integer, default=64, help="elements per scale for --granularity block")
    p.add_argument("--outlier-threshold", type=real, default=None,
                   help="experiment with LLM.int8()'s outlier criterion: keep in FP32 the weight columns whose input "
                        "features reach this activation magnitude on 2 calibration batches "
                        "(the paper's threshold: 6.0); activations are never quantized here")
    p.add_argument("--table", action="store_true", help="measure every bits x granularity combination")
    p.add_argument("--data", default=None, help="text file (default: the trainer's --data, else the embedded corpus)")
    p.add_argument("--eval-batches", type=integer, default=None,
                   help="validation batches of 16 sequences (default: the trainer's number, so the FP32 loss "
                        "is the one it printed)")
    p.add_argument("--json", default=None, help="write the measurements here")
    p.add_argument("--device", default="cpu", choices=list(backend.DEVICES),
                   help="where the model runs: cpu (NumPy), cuda (CuPy, GPU LOCAL_RANK %% count), "
                        "strict (host leaks raise)")
    return p


def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to a temporary name beside ``path``, then rename it over ``path``."""
    text = json.dumps(jsons.summary(obj), indent=1)
    atomic_write(path, lambda f: f.write(text), mode="w")


def run(args) -> dict:
    """Measure the configurations ``args`` asks for; returns ``{"baseline": {...}, "rows": [...], ...}`` (also
    ``weights``, ``num_parameters``, ``config``, ``tokens``, ``calibration``, ``outlier_threshold``: the --json)."""
    state = read_weights(args.weights)
    notes = []
    model, summary = load_trained(args.weights, args.model, state, flag="--model", notes=notes)
    cfg = model.config
    train_cfg = _train_section(summary, args.weights)
    for note in notes:  # model_config set summary.json aside: its data, seed and eval batches are not the run's
        print(wrapped(f"python -m minizero.quantize: note: {note}; its data, seed and eval batches are not used (the "
                      "built-in corpus, seed 0 and 4 batches unless given)"), file=sys.stderr)
    data, seed = args.data if args.data is not None else train_cfg.get("data"), train_cfg.get("seed", 0)
    if args.json and data is not None and args.data is None:  # main checked --data; this is summary.json's
        check_output(args.json, inputs={"summary.json's config.train.data": data})
    try:
        tokens = load_tokens(data)
    except (FileNotFoundError, ValueError) as e:  # say where a path the user did not type came from
        raise ValueError(f"summary.json's config.train.data: {e}; fix it or pass --data") if args.data is None else e
    need = min_data_bytes(cfg.block_size)
    if len(tokens) < need:
        name = f"--data {data!r}" if data is not None else "the built-in corpus"
        raise ValueError(f"{name} has {len(tokens):,} bytes; needs at least {need:,} (its last 10% validates "
                         f"and must hold block_size + 2 = {cfg.block_size + 2} tokens)")
    train_tok, val_tok = train_val_split(tokens)
    n_batches = args.eval_batches or train_cfg.get("eval_batches", 4)
    if not isinstance(n_batches, int) or not 1 <= n_batches <= MAX_EVAL_BATCHES:
        raise ValueError(f"summary.json beside --weights {args.weights!r}: config.train.eval_batches {n_batches!r} "
                         f"is not in [1, {MAX_EVAL_BATCHES:,}] as train allows; fix it or pass --eval-batches")
    val = eval_batches(val_tok, cfg.block_size, n_batches, 16, seed=seed + 1)  # the trainer's batches
    base = {"val_loss": evaluate_loss(model, val), "model_bytes": model_nbytes(model),
            "dtype": stored_dtype(state)}
    calib = [global_batch(train_tok, 10_000 + i, 16, cfg.block_size, seed) for i in range(2)]
    calibration = None
    if args.outlier_threshold is not None:  # what the FP32-column experiment sees: every layer's largest |input|
        stats = {k: backend.to_host(v) for k, v in calibrate_input_absmax(model, calib).items()}
        calibration = {"max_input_absmax": {k: float(v.max()) for k, v in stats.items()},
                       "columns_at_threshold": int(sum((v >= args.outlier_threshold).sum() for v in stats.values())),
                       "columns_at_6": int(sum((v >= 6.0).sum() for v in stats.values()))}
    combos = [(b, g) for b in (8, 4) for g in GRANULARITIES] if args.table else [(args.bits, args.granularity)]
    rows = []
    for bits, gran in combos:
        # the FP32-column experiment is row-wise (LLM.int8()'s vector-wise quantization); with
        # --table it is measured beside each per-row row, alone it replaces the plain one
        if args.outlier_threshold is None:
            thresholds = [None]
        elif args.table:
            thresholds = [None, args.outlier_threshold] if gran == "row" else [None]
        else:
            thresholds = [args.outlier_threshold]
        for threshold in thresholds:
            qmodel = load_trained(args.weights, args.model, state, flag="--model")[0]
            rep = quantize_model(qmodel, bits, gran, args.block_size, threshold, calib if threshold else None)
            loss = evaluate_loss(qmodel, val)
            rows.append({"bits": bits, "granularity": gran, "block_size": args.block_size if gran == "block" else None,
                         "outlier_threshold": threshold, "outlier_columns": rep["outlier_columns"],
                         "linear_dense_bytes": rep["dense_bytes"], "linear_bytes": rep["quantized_bytes"],
                         "model_bytes": model_nbytes(qmodel), "val_loss": loss, "delta": loss - base["val_loss"],
                         "skipped": rep["skipped"]})
    return {"weights": args.weights, "num_parameters": model.num_parameters(), "config": dataclasses.asdict(cfg),
            "tokens": n_batches * 16 * cfg.block_size, "baseline": base, "rows": rows, "calibration": calibration,
            "outlier_threshold": args.outlier_threshold}


def format_table(result: dict) -> str:
    """The measurements as a text table (bytes exact, losses in nats per byte), and a line saying what each
    column holds."""
    base, rows = result["baseline"], result["rows"]
    label = DTYPE_LABELS.get(base.get('dtype', 'float32'), base.get('dtype'))
    lines = wrap(f"{result['weights']}: {result['num_parameters']:,} parameters; validation loss on "
                 f"{result['tokens']:,} tokens; linear layers quantized (skipped, tied to another module's weight: "
                 f"{', '.join(rows[0]['skipped']) or '-'})")
    lines += [f"{'weights':<22}{'linear bytes':>14}{'model bytes':>13}{'ratio':>7}{'val loss':>10}{'delta':>10}",
              f"{label:<22}{rows[0]['linear_dense_bytes']:>14,}{base['model_bytes']:>13,}{1:>7.2f}"
              f"{base['val_loss']:>10.4f}{'':>10}"]
    for r in rows:
        name = f"int{r['bits']} {r['granularity']}" + (f" {r['block_size']}" if r["block_size"] else "")
        if r["outlier_threshold"] is not None:
            name += f" +{r['outlier_columns']} fp32 col"
        lines.append(f"{name:<22}{r['linear_bytes']:>14,}{r['model_bytes']:>13,}"
                     f"{r['model_bytes'] / base['model_bytes']:>7.2f}{r['val_loss']:>10.4f}{r['delta']:>+10.5f}")
    lines += wrap(f"bytes: the linear layers' weights and the whole model's; ratio: model bytes / the {label} row's; "
                  f"val loss in nats per byte; delta: val loss minus the {label} row's")
    cal = result.get("calibration")
    if cal:
        top = max(cal["max_input_absmax"], key=cal["max_input_absmax"].get)
        per_layer = sorted(cal["max_input_absmax"].values())
        counts = f"reaching {result['outlier_threshold']}: {cal['columns_at_threshold']}, " * (
            result["outlier_threshold"] != 6.0)  # the paper's threshold given: said once
        lines += wrap(f"outlier calibration (2 training batches): largest input |x| per layer {per_layer[0]:.2f} .. "
                      f"{per_layer[-1]:.2f} ({top}), median {per_layer[len(per_layer) // 2]:.2f}; input features "
                      f"{counts}reaching 6.0 (the paper's threshold): {cal['columns_at_6']}")
    return "\n".join(lines)


def _train_section(summary: dict, weights: str) -> dict:
    """summary.json's ``config.train`` ({} if none), its ``seed`` and ``data`` (what :func:`run` reads) checked."""
    train = summary["config"].get("train", {}) if isinstance(summary.get("config"), dict) else {}
    where = f"summary.json beside --weights {weights!r}: config.train"
    if not isinstance(train, dict):
        raise ValueError(f"{where} is {repr(train)[:40]}, not an object; fix it or remove summary.json")
    seed, data = train.get("seed", 0), train.get("data")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise ValueError(f"{where}.seed {repr(seed)[:40]} is not a whole number >= 0 as train allows; fix it")
    if not (data is None or isinstance(data, str)):
        raise ValueError(f"{where}.data {repr(data)[:40]} is not a file path; fix it or pass --data")
    return train


def main(argv=None) -> int:
    """Entry point; returns the exit status (2 for a bad argument or missing file)."""
    parser = build_parser()
    refuse_several_ranks(parser)  # every rank would measure the same model and write the same --json
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.block_size > MAX_ADAM8BIT_BLOCK:  # elements per scale, bounded as train's --adam8bit-block-size
        parser.error(f"--block-size must be <= {MAX_ADAM8BIT_BLOCK:,} elements per scale, got {args.block_size:,}")
    default = parser.get_default
    given = [f"--{k} {v}" for k, v in (("bits", args.bits), ("granularity", args.granularity)) if v != default(k)]
    if args.table and given:  # only the flags given: "--granularity row" was named though defaulted
        flags = " and ".join(g.split()[0] for g in given)
        parser.error(f"--table measures every bits x granularity and ignores {flags}; got {' '.join(given)}: drop "
                     f"{flags}, or drop --table to measure {' '.join(given)} alone")
    if args.block_size != default("block_size") and args.granularity != "block" and not args.table:
        parser.error(f"--block-size only applies with --granularity block (elements per scale); got --granularity "
                     f"{args.granularity}, one scale per {args.granularity}")
    if args.eval_batches is not None and not 1 <= args.eval_batches <= MAX_EVAL_BATCHES:
        parser.error(f"--eval-batches must be in [1, {MAX_EVAL_BATCHES:,}] as train's, got {args.eval_batches:,}")
    threshold = args.outlier_threshold
    if threshold is not None and not (threshold > 0 and math.isfinite(threshold)):
        parser.error(f"--outlier-threshold must be a positive number, got {args.outlier_threshold}")
    locks = []
    try:
        return _measure_and_write(args, locks)
    finally:
        release_all(locks)


def _measure_and_write(args, locks: list) -> int:
    """:func:`main` after the flag checks: lock and check --json, measure, print, write (``locks``: the held lock)."""
    try:
        if args.json is not None:  # '' too: refused
            sidecar = os.path.join(os.path.dirname(args.weights), SIDECAR)  # before any measuring:
            check_output(args.json, inputs={"--weights": args.weights, "--weights' config": sidecar,
                                            "--data": args.data})
            if lockable(args.json):  # a device such as /dev/null, or /dev/stdout: no lock
                held, refusal = lock_outputs([("--json", FolderLock.for_file(args.json))])
                if refusal:
                    raise ValueError(refusal)
                locks += held
        backend.set_device(args.device, backend.local_rank())
        result = run(args)
    except (FileNotFoundError, ValueError, backend.DeviceError) as e:
        print(error_lines("python -m minizero.quantize", str(e)), file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        try:
            write_json_atomic(args.json, result)
        except OSError as e:
            print(error_lines("python -m minizero.quantize", f"--json {args.json!r}: cannot write ({e.strerror or e})"),
                  file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(interruptible("minizero.quantize", WHOLE, main))
