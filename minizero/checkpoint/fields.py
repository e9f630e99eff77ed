"""What a checkpoint manifest must hold: every field's type and range, checked before any file is read.

:func:`manifest_problems` returns one line per distinct problem (none: the manifest can be read); the reader
(:func:`minizero.checkpoint.format.read_manifest`) raises them as one ``CheckpointError``.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import re

from minizero.checkpoint.layout import KINDS, saved_kinds
from minizero.checkpoint.model_fields import _is_int, model_problems
from minizero.checkpoint.state_fields import (data_problems, is_number, number_problems, pruning_problems,
                                               rng_problem, routing_problems, saved_state_problems, scaler_problems,
                                               shown)
from minizero.memory.offload import OFFLOADS
from minizero.memory.precision import PRECISIONS
from minizero.optim import OPTIMIZERS
from minizero.optim.adam8bit import CODES, MAX_BLOCK_SIZE as MAX_ADAM8BIT_BLOCK


def rank_file(rank: int) -> str:
    """``rank00003.safetensors``: rank ``rank``'s tensor file."""
    return f"rank{rank:05d}.safetensors"


def manifest_problems(man: dict) -> list[str]:
    """One line per problem a reader would trip on (missing, wrong type, out of range), or [] when none.

    In three passes, each needing the one before: the top-level fields, then each entry's fields
    present, then their values (file names, sizes, pieces against the params and their files, layout against
    train's choices and the rank files, train.lr, scaler, pruning, rng, coords, FP8 histories, routing biases);
    then each parameter's saved elements (:func:`_coverage_problems`).
    """
    for problems in (_top_problems, _entry_problems, _value_problems, _coverage_problems):
        found = problems(man)
        if found:
            return _collapse(found)
    return []


MAX_STEPS = 10 ** 9  #: --steps' largest value: no minizero run saves a later step

#: what a reader takes from a manifest: top-level fields, and the fields of each file and piece entry
FIELDS = {"step": int, "applied": int, "model": dict, "layout": dict, "train": dict, "params": dict, "pieces": list,
          "files": list}
JSON_NAMES = {dict: "object", list: "array"}
ENTRY_FIELDS = {"files": ("file", "rank", "bytes", "sha256", "coords"),
                "pieces": ("key", "kind", "param", "tp", "lo", "hi", "format", "dtype", "rank", "file")}


def _collapse(found: list[str]) -> list[str]:
    """One line per distinct problem: lines that differ only in their entry's index (``pieces[3] ...``,
    ``pieces[7] ...``) become one, ``pieces[3, 7] ... (2 entries)`` (the first five indices named)."""
    groups = collections.OrderedDict()
    for p in found:
        m = re.match(r"(\w+)\[(\d+)\](.*)", p, re.S)
        key = (m.group(1), m.group(3)) if m else (p, None)
        groups.setdefault(key, []).append(m.group(2) if m else None)
    out = []
    for (head, rest), idx in groups.items():
        if rest is None or len(idx) == 1:
            out.append(head if rest is None else f"{head}[{idx[0]}]{rest}")
        else:
            out.append(f"{head}[{', '.join(idx[:5])}{', ...' if len(idx) > 5 else ''}]{rest} ({len(idx)} entries)")
    return out


def _top_problems(man: dict) -> list[str]:
    """Each top-level field of its JSON type (integers >= 0), then ``applied`` (the optimizer steps taken) <= step."""
    out = [f"field {key!r} is {'missing' if key not in man else repr(man[key])[:40]}, expected "
            f"{'an integer >= 0' if kind is int else 'a JSON ' + JSON_NAMES[kind]}"
            for key, kind in FIELDS.items()
            if not isinstance(man.get(key), kind) or isinstance(man.get(key), bool) or kind is int and man[key] < 0]
    if not out and man["step"] > MAX_STEPS:  # inspect and consolidate printed it; resume said "give --steps > it"
        out.append(f"field 'step' is {repr(man['step'])[:40]}, expected an integer in 0..{MAX_STEPS:,} (the most "
                   "steps a run takes)")
    if not out and man["applied"] > man["step"]:
        out.append(f"field 'applied' is {man['applied']}, expected an integer in 0..step {man['step']} (the optimizer "
                   "steps taken, at most the steps run)")
    return out


