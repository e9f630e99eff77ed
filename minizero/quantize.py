"""``python -m minizero.quantize``: store a trained GPT's linear weights in INT8 or INT4 and measure the cost.

::

    python -m minizero.quantize --weights out/model.npz --bits 8 --granularity row
    python -m minizero.quantize --weights out/model.npz --table          # every bits x granularity

It loads the weights the trainer wrote (``OUT/model.npz``, nanoGPT names; the model shape
comes from ``OUT/summary.json`` when present, else ``--model``), replaces every
:class:`~minizero.nn.Linear` by a :class:`QuantizedLinear` (weights as codes + FP32 scales,
dequantized on the fly in forward — weight-only quantization), and prints the validation
loss and the model's bytes before and after.

The tied LM head is left alone: its matrix is the token embedding's, which stays FP32, so
quantizing the head would store the matrix twice. Embeddings, layer norms and biases stay
FP32 (as bitsandbytes' ``Linear8bitLt`` / ``Linear4bit`` replace only linear layers).

``--outlier-threshold T`` is the outlier-aware variant of LLM.int8() (Dettmers et al. 2022,
arXiv:2208.07339, section 3.2): a few calibration batches find the *input features* whose
activation magnitude reaches T (the paper uses 6.0); those columns of W stay FP32 and the
rest is quantized per row. LLM.int8() splits the matmul itself (an INT8 matmul plus an FP16
one for the outlier columns); weight-only, the same numbers come from putting the FP32
columns back into the dequantized matrix.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, functional as F, no_grad
from minizero.data import eval_batches, global_batch, load_tokens, train_val_split
from minizero.memory.ledger import get_ledger
from minizero.memory.quantize import GRANULARITIES, QuantizedTensor
from minizero.nn import GPT, PRESETS, get_config
from minizero.nn.module import Linear, Module


class QuantizedLinear(Module):
    """y = x W~^T + b with W~ = dequantize(codes, scales), rebuilt in every forward.

    Args:
        weight: :class:`~minizero.memory.quantize.QuantizedTensor` of shape (out, in).
        bias: the FP32 bias Parameter (out,) or None (kept as is).
        outlier_columns: int array (k,) of input features kept in full precision, or None.
        outlier_weight: float array (out, k), W's values in those columns (FP32).
    Shapes: x (..., in) -> (..., out). Stored bytes (:attr:`weight_nbytes`): the codes and
    scales, plus 4 * out * k + 8 * k for the outlier columns and their int64 indices. Each
    forward materializes one (out, in) float matrix, freed afterwards (under ``no_grad``;
    in training it is saved for backward like any weight).
    """

    def __init__(self, weight: QuantizedTensor, bias=None, outlier_columns=None, outlier_weight=None):
        super().__init__()
        self.weight_q = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.outlier_columns = None if outlier_columns is None else np.asarray(outlier_columns, np.int64)
        self.outlier_weight = outlier_weight
        ledger = get_ledger()
        for a in (weight.q, weight.scale, self.outlier_columns, outlier_weight):
            if a is not None:
                ledger.track(a, "parameters")

    @classmethod
    def from_linear(cls, linear: Linear, bits: int = 8, granularity: str = "row", block_size: int = 64,
                    outlier_columns=None) -> "QuantizedLinear":
        """Quantize ``linear.weight`` (errors as :func:`~minizero.memory.quantize.quantize`).

        ``outlier_columns``: input features kept in FP32 (zeroed before quantizing the rest,
        so they do not inflate the row scales), or None.
        """
        w = backend.to_host(linear.weight.data)
        kept = None
        if outlier_columns is not None and len(outlier_columns):
            outlier_columns = np.asarray(outlier_columns, np.int64)
            kept = w[:, outlier_columns].copy()
            w = w.copy()
            w[:, outlier_columns] = 0
        else:
            outlier_columns = None
        return cls(QuantizedTensor.from_array(w, bits, granularity, block_size), linear.bias, outlier_columns, kept)

    def dequantized_weight(self):
        """The (out, in) float matrix the forward uses."""
        w = self.weight_q.dequantize()
        if self.outlier_columns is not None:
            w[:, self.outlier_columns] = self.outlier_weight
        return backend.to_device(w)

    @property
    def weight_nbytes(self) -> int:
        """Exact bytes of the stored weight: codes + scales (+ outlier columns and their indices)."""
        extra = 0 if self.outlier_columns is None else self.outlier_weight.nbytes + self.outlier_columns.nbytes
        return self.weight_q.nbytes + extra

    def forward(self, x):
        return F.linear(x, Tensor(self.dequantized_weight()), self.bias)

    def __repr__(self):
        k = 0 if self.outlier_columns is None else len(self.outlier_columns)
        return f"QuantizedLinear({self.in_features} -> {self.out_features}, {self.weight_q!r}, {k} outlier columns)"


# --------------------------------------------------------------------------- the model
def _linear_slots(model: Module):
    """``[(parent, attribute, dotted name, Linear)]`` for every Linear whose weight no other module owns."""
    owners = {}
    for _, m in model.named_modules():
        for p in m._parameters.values():
            owners[id(p)] = owners.get(id(p), 0) + 1
    slots = []
    for pname, parent in model.named_modules():
        for attr, child in parent._modules.items():
            if isinstance(child, Linear) and owners[id(child.weight)] == 1:
                slots.append((parent, attr, f"{pname}.{attr}" if pname else attr, child))
    return slots


def calibrate_input_absmax(model: Module, batches) -> dict:
    """Per-input-feature max |x| of every quantizable Linear over ``batches`` [(x, y)]: name -> (in,) float64."""
    stats, removers = {}, []
    for _, _, name, lin in _linear_slots(model):
        def hook(module, args, name=name):
            a = np.abs(backend.to_host(args[0].data)).reshape(-1, module.in_features).max(axis=0)
            stats[name] = np.maximum(stats.get(name, 0.0), a.astype(np.float64))
        removers.append(lin.register_forward_pre_hook(hook))
    with no_grad():
        for x, _ in batches:
            model(backend.to_device(x))
    for r in removers:
        r()
    return stats


def quantize_model(model: Module, bits: int = 8, granularity: str = "row", block_size: int = 64,
                   outlier_threshold: float | None = None, calibration=None) -> dict:
    """Replace the model's Linear layers by QuantizedLinear, in place; returns a report.

    Args:
        bits, granularity, block_size: as :func:`~minizero.memory.quantize.quantize`.
        outlier_threshold: keep input features whose calibration activation magnitude is
            >= this in FP32 (LLM.int8(); needs ``calibration``, a list of (x, y) batches).
    Returns:
        ``{"layers": [name, ...], "skipped": [name, ...], "dense_bytes", "quantized_bytes",
        "outlier_columns"}``: bytes of the replaced weights before and after.
    Raises:
        ValueError: ``outlier_threshold`` without ``calibration``, or a quantizer error.
    """
    if outlier_threshold is not None and not calibration:
        raise ValueError("outlier_threshold needs calibration batches")
    stats = calibrate_input_absmax(model, calibration) if outlier_threshold is not None else {}
    report = {"layers": [], "skipped": [], "dense_bytes": 0, "quantized_bytes": 0, "outlier_columns": 0}
    slots = _linear_slots(model)
    tied = {n for n, m in model.named_modules() if isinstance(m, Linear)} - {s[2] for s in slots}
    report["skipped"] = sorted(tied)
    for parent, attr, name, lin in slots:
        cols = np.flatnonzero(stats[name] >= outlier_threshold) if name in stats else None
        q = QuantizedLinear.from_linear(lin, bits, granularity, block_size, cols)
        setattr(parent, attr, q)
        report["layers"].append(name)
        report["dense_bytes"] += lin.weight.data.nbytes
        report["quantized_bytes"] += q.weight_nbytes
        report["outlier_columns"] += 0 if q.outlier_columns is None else len(q.outlier_columns)
    return report


def model_nbytes(model: Module) -> int:
    """Bytes of the model's weights: distinct Parameters (a tied matrix once) + quantized weights."""
    total = sum(p.data.nbytes for p in model.parameters())
    return total + sum(m.weight_nbytes for _, m in model.named_modules() if isinstance(m, QuantizedLinear))


