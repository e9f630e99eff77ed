"""The training loop's instruments as callbacks (:mod:`minizero.callbacks`): progress, memory, tracing, checkpoints.

Each wraps one existing tool and says at which named point of the loop it acts; the loop itself
never mentions them (``default_callbacks`` lists what the main job installs, in calling order).
"""
from __future__ import annotations

import tracemalloc

from minizero import trace
from minizero.callbacks import Callback
from minizero.checkpoint import Checkpointer
from minizero.debug import timeline
from minizero.debug.anomaly import AnomalyDetector, LossSpikes
from minizero.debug.replicas import ReplicaCheck, has_replicas
from minizero.faults import FaultInjector
from minizero.header import Header
from minizero.ledger import get_ledger
from minizero.memory.monitor import MemoryMonitor
from minizero.parallel.tracing import TraceUnits, write_trace
from minizero.interrupts import Interrupts as _Signals
from minizero.progress import Progress, default_every


class Interrupts(_Signals, Callback):
    """:class:`minizero.interrupts.Interrupts` as a callback: a signal's exception that Python dropped in a weakref
    callback is raised again at the step's end (the rank would train on) and at the run's end."""

    def on_step_end(self, run, step, record):
        self.check()

    def on_train_end(self, run):  # a drop after the last step's check (its save, its later callbacks)
        self.check()


class ProgressCallback(Callback):
    """Rank 0's live progress (:class:`~minizero.progress.Progress`, made at ``setup``, after a resume set
    ``run.start``); other ranks say nothing."""

    def __init__(self, tokens_per_step: int, every: int):
        self.tokens_per_step, self.every, self.progress = tokens_per_step, every, None

    def setup(self, run):
        args = run.args
        self.progress = Progress(args.progress if run.comm.rank == 0 else "none", args.steps, self.tokens_per_step,
                                 every=self.every, fp16=run.scaler is not None, start_step=run.start)

    def on_eval(self, run, step, loss):
        self.progress.validation(step, loss)

    def on_train_start(self, run):
        self.progress.start_clock()

    def on_step_end(self, run, step, rec):
        self.progress.step(step, rec.loss, rec.lr, rec.scale, rec.skipped, extra=rec.notes)

    def on_train_end(self, run):
        self.progress.close()


class MemoryCallback(Callback):
    """The per-step memory window and module attribution (:class:`MemoryMonitor`, hooks attached now, so
    the first validation is measured too); at ``on_train_start`` the set-up peaks are kept apart
    (``result.setup_peak``) and the ledger's and tracemalloc's peaks reset to cover the steps only."""

    def __init__(self, every: int):
        self.every, self.monitor = every, None  # live text on the progress lines' steps

    def setup(self, run):
        self.monitor = run.result.memory_monitor = MemoryMonitor(run.strategy.stage, self.every, run.args.steps)

    def on_train_start(self, run):
        run.result.setup_peak = dict(get_ledger().peak, peak_total=get_ledger().peak_total)
        get_ledger().reset_peaks()
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()

    def on_step_start(self, run, step):
        self.monitor.begin_step()

    def on_step_end(self, run, step, rec):
        rec.notes = self.monitor.end_step(run.comm, step)  # collective on the progress steps

    def on_train_end(self, run):
        run.result.train_process_peak = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0

    def teardown(self, run):
        self.monitor.close()


