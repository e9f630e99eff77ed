"""Tracing is a callback the communicator calls: a tracer registered on a communicator's traffic ledger
records the collectives and messages of that communicator and of every group split from it; with none
registered (and no thread tracer) nothing is recorded."""
import numpy as np
import pytest

from minizero import trace
from minizero.comm import run_in_threads
from minizero.comm.collectives import all_reduce
from minizero.comm.nonblocking import RingCollective


def _ring_and_blocking(comm, register: bool):
    tracer = trace.Tracer(comm.rank)
    if register:
        comm.traffic.tracer = tracer
    group = comm.split(color=comm.rank % 2, key=comm.rank)  # a group's ledger reports to the world's
    buf = np.arange(64, dtype=np.float64) + comm.rank
    RingCollective(group, buf, "all_reduce", 1200, name="ring in the group").start().wait()
    with comm.traffic.op("metrics"):
        all_reduce(comm, np.ones(4))
    assert trace.get_tracer() is None  # nothing thread-global was installed
    return [(e["name"], e["tid"]) for e in tracer.events]


@pytest.mark.timeout(60)
def test_a_tracer_registered_on_the_communicator_records_its_groups_too():
    for events in run_in_threads(4, _ring_and_blocking, True):
        assert ("ring in the group", trace.IN_FLIGHT) in events
        assert ("metrics", trace.COMM) in events


@pytest.mark.timeout(60)
def test_no_tracer_registered_records_nothing():
    assert run_in_threads(4, _ring_and_blocking, False) == [[]] * 4


@pytest.mark.timeout(60)
def test_an_op_span_carries_the_bytes_sent_inside_it_not_since_the_start():
    def fn(comm):
        comm.traffic.tracer = tracer = trace.Tracer(comm.rank)
        for label, n in (("a", 4), ("b", 8)):
            with comm.traffic.op(label):
                all_reduce(comm, np.ones(n))
        return [e["args"]["bytes"] for e in tracer.events if e["name"] in ("a", "b")], comm.traffic.by_op

    for spans, by_op in run_in_threads(2, fn):
        assert spans == [by_op["a"], by_op["b"]] and 0 < by_op["a"] < by_op["b"], (spans, by_op)
