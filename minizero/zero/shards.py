"""ZeRO's bookkeeping: parameters grouped into flat units, and which rank owns which elements.

A unit is parameters end to end in one flat buffer, zero-padded to a multiple of N (FSDP's ``FlatParameter``);
rank r owns ``[r*S, (r+1)*S)``, S = padded / N (``shard_range``). ``--show-shards`` draws it::

    transformer.h.0: 3,280 elements (+0 padding), 820 per rank
      params  acccccccccccccccdeeeeegiiiiiiiiiiiiiiiiiiiijkkkkkkkkkkkkkkkkkkkk
      ranks   0000000000000000111111111111111122222222222222223333333333333333

Formulas: Rajbhandari et al., SC 2020 (arXiv:1910.02054), Figure 1 / section 5 and section 7.
"""
from __future__ import annotations

import dataclasses
import math
import textwrap

import numpy as np

from minizero import backend
from minizero.comm.collectives import shard_range
from minizero.nn.module import ModuleList
from minizero.nn.init import is_meta
from minizero.numerals import wrapped


# --------------------------------------------------------------------------- the shard map
def find_units(model, include=None):
    """``[(module_name, module, [(param_name, Parameter)])]``: ModuleList elements, other modules owning parameters.

    A shared parameter belongs to the first unit that reaches it (FSDP's transformer auto-wrap, generic).
    ``include``: a predicate on parameters (None: all); the others belong to no unit (expert parallelism
    shards the experts over another group: parallel/expert_parallel.py).
    """
    units, claimed = [], set()
    todo = [("", model, False)]  # (name, module, whole subtree?) in pre-order
    while todo:
        name, module, whole = todo.pop(0)
        prefix = f"{name}." if name else ""
        found = module.named_parameters() if whole else module.named_parameters(recurse=False, remove_duplicate=False)
        own = [(prefix + n, p) for n, p in found if id(p) not in claimed and (include is None or include(p))]
        if own:
            claimed.update(id(p) for _, p in own)
            units.append((name, module, own))
        if not whole:
            children = [(prefix + n, m, isinstance(module, ModuleList)) for n, m in module.named_children()]
            todo[:0] = children
    return units


@dataclasses.dataclass(frozen=True)
class Unit:
    """One flat buffer: parameters end to end (``offsets``), then zeros up to ``padded`` (a multiple of N)."""

    name: str
    param_names: tuple
    shapes: tuple
    offsets: tuple
    numel: int
    padded: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of parameter ``param`` (flat index) sit at ``[shard_lo, shard_lo + hi - lo)``
    of the owning rank's shard of unit ``unit`` (an index into ``ShardMap.units``)."""

    unit: int
    param: str
    ndim: int
    lo: int
    hi: int
    shard_lo: int

    @property
    def shard_slice(self) -> slice:  # where the piece sits in its owner's flat shard
        return slice(self.shard_lo, self.shard_lo + self.hi - self.lo)


