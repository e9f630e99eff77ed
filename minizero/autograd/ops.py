"""Elementwise, reduction, matmul and shape ops, and the Tensor operators that use them.

Each backward is beside its forward; broadcasting ops sum gradients back with :func:`unbroadcast`.
"""
from __future__ import annotations

import numpy as np

from minizero import backend
from minizero.autograd.engine import Function, Tensor


def unbroadcast(grad, shape):
    """Sum ``grad`` (the broadcast result's shape) over the axes broadcasting added or stretched:
    an array of ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def _shape(x):
    return backend.xp.shape(x)


class Add(Function):
    """a + b with broadcasting."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return backend.binary("add", a, b)

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if ctx.needs_input_grad[0] else None,
                unbroadcast(g, sb) if ctx.needs_input_grad[1] else None)


class Sub(Function):
    """a - b with broadcasting."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if ctx.needs_input_grad[0] else None,
                unbroadcast(-g, sb) if ctx.needs_input_grad[1] else None)


class Mul(Function):
    """a * b with broadcasting; saves both inputs."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.shapes = (_shape(a), _shape(b))
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        sa, sb = ctx.shapes
        return (unbroadcast(g * b, sa) if ctx.needs_input_grad[0] else None,
                unbroadcast(g * a, sb) if ctx.needs_input_grad[1] else None)


class Div(Function):
    """a / b with broadcasting; saves both inputs."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b)
        ctx.shapes = (_shape(a), _shape(b))
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        sa, sb = ctx.shapes
        return (unbroadcast(g / b, sa) if ctx.needs_input_grad[0] else None,
                unbroadcast(-g * a / (b * b), sb) if ctx.needs_input_grad[1] else None)


class Neg(Function):
    """-a."""

    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """a ** p for a Python scalar exponent p; saves a."""

    @staticmethod
    def forward(ctx, a, p):
        ctx.p = p
        ctx.save_for_backward(a)
        return a ** p

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * ctx.p * a ** (ctx.p - 1), None


class Exp(Function):
    """exp(a); saves the output."""

    @staticmethod
    def forward(ctx, a):
        y = backend.xp.exp(a)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Log(Function):
    """log(a); saves a."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return backend.xp.log(a)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g / a


class Tanh(Function):
    """tanh(a); saves the output."""

    @staticmethod
    def forward(ctx, a):
        y = backend.xp.tanh(a)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class Sum(Function):
    """Sum over ``axis`` (None: all), optionally keeping dims."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = a.shape, axis, keepdims
        return backend.xp.asarray(a.sum(axis=axis, keepdims=keepdims))

    @staticmethod
    def backward(ctx, g):
        if ctx.axis is not None and not ctx.keepdims:
            axes = (ctx.axis,) if isinstance(ctx.axis, int) else ctx.axis
            axes = sorted(ax % len(ctx.shape) for ax in axes)
            for ax in axes:
                g = backend.xp.expand_dims(g, ax)
        return backend.xp.broadcast_to(g, ctx.shape).copy()


class MatMul(Function):
    """``a @ b``: a (..., n, k), b (..., k, m) -> (..., n, m), batch dims broadcast. Saves a and b."""

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands of at least 2 dims, got shapes {a.shape} and {b.shape}")
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.shapes = (a.shape, b.shape)
        return backend.matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        sa, sb = ctx.shapes
        xp, gm, op = backend.xp, backend.matmul_operand(g), backend.matmul_operand  # g widened once for both
        da = (unbroadcast(backend.to_dtype(backend.matmul(gm, op(xp.swapaxes(b, -1, -2))),
                                           np.result_type(g.dtype, b.dtype)), sa) if ctx.needs_input_grad[0] else None)
        db = (unbroadcast(backend.to_dtype(backend.matmul(op(xp.swapaxes(a, -1, -2)), gm),
                                           np.result_type(a.dtype, g.dtype)), sb) if ctx.needs_input_grad[1] else None)
        return da, db


class Reshape(Function):
    """View with a new shape (same number of elements)."""

    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class ToDtype(Function):
    """forward: a copy of x in ``dtype``; backward: the gradient back in x's dtype (PyTorch's ``x.to(dtype)``)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.dtype), None


class Transpose(Function):
    """Permute axes (``axes`` as in ``numpy.transpose``; None reverses them)."""

    @staticmethod
    def forward(ctx, a, axes=None):
        ctx.axes = axes
        return backend.xp.transpose(a, axes)

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        if ctx.axes is None:
            return xp.transpose(g), None
        axes = [ax % g.ndim for ax in ctx.axes]  # negative axes count from the end, as in numpy.transpose
        inverse = sorted(range(len(axes)), key=axes.__getitem__)  # host ints: axes are not data
        return xp.transpose(g, inverse), None


class GetItem(Function):
    """Basic or advanced indexing ``a[index]``; backward scatters (adds) into zeros."""

    @staticmethod
    def forward(ctx, a, index):
        ctx.shape, ctx.dtype, ctx.index = a.shape, a.dtype, index
        return a[index]

    @staticmethod
    def backward(ctx, g):
        xp = backend.xp
        out = xp.zeros(ctx.shape, ctx.dtype)
        xp.add.at(out, ctx.index, g)
        return out, None


class Split(Function):
    """Split ``a`` into equal ``sections`` along ``axis``; returns a tuple of tensors."""

    @staticmethod
    def forward(ctx, a, sections, axis=-1):
        if a.shape[axis] % sections:
            raise ValueError(f"split: axis {axis} of size {a.shape[axis]} does not divide into {sections} sections")
        ctx.axis = axis
        return tuple(backend.xp.split(a, sections, axis=axis))

    @staticmethod
    def backward(ctx, *grads):
        return backend.xp.concatenate(grads, axis=ctx.axis), None, None


class Concat(Function):
    """Concatenate tensors along ``axis``; call as ``concat([t1, t2, ...], axis)``."""

    @staticmethod
    def forward(ctx, *arrays, axis=0):
        ctx.axis = axis
        ctx.sizes = [a.shape[axis] for a in arrays]
        return backend.xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        cuts = np.cumsum(ctx.sizes)[:-1].tolist()  # host ints: the sizes are shapes, not device data
        return tuple(backend.xp.split(g, cuts, axis=ctx.axis))


def concat(tensors, axis: int = 0) -> Tensor:
    """Concatenate a sequence of tensors along ``axis`` (like ``torch.cat``)."""
    return Concat.apply(*tensors, axis=axis)


def split(t: Tensor, sections: int, axis: int = -1):
    """Split into ``sections`` equal parts along ``axis`` (like ``numpy.split``)."""
    return Split.apply(t, sections, axis)
