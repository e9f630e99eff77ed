"""A tape-based reverse-mode autograd: ``Tensor``, ``Function``, ``backward``.

Saved arrays go through the innermost :func:`saved_tensors_hooks` pack and count as ``activations``;
:func:`backward` runs each node once, consumers first, and fires post-accumulate-grad hooks after a leaf's
last contribution. Mirrors: ``torch.autograd.Function``, ``torch.no_grad``, ``saved_tensors_hooks``,
``register_post_accumulate_grad_hook``, ``queue_callback``.
"""
from __future__ import annotations

import math
import numbers
import threading

from minizero import backend
from minizero.autograd.grad_mode import (current_saved_tensors_hooks, enable_grad,  # noqa: F401
                                         is_grad_enabled, no_grad, saved_tensors_hooks)
from minizero.ledger import get_ledger

_running = threading.local()  # per rank thread: depth of the running backwards, callbacks for the outermost


class Context:
    """The per-call record ``ctx``: ``needs_input_grad``, ``save_for_backward(*arrays)``, ``saved_tensors``."""

    def __init__(self, fn, needs_input_grad, recording):
        self.fn = fn
        self.needs_input_grad = needs_input_grad
        self._recording = recording
        self._saved = ()
        # graph edges, one per positional input, set by apply: None (no gradient needed),
        # a leaf Tensor, or (node, output index) of the Function that produced the input.
        # Edges point at nodes, never at intermediate Tensors, so the graph keeps alive
        # only what Functions saved -- exactly what the ledger counts.
        self.edges = ()
        self.input_shapes = ()
        self.num_outputs = 1
        self.output_meta = ()  # (shape, dtype) per output, to make zero grads

    def save_for_backward(self, *arrays) -> None:
        """Keep ``arrays`` (any shapes/dtypes, or None) for backward, through the active pack hook."""
        if not self._recording:
            return
        hooks = current_saved_tensors_hooks()
        ledger = get_ledger()
        saved = []
        for a in arrays:
            if not hasattr(a, "nbytes"):  # None or a Python scalar: kept as is, hooks see arrays only
                saved.append((a, None))
                continue
            packed = hooks[0](a) if hooks else a
            ledger.track(packed, "activations")
            saved.append((packed, hooks[1] if hooks else None))
        self._saved = tuple(saved)

    @property
    def saved_tensors(self) -> tuple:
        """The saved arrays, each passed through the ``unpack`` paired with its ``pack``."""
        if self._saved is None:
            raise RuntimeError(
                f"{self.fn.__name__}: saved tensors were already freed by an earlier backward; "
                "call backward(retain_graph=True) to backpropagate twice")
        return tuple(p if unpack is None else unpack(p) for p, unpack in self._saved)

    def release(self) -> None:
        """Drop saved tensors and graph edges (called by the engine after backward)."""
        self._saved = None
        self.edges = ()


class Function:
    """Base class of every differentiable op (mirrors ``torch.autograd.Function``).

    ``forward(ctx, *args)`` and ``backward(ctx, *grad_outputs)`` on raw arrays: one gradient per positional input
    (None where none), one grad_output per output (zeros where none arrived).
    """

    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grad_outputs):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        """Run the op on Tensors/arrays/scalars; returns Tensor(s)."""
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        recording = is_grad_enabled() and any(needs)
        ctx = Context(cls, needs, recording)
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        out = cls.forward(ctx, *raw, **kwargs)
        multi = isinstance(out, tuple)
        outs = out if multi else (out,)
        tensors = tuple(Tensor(o, requires_grad=recording) for o in outs)
        if recording:
            ctx.edges = tuple(_edge(a) for a in args)
            ctx.input_shapes = tuple(a.shape if isinstance(a, Tensor) else None for a in args)
            ctx.num_outputs = len(outs)
            ctx.output_meta = tuple((o.shape, o.dtype) for o in outs)
            for i, t in enumerate(tensors):
                t.grad_fn, t._out_index = ctx, i
        return tensors if multi else tensors[0]