class ShardMap:
    """Which rank owns which elements of which parameter (llm.c's ``offset, size``, per unit; :meth:`from_model`)."""

    def __init__(self, units, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}; allowed: >= 1")
        self.units, self.world_size = list(units), world_size

    @classmethod
    def from_model(cls, model, world_size: int, include=None) -> "ShardMap":
        """The shard map of ``model``'s units (:func:`find_units`, ``include``) over ``world_size`` ranks."""
        units = []
        for name, _, params in find_units(model, include):
            offsets, off = [], 0
            for _, p in params:
                offsets.append(off)
                off += p.size
            padded = -(-off // world_size) * world_size
            units.append(Unit(name, tuple(n for n, _ in params), tuple(p.shape for _, p in params),
                              tuple(offsets), off, padded))
        return cls(units, world_size)

    @property
    def numel(self) -> int:
        """Real parameter elements Ψ (a tied weight once)."""
        return sum(u.numel for u in self.units)

    @property
    def padded(self) -> int:
        """Elements including padding: what the flat buffers hold over all ranks."""
        return sum(u.padded for u in self.units)

    def shard(self, unit: int, rank: int) -> tuple[int, int]:
        """``(offset, size)`` of ``rank``'s slice of unit ``unit``'s flat buffer (``shard_range``)."""
        return shard_range(self.units[unit].padded, self.world_size, rank)

    def shard_numel(self, rank: int) -> int:
        """Elements ``rank`` owns over all units, padding included (= padded / N)."""
        return sum(self.shard(i, rank)[1] for i in range(len(self.units)))

    def pieces(self, rank: int, unit: int | None = None) -> list[Piece]:
        """The parameter pieces inside ``rank``'s shard (of one unit, or of all); padding is in none."""
        out = []
        for i, u in enumerate(self.units):
            if unit is not None and i != unit:
                continue
            s_off, s_size = self.shard(i, rank)
            for name, shape, off in zip(u.param_names, u.shapes, u.offsets):
                n = math.prod(shape)
                lo, hi = max(off, s_off), min(off + n, s_off + s_size)
                if lo < hi:
                    out.append(Piece(i, name, len(shape), lo - off, hi - off, lo - s_off))
        return out

    def flatten(self, unit: int, arrays: dict):
        """Unit ``unit``'s padded flat buffer built from ``arrays`` (param name -> array); a host array."""
        u = self.units[unit]
        flat = np.zeros(u.padded, dtype=np.result_type(*[np.asarray(arrays[n]).dtype for n in u.param_names]))
        for name, off in zip(u.param_names, u.offsets):
            a = np.asarray(backend.to_host(arrays[name])).reshape(-1)
            flat[off:off + a.size] = a
        return flat

    def format(self, ranks=None, width: int | None = None) -> str:
        """Text: one line per unit, then each rank's pieces as ``name[lo:hi]`` (flat element ranges), a unit's
        pieces wrapped at ``width`` columns when given (None: one line per unit)."""
        n = self.world_size
        first = (f"ZeRO shard map: {self.numel:,} parameters in {len(self.units)} flat units over N = {n} rank(s); "
                 f"{self.padded - self.numel} padding elements; each rank owns {self.shard_numel(0):,} elements")
        lines = [*(textwrap.wrap(first, width, subsequent_indent="  ") if width else [first]),
                 f"  {'unit':<28}{'elements':>10}{'padding':>9}{'per rank':>10}"]
        for u in self.units:
            lines.append(f"  {u.name:<28}{u.numel:>10,}{u.padded - u.numel:>9}{u.padded // n:>10,}")
        flat = "each piece name[lo:hi] below is name.reshape(-1)[lo:hi]: flat, row-major elements, not rows"
        lines += textwrap.wrap(flat, width, subsequent_indent="  ") if width else [flat]
        for r in (range(n) if ranks is None else ranks):
            lines.append(f"rank {r} owns:")
            for i in range(len(self.units)):
                pieces = self.pieces(r, i)
                text = " ".join(f"{p.param}[{p.lo}:{p.hi}]" for p in pieces) or "(padding only)"
                lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ",
                                       break_on_hyphens=False, break_long_words=False) if width else [f"  {text}"]
        return "\n".join(lines)

    def draw(self, width: int = 64) -> str:
        """ASCII picture of every unit: a letter per parameter ('.' = padding) above the owning rank's digit; a unit
        wider than ``width`` is scaled down, and a line names the parameters too small to get a column."""
        lines = []
        for u in self.units:
            cols = min(width, u.padded)
            ends = [off + math.prod(shape) for off, shape in zip(u.offsets, u.shapes)]
            params, ranks = "", ""
            for c in range(cols):
                e = c * u.padded // cols  # the first element this column stands for
                k = next((k for k, end in enumerate(ends) if u.offsets[k] <= e < end), None)
                params += "." if k is None else chr(ord("a") + k % 26)
                ranks += str(e // (u.padded // self.world_size) % 10)
            short = [n[len(u.name) + 1:] if u.name else n for n in u.param_names]
            lines += [f"{u.name}: {u.numel:,} elements (+{u.padded - u.numel} padding), "
                      f"{u.padded // self.world_size:,} per rank",
                      "  params  " + params, "  ranks   " + ranks,
                      wrapped("  " + ", ".join(f"{chr(ord('a') + k % 26)} = {n} {tuple(shape)}"
                                               for k, (n, shape) in enumerate(zip(short, u.shapes))))]
            hidden = [chr(ord("a") + k % 26) for k in range(len(u.shapes)) if chr(ord("a") + k % 26) not in params]
            if hidden:  # a column shows the parameter of its first element only
                lines.append(wrapped(f"  (scaled: 1 column = {u.padded / cols:.4g} elements; {', '.join(hidden)} "
                                     "are smaller and fall between columns; format() lists every range exactly)"))
        return "\n".join(lines)


# --------------------------------------------------------------------------- the owned shard
def owned_shard(params, offsets, lo: int, size: int, dtype):
    """Elements ``[lo, lo + size)`` of a unit's padded flat buffer, without the buffer: (size,) ``dtype``.

    Meta parameters draw only their overlap (``p.init.flat``), as DeepSpeed's ``zero.Init``; padding is zeros.
    """
    out = backend.xp.zeros(size, dtype)
    for p, off in zip(params, offsets):
        a, b = max(off, lo), min(off + p.size, lo + size)
        if a < b:
            src = p.init.flat(a - off, b - off) if is_meta(p.data) else p.data.reshape(-1)[a - off:b - off]
            out[a - lo:b - lo] = src
    return out


# --------------------------------------------------------------------------- formulas
def model_state_formula(stage: int, num_params: int, world_size: int, param_bytes: int = 4, grad_bytes: int = 4,
                        state_bytes: int = 8) -> dict:
    """Bytes per rank ``{"parameters", "gradients", "optimizer_state", "total"}`` for ZeRO ``stage`` (before padding).

    The ZeRO paper's Figure 1: stage 0 (P + G + K)Ψ; 1 (P + G + K/N)Ψ; 2 (P + (G + K)/N)Ψ; 3 (P + G + K)Ψ/N.
    Defaults P = G = 4, K = 8 (float32); the figure's own row: P = G = 2, K = 12. Raises ValueError: stage not 0-3.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}; allowed: 0, 1, 2, 3")
    n = world_size
    out = {"parameters": param_bytes * num_params / (n if stage >= 3 else 1),
           "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
           "optimizer_state": state_bytes * num_params / (n if stage >= 1 else 1)}
    out["total"] = sum(out.values())
    return out


def traffic_formula(stage: int, num_params: int, world_size: int, itemsize: int = 4, micro_batches: int = 1) -> float:
    """Bytes one rank sends per optimizer step for model states, M micro-batches, before padding (paper section 7).

    Stages 0-1: 2(N-1)/N; stage 2: (M+1)(N-1)/N; stage 3: 3M(N-1)/N of the parameter bytes.
    Raises ValueError: stage not 0-3.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}; allowed: 0, 1, 2, 3")
    one = (world_size - 1) / world_size * num_params * itemsize
    return {0: 2 * one, 1: 2 * one, 2: (micro_batches + 1) * one, 3: 3 * micro_batches * one}[stage]