def _entry_problems(man: dict) -> list[str]:
    out = []
    for key, need in ENTRY_FIELDS.items():
        for i, entry in enumerate(man[key]):
            missing = [f for f in need if not isinstance(entry, dict) or f not in entry]
            if missing:
                out.append(f"{key}[{i}] lacks {', '.join(missing)}")
    if not man["files"]:
        out.append("field 'files' is empty, expected one entry per rank file")
    return out


def _value_problems(man: dict) -> list[str]:
    out, names, refused = [], set(), set()  # refused: the ranks of files entries reported (not their pieces)
    for i, entry in enumerate(man["files"]):
        name, rank = entry["file"], entry["rank"]
        if not _is_int(entry["bytes"]) or entry["bytes"] < 0 or not _is_int(rank) or rank < 0:
            out.append(f"files[{i}] has bytes {repr(entry['bytes'])[:20]}, rank {repr(rank)[:20]}, expected "
                       "integers >= 0")
        if not _plain(name):
            out.append(f"files[{i}].file is {str(name)[:60]!r}, expected a plain file name inside the checkpoint "
                       "folder (no '..', no '/', not absolute)")
            refused.add(rank if _is_int(rank) else None)
        else:
            names.add(name)
        out += [f"files[{i}].{p}" for p in (rng_problem(entry.get("rng")), _coords_problem(entry, man["layout"]),
                                             *saved_state_problems(entry, man["layout"].get("moe_experts", 0))) if p]
    coords = {e["file"]: e.get("coords") for e in man["files"] if _plain(e["file"])}
    seen = {}  # (file, key) and (kind, param, tp, lo, hi) of the pieces before -> the first index
    for i, pc in enumerate(man["pieces"]):
        problem = _piece_problem(pc, man["params"])
        if problem:
            out.append(f"pieces[{i}] {problem}")
        if not (isinstance(pc["file"], str) and pc["file"] in names or _is_int(pc["rank"]) and pc["rank"] in refused):
            out.append(f"pieces[{i}].file is {str(pc['file'])[:60]!r}, expected one of the checked 'files' entries "
                       f"({', '.join(sorted(names))[:80]})")
        tp, c = pc["tp"], coords.get(pc["file"]) if isinstance(pc["file"], str) else None
        if not problem and tp is not None and isinstance(c, list) and len(c) == 3 and tp[2] != c[1] \
                and not re.search(r"\.moe\.w[12]$", pc["param"]):  # an expert shard's index is its ep rank
            out.append(f"pieces[{i}] tp index {tp[2]}, expected {c[1]!r:.20} (the tp rank of its file "
                       f"{pc['file']!r}, files coords[1])")
        if not problem and isinstance(pc["file"], str):
            same = [(pc["file"], pc["key"]), (pc["kind"], pc["param"], tuple(pc["tp"] or ()), pc["lo"], pc["hi"])]
            first = next((seen[k] for k in same if k in seen), None)
            if first is not None:
                out.append(f"pieces[{i}] (key {str(pc['key'])[:60]!r} in {pc['file'][:40]!r}) repeats pieces[{first}] "
                           "(the same file and key, or kind, param, tp, lo and hi), expected each piece once")
            for k in same:
                seen.setdefault(k, i)
    for key, section in (("dp", "layout"), ("tp", "layout"), ("pp", "layout"), ("seed", "train")):
        v = man[section].get(key)
        if not _is_int(v) or v < (0 if key == "seed" else 1):
            out.append(f"{section}.{key} is {v!r}, expected an integer >= {0 if key == 'seed' else 1}")
    if "lr" in man["train"] and not (is_number(man["train"]["lr"]) and 0 < man["train"]["lr"] < math.inf):
        out.append(f"train.lr is {man['train']['lr']!r:.40}, expected a finite number > 0 (the peak learning rate)")
    out += _param_dtype_problems(man["params"], man["pieces"])
    model = model_problems(man["model"], man["layout"], man["params"])  # sound: params are the model's
    return out + (model or routing_problems(man)) + scaler_problems(man.get("scaler")) + data_problems(man) \
        + pruning_problems(man.get("pruning"), names) + _layout_problems(man["layout"], man["files"], man["pieces"]) \
        + number_problems(man)


