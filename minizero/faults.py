"""Fault injection for tests: ``MINIZERO_FAULT=RANK:STEP:KIND``, installed by the training loop as a callback.

KIND ``raise`` (an exception), ``kill`` (SIGKILL of the process), ``stop`` (SIGSTOP: a stalled rank) or ``inf`` (this
rank's gradients become non-finite) at optimizer step STEP on rank RANK (0-based: STEP 0 is the progress log's step 1),
or ``diverge`` (after step STEP's update, this rank's first parameter, under ZeRO-3 its first shard held, moves by
1e-3: a replica that drifted), or ``diverge_state`` (so does the first element of its optimizer's first held Adam m,
or 8-bit code by 1), or ``slow`` (from step STEP on, this rank sleeps 50 ms at every step start: a straggler);
``kill_in_save`` fires inside the checkpoint save (:mod:`minizero.checkpoint.save`), not here. ``inf`` reaches the
gradients through a seam, a post-accumulate-grad hook on every parameter (registered first, so it runs before the
hooks with which data parallelism and ZeRO pack a finished gradient): no technique knows.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from minizero.callbacks import Callback
from minizero.numerals import is_count
from minizero.optim.adam8bit import state_arrays
from minizero.zero.stage3 import is_placeholder

FAULT_KINDS = ("raise", "kill", "inf", "stop", "kill_in_save", "diverge", "diverge_state", "slow")
#: the kinds that fire from :meth:`FaultInjector.on_step_start` alone (a loop without step ends or saves: finetune)
STEP_START_KINDS = ("raise", "kill", "inf", "stop", "slow")
SLOW_S = 0.05  #: seconds a ``slow`` rank sleeps per step


def spec_problem(spec: str, world_size: int | None = None, steps: int | None = None,
                 save_every: int | None = None, start: int = 0) -> str | None:
    """What is wrong with ``spec`` (``RANK:STEP:KIND``) as one message, or None: it must parse, name a rank
    < ``world_size``, a step < ``steps`` and >= ``start`` (a resumed run's first step) and for ``kill_in_save``
    one that ``save_every`` saves after (each checked when given)."""
    parts = spec.split(":")
    if len(parts) != 3 or not is_count(parts[0]) or not is_count(parts[1]) or parts[2] not in FAULT_KINDS:
        kinds = f"{', '.join(FAULT_KINDS[:-1])} or {FAULT_KINDS[-1]}"
        return f"MINIZERO_FAULT={spec!r}; expected RANK:STEP:KIND with KIND {kinds}"
    rank, step = int(parts[0]), int(parts[1])
    if world_size is not None and rank >= world_size:
        ranks = "one rank, 0" if world_size == 1 else f"ranks 0..{world_size - 1}"
        return f"MINIZERO_FAULT={spec!r} names rank {rank}; this job has {ranks}"
    if steps is not None and step >= steps:
        return (f"MINIZERO_FAULT={spec!r} names step {step} (0-based: the progress log's step {step + 1}); "
                f"--steps {steps} allows 0..{steps - 1}")
    if step < start:
        return (f"MINIZERO_FAULT={spec!r} never fires: it names step {step} (0-based) and the resumed checkpoint "
                f"starts this run at step {start}; give a step >= {start}")
    k = save_every  # kill_in_save fires only in a save: after every k-th step and the last
    if k is not None and parts[2] == "kill_in_save" and not (k and ((step + 1) % k == 0 or step + 1 == steps)):
        last = f", or the last, {steps - 1}" if steps is not None else ""
        allowed = f"allowed: a step s with s + 1 a multiple of --save-every {k}{last}" if k else "give --save-every N"
        return f"MINIZERO_FAULT={spec!r} never fires: no checkpoint is saved after step {step}; {allowed}"
    return None


class FaultInjector(Callback):
    """The loop's callback for ``MINIZERO_FAULT`` (spec checked by :func:`spec_problem`).

    Args:
        rank: this rank (world).
        params: this rank's parameters (Tensors); the ``inf`` hook is registered on them when the spec
            names this rank with KIND ``inf``.
        spec: ``RANK:STEP:KIND``, or None/"" for no fault.
    """

    def __init__(self, rank: int, params, spec: str | None = None):
        self.spec, self.rank, self.armed, self.step, self.kind = spec, rank, False, None, None
        self.params = list(params)
        if spec:
            r, s, kind = spec.split(":")
            if int(r) == rank:
                self.step, self.kind = int(s), kind
        if self.kind == "inf":
            for p in params:
                p.register_post_accumulate_grad_hook(self._poison, prepend=True)

    @classmethod
    def from_environment(cls, rank: int, params) -> "FaultInjector":
        return cls(rank, params, os.environ.get("MINIZERO_FAULT"))

    def _poison(self, p) -> None:
        if self.armed and p.grad is not None:
            with np.errstate(invalid="ignore"):  # 0 x inf = NaN: non-finite either way
                p.grad *= p.grad.dtype.type(np.inf)

    def on_step_start(self, run, step: int) -> None:
        """Fire the fault due at ``step``: raise, kill or stop now; arm the ``inf`` hook for this step's backward."""
        self.armed = False
        if self.kind == "slow" and step >= self.step:
            time.sleep(SLOW_S)
        if step != self.step or self.kind not in ("raise", "kill", "inf", "stop"):  # others: above, step end, saves
            return
        if self.kind == "inf":
            self.armed = True
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stop":  # a stalled rank: the others must time out (--comm-timeout), not hang
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected fault at step {step + 1} (MINIZERO_FAULT={self.spec}: 0-based step {step})")

    def setup(self, run) -> None:
        if self.kind in ("diverge", "diverge_state"):
            self._target(run)  # a rank holding nothing to move is refused now, not at the fault's step

    def _target(self, run):
        """What ``diverge`` moves (this rank's first parameter; ZeRO-3 between uses, the first shard held) or
        ``diverge_state`` (its first held Adam m, 8-bit Adam's codes): the first non-empty such array. Raises
        ValueError naming the rank when it holds none (a tiny model's shards over many ranks: padding only)."""
        first = self.params[0].data if self.params else None
        if self.kind == "diverge" and first is not None and first.size and not is_placeholder(first):
            return first
        kind = "param" if self.kind == "diverge" else "m"
        states = (state_arrays(a) for k, *_, a in run.strategy.opt.state_views() if k == kind)
        held = (next(iter(arrays.values())) for arrays in states)  # the values: the array itself, 8-bit Adam's codes
        found = next((a for a in held if a.size), None)
        if found is None:
            what = "parameter" if kind == "param" else "optimizer state (Adam m)"
            raise ValueError(f"MINIZERO_FAULT={self.spec!r} cannot fire: rank {self.rank} holds no element of any "
                             f"{what} (its shards are padding only); name another rank")
        return found

    def on_step_end(self, run, step: int, record=None) -> None:
        self.armed = False
        if step == self.step and self.kind in ("diverge", "diverge_state"):
            flat = self._target(run).reshape(-1)
            flat[:1] += flat.dtype.type(1e-3 if flat.dtype.kind == "f" else 1)
