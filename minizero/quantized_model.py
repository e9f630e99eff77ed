"""Weight-only quantization of a GPT: every Linear's weight as INT8/INT4 codes + FP32 scales.

:class:`QuantizedLinear` dequantizes its :class:`~minizero.quantization.QuantizedTensor` in every forward;
:func:`quantize_model` swaps a model's Linear layers for them in place (``Module.swap_modules``; not the tied head);
:func:`calibrate_input_absmax` finds LLM.int8()'s outlier input features (arXiv:2208.07339, section 3.2);
:func:`evaluate_loss` and :func:`model_nbytes` measure the result. Everything stays on ``backend.xp``.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd import Tensor, functional as F, no_grad
from minizero.ledger import get_ledger
from minizero.nn.module import Linear, Module
from minizero.quantization import QuantizedTensor


class QuantizedLinear(Module):
    """y = x W~^T + b with W~ = dequantize(codes, scales), rebuilt in every forward; x (..., in) -> (..., out).

    Args:
        weight: :class:`~minizero.quantization.QuantizedTensor` of shape (out, in).
        bias: the bias Parameter (out,), in the model's dtype, or None.
        outlier_columns: int array (k,) of input features kept unquantized, or None.
        outlier_weight: float array (out, k), W's values in those columns, in W's stored dtype.
    Stored bytes (:attr:`weight_nbytes`): codes and scales, plus itemsize * out * k + 8 * k for the outlier columns.
    """

    def __init__(self, weight: QuantizedTensor, bias=None, outlier_columns=None, outlier_weight=None):
        super().__init__()
        self.weight_q = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.outlier_columns = None if outlier_columns is None else backend.xp.asarray(outlier_columns, dtype=np.int64)
        self.outlier_weight = outlier_weight
        ledger = get_ledger()
        for a in (weight.q, weight.scale, self.outlier_columns, outlier_weight):
            if a is not None:
                ledger.track(a, "parameters")

    @classmethod
    def from_linear(cls, linear: Linear, bits: int = 8, granularity: str = "row", block_size: int = 64,
                    outlier_columns=None) -> "QuantizedLinear":
        """Quantize ``linear.weight`` (errors as :func:`~minizero.quantization.quantize`).

        ``outlier_columns``: input features kept unquantized, in the weight's dtype (zeroed before quantizing the rest,
        so they do not inflate the row scales), or None.
        """
        w = linear.weight.data
        kept = None
        if outlier_columns is not None and len(outlier_columns):
            outlier_columns = backend.xp.asarray(outlier_columns, dtype=np.int64)
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
        return w

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
    """``[(dotted name, Linear)]`` for every Linear whose weight no other module owns."""
    owners = {}
    for _, m in model.named_modules():
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    slots = []
    for pname, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, Linear) and owners[id(child.weight)] == 1:
                slots.append((f"{pname}.{attr}" if pname else attr, child))
    return slots


def calibrate_input_absmax(model: Module, batches) -> dict:
    """Per-input-feature max |x| of every quantizable Linear over ``batches`` [(x, y)]: name -> (in,) float64
    (device arrays)."""
    stats, removers = {}, []
    for name, lin in _linear_slots(model):
        def hook(module, args, name=name):
            xp = backend.xp
            a = xp.abs(args[0].data).reshape(-1, module.in_features).max(axis=0).astype(np.float64)
            stats[name] = xp.maximum(stats[name], a) if name in stats else a
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
            >= this unquantized (LLM.int8(); needs ``calibration``, a list of (x, y) batches).
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
    slots = {}
    for name, lin in _linear_slots(model):  # a Linear held under two names: its first, as named_modules() gives
        slots.setdefault(id(lin), name)
    report["skipped"] = sorted({n for n, m in model.named_modules() if isinstance(m, Linear)} - set(slots.values()))

    def quantized(lin):
        if id(lin) not in slots:
            return None
        name = slots[id(lin)]
        cols = backend.xp.flatnonzero(stats[name] >= outlier_threshold) if name in stats else None
        q = QuantizedLinear.from_linear(lin, bits, granularity, block_size, cols)
        report["dense_bytes"] += lin.weight.data.nbytes
        report["quantized_bytes"] += q.weight_nbytes
        report["outlier_columns"] += 0 if q.outlier_columns is None else len(q.outlier_columns)
        return q
    report["layers"] = model.swap_modules(quantized)
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