def _coverage_problems(man: dict) -> list[str]:
    """Every parameter has every kind the layout keeps (:func:`~minizero.checkpoint.layout.saved_kinds`: param; Adam's
    m, v; the master under fp16), one line per kind naming the parameters without it; and every element of each kind of
    each parameter in one of its pieces: per tp shard index 0..parts-1 the pieces' [lo, hi) cover the shard."""
    groups = collections.defaultdict(list)  # (kind, param) -> its pieces
    for pc in man["pieces"]:
        groups[(pc["kind"], pc["param"])].append(pc)
    out = [f"params[{n[:60]!r}] has no 'param' piece, expected its values saved in some rank's file"
           for n in man["params"] if ("param", n) not in groups]
    layout = man["layout"]
    for kind in saved_kinds(layout["optimizer"], layout["precision"])[1:]:
        lack = [n for n in man["params"] if (kind, n) not in groups]
        if lack:
            why = f"layout.precision {layout['precision']} keeps an FP32 master" if kind == "master" else \
                f"layout.optimizer {layout['optimizer']} keeps Adam's m and v"
            out.append(f"pieces hold no {kind} of {', '.join(repr(n[:60]) for n in lack[:3])}"
                       f"{', ...' if len(lack) > 3 else ''}{f' ({len(lack)} parameters)' if len(lack) > 1 else ''}, "
                       f"expected every parameter's {kind} ({why} of each)")
    for (kind, name), pcs in groups.items():
        shape, tps = man["params"][name]["shape"], {pc["tp"] and (pc["tp"][0], pc["tp"][1], pc["tp"][3]) for pc in pcs}
        if len(tps) > 1:  # one split per parameter in a checkpoint; else a reader reports the gap
            continue
        parts, size = (pcs[0]["tp"] or [0, 1, 0, 1])[3], math.prod(shape)
        spans = collections.defaultdict(list)  # tp index -> (lo, hi)
        for pc in pcs:
            spans[pc["tp"][2] if pc["tp"] else 0].append((pc["lo"], pc["hi"]))
        for index in [i for i in range(min(parts, len(spans) + 1)) if i not in spans][:1]:
            out.append(f"pieces hold no {kind} of {name[:60]!r} tp shard {index} of {parts}; expected every shard")
        for index, have in spans.items():
            end = 0
            for lo, hi in sorted(have):
                if lo > end:
                    break
                end = max(end, hi)
            if end < size // parts:
                out.append(f"pieces hold no {kind} of {name[:60]!r}{f' tp shard {index}' if parts > 1 else ''} "
                           f"element {end} (of {size // parts:,}), expected every element saved")
                break
    return out


ZERO_STAGES = (0, 1, 2, 3)


