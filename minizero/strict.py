"""A strict array module: NumPy underneath, but its arrays refuse to leak to the host (``--device strict``).

Refused (TypeError, or NotImplementedError for what CuPy lacks): ``np.asarray``, pickling, mixing with
``numpy.ndarray``, NumPy functions on strict arrays, iteration, ``float``/``int``/``bool`` of many elements.
Explicit transfers always copy and count in :data:`transfers`; results are bitwise NumPy's.
Mirrors: CuPy's ndarray (``cupy/_core/_kernel.pyx`` v13.6-14.2) and the Array API's no-implicit-transfer rule.
"""
from __future__ import annotations

import builtins
import weakref

import numpy as np

from minizero.strict_rules import (EVERY_OPERAND, FUNCTIONS, NOT_ARRAY_FIRST, UFUNC_METHODS, UFUNCS, Flags,
                                   Pointer, check, operand)

#: host<->device copies since the last :func:`reset_transfers`: ``{"to_device": n, "to_host": n}``;
#: ``to_host`` counts ``get()`` and every one-element conversion (``float(x)``, ``bool(x)``, ``x.item()``)
transfers = {"to_device": 0, "to_host": 0}

_HINT = "use backend.to_host(x) / backend.to_device(a) (x.get() / xp.asarray(a)) to move data explicitly"
#: id(owning ndarray) -> the StrictArray wrapping it, so that views report the same ``.base`` identity
_owners: "weakref.WeakValueDictionary[int, StrictArray]" = weakref.WeakValueDictionary()


def reset_transfers() -> None:
    """Set both counters of :data:`transfers` to 0."""
    transfers["to_device"] = transfers["to_host"] = 0


class StrictArray:
    """A device array of the strict module wrapping (not copying) a ``numpy.ndarray``.

    Attributes as ``numpy.ndarray`` (``flags``: CuPy's three; ``base``: the owning StrictArray of a view, else None).
    """

    __slots__ = ("_a", "_base", "__weakref__")
    __hash__ = None

    def __init__(self, a: np.ndarray):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"StrictArray holds a numpy.ndarray, got {type(a).__name__}")
        self._a, self._base = a, None
        root = _root(a)
        if root is a:
            if _owners.get(id(a)) is None:  # the first wrapper of an owning array owns it
                _owners[id(a)] = self
        else:  # a view holds its owner, as a NumPy or CuPy view holds its base (the ledger counts the owner)
            owner = _owners.get(id(root))
            self._base = owner if owner is not None else StrictArray(root)

    # ---- the refusals -------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError(f"implicit conversion to a NumPy array is not allowed; {_HINT}")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} on a device array is not allowed: call backend.xp."
                        f"{func.__name__} (every compute path runs on backend.xp); {_HINT}")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if not builtins.any(isinstance(v, np.generic) for v in inputs):  # not ``np.float32(2) * x``: an np.<ufunc> call
            raise TypeError(f"numpy.{ufunc.__name__} on a device array is not allowed: call backend.xp."
                            f"{ufunc.__name__} (every compute path runs on backend.xp); {_HINT}")
        return _call(getattr(ufunc, method), inputs, kwargs, f"numpy.{ufunc.__name__}")

    def __iter__(self):
        raise TypeError(f"iterating over a device array is not allowed (one transfer per element); {_HINT}")

    def __reduce_ex__(self, protocol):
        raise TypeError("pickling a device array is an implicit host copy; pickle backend.to_host(x) instead")

    def _one(self, what: str):
        if self._a.size != 1:
            raise TypeError(f"only size-1 device arrays can be converted to Python {what} "
                            f"(got shape {self._a.shape}); {_HINT}")
        transfers["to_host"] += 1  # one element to the host: a device sync on a GPU, counted as a copy
        return self._a.reshape(())

    def __float__(self):
        return float(self._one("scalars"))

    def __int__(self):
        return int(self._one("scalars"))

    def __complex__(self):
        return complex(self._one("scalars"))

    def __bool__(self):
        if self._a.size != 1:
            raise ValueError(f"the truth value of a device array with {self._a.size} elements is ambiguous")
        return bool(self._one("bool"))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return "strict_" + repr(self._a)

    __str__ = __repr__

    # ---- explicit transfers -------------------------------------------------
    def get(self) -> np.ndarray:
        """A host copy (``numpy.ndarray``) of this array; counted in :data:`transfers`."""
        transfers["to_host"] += 1
        return self._a.copy()

    def set(self, host) -> None:
        """Copy the host array ``host`` (same shape) into this array; counted in :data:`transfers`."""
        transfers["to_device"] += 1
        self._a[...] = np.asarray(host)

    def item(self):
        """The one element as a Python scalar (an explicit sync, as ``cupy.ndarray.item``)."""
        return self._one("scalars").item()

    # ---- attributes ---------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: Flags(self._a.flags))
    T = property(lambda self: StrictArray(self._a.T))

    @property
    def data(self):
        """As ``cupy.ndarray.data`` (a ``MemoryPointer``) as far as NCCL needs it: ``.ptr``, the address
        of the first element."""
        return Pointer(self._a.__array_interface__["data"][0])

    @property
    def base(self):
        """The StrictArray owning this view's memory (kept alive by the view), or None when this array owns it."""
        return self._base

    def __copy__(self):
        return StrictArray(self._a.copy())

    def __deepcopy__(self, memo):
        return StrictArray(self._a.copy())

    # ---- indexing -----------------------------------------------------------
    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key, "indexing")])

    def __setitem__(self, key, value):
        self._a[_unwrap(key, "indexing")] = _unwrap(value, "assignment")

    # ---- methods (each the NumPy method on the wrapped array) ---------------
    def view(self, dtype):
        """A view with another dtype (``ndarray.view(dtype)``; array types are refused, and so is a view
        whose first element is not aligned to its dtype's size: a device faults on such loads)."""
        if isinstance(dtype, type) and issubclass(dtype, np.ndarray):
            raise TypeError(f"view as {dtype.__name__} is not allowed; {_HINT}")
        out = self._a.view(dtype)
        address = out.__array_interface__["data"][0]
        if out.size and address % out.dtype.itemsize:
            raise ValueError(f"a {out.dtype} view at byte address {address} is not {out.dtype.itemsize}-byte "
                             "aligned (an unaligned load faults on a GPU); lay the data out aligned")
        return StrictArray(out)

    def __getattr__(self, name):
        if name in _METHODS:
            method = getattr(self._a, name)

            def call(*args, **kwargs):
                check(name, (), kwargs, 0)
                result = method(*_unwrap(args, name), **_unwrap(kwargs, name))
                return self if result is self._a else _wrap(result)  # astype(copy=False): the same array
            return call
        raise AttributeError(f"a strict device array has no attribute {name!r}"
                             + (f"; {_HINT}" if name in ("tolist", "tobytes", "tofile") else ""))


