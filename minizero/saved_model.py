"""A trained GPT's two files written as one pair: ``model.npz`` and ``model.json`` beside it (train, finetune --out,
checkpoint consolidate), and a split pair told apart (:func:`check_pair`, run by every reader of model.npz).

model.npz's zip archive comment holds the config it was saved with (:data:`TAG` + JSON; ``np.load`` and
nanoGPT-style loaders ignore it). The order (:func:`save_model`): model.npz first, then model.json, each whole or not
at all (:func:`~minizero.files.atomic_write`). An interruption between them (Ctrl-C, SIGTERM, kill -9, a full disk)
leaves the new weights beside the previous model.json: refused, both files named, where the configs' shapes or
dtype differ (:data:`PAIR_FIELDS`; n_head is in no array's shape: it was built silently wrong). Where they agree
the pair on disk is what the whole save writes. Weights without the comment (saved before it, or by ``np.savez``)
load as before: their model.json is checked against the arrays' shapes only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zipfile

import numpy as np

from minizero.files import atomic_write, read_json
from minizero.nn import GPTConfig
from minizero.overwrite import refusing_unreadable

SIDECAR = "model.json"  #: the GPT config beside model.npz (see :func:`minizero.weights.model_config`)
TAG = b"minizero model.json "  #: how model.npz's zip comment starts; the config saved with the weights follows
_FIELDS = dataclasses.asdict(GPTConfig()).keys()  #: a model.json's keys (check_model_fields: some may be missing)
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  #: what decides the arrays and heads
#: what a pair must agree on: the shapes, and the dtype (readers refuse a model.json whose dtype is not the arrays').
#: dropout is training's only: a model.json edited to another dropout still names these weights.
PAIR_FIELDS = SHAPE_FIELDS + ("dtype",)


def _config_json(cfg: GPTConfig, **kwargs) -> str:
    return json.dumps(dataclasses.asdict(cfg), **kwargs)


def write_npz(f, state: dict, cfg: GPTConfig) -> None:
    """``np.savez(f, **state)`` (the same members, uncompressed ``NAME.npy``), its zip comment saying ``cfg``."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in state.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)
        zf.comment = TAG + _config_json(cfg, separators=(",", ":")).encode()


def write_model_json(folder: str, cfg: GPTConfig) -> str:
    """Write ``FOLDER/model.json`` (every field of ``cfg``); returns its path. Callers check first that it
    overwrites nothing of the user's."""
    path = os.path.join(folder, SIDECAR)
    atomic_write(path, lambda f: f.write(_config_json(cfg, indent=1) + "\n"), mode="w")
    return path


def save_model(folder: str, state: dict, cfg: GPTConfig) -> str:
    """Write ``FOLDER/model.npz`` (:func:`write_npz`), then ``FOLDER/model.json``; returns the weights' path."""
    weights = os.path.join(folder, "model.npz")
    atomic_write(weights, lambda f: write_npz(f, state, cfg))
    write_model_json(folder, cfg)
    return weights


def check_pair(weights: str, comment: bytes, side: dict | None) -> None:
    """Raise ValueError when ``side`` (model.json beside ``weights``, read) says another config than the one the
    weights' zip ``comment`` holds: the pair of an interrupted save, or of two models."""
    saved = None
    if comment.startswith(TAG):
        with contextlib.suppress(ValueError, RecursionError):  # not JSON (or nested deep): not one this module wrote
            saved = json.loads(comment[len(TAG):])
    if not isinstance(saved, dict) or side is None:
        return
    clash = [k for k in PAIR_FIELDS if k in side and k in saved and saved[k] != side[k]]
    if clash:
        side_path = os.path.join(os.path.dirname(os.path.abspath(weights)), SIDECAR)
        said = [", ".join(f"{k} {_cut(repr(cfg[k]), 40)}" for k in clash) for cfg in (side, saved)]
        raise ValueError(f"{side_path!r} ({said[0]}) is not the model.json saved with --weights {weights!r} "
                         f"({said[1]}): a save interrupted between its two files leaves the new weights (written "
                         f"first) beside the previous model.json; save again, or replace {side_path!r} by the "
                         f"weights' own config: {_cut(json.dumps(saved, sort_keys=True), 400)}")


def _cut(text: str, width: int) -> str:  # a forged comment (up to 64 KiB) is not echoed whole
    return text if len(text) <= width else text[:width - 3] + "..."


def refuse_replacing(path: str, flag: str) -> None:
    """Raise ValueError when ``path`` (model.npz or .json to write) is there, unreadable or not an earlier output,
    or is a model.npz link (its target replaced, in another folder than the model.json written beside the link)."""
    config = path.endswith(".json")
    if not config and os.path.islink(path):
        raise ValueError(f"{flag}: {path!r} is a link to {os.path.realpath(path)!r}; the weights would be written "
                         f"there, away from the {SIDECAR} written beside the link (a pair split over two folders): "
                         "remove the link or give another folder")
    with refusing_unreadable(path, flag):  # one it cannot read (permission denied) is not called another program's
        if os.path.isfile(path):
            open(path, "rb").close()
    if not os.path.lexists(path) or os.path.isfile(path) and _is_earlier_output(path, config):
        return
    raise ValueError(f"{flag}: {path!r} is there and is not {'a model config' if config else 'an .npz'} minizero "
                     "wrote; it replaces only earlier weights and their config: move it away, or give another folder")


def _is_earlier_output(path: str, config: bool) -> bool:  # a model.json (some GPTConfig keys, no others), an .npz
    with contextlib.suppress(OSError, ValueError, AttributeError):  # unreadable, not JSON, a list: not ours
        if not config:
            return zipfile.is_zipfile(path)
        keys = read_json(path).keys()
        return 0 < len(keys) and keys <= _FIELDS
    return False