def _layout_problems(layout: dict, files: list, pieces: list) -> list[str]:
    """The layout against the rank files: ``zero`` in 0-3, a known optimizer and precision; ``world_size`` =
    dp x cp x tp x pp (cp absent: 1), one files entry per rank 0..world_size-1 (none missing, none twice), then each
    named as its rank."""
    out = []
    if layout.get("zero") not in ZERO_STAGES or isinstance(layout.get("zero"), bool):
        out.append(f"layout.zero is {repr(layout.get('zero'))[:20]}, expected one of "
                   f"{', '.join(map(str, ZERO_STAGES))} (the ZeRO stage)")
    for key, allowed in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS), ("offload_optimizer", OFFLOADS),
                         ("adam8bit_code", CODES)):
        if layout.get(key, "dynamic" if key == "adam8bit_code" else None) not in allowed:  # absent: dynamic
            whose = ("8-bit Adam's codes, optim/adam8bit.py" if key == "adam8bit_code" else
                     f"train's --{key.replace('_', '-')} choices")
            out.append(f"layout.{key} is {shown(layout, key)}, expected one of {', '.join(allowed)} ({whose})")
    ws, sizes = layout.get("world_size"), _sizes(layout)
    if not _is_int(ws) or ws < 1:
        return out + [f"layout.world_size is {repr(ws)[:20]}, expected an integer >= 1 (the number of ranks)"]
    if not _is_int(layout.get("cp", 1)) or layout.get("cp", 1) < 1:
        return out + [f"layout.cp is {shown(layout, 'cp')}, expected an integer >= 1 (context-parallel size)"]
    dp, n = layout.get("dp"), layout.get("dp_shard")
    n = dp if n is None else n  # absent (older saves) or None (a run that never resolved it): dp, plain ZeRO
    if _is_int(dp) and dp >= 1 and (not _is_int(n) or n < 1 or dp % n):  # inspect crashed on "x", said "groups of 0"
        out.append(f"layout.dp_shard is {shown(layout, 'dp_shard')}, expected a divisor of layout.dp {dp} (the ranks "
                   "ZeRO shards over, zero/hybrid.py)")
    if all(_is_int(n) and n >= 1 for n in sizes) and ws != sizes[0] * sizes[1] * sizes[2]:  # before range(ws)
        return out + [f"layout.world_size is {repr(ws)[:20]}, expected dp x cp x tp x pp = "
                      f"{sizes[0] * sizes[1] * sizes[2]}"]
    if not all(_is_int(f["rank"]) and f["rank"] >= 0 for f in files):
        return out  # reported (files[i] has ... rank): not blamed again as a missing rank
    ranks = collections.Counter(f["rank"] for f in files)
    twice = sorted(r for r, n in ranks.items() if n > 1)
    if twice:
        out.append(f"files has rank {', '.join(map(str, twice[:5]))} more than once, expected one entry per rank")
    missing = list(itertools.islice((r for r in range(ws) if r not in ranks), 6))  # at most len(files) + 6 tried
    extra = sorted(r for r in ranks if r >= ws)
    if missing or extra or len(files) != ws:
        out.append(f"layout.world_size is {ws} but files has {len(files)} entries"
                   + (f", rank(s) {', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''} missing"
                      if missing else "")
                   + (f", rank(s) {', '.join(map(str, extra[:5]))} outside 0..{ws - 1}" if extra else "")
                   + f"; expected one entry for each rank 0..{ws - 1}")
    return out + ([] if twice or missing or extra or len(files) != ws else _rank_file_problems(files, pieces))


def _rank_file_problems(files: list, pieces: list) -> list[str]:
    """Each rank's file under its own rank (files 0..world_size-1, once each): its name as save gives it
    (:func:`rank_file`), then each piece's rank that of the files entry it names (a swap is one fault: the
    files entries are reported, not their pieces too)."""
    out, names = [], {}
    for i, entry in enumerate(files):
        if _plain(entry["file"]):  # else reported
            names[entry["file"]] = entry["rank"]
            if entry["file"] != rank_file(entry["rank"]):
                out.append(f"files[{i}].file is {entry['file'][:60]!r}, expected {rank_file(entry['rank'])!r} (the "
                           f"file of its rank {entry['rank']})")
    for i, pc in enumerate([] if out else pieces):
        saved = names.get(pc["file"]) if isinstance(pc["file"], str) else None
        if saved is not None and _is_int(pc["rank"]) and pc["rank"] != saved:
            out.append(f"pieces[{i}] rank {pc['rank']}, but its file {pc['file']!r} is rank {saved}'s in files, "
                       f"expected {saved}")
    return out


def _sizes(layout: dict) -> list:
    """[data group, tp, pp]: the data group is dp x cp ranks (--cp; a checkpoint without "cp" had none)."""
    dp, cp = layout.get("dp"), layout.get("cp", 1)
    return [dp * cp if _is_int(dp) and _is_int(cp) else dp, layout.get("tp"), layout.get("pp")]


def _coords_problem(entry: dict, layout: dict) -> str | None:
    """A rank's (data, tensor, pipeline) coordinates: three ints inside the layout's (dp x cp) x tp x pp."""
    c = entry.get("coords")
    sizes = _sizes(layout)
    if not all(_is_int(n) and n >= 1 for n in sizes):  # a bad layout is its own problem
        return None
    if not (isinstance(c, list) and len(c) == 3 and all(_is_int(v) and 0 <= v < n for v, n in zip(c, sizes))):
        return f"coords is {str(c)[:40]}, expected [data rank, tp rank, pp rank] inside dp x cp, tp, pp = {sizes}"
    return None


