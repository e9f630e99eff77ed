"""A manifest's training state (loss scaler, pruning, each rank's rng, FP8 histories, routing biases): fields.py's
checks, one line a problem."""
from __future__ import annotations

import math
import sys

from minizero.checkpoint.model_fields import _is_int
from minizero.memory.precision import SCALE_RANGE
from minizero.memory.sparsity import SCOPES
from minizero.optim.adam8bit import MAX_BLOCK_SIZE as MAX_ADAM8BIT_BLOCK


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_finite(v) -> bool:
    """A number within float's range: not inf, not NaN, not a JSON integer past it (math.isfinite would raise
    OverflowError there; an int compares with a float exactly)."""
    return is_number(v) and abs(v) <= sys.float_info.max


#: the loss scaler's state (memory/precision.py ``DynamicLossScaler.state_dict``): its counts, besides the scale,
#: then the counts a checkpoint may leave out (0)
SCALER_COUNTS = ("good_steps", "skipped", "hysteresis_left")
SCALER_OPTIONAL = ("consecutive_skips", "skips_at_min")


def shown(section: dict, key: str, width: int = 40) -> str:
    """``section[key]`` as a message shows it (cut to ``width``), or "missing"."""
    return repr(section[key])[:width] if key in section else "missing"


def scaler_problems(sc) -> list[str]:
    """FP16's loss scaler: null (absent), or the scale (a finite number > 0) and its counts (integers >= 0);
    the first bad field is named."""
    if sc is None:
        return []
    if not isinstance(sc, dict):
        return [f"scaler is {str(sc)[:60]}, expected null or {{'scale': a finite number > 0, "
                f"{', '.join(repr(k) for k in SCALER_COUNTS)}: integers >= 0}} (FP16's loss scaler)"]
    if not (is_number(sc.get("scale")) and 0 < sc["scale"] < math.inf):
        return [f"scaler.scale is {shown(sc, 'scale')}, expected a finite number > 0 (FP16's loss scale)"]
    if not SCALE_RANGE[0] <= sc["scale"] <= SCALE_RANGE[1]:
        return [f"scaler.scale is {shown(sc, 'scale')}, expected a number in [2**-24, 2**64] (the loss scales "
                "DynamicLossScaler can hold, memory/precision.py)"]
    for k in SCALER_COUNTS + SCALER_OPTIONAL:
        v = sc.get(k, 0 if k in SCALER_OPTIONAL else None)
        if not (_is_int(v) and v >= 0):
            return [f"scaler.{k} is {shown(sc, k)}, expected an integer >= 0 (a count of FP16's loss scaler)"]
    return []


def pruning_problems(pr, names: set) -> list[str]:
    """The pruning masks' section: absent or null, or ``{"sparsity" in [0, 1), "scope", "shapes": {name: [sizes]},
    "file"}`` with ``file`` one of the checked files entries (its masks are read from there on resume); the first
    bad field is named."""
    if pr is None:
        return []
    if not isinstance(pr, dict):
        return [f"pruning is {str(pr)[:60]}, expected null or {{'sparsity': a number in [0, 1), 'scope': "
                f"{' or '.join(SCOPES)}, 'shapes': {{name: [sizes]}}, 'file': one of the files entries}}"]
    if not (is_number(pr.get("sparsity")) and 0 <= pr["sparsity"] < 1):
        return [f"pruning.sparsity is {shown(pr, 'sparsity')}, expected a number in [0, 1)"]
    if pr.get("scope") not in SCOPES:
        return [f"pruning.scope is {shown(pr, 'scope')}, expected {' or '.join(map(repr, SCOPES))}"]
    if not (isinstance(pr.get("file"), str) and pr["file"] in names):
        return [f"pruning.file is {shown(pr, 'file', 60)}, expected one of the files entries (the masks' file)"]
    if not isinstance(pr.get("shapes"), dict):
        return [f"pruning.shapes is {shown(pr, 'shapes')}, expected {{parameter name: [sizes]}}"]
    for name, shape in pr["shapes"].items():
        if not (isinstance(shape, list) and all(_is_int(d) and d > 0 for d in shape)):
            return [f"pruning.shapes[{name[:60]!r}] is {shape!r:.40}, expected a list of sizes >= 1"]
    return []


def _bad_number(values, n: int | None = None) -> str | None:
    """Why ``values`` is not a non-empty list of finite numbers (of length ``n`` when given), or None."""
    if not isinstance(values, list) or not values:
        return f"is {values!r:.40}, expected a non-empty list of finite numbers"
    if n is not None and len(values) != n:
        return f"has {len(values)} numbers, expected {n} (layout.moe_experts)"
    bad = next((v for v in values if not is_finite(v)), None)
    return None if bad is None and all(is_number(v) for v in values) else f"holds {bad!r:.30}, expected finite numbers"


