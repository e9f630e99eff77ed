"""What CuPy refuses and NumPy accepts, as tables the strict array module (:mod:`minizero.strict`) enforces.

Read from CuPy's source, v13.6 and v14.2: ``cupy/_core/_kernel.pyx`` (``ufunc.__call__`` takes ``out``,
``dtype``, ``casting``; an operand that is not an ndarray or a scalar is "Unsupported type"; ``reduce``,
``accumulate``, ``reduceat``, ``at`` exist for a few ufuncs only) and the signatures of ``cupy.sum``,
``cupy.amax``, ``cupy.mean``, ``cupy.sort``, ... (no ``initial=``, no ``where=``).
"""
from __future__ import annotations

#: the ufuncs and functions the strict module offers as ``backend.xp.<name>`` (all exist in CuPy)
UFUNCS = """add subtract multiply divide true_divide floor_divide power negative positive absolute abs sign
    exp expm1 exp2 log log1p log2 log10 sqrt square reciprocal tanh sinh cosh sin cos tan arctan arctanh
    maximum minimum fmax fmin floor ceil rint trunc isfinite isnan isinf signbit copysign mod remainder
    equal not_equal less less_equal greater greater_equal logical_and logical_or logical_not logical_xor
    bitwise_and bitwise_or bitwise_xor invert left_shift right_shift erf""".split()
FUNCTIONS = """zeros empty ones full zeros_like empty_like ones_like full_like arange linspace eye
    ascontiguousarray concatenate stack hstack vstack split array_split where swapaxes transpose moveaxis
    broadcast_to broadcast_arrays expand_dims squeeze reshape ravel triu tril cumsum prod sum mean max min amax
    amin argmax argmin argsort sort bincount flatnonzero nonzero all any clip matmul dot einsum outer
    take take_along_axis tile repeat pad roll unique searchsorted copyto shape ndim size var std round
    array_equal allclose isclose count_nonzero diff flip may_share_memory""".split()

#: the ufunc methods CuPy has beyond ``__call__`` and ``outer``, and the ufuncs that have each
UFUNC_METHODS = {"reduce": ("add", "multiply"), "accumulate": ("add", "multiply"), "reduceat": ("add",),
                 "at": ("add", "subtract", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor")}
#: functions whose every positional argument is an array operand (CuPy runs them as ufuncs or needs ndarrays),
#: and those whose first one is not an array (a shape, a sequence of arrays, a subscript string)
EVERY_OPERAND = frozenset("where clip matmul dot outer array_equal allclose isclose take_along_axis "
                           "may_share_memory".split())
NOT_ARRAY_FIRST = frozenset("zeros empty ones full arange linspace eye concatenate stack hstack vstack "
                            "broadcast_arrays einsum".split())


def operand(v, where: str):
    """``v``, an array operand; a list or tuple is refused (CuPy: "Unsupported type")."""
    if isinstance(v, (list, tuple)):
        raise TypeError(f"{where}: a {type(v).__name__} as an array operand is not allowed (CuPy refuses it); "
                        "make it a device array with backend.xp.asarray")
    return v


#: keywords NumPy takes and CuPy 13.6-14.2 does not, per function or method name (from CuPy's signatures)
_NUMPY_ONLY = {n: frozenset(k.split()) for names, k in (
    ("sum prod max min amax amin", "initial where"), ("mean all any", "where"), ("std var", "where mean correction"),
    ("sort argsort", "order stable"), ("clip", "min max"), ("take", "mode"), ("count_nonzero", "keepdims"),
    ("unique", "sorted"), ("broadcast_to broadcast_arrays zeros_like empty_like ones_like full_like", "subok device"),
    ("zeros empty ones full arange eye ascontiguousarray linspace", "like device")) for n in names.split()}
_UFUNC_KEYWORDS = frozenset(("out", "dtype", "casting"))


def check(name: str, args, kwargs, operands: int) -> None:
    """Refuse what CuPy refuses: a list or tuple among the first ``operands`` arguments (array operands),
    a keyword CuPy's ``name`` lacks."""
    for v in args[:operands]:
        operand(v, f"xp.{name}")
    bad = (kwargs.keys() - _UFUNC_KEYWORDS) if name in UFUNCS else (_NUMPY_ONLY.get(name, frozenset()) & kwargs.keys())
    if bad:
        raise TypeError(f"xp.{name}: keyword(s) {sorted(bad)} are NumPy's only; CuPy's {name} has no such keyword")


class Flags:
    """``cupy.ndarray.flags`` as CuPy has it (``cupy/_core/flags.pyx`` through 14.2): ``c_contiguous``, ``f_contiguous``
    and ``owndata`` only (no ``writeable``: CuPy arrays, broadcast views included, are never read-only)."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, f):
        self.c_contiguous, self.f_contiguous, self.owndata = bool(f.c_contiguous), bool(f.f_contiguous), bool(f.owndata)

    def __repr__(self):
        return f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n  OWNDATA : {self.owndata}"


class Pointer:
    """``cupy.cuda.MemoryPointer`` as NCCL reads it: ``ptr``, a device address."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr
