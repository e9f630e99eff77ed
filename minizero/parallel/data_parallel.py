"""Data parallelism: every rank holds the whole model, gradients are averaged with all-reduce.

Gradients go in flat buckets of at most ``bucket_bytes`` (reverse parameter order, ledger ``comm_buffers``),
each summed by one all-reduce per optimizer step and divided by N (before the sum for float16, after it for
float32/64: :func:`~minizero.comm.collectives.divide_before_sum`).
Mirrors: PyTorch ``DistributedDataParallel``; Li et al. 2020, "PyTorch Distributed" (VLDB).
"""
from __future__ import annotations

import contextlib
import numbers

import numpy as np

from minizero import backend
from minizero.comm.collectives import all_reduce, broadcast, mean_scale_
from minizero.ledger import get_ledger
from minizero.optim.used_parameters import used_anywhere


def check_steps(steps) -> int:
    """``steps`` (a count of optimizer steps) as an int. Raises ValueError naming it unless it is an integer >= 0
    (NumPy's too; not a bool): 2.5 or nan steps divided silently, None failed on '<'."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"steps={steps!r}; allowed: an integer >= 0")
    return int(steps)


def mean_per_step(total: float, steps: int) -> float:
    """``total`` bytes over ``steps`` steps; 0.0 over no steps. Raises ValueError: see :func:`check_steps`."""
    steps = check_steps(steps)
    return total / steps if steps else 0.0


def fill_bucket(flat, layout) -> None:
    """Copy each parameter's gradient into its slice of the flat bucket ``flat`` (zeros for a parameter
    with no gradient). ``layout``: ``[(parameter, offset in elements), ...]``; ``flat``: 1-D, the
    gradients' dtype, as :class:`DataParallel` lays out its buckets (PyTorch DDP's bucket copy-in)."""
    for p, off in layout:
        view = flat[off:off + p.size]
        if p.grad is None:
            view[...] = 0
        else:
            view[...] = p.grad.reshape(-1)


class DataParallel:
    """Gradient averaging over a data-parallel communicator.

    Args:
        params: the same Parameters in the same order on every rank.  comm: the data group (N ranks).
        bucket_bytes: most bytes per bucket (a larger parameter gets its own; default 1 MiB).
        native: the library's all-reduce.  broadcast_params: copy rank 0's parameters at construction.
        allreduce: ``allreduce(flat, out=flat)`` summing in place; None: :func:`all_reduce` (recursive doubling for
        a bucket up to 256 KiB, else the ring).
        find_unused_parameters: agree each step on the used parameters (all-gather of a ceil(P/8)-byte mask).
        predivided: gradients already carry the 1/N; the reduction is a plain sum.
    Raises ValueError: ``bucket_bytes`` < 1.
    """

    def __init__(self, params, comm, bucket_bytes: int = 1 << 20, native: bool = False,
                 broadcast_params: bool = True, allreduce=None, find_unused_parameters: bool = True,
                 predivided: bool = False):
        if isinstance(bucket_bytes, (bool, str)) or not bucket_bytes >= 1:  # "not >=": NaN is refused too
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes!r}")
        self.params, self.comm, self.native = list(params), comm, native
        self.predivided = predivided
        if allreduce is not None and native:
            raise ValueError("native=True and an allreduce callable exclude each other")
        self.allreduce, self.find_unused_parameters = allreduce, find_unused_parameters
        self.buckets = []  # list of (flat buffer, [(param, offset), ...])
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.bytes_sent = 0  # gradient all-reduce bytes this rank sent, over all steps
        current, size, dtype = [], 0, None
        for p in (reversed(self.params) if comm.world_size > 1 else ()):  # one rank: nothing to reduce
            if current and (size + p.data.nbytes > bucket_bytes or p.dtype != dtype):
                self._add_bucket(current, dtype)
                current, size = [], 0
            current.append(p)
            size += p.data.nbytes
            dtype = p.dtype
        if current:
            self._add_bucket(current, dtype)
        if broadcast_params and comm.world_size > 1:
            with comm.traffic.op("broadcast_params"):
                for p in self.params:
                    broadcast(comm, p.data, root=0)

    def _add_bucket(self, params, dtype):
        n = sum(p.size for p in params)
        flat = backend.xp.zeros(n, dtype)
        get_ledger().track(flat, "comm_buffers")
        layout, off = [], 0
        for p in params:
            layout.append((p, off))
            off += p.size
        self.buckets.append((flat, layout))

    def agree_on_used(self) -> list:
        """Collective: for each of ``params``, True where some rank has a ``.grad`` (see :func:`used_anywhere`);
        without ``find_unused_parameters``, no message: where this rank has one."""
        here = [p.grad is not None for p in self.params]
        return used_anywhere(self.comm, here) if self.find_unused_parameters else here

    def write_back(self, used) -> None:
        """Every bucket's averages into ``.grad`` of the parameters some rank used (``used``, from
        :meth:`agree_on_used`); a rank that had none gets a new array (``gradients`` in the ledger),
        a parameter no rank used keeps ``.grad = None``."""
        for flat, layout in self.buckets:
            for p, off in layout:
                if not used[self._index[id(p)]]:
                    continue
                g = flat[off:off + p.size].reshape(p.shape)
                if p.grad is None:
                    p.grad = g.copy()
                    get_ledger().track(p.grad, "gradients")
                else:
                    p.grad[...] = g

    def allreduce_gradients(self) -> None:
        """Average every parameter's ``.grad`` across the group, one ``all_reduce`` per bucket (bytes: its algorithm's).

        A parameter no rank has a gradient for stays ``None`` everywhere; one some rank lacks counts zeros there
        (the mask's all-gather is labelled ``used_parameters``). float16 is divided before the sum, wider after.
        Collective over ``comm``: every rank calls it, with its buckets in the same order.
        """
        n = self.comm.world_size
        if n == 1:
            return
        used = self.agree_on_used()
        before = self.comm.traffic.bytes_sent
        for flat, layout in self.buckets:
            fill_bucket(flat, layout)
            mean_scale_(flat, n, before_sum=True, predivided=self.predivided)  # float16: divide first
            if self.allreduce is not None:
                self.allreduce(flat, out=flat)
            else:
                all_reduce(self.comm, flat, native=self.native, out=flat)
            mean_scale_(flat, n, before_sum=False, predivided=self.predivided)  # float32/64: divide the sum
        self.write_back(used)
        self.bytes_sent += self.comm.traffic.bytes_sent - before

    # ---- the gradient synchroniser's interface (as ZeRO's, minizero/zero/base.py) ----------
    reduce_gradients = allreduce_gradients

    def local_grads(self) -> list:
        """The gradient arrays this rank holds: every ``.grad`` that is not None."""
        return [p.grad for p in self.params if p.grad is not None]

    def held_grad_pieces(self, params) -> None:
        """None: gradients stay whole until :meth:`reduce_gradients` (``strategy.Synchroniser``)."""
        return None

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective over ``model_comm`` (the other parts of the model; data replicas hold equal gradients,
        ``world`` unused): the squared global norm (float64) of the ``.grad`` of parameters ``counts(p)``
        accepts. Traffic label ``grad_norm``: one float64."""
        local = backend.xp.zeros(1, dtype=np.float64)  # summed on the device: one transfer a step
        for p in self.params:
            if p.grad is not None and counts(p):
                local += (backend.to_dtype(p.grad, np.float64) ** 2).sum()
        with model_comm.traffic.op("grad_norm"):
            return float(backend.to_host(all_reduce(model_comm, local))[0])

    def full_parameters(self):
        """Every rank holds every parameter whole: nothing to gather."""
        return contextlib.nullcontext()

    def bytes_per_step(self, steps: int) -> float:
        """Gradient all-reduce bytes this rank sent per step over ``steps`` steps; 0.0 over no steps,
        as ZeRO's. Raises ValueError for a negative ``steps``."""
        return mean_per_step(self.bytes_sent, steps)
