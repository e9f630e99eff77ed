"""Reading a trained GPT back: ``OUT/model.npz`` (nanoGPT state_dict names) and the shape it needs.

Loaded with ``allow_pickle=False``; the config by one rule for every program (:func:`model_config`): ``--model``,
else ``model.json`` beside the weights, else ``summary.json``'s config.model, else the preset of the arrays' shapes.
Both files' fields are checked in one place (:func:`check_model_fields`), a split pair first (:mod:`.saved_model`).
Errors name the file and what was expected.
"""
from __future__ import annotations

import dataclasses
import os
import tokenize
import zipfile
import zlib

import numpy as np

from minizero import backend
from minizero.autograd.rng import MAX_DROPOUT
from minizero.data import describe_non_file
from minizero.files import read_json
from minizero.nn import GPT, PRESETS, GPTConfig, get_config
from minizero.saved_model import SHAPE_FIELDS, SIDECAR, check_pair

SUMMARY = "summary.json"  #: a training run's summary beside its model.npz (config.model: the GPT config)


def _not_weights(weights: str, why: str) -> ValueError:
    return ValueError(f"--weights {weights!r} is not a model.npz written by minizero.train ({why})")


def too_large(dims: dict) -> str | None:
    """Why ``dims`` is a GPT larger than the largest preset train builds (:data:`minizero.nn.PRESETS`), or None."""
    for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        v, cap = dims.get(field), max(getattr(cfg, field) for cfg in PRESETS.values())
        if isinstance(v, int) and v > cap:
            return f"{field} {v:,} exceeds {cap:,}, the largest any preset (--model {', '.join(sorted(PRESETS))}) has"
    return None


class _Header:
    """An array's shape and dtype as its .npy header declares them (no data read)."""
    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)