class Tensor:
    """An array (``data``) with an optional gradient (``grad``, data's shape and dtype) and ``grad_fn``
    (None for leaves).

    Operators and methods each apply one Function of :mod:`minizero.autograd.ops`.
    """

    #: the module of elementary Functions, :mod:`minizero.autograd.ops` (bound by the package's __init__)
    ops = None

    def __init__(self, data, requires_grad: bool = False):
        self.data = data if isinstance(data, backend.xp.ndarray) else backend.xp.asarray(data)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.grad_fn = None
        self._out_index = 0
        self._post_accumulate_hooks = []
        #: ledger category of this leaf's ``.grad`` ("gradients"); None for a temporary leaf whose
        #: gradient is an activation gradient (recompute's inputs), which the ledger does not count
        #: -- as it does not count any gradient flowing between Functions
        self.grad_category = "gradients"

    shape = property(lambda self: self.data.shape, doc="the array's shape")
    dtype = property(lambda self: self.data.dtype, doc="the array's dtype")
    ndim = property(lambda self: self.data.ndim, doc="number of dimensions")
    size = property(lambda self: self.data.size, doc="number of elements")
    is_leaf = property(lambda self: self.grad_fn is None, doc="True when no Function produced it")

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def numpy(self):
        """The data as a host NumPy array."""
        return backend.to_host(self.data)

    def item(self) -> float:
        """The value of a one-element tensor as a Python float."""
        return float(self.data.reshape(-1)[0]) if self.data.size == 1 else float(self.data)

    def detach(self) -> "Tensor":
        """A new leaf sharing ``data``, cut from the graph."""
        return Tensor(self.data, requires_grad=False)

    def register_post_accumulate_grad_hook(self, hook, prepend: bool = False) -> None:
        """Call ``hook(tensor)`` on a leaf after its last gradient contribution in a backward
        (``prepend``: before the hooks already registered, as PyTorch's module hooks' ``prepend``)."""
        if prepend:
            self._post_accumulate_hooks.insert(0, hook)
        else:
            self._post_accumulate_hooks.append(hook)

    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Backpropagate from this tensor; see :func:`backward`."""
        backward(self, grad, retain_graph=retain_graph)

    # ---- operators: one elementary Function each (other operands: Tensors, arrays or scalars) ----
    __array_ufunc__ = None  # ``array - tensor``: NumPy defers to __rsub__ (it made an object array of Tensors)

    def __add__(self, other):
        return self.ops.Add.apply(self, other)

    def __radd__(self, other):
        return self.ops.Add.apply(other, self)

    def __sub__(self, other):
        return self.ops.Sub.apply(self, other)

    def __rsub__(self, other):
        return self.ops.Sub.apply(other, self)

    def __mul__(self, other):
        return self.ops.Mul.apply(self, other)

    def __rmul__(self, other):
        return self.ops.Mul.apply(other, self)

    def __truediv__(self, other):
        return self.ops.Div.apply(self, other)

    def __rtruediv__(self, other):
        return self.ops.Div.apply(other, self)

    def __neg__(self):
        return self.ops.Neg.apply(self)

    def __pow__(self, p):  # a Tensor exponent got no gradient; an array one broadcast past the base's shape
        if not isinstance(p, numbers.Real):
            raise ValueError(f"Tensor ** p: p must be a real scalar (int or float, NumPy's too), got "
                             f"{f'{type(p).__name__} of shape {p.shape}' if hasattr(p, 'shape') else repr(p)}")
        return self.ops.Pow.apply(self, p)

    def __matmul__(self, other):
        return self.ops.MatMul.apply(self, other)

    def __rmatmul__(self, other):
        return self.ops.MatMul.apply(other, self)

    def __getitem__(self, idx):
        return self.ops.GetItem.apply(self, idx)

    def exp(self):
        return self.ops.Exp.apply(self)

    def log(self):
        return self.ops.Log.apply(self)

    def tanh(self):
        return self.ops.Tanh.apply(self)

    def sum(self, axis=None, keepdims: bool = False):
        """Sum over ``axis`` (None: all elements)."""
        return self.ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims: bool = False):
        """Mean over ``axis`` (None: all elements): the sum times 1/n."""
        n = self.size if axis is None else (
            self.shape[axis] if isinstance(axis, int) else math.prod(self.shape[i] for i in axis))
        return self.sum(axis=axis, keepdims=keepdims) * (1.0 / n)

    def reshape(self, *shape):
        """``reshape(2, 3)`` or ``reshape((2, 3))``, as NumPy."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self.ops.Reshape.apply(self, shape)

    def transpose(self, *axes):
        """Permute axes (none given: reverse them), as NumPy."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return self.ops.Transpose.apply(self, axes or None)

    T = property(lambda self: self.ops.Transpose.apply(self, None), doc="the transpose (axes reversed)")


def _topological_nodes(root: Tensor):
    """Nodes reachable from ``root.grad_fn`` in an order where each node precedes its inputs' nodes."""
    order, visited = [], set()
    stack = [(root.grad_fn, False)]
    while stack:
        node, expanded = stack.pop()
        if node is None:
            continue
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for e in node.edges:
            if isinstance(e, tuple) and id(e[0]) not in visited:
                stack.append((e[0], False))
    order.reverse()  # post-order reversed: consumers before producers
    return order


