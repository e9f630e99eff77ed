"""Reading a trained GPT back: ``OUT/model.npz`` (nanoGPT state_dict names) and the shape it needs.

Loaded with ``allow_pickle=False``; the shape from ``model.json`` beside the weights, else from the arrays and
the preset of those shapes. Errors name the file and what was expected.
"""
from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib

import numpy as np

from minizero.data import describe_non_file
from minizero.nn import GPT, PRESETS, GPTConfig, get_config

SIDECAR = "model.json"  #: the GPT config beside model.npz


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
    except ValueError as e:
        if str(e).startswith("--weights"):
            raise
        raise _not_weights(weights, f"unreadable array header: {e}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _not_weights(weights, f"unreadable or truncated archive: {type(e).__name__}: {e}") from None
    if not heads:
        raise _not_weights(weights, "the archive holds no arrays")
    dims = shape_from_state(heads, weights)
    why = too_large(dims)
    if why:
        raise _not_weights(weights, f"in the array headers, {why}")
    side = read_sidecar(weights)
    clash = [f"{k} {side[k]} vs {v}" for k, v in dims.items() if side and k in side and side[k] != v]
    if clash:
        raise ValueError(f"model.json beside --weights {weights!r} disagrees with the array headers: "
                         f"{', '.join(clash)}")


def read_weights(weights: str) -> dict:
    """{name: float array} from the .npz ``weights`` (``allow_pickle=False``).

    Raises FileNotFoundError: no such file; ValueError: not an .npz of numeric arrays, or NaN/inf (tensor named).
    """
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
                                 f"(NaN or inf) of {v.size}; quantization and evaluation need finite weights")
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
        raise ValueError(f"--weights {weights!r} holds a mixture-of-experts model ({moe[0]!r}, ...); this program "
                         f"reads dense GPT weights only (the main job prints an MoE sample at its end)")
    if n_layer == 0 or want != have:
        diff = sorted(set(want) ^ set(have)) or [k for k in sorted(want) if want[k] != have[k]]
        first = diff[0] if diff else "transformer.h.0.ln_1.weight"
        raise _not_weights(weights, f"names or shapes differ from a GPT of {n_layer} layer(s), width "
                                    f"{dims['n_embd']}: first {first!r}")
    if "lm_head.weight" in state and state["lm_head.weight"].shape != wte.shape:
        raise _not_weights(weights, f"lm_head.weight {state['lm_head.weight'].shape} is not wte's {wte.shape}")
    return dims


def read_sidecar(weights: str) -> dict | None:
    """The GPT config in ``model.json`` beside ``weights``, or None. ValueError: not a JSON object of GPTConfig fields."""
    path = os.path.join(os.path.dirname(os.path.abspath(weights)), SIDECAR)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(cfg) - fields)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path!r} (beside --weights) is not a model config written by minizero.train ({e}); "
                         f"fix or remove it") from None
    return cfg


def config_for(weights: str, state: dict) -> GPTConfig:
    """The :class:`GPTConfig` of ``state`` (from ``weights``), in its dtype; heads from ``model.json`` or a preset.

    Raises ValueError: not minizero's GPT, a disagreeing ``model.json``, or no way to know the head count.
    """
    dims = shape_from_state(state, weights)
    dtype = stored_dtype(state)
    side = read_sidecar(weights)
    if side is not None:
        clash = [f"{k} {side[k]} vs {v}" for k, v in dims.items() if k in side and side[k] != v]
        if clash:
            raise ValueError(f"model.json beside --weights {weights!r} disagrees with the arrays: {', '.join(clash)}")
        try:
            return get_config("default", **dict(side, **dims, dtype=dtype))
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.json beside --weights {weights!r}: {e}") from None
    preset = infer_preset(state)
    if preset is None:
        raise ValueError(f"--weights {weights!r}: no {SIDECAR} beside it and no preset has these shapes "
                         f"({dims['n_layer']} layers, width {dims['n_embd']}, context {dims['block_size']}), so the "
                         f"head count is unknown; write {SIDECAR} with n_head")
    return get_config(preset, dtype=dtype)


def load_gpt(weights: str) -> GPT:
    """The GPT stored in ``weights`` (model.npz), in the file's dtype.

    Raises FileNotFoundError: no such file; ValueError: as :func:`read_weights`, :func:`config_for`, or integer arrays.
    """
    state = read_weights(weights)
    ints = sorted(k for k, v in state.items() if v.dtype.kind != "f")
    if ints:  # a GPT computes in floating point; integers would be cast silently and sample nonsense
        raise _not_weights(weights, f"array {ints[0]!r} has dtype {state[ints[0]].dtype}; sampling needs "
                                    f"float16, float32 or float64 weights")
    model = GPT(config_for(weights, state))
    if "lm_head.weight" not in state:  # the tied head: the embedding matrix
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    return model


def stored_dtype(state: dict) -> str:
    """NumPy name of the floating dtype the arrays are stored in (``"float16"`` after an FP16 run), else float32."""
    kinds = [v.dtype for v in state.values() if v.dtype.kind == "f"]
    return np.dtype(kinds[0]).name if kinds else "float32"


def _looks_like(state: dict) -> str:
    guess = infer_preset(state)
    return f" (these weights look like the {guess!r} preset)" if guess else ""


def load_trained(weights: str, preset: str | None = None, state: dict | None = None):
    """(model, summary dict or {}) from ``weights``; the shape from ``preset``, else summary.json beside it, else
    model.json beside it (finetune's merged model).

    Raises FileNotFoundError: no weights file; ValueError: not a minizero .npz, a corrupt summary.json, no shape,
    or weights that do not fit the shape (file, first names and ``--model`` named).
    """
    if state is None:
        state = read_weights(weights)
    summary_path = os.path.join(os.path.dirname(os.path.abspath(weights)), "summary.json")
    summary = {}
    if os.path.isfile(summary_path):
        try:
            with open(summary_path) as f:
                summary = json.load(f)
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{summary_path!r} (beside --weights) is not a summary written by minizero.train "
                             f"({e}); fix or remove it") from None
    if preset is not None:  # in the dtype the arrays are stored in (float16 after --precision fp16)
        cfg, source = get_config(preset, dtype=stored_dtype(state)), f"--model {preset}"
    elif summary:
        model_cfg = summary.get("config", {}).get("model") if isinstance(summary.get("config"), dict) else None
        if not isinstance(model_cfg, dict):
            raise ValueError(f"{summary_path!r} has no config.model section; pass --model{_looks_like(state)}")
        if too_large(model_cfg):
            raise ValueError(f"{summary_path!r}: config.model's {too_large(model_cfg)}; fix it or pass --model")
        try:
            cfg = get_config("default", **model_cfg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{summary_path!r}: config.model is not a model shape ({e}); pass --model") from None
        source = summary_path
    elif read_sidecar(weights) is not None:  # fine-tuned weights: model.json beside them, no summary
        cfg, source = config_for(weights, state), os.path.join(os.path.dirname(os.path.abspath(weights)), SIDECAR)
    else:
        guess = infer_preset(state)
        raise ValueError(f"no summary.json or {SIDECAR} beside --weights {weights!r}; pass --model "
                         + (f"(these weights look like the {guess!r} preset)" if guess
                            else f"(one of {', '.join(sorted(PRESETS))}; no preset matches these shapes)"))
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
                         f"pass the --model the weights were trained with{_looks_like(state)}") from None
    return model, summary