def _check_headers(weights: str) -> None:
    """Refuse, from the zip and .npy headers only, an archive that is not a GPT within the largest preset."""
    try:
        with zipfile.ZipFile(weights) as zf:
            heads = {}
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    raise _not_weights(weights, f"member {info.filename!r} is not an .npy array")
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(f)
                    offset = f.tell()
                name = info.filename[:-4]
                if dtype.kind not in "fiu" or dtype.hasobject:
                    raise _not_weights(weights, f"array {name!r} has dtype {dtype}, not a number type")
                declared = offset + int(np.prod(shape, dtype=object)) * dtype.itemsize
                if declared != info.file_size:
                    raise _not_weights(weights, f"array {name!r}: header {shape} {dtype} needs {declared:,} bytes "
                                                f"but the archive member holds {info.file_size:,}")
                heads[name] = _Header(shape, dtype)
            comment = zf.comment
    except (ValueError, SyntaxError, tokenize.TokenError) as e:  # NumPy's header parser raises all three
        if str(e).startswith("--weights"):
            raise
        why = str(e).splitlines()[0] if isinstance(e, ValueError) else "not the dictionary an .npy header holds"
        raise _not_weights(weights, f"unreadable array header: {why}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _not_weights(weights, f"unreadable or truncated archive: {type(e).__name__}: {e}") from None
    if not heads:
        raise _not_weights(weights, "the archive holds no arrays")
    dims = shape_from_state(heads, weights)
    if why := too_large(dims):
        raise _not_weights(weights, f"in the array headers, {why}")
    side = read_sidecar(weights)
    check_pair(weights, comment, side)  # before the shapes: a split pair is named as one
    clash = [f"{k} {side[k]} vs {v}" for k, v in dims.items() if side and k in side and side[k] != v]
    if clash:
        raise ValueError(f"model.json beside --weights {weights!r} disagrees with the array headers: "
                         f"{', '.join(clash)}")


def read_weights(weights: str) -> dict:
    """{name: float array} from the .npz ``weights`` (``allow_pickle=False``). Raises FileNotFoundError: no such
    file; ValueError: not an .npz of numeric arrays, or NaN/inf (tensor named)."""
    what = describe_non_file(weights)
    if what == ": no such file":
        raise FileNotFoundError(f"--weights {weights!r}: no such file (write one with python -m minizero.train)")
    if what:
        raise ValueError(f"--weights {weights!r}{what}; give the model.npz written by python -m minizero.train")
    if os.path.getsize(weights) == 0:
        raise _not_weights(weights, "the file is empty")
    _check_headers(weights)
    try:
        loaded = np.load(weights, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise _not_weights(weights, "a single .npy array, not an .npz archive")
        with loaded as z:
            state = {k: z[k] for k in z.files}
    except ValueError as e:
        if str(e).startswith("--weights"):
            raise
        raise _not_weights(weights, "not an .npz archive; it is never loaded with pickle") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _not_weights(weights, f"unreadable or truncated archive: {type(e).__name__}: {e}") from None
    if not state:
        raise _not_weights(weights, "the archive holds no arrays")
    for k, v in state.items():
        if v.dtype.kind not in "fiu":
            raise _not_weights(weights, f"array {k!r} has dtype {v.dtype}, not a number type")
        if v.dtype.kind == "f":
            bad = ~np.isfinite(v)
            if bad.any():
                raise ValueError(f"--weights {weights!r}: tensor {k!r} has {int(bad.sum())} non-finite value(s) "
                                 f"(NaN or inf) of {v.size}; sampling, quantizing and fine-tuning need finite weights")
    return state


def expected_shapes(n_layer: int, n_embd: int, block_size: int, vocab_size: int) -> dict:
    """{name: shape} of minizero's GPT (nanoGPT names, without the tied ``lm_head.weight``); no head count needed."""
    c, t, v = n_embd, block_size, vocab_size
    want = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (t, c),
            "transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        want.update({h + "ln_1.weight": (c,), h + "ln_1.bias": (c,), h + "attn.c_attn.weight": (3 * c, c),
                     h + "attn.c_attn.bias": (3 * c,), h + "attn.c_proj.weight": (c, c),
                     h + "attn.c_proj.bias": (c,), h + "ln_2.weight": (c,), h + "ln_2.bias": (c,),
                     h + "mlp.c_fc.weight": (4 * c, c), h + "mlp.c_fc.bias": (4 * c,),
                     h + "mlp.c_proj.weight": (c, 4 * c), h + "mlp.c_proj.bias": (c,)})
    return want


def _shapes(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items() if k != "lm_head.weight"}


def infer_preset(state: dict) -> str | None:
    """The preset whose parameter names and shapes match ``state`` exactly, or None."""
    shapes = _shapes(state)
    for name in sorted(PRESETS):
        cfg = PRESETS[name]
        if shapes == expected_shapes(cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size):
            return name
    return None


class MoEWeights(ValueError):
    """A mixture-of-experts model.npz, which sample, quantize and finetune refuse (each adds its own advice)."""


def shape_from_state(state: dict, weights: str = "weights") -> dict:
    """``{n_layer, n_embd, block_size, vocab_size}`` from the arrays' shapes; ValueError: not minizero's GPT."""
    wte, wpe = state.get("transformer.wte.weight"), state.get("transformer.wpe.weight")
    if wte is None or wpe is None or wte.ndim != 2 or wpe.ndim != 2:
        raise _not_weights(weights, "no 2-D transformer.wte.weight and transformer.wpe.weight arrays")
    n_layer = 0
    while f"transformer.h.{n_layer}.ln_1.weight" in state:
        n_layer += 1
    dims = dict(n_layer=n_layer, n_embd=int(wte.shape[1]), block_size=int(wpe.shape[0]), vocab_size=int(wte.shape[0]))
    want, have = expected_shapes(**dims), _shapes(state)
    moe = sorted(k for k in have if ".mlp.moe." in k)
    if moe:  # router and experts are not a dense GPT's: say so rather than 'names differ'
        raise MoEWeights(f"--weights {weights!r} holds a mixture-of-experts model ({moe[0]!r}, ...); this program "
                         "reads dense GPT weights only: train without --moe-experts for them")
    if n_layer == 0 or want != have:
        diff = sorted(set(want) ^ set(have)) or [k for k in sorted(want) if want[k] != have[k]]
        first = diff[0] if diff else "transformer.h.0.ln_1.weight"
        raise _not_weights(weights, f"names or shapes differ from a GPT of {n_layer} layer(s), width "
                                    f"{dims['n_embd']}: first {first!r}")
    if "lm_head.weight" in state and state["lm_head.weight"].shape != wte.shape:
        raise _not_weights(weights, f"lm_head.weight {state['lm_head.weight'].shape} is not wte's {wte.shape}")
    return dims


