"""What rank 0 shows while training runs: a tqdm bar, or one log line every K steps.

``auto`` picks the bar only when rank 0's stdout is a terminal, else log lines; ``bar`` forces the bar, ``log``
lines, ``none`` nothing. A log line: step, loss, lr, tok/s, elapsed, ETA (and FP16's scale and skips).
"""
from __future__ import annotations

import numbers
import sys
import time

MODES = ("auto", "bar", "log", "none")
LINE_MAX = 120  #: columns of a log line before its notes (memory, MoE loads) go on a line of their own


def _duration(seconds: float) -> str:
    """Seconds under a minute, minutes from there; 5 characters before the unit (strip them to save columns)."""
    return f"{seconds:5.1f} s" if seconds < 60 else f"{seconds / 60:5.1f} min"


def default_every(total: int) -> int:
    """Steps between log lines when none is asked for: about 15 lines per run, at round steps (1, 2 or 5 times a
    power of ten, the nearest by ratio to ``total`` / 15): 300 steps log every 20, 100 every 5, 1,000 every 50."""
    target = max(1.0, total / 15)
    nice = [m * 10 ** k for k in range(len(str(int(target))) + 1) for m in (1, 2, 5)]
    return min(nice, key=lambda n: max(n / target, target / n))


class Progress:
    """Live progress of one training run, shown by rank 0 (other ranks pass ``mode="none"``).

    Args:
        mode: one of :data:`MODES`.
        total: optimizer steps of the run.  tokens_per_step: global tokens per optimizer step.
        every: log lines every ``every`` steps (``None``/0: :func:`default_every`).
        fp16: add the loss scale and the skipped-step count to each line.
        out: the stream (default ``sys.stdout``).  start_step: first step (a resumed run).
    Raises:
        ValueError: ``mode`` not in :data:`MODES`; ``every`` not None or an integer >= 0.
    """

    def __init__(self, mode: str, total: int, tokens_per_step: int, every: int | None = None, fp16: bool = False,
                 out=None, start_step: int = 0):
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}; allowed: {', '.join(MODES)}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 0):
            raise ValueError(f"every={every!r}; allowed: an integer >= 1 (steps between log lines), or None or 0 "
                             f"(about 15 lines a run)")  # -3 logged every 3rd step, 2.5 every 5th
        self.out = out if out is not None else sys.stdout
        if mode == "auto":
            isatty = getattr(self.out, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "log"
        self.mode, self.total, self.tokens_per_step, self.fp16 = mode, total, tokens_per_step, fp16
        self.every = int(every) if every else default_every(total)
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=self.out, disable=False)

    def start_clock(self) -> None:
        """Time from now: the training loop calls this right before its first step, so tok/s, elapsed and ETA
        leave out the set-up and the first validation (as the closing line's tokens/s does)."""
        self.t0 = time.perf_counter()

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        elif self.mode == "log":
            print(line, file=self.out, flush=True)

    def step(self, step: int, loss: float, lr: float, scale: float | None = None, skipped: int = 0,
             extra: str = "") -> None:
        """Step ``step`` (0-based) just finished with mean training loss ``loss`` at learning rate ``lr``."""
        if self.mode == "none":
            return
        done = step + 1 - self.start_step
        elapsed = time.perf_counter() - self.t0
        tok_s = self.tokens_per_step * done / elapsed if elapsed > 0 else 0.0
        if self.bar is not None:
            post = dict(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            if self.fp16:
                post.update(scale=f"{scale:g}", skipped=skipped)
            self.bar.set_postfix(post)
            self.bar.update(1)
            return
        if (step + 1) % self.every and step + 1 != self.total:
            return
        eta = elapsed / done * (self.total - step - 1) if done else 0.0
        w = len(str(self.total))
        line = (f"step {step + 1:>{w}}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {tok_s:>6,.0f} tok/s  "
                f"elapsed {_duration(elapsed).lstrip()}, ETA {_duration(eta).lstrip()}")
        if self.fp16:
            line += f"  [fp16: scale {scale:g}, skipped {skipped}]"
        if extra:  # notes past 120 columns (MoE's expert loads, FP16's scale) and their further lines go below
            first, *below = extra.split("\n")
            line += f"\n{' ' * (2 * w + 8)}{first}" if len(line) + 2 + len(first) > LINE_MAX else f"  {first}"
            line += "".join(f"\n{' ' * (2 * w + 8)}{more}" for more in below)
        self._say(line)

    def validation(self, step: int, loss: float) -> None:
        """A validation loss taken after ``step`` optimizer steps."""
        if self.mode != "none":
            self._say(f"step {step:>{len(str(self.total))}}/{self.total}  validation loss {loss:.4f}")

    def close(self) -> None:
        """End the bar (its last state stays on screen); nothing to do for log lines."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