def saved_state_problems(entry: dict, experts) -> list[str]:
    """A rank's FP8 amax histories and MoE routing biases by layer name (absent: none saved), as
    ``memory.fp8.fp8_state`` and ``parallel.expert_parallel.routing_state`` write them; the first bad one named.
    (An FP8 history that recorded an overflow holds inf: such a run's weights are refused as non-finite too.)"""
    fp8, routing = entry.get("fp8", {}), entry.get("routing", {})
    if not isinstance(fp8, dict):
        return [f"fp8 is {str(fp8)[:60]}, expected {{layer name: {{'x' | 'w' | 'g': [finite numbers]}}}} (FP8's "
                "amax histories)"]
    for layer, h in fp8.items():
        if not (isinstance(h, dict) and h):
            return [f"fp8[{layer[:60]!r}] is {h!r:.40}, expected {{'x' | 'w' | 'g': [finite numbers]}}"]
        for k, v in h.items():
            why = f"has key {k!r:.20}, expected 'x', 'w' or 'g'" if k not in ("x", "w", "g") else _bad_number(v)
            if why:
                return [f"fp8[{layer[:60]!r}]" + (f" {why}" if k not in ("x", "w", "g") else f"[{k!r}] {why}")]
    if not isinstance(routing, dict):
        return [f"routing is {str(routing)[:60]}, expected {{layer name: [finite numbers, one per expert]}} "
                "(MoE's routing biases)"]
    n = experts if _is_int(experts) and experts > 0 else None
    for layer, biases in routing.items():
        why = _bad_number(biases, n)
        if why:
            return [f"routing[{layer[:60]!r}] {why} (MoE's routing biases)"]
    return []


def _same_numbers(a, b) -> bool:  # a == b, but NaN equals NaN (two float("nan") objects compare unequal)
    return a == b or isinstance(a, list) and isinstance(b, list) and len(a) == len(b) \
        and all(x == y or x != x and y != y for x, y in zip(a, b))


def routing_problems(man: dict) -> list[str]:
    """Every MoE layer (a ``.moe.router`` in the checked ``params``) has its routing biases in some files entry (a
    rank saves its stage's layers; resume sets them by name and stops after the model is built when one lacks),
    the same biases in each entry that holds them (one state, every rank's copy; resume took the last)."""
    layers = sorted(n[:-len(".router")] for n in man["params"] if n.endswith(".moe.router"))
    first = {}  # layer -> the index of the first files entry holding it
    for i, f in enumerate(man["files"]):
        for name, biases in (f["routing"] if isinstance(f.get("routing"), dict) else {}).items():
            j = first.setdefault(name, i)
            if not _same_numbers(biases, man["files"][j]["routing"][name]):  # a NaN is the entry check's to report
                return [f"files[{i}].routing[{name[:60]!r}] differs from files[{j}]'s, expected one state in every "
                        "file (MoE's routing biases: each rank saves its copy)"]
    lack = [n for n in layers if n not in first]
    if not lack:
        return []
    return [f"files hold no routing biases of {', '.join(repr(n[:60]) for n in lack[:3])}"
            f"{', ...' if len(lack) > 3 else ''}, expected every MoE layer's (save writes them in its ranks' entries)"]


#: the manifest's numbers that no other check reads, as train's checks bound its flags: (section, key) -> (kind, least,
#: most); "number" may be inf (--grad-clip). Absent (an older save) passes: resume compares and shows only those present
NUMBERS = {("layout", "micro_batch_size"): ("integer", 1, None), ("layout", "grad_accum"): ("integer", 1, None),
           ("layout", "adam8bit_block_size"): ("integer", 1, MAX_ADAM8BIT_BLOCK),
           ("train", "steps"): ("integer", 1, None), ("train", "warmup"): ("integer", 0, None),
           ("train", "batch_size"): ("integer", 1, None), ("train", "min_lr"): ("finite number", 0, None),
           ("train", "weight_decay"): ("finite number", 0, None), ("train", "grad_clip"): ("number", 0, None),
           **{("train", k): ("finite number", 0, None) for k in ("moe_aux_loss", "moe_z_loss", "moe_bias_update")},
           ("data", "seed"): ("integer", 0, None), ("data", "global_batch"): ("integer", 1, None),
           ("data", "block_size"): ("integer", 1, None)}


def number_problems(man: dict) -> list[str]:
    """Each of :data:`NUMBERS` present: of its kind, in its range (a forged micro_batch_size 0 passed)."""
    out = []
    for (section, key), (kind, least, most) in NUMBERS.items():
        part = man.get(section)
        if not isinstance(part, dict) or key not in part:
            continue
        v = part[key]
        typed = _is_int(v) if kind == "integer" else is_finite(v) or kind == "number" and is_number(v)
        if not (typed and least <= v <= (math.inf if most is None else most)):
            out.append(f"{section}.{key} is {shown(part, key)}, expected {'an' if kind == 'integer' else 'a'} {kind} "
                       + (f">= {least}" if most is None else f"in {least}..{most:,}"))
    return out


def data_problems(man: dict) -> list[str]:
    """The data section (absent in older saves): a JSON object whose ``text`` (resume compares it) is null or the
    string save writes."""
    if "data" not in man:
        return []
    data = man["data"]
    if not isinstance(data, dict):
        return [f"data is {str(data)[:40]}, expected a JSON object {{'seed', 'global_batch', 'block_size', 'text'}}"]
    if not (data.get("text") is None or isinstance(data["text"], str)):
        return [f"data.text is {shown(data, 'text')}, expected null or a string (the training text's bytes and "
                "SHA-256)"]
    return []


def rng_problem(rng) -> str | None:
    """A rank's dropout generator state: ``{"key", "offset"}`` ints in [0, 2**64); absent or an earlier
    checkpoint's NumPy PCG64 state (a dict without ``key``) is re-seeded instead (load.py)."""
    if rng is None or isinstance(rng, dict) and "key" not in rng:
        return None
    if not (isinstance(rng, dict) and all(_is_int(rng.get(k)) and 0 <= rng[k] < 2 ** 64 for k in ("key", "offset"))):
        return f"rng is {str(rng)[:60]}, expected {{'key': int, 'offset': int}} in [0, 2**64)"
    return None