def _kind(v) -> str:
    return {bool: "true/false", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(v), type(v).__name__)


def check_model_fields(cfg, path: str, where: str = "") -> dict:
    """``cfg`` (a model config read from ``path``: model.json, or the section ``where`` of summary.json)
    if every field is a :class:`GPTConfig` field of its type and range, else ValueError naming the file, the field,
    the value and what is allowed. Fields may be missing (the arrays and the preset fill them); none may be extra.
    Allowed: sizes integers in [1, the largest preset's] (JSON numbers, not strings), ``n_embd`` divisible by
    ``n_head``, ``dropout`` a number in [0, 1), ``dtype`` one of :data:`minizero.backend.DTYPES` (the float dtypes
    minizero trains and stores in).
    """
    def bad(why: str) -> ValueError:
        return ValueError(f"{path!r} (beside --weights): {why}; fix or remove it")
    if not isinstance(cfg, dict):
        raise bad(f"{where or 'the file'} is {_kind(cfg)}, not a JSON object of model fields")
    where = f"{where}'s " if where else ""
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    if unknown := sorted(set(cfg) - set(fields)):
        raise bad(f"{where}unknown field(s) {unknown}; allowed: {', '.join(fields)}")
    for f in SHAPE_FIELDS:
        v, cap = cfg.get(f), max(getattr(c, f) for c in PRESETS.values())
        if f in cfg and (type(v) is not int or v < 1):
            raise bad(f"{where}{f} {v!r} is {_kind(v) if type(v) is not int else 'below 1'}; allowed: an integer "
                      f"in [1, {cap:,}] (a JSON number, no quotes)")
        if f in cfg and too_large({f: v}):
            raise bad(f"{where}{too_large({f: v})}")
    if "n_embd" in cfg and "n_head" in cfg and cfg["n_embd"] % cfg["n_head"]:
        raise bad(f"{where}n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}; allowed: n_head "
                  f"dividing n_embd")
    v = cfg.get("dropout", 0.0)
    if type(v) not in (int, float) or not 0 <= v <= MAX_DROPOUT:
        raise bad(f"{where}dropout {v!r} is not allowed; allowed: a number in [0, 1), at most {MAX_DROPOUT:.8g} in "
                  "float32 (the masks compare float32(p))")
    v = cfg.get("dtype", "float32")
    if not isinstance(v, str) or v not in backend.DTYPES:
        raise bad(f"{where}dtype {v!r} is not allowed; allowed: {', '.join(sorted(backend.DTYPES))} (the float "
                  f"dtypes minizero trains and stores weights in)")
    return cfg


_NONE = object()  #: no such file (a file holding JSON null is not "no file")


def _read_beside(weights: str, name: str):
    """(path, JSON value) of the file ``name`` beside ``weights``, or (path, :data:`_NONE`) when there is none."""
    path = os.path.join(os.path.dirname(os.path.abspath(weights)), name)
    if not os.path.isfile(path):
        return path, _NONE
    try:
        return path, read_json(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path!r} (beside --weights) is not a file minizero.train writes ({e}); "
                         f"fix or remove it") from None


def read_sidecar(weights: str) -> dict | None:
    """The GPT config in ``model.json`` beside ``weights`` (checked by :func:`check_model_fields`), or None."""
    path, cfg = _read_beside(weights, SIDECAR)
    return None if cfg is _NONE else check_model_fields(cfg, path)


