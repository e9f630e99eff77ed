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
import tempfile
import zipfile
import zlib

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, functional as F, no_grad
from minizero.data import describe_non_file, eval_batches, global_batch, load_tokens, train_val_split
from minizero.files import atomic_write
from minizero.ledger import get_ledger
from minizero.quantization import GRANULARITIES, QuantizedTensor
from minizero.nn import GPT, PRESETS, get_config
from minizero.nn.module import Linear, Module


class QuantizedLinear(Module):
    """y = x W~^T + b with W~ = dequantize(codes, scales), rebuilt in every forward.

    Args:
        weight: :class:`~minizero.quantization.QuantizedTensor` of shape (out, in).
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
        """Quantize ``linear.weight`` (errors as :func:`~minizero.quantization.quantize`).

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
        bits, granularity, block_size: as :func:`~minizero.quantization.quantize`.
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
def _not_weights(weights: str, why: str) -> ValueError:
    return ValueError(f"--weights {weights!r} is not a model.npz written by minizero.train ({why})")


def read_weights(weights: str) -> dict:
    """{name: float array} from ``weights`` (an .npz, loaded with ``allow_pickle=False``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an .npz of numeric arrays (empty, truncated, pickled, text...), or a
            tensor with NaN/inf (tensor and file named).
    """
    what = describe_non_file(weights)
    if what == ": no such file":
        raise FileNotFoundError(f"--weights {weights!r}: no such file (write one with python -m minizero.train)")
    if what:
        raise ValueError(f"--weights {weights!r}{what}; give the model.npz written by python -m minizero.train")
    if os.path.getsize(weights) == 0:
        raise _not_weights(weights, "the file is empty")
    try:
        loaded = np.load(weights, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise _not_weights(weights, "a single .npy array, not an .npz archive")
        with loaded as z:
            state = {k: z[k] for k in z.files}
    except ValueError as e:
        if str(e).startswith("--weights"):
            raise
        raise _not_weights(weights, "not an .npz archive; it is never loaded with pickle") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _not_weights(weights, f"unreadable or truncated archive: {type(e).__name__}: {e}") from None
    if not state:
        raise _not_weights(weights, "the archive holds no arrays")
    for k, v in state.items():
        if v.dtype.kind not in "fiu":
            raise _not_weights(weights, f"array {k!r} has dtype {v.dtype}, not a number type")
        if v.dtype.kind == "f":
            bad = ~np.isfinite(v)
            if bad.any():
                raise ValueError(f"--weights {weights!r}: tensor {k!r} has {int(bad.sum())} non-finite value(s) "
                                 f"(NaN or inf) of {v.size}; quantization and evaluation need finite weights")
    return state


def infer_preset(state: dict) -> str | None:
    """The preset whose parameter names and shapes match ``state`` exactly, or None."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    for name in sorted(PRESETS):
        cfg = PRESETS[name]
        # shapes only depend on n_layer, n_embd, block_size, vocab_size: compare without building the model
        c, t, v = cfg.n_embd, cfg.block_size, cfg.vocab_size
        want = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (t, c),
                "transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}."
            want.update({h + "ln_1.weight": (c,), h + "ln_1.bias": (c,), h + "attn.c_attn.weight": (3 * c, c),
                         h + "attn.c_attn.bias": (3 * c,), h + "attn.c_proj.weight": (c, c),
                         h + "attn.c_proj.bias": (c,), h + "ln_2.weight": (c,), h + "ln_2.bias": (c,),
                         h + "mlp.c_fc.weight": (4 * c, c), h + "mlp.c_fc.bias": (4 * c,),
                         h + "mlp.c_proj.weight": (c, 4 * c), h + "mlp.c_proj.bias": (c,)})
        if {k: s for k, s in shapes.items() if k != "lm_head.weight"} == want:
            return name
    return None


def _looks_like(state: dict) -> str:
    guess = infer_preset(state)
    return f" (these weights look like the {guess!r} preset)" if guess else ""


def load_trained(weights: str, preset: str | None = None, state: dict | None = None):
    """(model, summary dict or {}) from ``weights`` (model.npz); the shape from summary.json beside it, else ``preset``.

    ``state``: the arrays of ``weights`` when already read (:func:`read_weights`).
    Raises:
        FileNotFoundError: no such weights file.
        ValueError: not a minizero .npz, a corrupt summary.json, no shape to build, or the weights do not
            fit the model shape (the file, the first names and ``--model`` named).
    """
    if state is None:
        state = read_weights(weights)
    summary_path = os.path.join(os.path.dirname(os.path.abspath(weights)), "summary.json")
    summary = {}
    if os.path.isfile(summary_path):
        try:
            with open(summary_path) as f:
                summary = json.load(f)
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{summary_path!r} (beside --weights) is not a summary written by minizero.train "
                             f"({e}); fix or remove it") from None
    if preset is not None:
        cfg, source = get_config(preset), f"--model {preset}"
    elif summary:
        model_cfg = summary.get("config", {}).get("model") if isinstance(summary.get("config"), dict) else None
        if not isinstance(model_cfg, dict):
            raise ValueError(f"{summary_path!r} has no config.model section; pass --model{_looks_like(state)}")
        try:
            cfg = get_config("default", **model_cfg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{summary_path!r}: config.model is not a model shape ({e}); pass --model") from None
        source = summary_path
    else:
        guess = infer_preset(state)
        raise ValueError(f"no summary.json beside --weights {weights!r}; pass --model "
                         + (f"(these weights look like the {guess!r} preset)" if guess
                            else f"(one of {', '.join(sorted(PRESETS))}; no preset matches these shapes)"))
    model = GPT(cfg)
    try:
        model.load_state_dict(state)
    except (KeyError, ValueError) as e:
        own = dict(model.state_dict())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            detail = ", ".join(f"{len(names)} {what} name(s) (first: {', '.join(names[:2])})"
                               for what, names in (("missing", missing), ("unexpected", unexpected)) if names)
        else:
            detail = e.args[0] if e.args else str(e)
        raise ValueError(f"--weights {weights!r} does not fit the model shape from {source}: {detail}; "
                         f"pass the --model the weights were trained with{_looks_like(state)}") from None
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


def min_data_bytes(block_size: int) -> int:
    """The fewest tokens whose validation split (the last 10%) holds one (block_size + 1)-token window."""
    n = 10 * (block_size + 2)
    while len(train_val_split(np.zeros(n, np.uint8))[1]) < block_size + 2:
        n += 1
    return n


def check_output(path: str, flag: str = "--json") -> None:
    """Raise ValueError unless ``path`` can be written (not a directory; its folder exists and takes a file)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ValueError(f"{flag} {path!r}: folder {d!r} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot write in {d!r} ({e.strerror or e})") from None


def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to a temporary name beside ``path``, then rename it over ``path``."""
    text = json.dumps(obj, indent=1)
    atomic_write(path, lambda f: f.write(text), mode="w")


def run(args) -> dict:
    """Measure the configurations ``args`` asks for; returns ``{"baseline": {...}, "rows": [...]}``."""
    state = read_weights(args.weights)
    model, summary = load_trained(args.weights, args.model, state)
    cfg = model.config
    train_cfg = summary.get("config", {}).get("train", {}) if isinstance(summary.get("config"), dict) else {}
    data = args.data if args.data is not None else train_cfg.get("data")
    try:
        seed = int(train_cfg.get("seed", 0))
    except (TypeError, ValueError):
        seed = 0
    tokens = load_tokens(data)
    need = min_data_bytes(cfg.block_size)
    if len(tokens) < need:
        name = f"--data {data!r}" if data is not None else "the built-in corpus"
        raise ValueError(f"{name} has {len(tokens):,} bytes; needs at least {need:,} (its last 10% validates "
                         f"and must hold block_size + 2 = {cfg.block_size + 2} tokens)")
    train_tok, val_tok = train_val_split(tokens)
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
            qmodel, _ = load_trained(args.weights, args.model, state)
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
        if args.json:
            check_output(args.json)  # before any measuring
        result = run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m minizero.quantize: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        try:
            write_json_atomic(args.json, result)
        except OSError as e:
            print(f"python -m minizero.quantize: error: --json {args.json!r}: cannot write ({e.strerror or e})",
                  file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
