"""FP16 mixed precision: half-precision model, FP32 master weights, dynamic loss scaling.

2 + 2 + 12 = 16 bytes per parameter (ZeRO section 3.1). Defaults are ``torch.amp.GradScaler``'s;
``hysteresis`` and ``min_scale`` reproduce DeepSpeed's ``DynamicLossScaler``.
Source: Micikevicius et al., "Mixed Precision Training", 2018, section 3.2.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_reduce

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")  #: train's --precision choices, a checkpoint's layout.precision
#: the loss scales a run can hold: ``min_scale`` at least FP16's smallest subnormal 2**-24 (a lower scale flushes
#: every gradient to 0), growth capped at 2**64 (no FP16 gradient needs more); a checkpoint's scaler.scale too
SCALE_RANGE = (2.0 ** -24, 2.0 ** 64)


class LossScaleError(FloatingPointError):
    """Training cannot continue: gradients overflow even at the minimum loss scale."""


class DynamicLossScaler:
    """The loss scale S and its update rule; one per training job, identical on every rank.

    S starts at ``init_scale`` (2^16), *= ``backoff_factor`` after ``hysteresis`` overflows, *= ``growth_factor``
    after ``growth_interval`` clean steps, never below ``min_scale``. Attributes: scale, skipped, consecutive_skips.
    ``warn(note)``: called with a one-line note at the first of each run of overflows at ``min_scale`` (default: a
    RuntimeWarning; the training loop passes rank 0's log, so a job of N ranks says it once, not N times).
    Raises ValueError: a factor or count out of range (named).
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, min_scale=1.0, max_skips_at_min=10, warn=None):
        if not (0 < init_scale < math.inf and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and hysteresis >= 1 and SCALE_RANGE[0] <= min_scale <= init_scale <= SCALE_RANGE[1]
                and max_skips_at_min >= 1):
            raise ValueError(
                f"loss scaler needs a finite init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                f"growth_interval >= 1, hysteresis >= 1, 2**-24 <= min_scale <= init_scale <= 2**64, "
                f"max_skips_at_min >= 1; got init_scale={init_scale}, "
                f"growth_factor={growth_factor}, backoff_factor={backoff_factor}, growth_interval={growth_interval}, "
                f"hysteresis={hysteresis}, min_scale={min_scale}, max_skips_at_min={max_skips_at_min}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        self.max_skips_at_min = max_skips_at_min
        self.warn = warn or (lambda note: warnings.warn(note, RuntimeWarning, stacklevel=3))
        self._good_steps = 0
        self._hysteresis_left = hysteresis
        self.skipped = 0
        self.consecutive_skips = 0
        self._skips_at_min = 0

    def update(self, overflow: bool) -> bool:
        """Record one step's outcome; True: skip it. Raises LossScaleError: ``max_skips_at_min`` skips at the
        minimum."""
        if not overflow:
            self.consecutive_skips = 0
            self._skips_at_min = 0
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.scale = min(self.scale * self.growth_factor, SCALE_RANGE[1])
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
            return False
        self.skipped += 1
        self.consecutive_skips += 1
        self._good_steps = 0
        if self.scale <= self.min_scale:
            self._skips_at_min += 1
            if self._skips_at_min == 1:
                self.warn(f"FP16 gradients overflow at the minimum loss scale {self.min_scale:g}; steps are being "
                          "skipped")
            if self._skips_at_min >= self.max_skips_at_min:
                raise LossScaleError(
                    f"gradients overflowed in {self._skips_at_min} consecutive steps at the minimum loss scale "
                    f"{self.min_scale}: the model diverges in FP16 (lower the learning rate, or train in fp32)")
            return True
        if self._hysteresis_left <= 1:  # tolerance used up: every overflow lowers S until S grows again
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._hysteresis_left -= 1
        return True

    def state_dict(self) -> dict:
        """The scaler's state as plain numbers (everything :meth:`load_state_dict` needs to continue)."""
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped": self.skipped,
                "hysteresis_left": self._hysteresis_left, "consecutive_skips": self.consecutive_skips,
                "skips_at_min": self._skips_at_min}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (a checkpoint): the scale is not reset to its initial value,
        the growth tracker and hysteresis go on counting where they were."""
        self.scale = float(state["scale"])
        self._good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self._skips_at_min = int(state.get("skips_at_min", 0))


def loss_scaler(precision: str, initial_scale: float, growth_interval: int, hysteresis: int, min_scale: float,
                warn=None) -> DynamicLossScaler | None:
    """The loss scaler ``precision`` needs: FP16's dynamic one; None for the others (their range needs none)."""
    if precision != "fp16":
        return None
    return DynamicLossScaler(initial_scale, growth_interval=growth_interval, hysteresis=hysteresis,
                             min_scale=min_scale, warn=warn)


def local_overflow(grads) -> bool:
    """True if any of ``grads`` (arrays, None skipped) holds an inf or NaN on this rank.

    The per-array checks stay on the device; one 0-d flag comes to the host (one sync per step,
    not one per parameter)."""
    xp = backend.xp
    finite = [xp.isfinite(g).all() for g in grads if g is not None]
    return bool(finite) and not bool(xp.stack(finite).all())


def overflow_anywhere(local: bool, comm) -> bool:
    """Agree on overflow across ``comm``: one all-reduce of a 0/1 flag (8 bytes), True if any rank saw one."""
    if comm is None or comm.world_size == 1:
        return bool(local)
    with comm.traffic.op("overflow_flag"):
        flag = all_reduce(comm, backend.to_device(np.array([1.0 if local else 0.0])))
    return bool(backend.to_host(flag)[0] > 0)
