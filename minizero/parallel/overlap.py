"""Data-parallel gradient all-reduce overlapped with backward (PyTorch DDP's Reducer and ``no_sync``).

A post-accumulate-grad hook submits a bucket's :class:`~minizero.comm.nonblocking.RingCollective` to a
``Stream`` once its last parameter fires on the step's last micro-batch; bitwise the blocking path's result.
"""
from __future__ import annotations

from minizero.comm.collectives import all_reduce, bytes_sent, mean_scale_
from minizero.comm.recursive_doubling import all_reduce_algorithm
from minizero.comm.nonblocking import RingCollective, Stream
from minizero.parallel.data_parallel import fill_bucket, mean_per_step

OVERLAP_TAG = 1006  #: tag of the overlapped gradient ring (every kind of message has its own: tests/test_tags.py)


def can_overlap(dp) -> bool:
    """True when ``dp``'s buckets can be reduced by overlapped rings: more than one rank, the hand-written
    ring (not ``native``, not a hierarchical all-reduce) and a communicator with ``isend``/``irecv``."""
    return (dp is not None and dp.comm.world_size > 1 and not dp.native and dp.allreduce is None
            and dp.comm.nonblocking)


class OverlappedReducer:
    """Launch each bucket's all-reduce from the hook of its last gradient; :meth:`finish` before the step.

    A synchroniser (``strategy.Synchroniser``) in place of ``dp``, with its own ``bytes_sent``.
    ``dp``: the DataParallel whose buckets to reduce; ``defer``: parameters whose gradient changes after
    backward (the tied embedding's): their buckets start in :meth:`finish`.
    Raises ValueError: :func:`can_overlap` is False for ``dp``.
    """

    def __init__(self, dp, defer=()):
        if not can_overlap(dp):
            raise ValueError("overlap needs dp > 1, the hand-written ring (not the library's all-reduce, not the "
                             "hierarchical one) and a communicator with isend/irecv; reduce after backward instead")
        self.dp, self.stream = dp, Stream(dp.comm)
        deferred = {id(p) for p in defer}
        self.deferred = [any(id(p) in deferred for p, _ in layout) for _, layout in dp.buckets]
        self.micro_steps, self.bytes_sent = 1, 0  # bytes: the gradient all-reduces this rank sent, all steps
        self.order = [b for b in range(len(dp.buckets)) if not self.deferred[b]]  # launched from the hooks
        self._reset()
        for b, (_, layout) in enumerate(dp.buckets):
            for p, _ in layout:
                p.register_post_accumulate_grad_hook(self._hook(b))

    def begin_step(self, micro_steps: int) -> None:
        """A new optimizer step of ``micro_steps`` backward passes; buckets launch after the last one."""
        if micro_steps < 1:
            raise ValueError(f"micro_steps={micro_steps}; allowed: >= 1")
        self.micro_steps = micro_steps
        self._reset()

    def _reset(self) -> None:
        nb = len(self.dp.buckets)
        self.fired, self.complete, self._pos = [0] * nb, [False] * nb, 0

    def _hook(self, b: int):
        def hook(_param):
            self.stream.progress()
            self.fired[b] += 1
            if self.fired[b] == self.micro_steps * len(self.dp.buckets[b][1]):
                self.complete[b] = True
                self._launch_in_order()
        return hook

    def _launch_in_order(self) -> None:
        """Launch complete buckets in bucket order (deferred aside), so every rank submits the same sequence."""
        while self._pos < len(self.order) and self.complete[self.order[self._pos]]:
            self._launch(self.order[self._pos])
            self._pos += 1

    def _launch(self, b: int) -> None:
        flat, layout = self.dp.buckets[b]
        n = self.dp.comm.world_size
        fill_bucket(flat, layout)
        mean_scale_(flat, n, before_sum=True, predivided=self.dp.predivided)  # float16: divide first
        if all_reduce_algorithm(flat.nbytes, n) != "ring":  # a small bucket: recursive doubling, blocking, in
            return  # finish() -- the blocking path's algorithm, so the result stays bit for bit the same
        self.stream.submit(RingCollective(self.dp.comm, flat, "all_reduce", OVERLAP_TAG, name=f"all_reduce bucket {b}",
                                          bucket=b))

    def progress(self) -> None:
        """Advance the rings in flight without waiting."""
        self.stream.progress()

    def finish(self) -> None:
        """Launch the buckets not yet launched (in order, the deferred ones last), wait for all, agree on
        which parameters some rank used (:meth:`DataParallel.agree_on_used`), and write the averages
        into ``.grad`` as the blocking path does."""
        for b in self.order[self._pos:] + [b for b in range(len(self.dp.buckets)) if self.deferred[b]]:
            self._launch(b)
        with self.dp.comm.traffic.span("wait gradients"):
            self.stream.synchronize()
        used = self.dp.agree_on_used()
        n, comm = self.dp.comm.world_size, self.dp.comm
        for flat, layout in self.dp.buckets:
            if all_reduce_algorithm(flat.nbytes, n) != "ring":
                all_reduce(comm, flat, out=flat)
            mean_scale_(flat, n, before_sum=False, predivided=self.dp.predivided)  # float32/64: divide the sum
            self.bytes_sent += bytes_sent("all_reduce", flat.size, flat.itemsize, n, comm.rank)
        self.dp.write_back(used)
        self._reset()

    # ---- the gradient synchroniser's interface: the buckets' own reduction, the rest is dp's ----------
    reduce_gradients = finish

    def local_grads(self) -> list:
        """Every ``.grad`` that is not None (:meth:`DataParallel.local_grads`)."""
        return self.dp.local_grads()

    def held_grad_pieces(self, params) -> None:
        """:meth:`DataParallel.held_grad_pieces`: None, the gradients stay whole until :meth:`reduce_gradients`."""
        return self.dp.held_grad_pieces(params)

    def grad_norm_sq(self, counts, model_comm, world) -> float:
        """Collective over ``model_comm``: :meth:`DataParallel.grad_norm_sq`."""
        return self.dp.grad_norm_sq(counts, model_comm, world)

    def full_parameters(self):
        """:meth:`DataParallel.full_parameters`: every parameter is whole, nothing to gather."""
        return self.dp.full_parameters()

    def bytes_per_step(self, steps: int) -> float:
        """Gradient all-reduce bytes this rank sent per step over ``steps`` steps (its own count, not ``dp``'s);
        0.0 over no steps, as ZeRO's. Raises ValueError for a negative ``steps``."""
        return mean_per_step(self.bytes_sent, steps)