def backward(root: Tensor, grad=None, retain_graph: bool = False) -> None:
    """Reverse-mode differentiation from ``root``; leaf gradients accumulate into ``.grad`` (ledger ``gradients``).

    ``grad``: d(objective)/d(root), root's shape (default 1 for one element); ``retain_graph``: keep saved tensors.
    :func:`queue_callback`'s callbacks run when the outermost backward returns.
    Raises RuntimeError: ``root`` needs no grad, or no ``grad`` for a non-scalar root; ValueError: grad's shape.
    """
    depth = getattr(_running, "depth", 0)
    if depth == 0:
        _running.callbacks = []
    _running.depth = depth + 1
    try:
        _backward(root, grad, retain_graph)
    finally:
        _running.depth = depth
    if depth == 0:  # not after an exception: its callbacks are dropped with the failed backward
        while _running.callbacks:
            _running.callbacks.pop(0)()


def queue_callback(fn) -> None:
    """Call ``fn()`` once the outermost backward has ended (PyTorch's ``queue_callback``); RuntimeError if none runs."""
    if getattr(_running, "depth", 0) == 0:
        raise RuntimeError("queue_callback() called outside backward; it runs fn when the running backward ends")
    _running.callbacks.append(fn)


def _backward(root: Tensor, grad, retain_graph: bool) -> None:
    """The body of :func:`backward` (one pass over the graph)."""
    xp = backend.xp
    if not root.requires_grad:
        raise RuntimeError("backward() called on a tensor that does not require grad")
    if grad is None:
        if root.data.size != 1:
            raise RuntimeError(f"grad must be given for a non-scalar root of shape {root.shape}")
        grad = xp.ones_like(root.data)
    grad = grad if isinstance(grad, xp.ndarray) else xp.asarray(grad)  # array-likes convert, as Tensor(data) does
    # never reshaped or broadcast; the recorded shape: a pipeline frees a sent output's data (Megatron's deallocate)
    want = root.grad_fn.output_meta[root._out_index][0] if root.grad_fn is not None else root.shape
    if grad.shape != want:
        raise ValueError(f"grad has shape {grad.shape}; the root has shape {want} (grad must have it too)")
    if root.grad_fn is None:  # a leaf root: its gradient is the one given
        _accumulate_leaf(root, grad)
        for hook in root._post_accumulate_hooks:
            hook(root)
        return
    nodes = _topological_nodes(root)
    # how many times each leaf will receive a gradient, so hooks fire after the last one
    pending = {}
    for node in nodes:
        for e in node.edges:
            if isinstance(e, Tensor):
                pending[id(e)] = pending.get(id(e), 0) + 1
    split = getattr(_running, "split", None)  # autograd/split_backward.py's WeightGradients, collecting W work
    grads = {id(root.grad_fn): [None] * root.grad_fn.num_outputs}  # id(node) -> its outputs' gradients
    grads[id(root.grad_fn)][root._out_index] = grad
    for node in nodes:
        outs = grads.pop(id(node), None)
        if outs is None:  # no gradient reached this node: its leaves' contributions are all None
            for e in node.edges:
                if isinstance(e, Tensor):
                    _contribution_done(e, pending)
            continue
        if node._saved is None:
            raise RuntimeError(f"{node.fn.__name__}: this part of the graph was already freed by an earlier "
                               "backward; call backward(retain_graph=True) to backpropagate twice")
        outs = [g if g is not None else xp.zeros(shape, dtype) for g, (shape, dtype) in zip(outs, node.output_meta)]
        later = split.deferred_inputs(node) if split is not None else ()  # weight gradients left to a W
        in_grads = call_backward(node, outs, skip=later)
        edges, shapes = node.edges, node.input_shapes
        if later:
            split.defer(node, outs, later, pending, retain_graph)
        elif not retain_graph:
            node.release()
        for i, (e, shape, g) in enumerate(zip(edges, shapes, in_grads)):
            if e is None or i in later:
                continue
            if g is None:  # a None contribution still counts: the leaf's hooks must fire after its last one
                if isinstance(e, Tensor):
                    _contribution_done(e, pending)
                continue
            if g.shape != shape:
                raise RuntimeError(f"{node.fn.__name__}.backward gave a gradient of shape {g.shape} "
                                   f"for an input of shape {shape}")
            if isinstance(e, Tensor):  # a leaf
                _accumulate_leaf(e, g)
                _contribution_done(e, pending)
            else:
                producer, k = e  # k: which of producer's outputs (i numbers this node's inputs)
                slot = grads.setdefault(id(producer), [None] * producer.num_outputs)
                slot[k] = g if slot[k] is None else backend.binary("add", slot[k], g)