#: the dtypes a piece may hold, by format
PIECE_DTYPES = {"dense": ("float16", "float32", "float64"), "8bit": ("uint8",)}


def _param_dtype_problems(params: dict, pieces: list) -> list[str]:
    """Each ``params[name].dtype`` a dense dtype, the one its values' pieces hold (8-bit state is read into it)."""
    dense, out = PIECE_DTYPES["dense"], []
    held = {pc["param"]: pc["dtype"] for pc in pieces
            if pc["kind"] == "param" and pc["dtype"] in dense and isinstance(pc["param"], str)}
    for name, info in params.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in dense:  # before: unread until an 8-bit state was consolidated (np.dtype's TypeError)
            out.append(f"params[{name[:60]!r}].dtype is {repr(dtype)[:20]}, expected {', '.join(dense[:-1])} or "
                       f"{dense[-1]}")
        elif held.get(name, dtype) != dtype:
            out.append(f"params[{name[:60]!r}].dtype is {dtype}, but its values are saved as {held[name]} (its "
                       "'param' pieces), expected the same dtype")
    return out


def _plain(name) -> bool:
    """A plain file name inside the checkpoint folder: no '..', no '/', not absolute, not empty."""
    return isinstance(name, str) and bool(name) and not os.path.isabs(name) and os.path.basename(name) == name \
        and name not in (".", "..")


def _piece_problem(pc: dict, params: dict) -> str | None:
    """What is wrong with one piece entry against the manifest's ``params``, or None (metadata only, no reads)."""
    info = params.get(pc["param"]) if isinstance(pc["param"], str) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not isinstance(shape, list) or not all(_is_int(d) and d > 0 for d in shape):
        return f"param {str(pc['param'])[:40]!r} is not a parameter of the manifest with a valid shape"
    if pc["kind"] not in KINDS:
        return f"kind {str(pc['kind'])[:20]!r}, expected one of {', '.join(KINDS)}"
    if not isinstance(pc["key"], str):
        return f"key {str(pc['key'])[:40]!r}, expected a string (the tensor's name in its file)"
    if not isinstance(pc["format"], str) or pc["format"] not in PIECE_DTYPES:
        return f"format {str(pc['format'])[:20]!r}, expected one of {', '.join(PIECE_DTYPES)}"
    if pc["dtype"] not in PIECE_DTYPES[pc["format"]]:
        return f"dtype {str(pc['dtype'])[:20]!r}, expected {' or '.join(PIECE_DTYPES[pc['format']])} for a " \
               f"{pc['format']} piece"
    size = math.prod(shape)
    tp = pc["tp"]
    if tp is not None:
        if not (isinstance(tp, list) and len(tp) == 4 and all(_is_int(v) for v in tp)):
            return f"tp {str(tp)[:40]}, expected null or [dim, stride, index, parts] integers"
        dim, stride, index, parts = tp
        if not (0 <= dim < len(shape) and stride > 0 and parts > 0 and 0 <= index < parts
                and shape[dim] % (stride * parts) == 0):
            return f"tp {tp} does not split shape {shape} (need 0 <= dim < {len(shape)}, 0 <= index < parts, " \
                   "stride * parts dividing that dimension)"
        size //= parts
    lo, hi = pc["lo"], pc["hi"]
    if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi <= size):
        return f"lo {str(lo)[:20]}, hi {str(hi)[:20]}: expected integers with 0 <= lo <= hi <= {size:,} " \
               f"(the elements of {pc['param']!r}{' shard' if tp is not None else ''})"
    if not _is_int(pc["rank"]) or pc["rank"] < 0:
        return f"rank {str(pc['rank'])[:20]}, expected an integer >= 0"
    if pc["format"] == "8bit" and not (_is_int(pc.get("block_size")) and 1 <= pc["block_size"] <= MAX_ADAM8BIT_BLOCK):
        return f"block_size {repr(pc.get('block_size'))[:40]}, expected an integer in 1..{MAX_ADAM8BIT_BLOCK} " \
               "(train's --adam8bit-block-size)"
    return None
