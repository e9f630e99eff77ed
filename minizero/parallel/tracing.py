"""``--trace PATH``: spans for each unit's forward and backward, and one timeline file for all ranks.

Forward spans from module hooks; backward spans from identity Functions on each unit's output (begin) and
input (end). Mirrors: ``torch.profiler`` (``record_function``, ``export_chrome_trace``).
"""
from __future__ import annotations

import json

import numpy as np

from minizero import jsons, trace
from minizero.autograd import Function, Tensor
from minizero.files import atomic_write
from minizero.zero.shards import find_units

TRACE_TAG = 1200  #: tag of the messages that gather the ranks' events


class _BackwardMark(Function):
    """Identity; its backward calls ``mark()`` (the moment the gradient passed this point)."""

    @staticmethod
    def forward(ctx, x, mark):
        ctx.mark = mark
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.mark()
        return g, None


class TraceUnits:
    """Spans ``forward NAME`` / ``backward NAME`` of every unit of ``model`` into this rank's tracer."""

    def __init__(self, model):
        self.removers = []
        for name, module, _ in find_units(model):
            self.removers.append(module.register_forward_pre_hook(self._pre(name)))
            self.removers.append(module.register_forward_hook(self._post(name)))

    def remove(self) -> None:
        """Take the hooks off again."""
        for r in self.removers:
            r()
        self.removers = []

    def _pre(self, name):
        def hook(module, args):
            tracer = trace.get_tracer()
            if tracer is None:
                return None
            record = {"fwd": trace.now_us(), "bwd": None}
            module.__dict__.setdefault("_trace_records", []).append(record)
            if args and isinstance(args[0], Tensor) and args[0].requires_grad:
                def end():
                    if record["bwd"] is not None:
                        tracer.complete(f"backward {name}", "backward", record["bwd"], trace.now_us())
                return (_BackwardMark.apply(args[0], end), *args[1:])
            return None
        return hook

    def _post(self, name):
        def hook(module, args, out):
            tracer = trace.get_tracer()
            records = module.__dict__.get("_trace_records")
            if tracer is None or not records:
                return None
            record = records.pop()
            tracer.complete(f"forward {name}", "forward", record["fwd"], trace.now_us())
            if isinstance(out, Tensor) and out.requires_grad:
                def begin():
                    record["bwd"] = trace.now_us()
                return _BackwardMark.apply(out, begin)
            return None
        return hook


def write_trace(comm, tracer: trace.Tracer, path: str) -> list | None:
    """Collective over ``comm``: rank 0 writes every rank's events to ``path``
    (Chrome trace-event JSON, ``pid`` = rank).

    Each rank sends an int64 length, then the JSON bytes. Returns the events written on rank 0 (what is analysed,
    not read back: PATH may be /dev/null or a pipe), None elsewhere.
    """
    mine = np.frombuffer(json.dumps(tracer.events).encode(), dtype=np.uint8).copy()
    if comm.rank != 0:
        with comm.traffic.op("trace"):
            comm.send(np.array([mine.size], dtype=np.int64), 0, tag=TRACE_TAG)
            comm.send(mine, 0, tag=TRACE_TAG)
        return None
    events = list(tracer.events)
    for r in range(1, comm.world_size):
        n = comm.recv(np.empty(1, dtype=np.int64), r, tag=TRACE_TAG)
        buf = comm.recv(np.empty(int(n[0]), dtype=np.uint8), r, tag=TRACE_TAG)
        events.extend(json.loads(buf.tobytes().decode()))
    events += trace.metadata_events(range(comm.world_size))
    text = json.dumps(jsons.trace(events))
    atomic_write(path, lambda f: f.write(text), mode="w")
    return json.loads(text)["traceEvents"]  # as a reader of PATH gets them (JSON's types, not the tracer's)