def _clash(a: dict, b: dict, fields) -> list:
    return [f"{k} {a[k]!r} vs {b[k]!r}" for k in fields if k in a and k in b and a[k] != b[k]]


def model_config(weights: str, state: dict, preset: str | None = None,
                 flag: str | None = None) -> tuple[GPTConfig, str, dict, str | None]:
    """(the :class:`GPTConfig` of ``state`` read from ``weights``, where it came from, summary.json's dict or {},
    a note saying why summary.json was set aside or None).
    The one rule every program that reads a model.npz follows (sample, quantize, finetune):

    1. ``preset`` (a program's ``--model``) when given; refused when the arrays or model.json disagree.
    2. else ``model.json`` beside the weights, refused when it disagrees with the arrays. It wins over summary.json,
       which may be another run's (one stopped between writing the weights and the summary, or a copy).
    3. else summary.json's ``config.model`` (a run's folder without model.json).
    4. else the preset whose names and shapes match the arrays exactly (only the head count is not in them).
    model.json's fields are checked (:func:`check_model_fields`); summary.json is never fatal: one that is not a
    run's summary, has no valid ``config.model``, or whose sizes contradict the arrays or the config chosen is set
    aside ({} returned, with the note). The dtype is the arrays' (an FP16 run's weights are float16).
    ``flag``: the caller's ``--model`` flag, named in the advice (None: the program has none).
    Raises ValueError naming the file, the field and both values; or no way to know the head count.
    """
    dims, dtype = shape_from_state(state, weights), stored_dtype(state)
    side_path, side = os.path.join(os.path.dirname(os.path.abspath(weights)), SIDECAR), read_sidecar(weights)
    if side is not None:
        if "n_head" not in side:  # the one size the arrays cannot tell: never a default's
            raise ValueError(f"{side_path!r} (beside --weights) has no n_head, the head count the arrays do not "
                             f"hold; add it (\"n_head\": an integer dividing n_embd {dims['n_embd']})")
        clash = _clash(side, dict(dims, dtype=dtype), list(dims) + ["dtype"])
        if clash:
            raise ValueError(f"{side_path!r} disagrees with the arrays of --weights {weights!r}: {', '.join(clash)}; "
                             f"fix or remove it")
    summary_path = os.path.join(os.path.dirname(os.path.abspath(weights)), SUMMARY)
    summary, run_cfg, note = None, None, None
    try:
        summary = _read_beside(weights, SUMMARY)[1]
        summary = None if summary is _NONE else summary if summary is not None else {}  # null: no config.model
        run_cfg = summary.get("config").get("model") if isinstance(summary, dict) and isinstance(
            summary.get("config"), dict) else None
        if summary is not None and run_cfg is None:
            raise ValueError("it has no config.model section")
        if run_cfg is not None:
            check_model_fields(run_cfg, summary_path, "config.model")
            if "n_head" not in run_cfg:
                raise ValueError("its config.model has no n_head")
            clash = _clash(run_cfg, dims, dims)
            if clash:
                raise ValueError(f"its config.model disagrees with the arrays: {', '.join(clash)}")
    except ValueError as e:
        summary, run_cfg, note = None, None, f"{summary_path!r} set aside: {e}"
    advice = f"write {SIDECAR} with n_head beside the weights" + (f", or pass {flag}" if flag else "")
    if preset is not None:
        cfg, source = get_config(preset, dtype=dtype), f"{flag or '--model'} {preset}"
        clash = _clash(dataclasses.asdict(cfg), dict(dims, **(side or {})), SHAPE_FIELDS)
        if clash:
            whose = f"{side_path!r} and the arrays" if side else "the arrays"
            raise ValueError(f"{source} disagrees with {whose} of --weights {weights!r}: {', '.join(clash)}; drop "
                             f"{flag or '--model'}{_looks_like(state)}")
    elif side is not None:
        cfg, source = get_config("default", **dict(side, **dims, dtype=dtype)), side_path
    elif run_cfg is not None:
        cfg, source = get_config("default", **dict(run_cfg, **dims, dtype=dtype)), summary_path
    elif infer_preset(state) is not None:
        cfg, source = get_config(infer_preset(state), dtype=dtype), f"the {infer_preset(state)!r} preset's shapes"
    else:
        files = f"no {SIDECAR} beside it ({note})" if note else f"no {SIDECAR} or {SUMMARY} beside it"
        raise ValueError(f"--weights {weights!r}: {files} and no preset has these shapes ({dims['n_layer']} layers, "
                         f"width {dims['n_embd']}, context {dims['block_size']}), so the head count is unknown; "
                         f"{advice}")
    if run_cfg is not None and _clash(dataclasses.asdict(cfg), run_cfg, SHAPE_FIELDS):
        summary, note = None, (f"{summary_path!r} set aside: its config.model disagrees with {source}: "
                               f"{', '.join(_clash(run_cfg, dataclasses.asdict(cfg), SHAPE_FIELDS))}")
    return cfg, source, summary or {}, note