def call_backward(node: Context, outs, skip=()) -> tuple:
    """``node.fn.backward(node, *outs)`` as a tuple, the inputs numbered in ``skip`` taken out of
    ``needs_input_grad`` (None for them; not called at all when no input is left)."""
    need = node.needs_input_grad
    if skip:
        node.needs_input_grad = tuple(n and i not in skip for i, n in enumerate(need))
    try:  # a recorded node always needs some input's gradient: unsplit, backward always runs
        in_grads = node.fn.backward(node, *outs) if any(node.needs_input_grad) else (None,) * len(need)
    finally:
        node.needs_input_grad = need
    in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
    if len(in_grads) != len(node.edges):
        raise RuntimeError(f"{node.fn.__name__}.backward returned {len(in_grads)} gradients "
                           f"for {len(node.edges)} inputs")
    return in_grads


def _contribution_done(leaf: Tensor, pending: dict) -> None:
    """Count one contribution (an array or None) to ``leaf``; after its last, fire its post-accumulate hooks
    (as PyTorch's, once per backward even if no contribution carried a gradient: ``leaf.grad`` may be None)."""
    pending[id(leaf)] -= 1
    if pending[id(leaf)] == 0:
        for hook in leaf._post_accumulate_hooks:
            hook(leaf)


def _edge(a):
    """The graph edge for one Function input (see ``Context.edges``)."""
    if not isinstance(a, Tensor) or not a.requires_grad:
        return None
    return a if a.grad_fn is None else (a.grad_fn, a._out_index)


def _accumulate_leaf(t: Tensor, g) -> None:
    if t.grad is None:
        t.grad = backend.xp.array(g, dtype=t.data.dtype, copy=True, order="C")
        if t.grad_category is not None:
            get_ledger().track(t.grad, t.grad_category)
    else:
        t.grad += g
