"""A manifest's model section, MoE layout fields and parameter shapes, checked against what train builds.

:func:`model_problems` (called by :func:`minizero.checkpoint.fields.manifest_problems`) returns one line per
problem: ``model`` holds only :class:`~minizero.nn.GPTConfig` fields, each as ``GPTConfig.validate`` allows; the
``layout.moe_*`` fields as train's ``check_moe`` allows; then every shape in ``params`` is the shape of that
parameter in the model they describe (a GPT built on 0-byte meta parameters, plus the MoE layers' router (C, E),
w1 (E, C, 4C) and w2 (E, 4C, C)), and no parameter is missing or extra.
"""
from __future__ import annotations

import dataclasses
import math

from minizero.nn import GPT, GPTConfig
from minizero.parallel.expert_parallel import MAX_EXPERTS, MOE_EVERY, MoEConfig

SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
DTYPES = ("float16", "float32", "float64")


def clipped(text, width: int = 80) -> str:
    """``str(text)`` whole if it fits in ``width`` columns, else cut at a space before them and ended by "..."."""
    text = " ".join(str(text).split())
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, width - 3)
    return (text[:cut] if cut > 0 else text[:width - 4]) + " ..."


def _is_int(v) -> bool:
    """An int, not a bool (JSON's true is not a count); fields.py uses it too."""
    return isinstance(v, int) and not isinstance(v, bool)


def model_problems(model: dict, layout: dict, params: dict) -> list[str]:
    """The model section, the MoE fields, then (both sound) the shapes in ``params``; see the module docstring."""
    out = _config_problems(model) + _moe_problems(layout)
    return out or _shape_problems(model, layout, params)


def _config_problems(model: dict) -> list[str]:
    known = [f.name for f in dataclasses.fields(GPTConfig)]
    out = [f"model.{k[:40]} is {repr(v)[:20]}, expected one of GPTConfig's fields ({', '.join(known)})"
           for k, v in model.items() if k not in known]
    out += [f"model.{k} is {repr(model.get(k))[:20]}, expected an integer >= 1" for k in SIZES
            if not _is_int(model.get(k)) or model[k] < 1]
    if "dropout" in model and not (isinstance(model["dropout"], (int, float)) and not isinstance(model["dropout"], bool)
                                   and 0 <= model["dropout"] < 1):  # NaN fails both comparisons
        out.append(f"model.dropout is {repr(model['dropout'])[:20]}, expected a number in [0, 1)")
    if model.get("dtype") not in DTYPES:
        out.append(f"model.dtype is {repr(model.get('dtype'))[:20]}, expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")
    if out or model["n_embd"] % model["n_head"]:
        return out or [f"model.n_head {model['n_head']} does not divide model.n_embd {model['n_embd']}"]
    try:  # anything validate refuses that the lines above do not name
        GPTConfig(**model).validate()
    except (TypeError, ValueError) as e:
        return [f"model is {repr(model)[:60]}: {clipped(e)}"]
    return []


def _moe_problems(layout: dict) -> list[str]:
    """``layout.moe_experts`` (absent: 0, dense) in 0..MAX_EXPERTS; with experts, top_k in 1..E, a finite
    capacity factor > 0 and ``moe_every`` one of train's choices (the first bad field named)."""
    e = layout.get("moe_experts", 0)
    if not (_is_int(e) and 0 <= e <= MAX_EXPERTS):
        return [f"layout.moe_experts is {repr(e)[:20]}, expected an integer in 0..{MAX_EXPERTS} (0: dense MLPs)"]
    if not e:
        return []
    shown = {k: repr(layout[k])[:20] if k in layout else "missing" for k in
             ("moe_top_k", "moe_capacity_factor", "moe_every")}
    k, cf, every = (layout.get(k) for k in ("moe_top_k", "moe_capacity_factor", "moe_every"))
    if not (_is_int(k) and 1 <= k <= e):
        return [f"layout.moe_top_k is {shown['moe_top_k']}, expected an integer in 1..{e} (layout.moe_experts)"]
    if not (isinstance(cf, (int, float)) and not isinstance(cf, bool) and 0 < cf < math.inf):
        return [f"layout.moe_capacity_factor is {shown['moe_capacity_factor']}, expected a finite number > 0"]
    if not (_is_int(every) and every in MOE_EVERY):
        return [f"layout.moe_every is {shown['moe_every']}, expected one of {', '.join(map(str, MOE_EVERY))}"]
    return []


def expected_shapes(model: dict, layout: dict) -> dict:
    """``{logical name: shape}`` of every parameter the (checked) model section and MoE fields describe; no memory."""
    cfg = GPTConfig(**model)
    gpt, seen, shapes = GPT(cfg, meta=True), set(), {}
    e = layout.get("moe_experts", 0)
    moe = set(MoEConfig(e, layout["moe_top_k"], layout["moe_capacity_factor"], layout["moe_every"]).layers(
        cfg.n_layer)) if e else set()
    c, h = cfg.n_embd, 4 * cfg.n_embd
    for name, p in gpt.named_parameters(remove_duplicate=False):
        if id(p) in seen or any(name.startswith(f"transformer.h.{i}.mlp.") for i in moe):
            continue
        seen.add(id(p))
        shapes[name] = list(p.data.shape)
    for i in sorted(moe):
        shapes.update({f"transformer.h.{i}.mlp.moe.router": [c, e], f"transformer.h.{i}.mlp.moe.w1": [e, c, h],
                       f"transformer.h.{i}.mlp.moe.w2": [e, h, c]})
    return shapes


def _shape_problems(model: dict, layout: dict, params: dict) -> list[str]:
    """The layer count first (building a model of 10**9 layers would take for ever), then every shape, one line."""
    layers = sum(1 for k in params if k.startswith("transformer.h.") and k.endswith(".ln_1.weight"))
    if layers != model["n_layer"]:
        return [f"model.n_layer is {model['n_layer']}, but params holds {layers} layer(s)"]
    try:  # sizes past what an array's shape can hold (NumPy: "Maximum allowed dimension exceeded")
        want = expected_shapes(model, layout)
    except (ValueError, OverflowError, MemoryError) as e:
        sizes = ", ".join(f"{k} {model[k]:,}" for k in SIZES)
        return [f"model has {sizes}: too large for its arrays to exist ({clipped(e, 60)}); expected the saved sizes"]
    say = "as the model section" + (" and layout.moe_* say" if layout.get("moe_experts") else " says")
    bad = [n for n in want if n in params and (params[n].get("shape") if isinstance(params[n], dict) else None)
           != want[n]]
    missing, extra = [n for n in want if n not in params], [n for n in params if n not in want]
    more = len(bad) + len(missing) + len(extra) - 1
    tail = f"; and {more} more parameter(s) disagree" if more > 0 else ""
    if bad:
        n = bad[0]
        got = params[n].get("shape") if isinstance(params[n], dict) else params[n]
        return [f"params[{n[:60]!r}].shape is {repr(got)[:40]}, expected {want[n]} ({say}){tail}"]
    if missing:
        return [f"params lacks {missing[0][:60]!r} of shape {want[missing[0]]} ({say}){tail}"]
    if extra:
        return [f"params[{extra[0][:60]!r}] is not a parameter of the model ({say}){tail}"]
    return []