_METHODS = frozenset("""astype reshape transpose swapaxes ravel flatten squeeze copy fill sum mean max min prod
    cumsum argmax argmin argsort sort std var any all clip dot nonzero round conj repeat take""".split())


def _binary(name):
    def op(self, other):
        return _wrap(getattr(self._a, name)(_unwrap(operand(other, name), "an operator")))
    op.__name__ = name
    return op


def _inplace(name):
    def op(self, other):
        getattr(self._a, name)(_unwrap(operand(other, name), "an operator"))
        return self
    op.__name__ = name
    return op


def _unary(name):
    def op(self):
        return _wrap(getattr(self._a, name)())
    op.__name__ = name
    return op


for _n in ("add sub mul truediv floordiv mod pow matmul and or xor lshift rshift "
           "lt le eq ne gt ge").split():
    setattr(StrictArray, f"__{_n}__", _binary(f"__{_n}__"))
    if _n not in ("lt", "le", "eq", "ne", "gt", "ge"):
        setattr(StrictArray, f"__r{_n}__", _binary(f"__r{_n}__"))
        setattr(StrictArray, f"__i{_n}__", _inplace(f"__i{_n}__"))
for _n in ("neg", "pos", "abs", "invert"):
    setattr(StrictArray, f"__{_n}__", _unary(f"__{_n}__"))


def _unwrap(x, where: str):
    """``x`` with every StrictArray replaced by its NumPy array (recursively). TypeError:
    a ``numpy.ndarray`` operand."""
    if isinstance(x, StrictArray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"a host numpy.ndarray {x.shape} in {where} with device arrays is not allowed; {_HINT}")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, where) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, where) for k, v in x.items()}
    return x


def _call(f, args, kwargs, where: str):
    """``f`` on the unwrapped operands; results wrapped, except that an ``out=`` array is returned as given."""
    result = f(*_unwrap(args, where), **_unwrap(kwargs, where))
    out = kwargs.get("out")
    if out is not None:
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    return _wrap(result)