def config_for(weights: str, state: dict) -> GPTConfig:
    """The :class:`GPTConfig` of ``state`` (from ``weights``), by :func:`model_config`'s rule."""
    return model_config(weights, state)[0]


def load_gpt(weights: str) -> GPT:
    """The GPT in ``weights`` (model.npz), in its dtype; raises as :func:`read_weights`, :func:`load_trained`."""
    return load_trained(weights, None, read_weights(weights))[0]


def stored_dtype(state: dict) -> str:
    """NumPy name of the floating dtype the arrays are stored in (``"float16"`` after an FP16 run), else float32."""
    kinds = [v.dtype for v in state.values() if v.dtype.kind == "f"]
    return np.dtype(kinds[0]).name if kinds else "float32"


def _looks_like(state: dict) -> str:
    guess = infer_preset(state)
    return f" (these weights look like the {guess!r} preset)" if guess else ""


def load_trained(weights: str, preset: str | None = None, state: dict | None = None, flag: str | None = None,
                 notes: list | None = None):
    """(model, summary dict or {}) from ``weights`` (``state``: its arrays, when already read); the config by
    :func:`model_config`'s rule, ``preset`` being the program's ``flag`` (its ``--model``; None: it has none).
    ``notes``: a list that gets model_config's note, when summary.json was set aside.

    Raises FileNotFoundError: no weights file; ValueError: not a minizero .npz, integer arrays, a bad model.json or
    summary.json, no shape, or weights that do not fit the shape (file, first names and ``--model`` named).
    """
    state = read_weights(weights) if state is None else state
    ints = sorted(k for k, v in state.items() if v.dtype.kind != "f")
    if ints:  # a GPT computes in floating point; integers would be cast silently (truncated values) and used
        raise _not_weights(weights, f"array {ints[0]!r} has dtype {state[ints[0]].dtype}; sampling, quantizing and "
                                    "fine-tuning need float16, float32 or float64 weights")
    cfg, source, summary, note = model_config(weights, state, preset, flag)
    if note and notes is not None:
        notes.append(note)
    wte = state["transformer.wte.weight"]  # the tied head: the embedding matrix under a second name
    # a head apart would be put in wte by load_state_dict; equal_nan: NaN in a tied head is the same (floats only)
    if not np.array_equal(state.get("lm_head.weight", wte), wte, equal_nan=True):
        raise _not_weights(weights, "lm_head.weight differs from transformer.wte.weight, which minizero's GPT ties")
    state = dict(state, **{"lm_head.weight": wte})
    model = GPT(cfg)
    try:
        model.load_state_dict(state)
    except (KeyError, ValueError) as e:
        own = dict(model.state_dict())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            detail = ", ".join(f"{len(names)} {what} name(s) (first: {', '.join(names[:2])})"
                               for what, names in (("missing", missing), ("unexpected", unexpected)) if names)
        else:
            detail = e.args[0] if e.args else str(e)
        raise ValueError(f"--weights {weights!r} does not fit the model shape from {source}: {detail}; "
                         f"fix {source}{_looks_like(state)}") from None
    return model, summary
