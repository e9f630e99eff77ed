"""Non-finite attribution (``--detect-anomaly``): the first module (forward) or parameter gradient (backward)
that turned finite values into inf or NaN, with rank, step and value ranges; ``--loss-spike``.

Seams only: a forward hook on every module (innermost modules finish first, so the first non-finite output
from finite inputs is where it was made) and a post-accumulate-grad hook on every parameter (prepended: it sees
the gradient before data parallelism or ZeRO pack it). FP32 raises :class:`AnomalyError`; FP16 prints the
finding for the step the loss scaler skipped. Mirrors ``torch.autograd.detect_anomaly``.
"""
from __future__ import annotations

import sys

from minizero import backend
from minizero.callbacks import Callback
from minizero.numerals import thousands
from minizero.zero.stage3 import is_placeholder


class AnomalyError(FloatingPointError):
    """A module's forward or a parameter's gradient became non-finite (FP32 training, ``--detect-anomaly``)."""


def _arrays(x):
    """The arrays of a module's inputs or output (Tensors, arrays, tuples of them)."""
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in _arrays(item)]
    data = getattr(x, "data", x)
    return [data] if hasattr(data, "dtype") and getattr(data.dtype, "kind", "") in "fc" and data.size else []


def _range(arrays) -> str:
    """``[min, max]`` of the finite elements of ``arrays`` (as text), and how many are not finite."""
    if not arrays:
        return "(none)"
    lo, hi, bad, n = float("inf"), float("-inf"), 0, 0
    for a in arrays:
        xp = backend.array_module(a)
        fin = xp.isfinite(a)
        n, bad = n + a.size, bad + int(a.size - int(fin.sum()))
        if bool(fin.any()):
            lo, hi = min(lo, float(a[fin].min())), max(hi, float(a[fin].max()))
    told = f"[{lo:.4g}, {hi:.4g}]" if lo <= hi else "no finite value"
    return told + (f", {thousands(bad)} of {thousands(n)} not finite" if bad else "")


def _held(params) -> list:  # ZeRO-3's placeholders hold no values (a read raises): left out
    return [p.data for p in params if p.data.size and not is_placeholder(p.data)]


def _finite(arrays) -> bool:
    return all(bool(backend.array_module(a).isfinite(a).all()) for a in arrays)


class AnomalyDetector(Callback):
    """The loop's ``--detect-anomaly``: hooks on every module and parameter of ``stage`` (registered now).

    Args:
        stage: this rank's model or pipeline stage (a :class:`~minizero.nn.Module`).
        rank: this rank (world), for the message.
        fp16: report (stderr, ``[rank r]``) instead of raising; the loss scaler skips such steps.
    Attributes:
        finding: the first finding of the current step (text), or None.
    """

    def __init__(self, stage, rank: int, fp16: bool = False):
        self.rank, self.fp16, self.step, self.finding = rank, fp16, None, None
        for name, module in stage.named_modules():
            module.register_forward_hook(self._forward_hook(name or type(module).__name__))
        for name, p in stage.named_parameters():
            p.register_post_accumulate_grad_hook(self._grad_hook(name), prepend=True)

    def _found(self, text: str) -> None:
        self.finding = f"rank {self.rank} step {self.step + 1}: {text} (--detect-anomaly)"  # as the progress log
        if not self.fp16:
            raise AnomalyError(self.finding)

    def _forward_hook(self, name: str):
        def hook(module, args, out):
            if self.step is None or self.finding is not None:
                return
            outs = _arrays(out)
            if outs and not _finite(outs):
                ins, params = _arrays(args), _held(p for _, p in module.named_parameters())
                if _finite(ins):  # the first module whose inputs were finite: it made them (or a parameter did)
                    self._found(f"forward of module {name!r} ({type(module).__name__}) made non-finite values from "
                                f"finite inputs: inputs in {_range(ins)}, parameters in {_range(params)}, "
                                f"output in {_range(outs)}")
        return hook

    def _grad_hook(self, name: str):
        def hook(p):
            if self.step is None or self.finding is not None or p.grad is None:
                return
            if not _finite([p.grad]):
                self._found(f"backward: the gradient of parameter {name!r} {tuple(p.grad.shape)} is not finite "
                            f"({_range([p.grad])}); the parameter is in {_range(_held([p]))}")
        return hook

    def on_step_start(self, run, step):
        self.step, self.finding = step, None

    def on_step_end(self, run, step, record):
        if self.finding is not None and self.fp16:
            told = "skipped" if step in run.result.skipped_at else "did not skip"  # both 0-based
            print(f"minizero.train: {self.finding}; the loss scaler {told} this step", file=sys.stderr, flush=True)
        self.step = None  # validation forwards are not watched


class LossSpikes(Callback):
    """``--loss-spike K``: when a step's loss exceeds K times the mean of the previous (up to) 20, record that
    step's gradient norm of every parameter of this rank (local, before the data-parallel reduction, as the
    last micro-batch's backward left it) in ``run.result.loss_spikes`` (rank 0's go to ``summary.json``; their
    ``step`` is 0-based, the progress log's and the logged line's step + 1).

    Args:
        stage: this rank's model or pipeline stage. factor: K > 1. warmup: steps before the first comparison.
    Raises:
        ValueError: ``factor`` not > 1 or ``warmup`` < 1.
    """

    WINDOW = 20  #: steps in the running mean

    def __init__(self, stage, factor: float, warmup: int = 5):
        if not factor > 1 or warmup < 1:
            raise ValueError(f"factor={factor!r}, warmup={warmup!r}; allowed: factor > 1, warmup >= 1")
        self.factor, self.warmup, self.losses, self.sq = factor, warmup, [], {}
        for name, p in stage.named_parameters():
            p.register_post_accumulate_grad_hook(self._grad_hook(name), prepend=True)

    def _grad_hook(self, name: str):
        def hook(p):
            if p.grad is not None:
                self.sq[name] = float(backend.to_host((p.grad.astype("float64") ** 2).sum()))
        return hook

    def on_step_start(self, run, step):
        self.sq = {}

    def on_step_end(self, run, step, record):
        recent = self.losses[-self.WINDOW:]
        mean = sum(recent) / len(recent) if recent else 0.0
        if len(self.losses) >= self.warmup and record.loss > self.factor * mean:
            run.result.loss_spikes.append({"step": step, "loss": record.loss, "running_mean": mean,
                                           "grad_norms": {k: v ** 0.5 for k, v in self.sq.items()}})
            run.log(f"loss spike at step {step + 1}: {record.loss:.4f} > {self.factor:g} x running mean {mean:.4f}; "
                    f"per-parameter gradient norms in summary.json (loss_spikes)")
        self.losses.append(record.loss)