def evaluate_loss(model: Module, batches) -> float:
    """Mean cross-entropy (nats per token) over ``batches`` [(x, y)], eval mode, no grad."""
    was = model.training
    model.eval()
    with no_grad():
        losses = [model(backend.to_device(x), backend.to_device(y))[1].item() for x, y in batches]
    model.train(was)
    return float(np.mean(losses))


# --------------------------------------------------------------------------- the command
def load_trained(weights: str, preset: str | None = None):
    """(model, summary dict or {}) from ``weights`` (model.npz); the shape from summary.json beside it, else ``preset``.

    Raises:
        FileNotFoundError: no such weights file.
        KeyError / ValueError: the weights do not fit the model shape (names listed).
    """
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"--weights {weights!r}: no such file (write one with python -m minizero.train)")
    summary_path = os.path.join(os.path.dirname(os.path.abspath(weights)), "summary.json")
    summary = {}
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    if preset is None and summary:
        cfg = get_config("default", **summary["config"]["model"])
    else:
        cfg = get_config(preset or "default")
    model = GPT(cfg)
    with np.load(weights) as state:
        model.load_state_dict({k: state[k] for k in state.files})
    return model, summary


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m minizero.quantize``."""
    p = argparse.ArgumentParser(prog="python -m minizero.quantize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--weights", default=os.path.join("out", "model.npz"), help="model.npz written by minizero.train")
    p.add_argument("--model", default=None, choices=sorted(PRESETS),
                   help="model preset (default: read from summary.json beside the weights)")
    p.add_argument("--bits", type=int, default=8, choices=[8, 4], help="bits per weight")
    p.add_argument("--granularity", default="row", choices=list(GRANULARITIES), help="one scale per tensor/row/block")
    p.add_argument("--block-size", type=int, default=64, help="elements per scale for --granularity block")
    p.add_argument("--outlier-threshold", type=float, default=None,
                   help="LLM.int8(): keep input features with activation magnitude >= this in FP32 (paper: 6.0)")
    p.add_argument("--table", action="store_true", help="measure every bits x granularity combination")
    p.add_argument("--data", default=None, help="text file (default: the trainer's --data, else the embedded corpus)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="validation batches of 16 sequences (default: the trainer's number, so the FP32 loss "
                        "is the one it printed)")
    p.add_argument("--json", default=None, help="write the measurements here")
    return p


def run(args) -> dict:
    """Measure the configurations ``args`` asks for; returns ``{"baseline": {...}, "rows": [...]}``."""
    model, summary = load_trained(args.weights, args.model)
    cfg = model.config
    train_cfg = summary.get("config", {}).get("train", {})
    data = args.data if args.data is not None else train_cfg.get("data")
    seed = int(train_cfg.get("seed", 0))
    train_tok, val_tok = train_val_split(load_tokens(data))
    n_batches = args.eval_batches or int(train_cfg.get("eval_batches", 4))
    val = eval_batches(val_tok, cfg.block_size, n_batches, 16, seed=seed + 1)  # the trainer's batches
    base = {"val_loss": evaluate_loss(model, val), "model_bytes": model_nbytes(model)}
    calib = [global_batch(train_tok, 10_000 + i, 16, cfg.block_size, seed) for i in range(2)]
    calibration = None
    if args.outlier_threshold is not None:  # what the outlier variant sees: every layer's largest |input|
        stats = calibrate_input_absmax(model, calib)
        calibration = {"max_input_absmax": {k: float(v.max()) for k, v in stats.items()},
                       "columns_at_threshold": int(sum((v >= args.outlier_threshold).sum() for v in stats.values())),
                       "columns_at_6": int(sum((v >= 6.0).sum() for v in stats.values()))}
    combos = [(b, g) for b in (8, 4) for g in GRANULARITIES] if args.table else [(args.bits, args.granularity)]
    rows = []
    for bits, gran in combos:
        # the outlier-aware variant is row-wise (LLM.int8()'s vector-wise quantization); with
        # --table it is measured beside each per-row row, alone it replaces the plain one
        if args.outlier_threshold is None:
            thresholds = [None]
        elif args.table:
            thresholds = [None, args.outlier_threshold] if gran == "row" else [None]
        else:
            thresholds = [args.outlier_threshold]
        for threshold in thresholds:
            qmodel, _ = load_trained(args.weights, args.model)
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
    """The measurements as a text table (bytes exact, losses in nats per token)."""
    base, rows = result["baseline"], result["rows"]
    lines = [f"{result['weights']}: {result['num_parameters']:,} parameters; validation loss on "
             f"{result['tokens']:,} tokens; linear layers quantized (skipped: {', '.join(rows[0]['skipped']) or '-'})",
             f"{'weights':<22}{'linear bytes':>14}{'model bytes':>13}{'ratio':>7}{'val loss':>10}{'delta':>10}",
             f"{'fp32':<22}{rows[0]['linear_dense_bytes']:>14,}{base['model_bytes']:>13,}{1:>7.2f}"
             f"{base['val_loss']:>10.4f}{'':>10}"]
    for r in rows:
        name = f"int{r['bits']} {r['granularity']}" + (f" {r['block_size']}" if r["block_size"] else "")
        if r["outlier_threshold"] is not None:
            name += f" +{r['outlier_columns']} fp32 col"
        lines.append(f"{name:<22}{r['linear_bytes']:>14,}{r['model_bytes']:>13,}"
                     f"{r['model_bytes'] / base['model_bytes']:>7.2f}{r['val_loss']:>10.4f}{r['delta']:>+10.5f}")
    cal = result.get("calibration")
    if cal:
        top = max(cal["max_input_absmax"], key=cal["max_input_absmax"].get)
        per_layer = sorted(cal["max_input_absmax"].values())
        lines.append(f"outlier calibration (2 training batches): largest input |x| per layer {per_layer[0]:.2f} .. "
                     f"{per_layer[-1]:.2f} ({top}), median {per_layer[len(per_layer) // 2]:.2f}; input features "
                     f"reaching {result['outlier_threshold']}: {cal['columns_at_threshold']}, reaching 6.0 (the "
                     f"paper's threshold): {cal['columns_at_6']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Entry point; returns the exit status (2 for a bad argument or missing file)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.eval_batches is not None and args.eval_batches < 1:
        parser.error(f"--eval-batches must be >= 1, got {args.eval_batches}")
    threshold = args.outlier_threshold
    if threshold is not None and not (threshold > 0 and math.isfinite(threshold)):
        parser.error(f"--outlier-threshold must be a positive number, got {args.outlier_threshold}")
    try:
        result = run(args)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"python -m minizero.quantize: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