def _root(a: np.ndarray) -> np.ndarray:
    """The ndarray at the end of ``a``'s ``.base`` chain: the one that owns the memory."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _wrap(x):
    """NumPy results as device arrays: ndarrays and NumPy scalars (as 0-d arrays, as CuPy returns).

    An owning ndarray that already has a wrapper gets that wrapper back: NumPy returned the same
    object (``ascontiguousarray`` of a contiguous array), and so does CuPy."""
    if isinstance(x, np.ndarray):
        known = _owners.get(id(x)) if x.base is None else None
        return known if known is not None else StrictArray(x)
    if isinstance(x, np.generic):
        return StrictArray(np.asarray(x))
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(v) for v in x)
    return x


# ---- the module namespace: what minizero calls as backend.xp.<name> --------------
ndarray = StrictArray


def asarray(a, dtype=None, order=None):
    """``a`` as a device array (``cupy.asarray``): host data copied and counted in :data:`transfers`.

    Raises TypeError: a list mixing device arrays with host values.
    """
    if isinstance(a, StrictArray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else StrictArray(a._a.astype(dtype))
    if _contains_device(a):
        raise TypeError("a list mixing device arrays with host values; build it with backend.xp.stack/concatenate")
    transfers["to_device"] += 1
    return StrictArray(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order=None):
    """As :func:`asarray`, but a device input is copied too (``cupy.array``)."""
    if isinstance(a, StrictArray):
        return StrictArray(np.array(a._a, dtype=dtype, copy=True, order=order or "K"))
    return asarray(a, dtype=dtype, order=order)


def _contains_device(a) -> bool:
    return isinstance(a, (list, tuple)) and builtins.any(isinstance(v, StrictArray) or _contains_device(v) for v in a)


class _Ufunc:
    """A NumPy ufunc on device arrays, with CuPy's methods only: ``outer`` on all, ``reduce``/``accumulate`` on
    add and multiply, ``reduceat`` on add, ``at`` on CuPy's scatter ops (``NotImplementedError`` otherwise)."""

    def __init__(self, ufunc):
        self._u = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        check(self.__name__, args, kwargs, len(args))
        return _call(self._u, args, kwargs, self.__name__)

    def _method(self, method: str, a):
        if self.__name__ not in UFUNC_METHODS.get(method, (self.__name__,)):
            raise NotImplementedError(f"xp.{self.__name__}.{method} is not in CuPy (it has {method} on "
                                      f"{', '.join(UFUNC_METHODS[method])} only)")
        if method != "outer" and not isinstance(a, StrictArray):
            raise TypeError(f"xp.{self.__name__}.{method} needs a device array, got {type(a).__name__}")

    def at(self, a, indices, b=None):
        """In-place unbuffered operation on ``a`` (``numpy.ufunc.at``)."""
        self._method("at", a)
        args = (_unwrap(indices, "ufunc.at"),) + (() if b is None else (_unwrap(b, "ufunc.at"),))
        self._u.at(a._a, *args)

    def __getattr__(self, method):
        if method not in ("reduce", "accumulate", "outer", "reduceat"):
            raise AttributeError(method)
        f = getattr(self._u, method)

        def call(a, *args, **kwargs):
            self._method(method, a)
            check("sum", (), kwargs, 0)  # CuPy's reduce is array.sum/prod: no initial=, no where=
            return _wrap(f(_unwrap(a, method), *_unwrap(args, method), **_unwrap(kwargs, method)))
        return call


def _function(name):
    f = getattr(np, name)
    every = name in EVERY_OPERAND

    def call(*args, **kwargs):
        check(name, args, kwargs, len(args) if every else 0 if name in NOT_ARRAY_FIRST else 1)
        return _call(f, args, kwargs, f"xp.{name}")
    call.__name__ = name
    call.__doc__ = f"``numpy.{name}`` on device arrays (host ndarray operands refused)."
    return call


for _n in UFUNCS:
    if hasattr(np, _n):
        globals()[_n] = _Ufunc(getattr(np, _n))
for _n in FUNCTIONS:
    globals()[_n] = _function(_n)

# dtypes, constants and dtype helpers: host objects, the same as NumPy's (as on CuPy)
for _n in ("bool_ dtype e finfo float16 float32 float64 iinfo inf int8 int16 int32 int64 nan newaxis pi promote_types "
           "result_type can_cast uint8 uint16 uint32 uint64 intp integer floating").split():
    globals()[_n] = getattr(np, _n)


def device_array(x) -> np.ndarray:
    """The NumPy array inside the device array ``x``, for a kernel that runs the NumPy code itself
    (``backend.matmul``); not a transfer, so not counted. Raises TypeError for anything else."""
    if not isinstance(x, StrictArray):
        raise TypeError(f"expected a strict device array, got {type(x).__name__}; {_HINT}")
    return x._a