class TraceCallback(Callback):
    """``--trace PATH``: this rank's timeline (forward/backward per unit, collectives, the optimizer step)
    from ``on_train_start`` to ``on_train_end``, then every rank's merged into PATH (collective); rank 0 logs the
    straggler and keeps each rank's time split (:mod:`minizero.debug.timeline`) in ``result.time_per_rank``. The tracer
    is registered on the world communicator's traffic ledger, which every group's ledger reports to."""

    def __init__(self, path: str):
        self.path, self.tracer, self.units = path, None, None

    def on_train_start(self, run):
        self.tracer = run.comm.traffic.tracer = trace.Tracer(run.comm.rank)  # collectives and messages, every group
        trace.set_tracer(self.tracer)  # compute: the units' forward/backward hooks, the optimizer step
        self.units = TraceUnits(run.strategy.stage)

    def on_train_end(self, run):
        trace.set_tracer(None)
        run.comm.traffic.tracer = None
        self.units.remove()
        events = write_trace(run.comm, self.tracer, self.path)
        if run.comm.rank == 0:  # per rank: compute, exposed communication, bubble; the straggler
            run.log(f"wrote {self.path} (Chrome trace-event JSON, one row per rank; open in https://ui.perfetto.dev)")
            run.result.time_per_rank = {p: timeline.rank_figures(events, p) for p in range(run.comm.world_size)}
            for line in (line for line in timeline.report(events) if not line.startswith("|")):  # the verdicts
                run.log(line)


class Resume(Callback):
    """``--resume`` at ``setup``: the state loaded into the built strategy; sets ``run.start`` (loop steps done,
    the data position: step k draws global batch (seed, k)), ``run.applied`` (updates taken), ``run.pruner``."""

    def setup(self, run):
        self.ckpt = Checkpointer(run.args, run.comm, run.cfg, run.text_digest,
                                 run.log if run.comm.rank == 0 else (lambda line: None))
        run.start, run.applied, run.pruner = self.ckpt.resume(run.strategy, run.scaler)
        run.result.start_step, run.result.load_peak = run.start, self.ckpt.load_peak
        run.result.checkpoints = self.ckpt.saved


class SaveCheckpoints(Callback):
    """``--save-every``: a sharded checkpoint after each due step (:meth:`Checkpointer.maybe_save`)."""

    def __init__(self, resume: Resume):
        self.resume = resume

    def on_step_end(self, run, step, rec):
        self.resume.ckpt.maybe_save(step, run.strategy, run.applied, run.scaler, run.pruner)


class ExpertLoadCallback(Callback):
    """MoE: the last step's share of the choices per expert and the drop rate on each progress line; the run's
    totals in ``result.moe`` (summary.json ``moe``). The counts are the strategy's (``expert_load``)."""

    def on_step_end(self, run, step, rec):
        line = run.strategy.expert_load.line()
        first, below = rec.notes.partition("\n")[::2]  # on the memory figures' line, above their note
        rec.notes = f"{first}  {line}" + (f"\n{below}" if below else "") if first else line

    def on_train_end(self, run):
        run.result.moe = run.strategy.expert_load.summary()


def replica_check(args) -> ReplicaCheck | None:
    """The replica check the flags ask for: ``--check-replicas N``, else by default wherever a replica exists."""
    replicated = has_replicas(args.dp * args.cp, args.dp_shard * args.cp, args.zero)  # not plain ZeRO-3, not 1 rank
    if args.check_replicas or (args.check_replicas is None and replicated):
        return ReplicaCheck(args.check_replicas or None, args.save_every)
    return None


def default_callbacks(run) -> list[Callback]:
    """The main job's instruments for ``run`` (a :class:`~minizero.loop.Run`), in calling order."""
    args, resume = run.args, Resume()
    every = args.log_every or default_every(args.steps)  # progress lines (and the memory figures on them)
    callbacks = [Interrupts(), Header(), resume]
    if args.detect_anomaly:  # before the fault injector: its gradient hook then runs first, this one sees it
        callbacks.append(AnomalyDetector(run.strategy.stage, run.comm.rank, fp16=run.scaler is not None))
    if args.loss_spike:
        callbacks.append(LossSpikes(run.strategy.stage, args.loss_spike))
    callbacks += [FaultInjector.from_environment(run.comm.rank, run.strategy.params), MemoryCallback(every)]
    if args.trace:
        callbacks.append(TraceCallback(args.trace))
    callbacks += [c for c in (replica_check(args),) if c is not None]
    if run.strategy.expert_load is not None:
        callbacks.append(ExpertLoadCallback())
    return callbacks + [ProgressCallback(args.batch_size * run.cfg.block_size, every), SaveCheckpoints(resume)]
