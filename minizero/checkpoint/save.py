"""Saving a sharded checkpoint: every rank writes what it holds, rank 0 the manifest, atomically (collective).

Mirrors: DeepSpeed's ``save_checkpoint``; PyTorch DCP's ``save``.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal

import numpy as np
from safetensors.numpy import save_file

from minizero import backend
from minizero.autograd.functional import get_rng_state
from minizero.checkpoint.format import (FORMAT, LATEST, MANIFEST, TMP, TRASH, VERSION, CheckpointError, clean_partial,
                                        complete, folder_name, fsync_path, rank_file, resolve, sha256)
from minizero.checkpoint.layout import host_arrays, slots
from minizero.files import WriteError, atomic_write, umask, write_error
from minizero.memory.fp8 import fp8_state
from minizero.optim.adam8bit import QuantizedState
from minizero.parallel.expert_parallel import routing_state

_LEN_TAG, _DATA_TAG = 1301, 1302


def gather_json(comm, obj, root: int = 0):
    """Collective: every rank's JSON-able ``obj`` as a list by rank on ``root`` (None elsewhere).

    Two point-to-point messages per rank to ``root`` (length, then UTF-8 bytes as uint8; label ``p2p``).
    """
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    if comm.rank != root:
        comm.send(np.array([data.size], dtype=np.int64), root, tag=_LEN_TAG)
        comm.send(data.copy(), root, tag=_DATA_TAG)
        return None
    out = []
    for r in range(comm.world_size):
        if r == root:
            out.append(obj)
            continue
        n = int(comm.recv(np.empty(1, dtype=np.int64), r, tag=_LEN_TAG)[0])
        out.append(json.loads(comm.recv(np.empty(n, dtype=np.uint8), r, tag=_DATA_TAG).tobytes().decode()))
    return out


def fault_in_save(rank: int, step: int) -> None:
    """``MINIZERO_FAULT=RANK:STEP:kill_in_save``: SIGKILL this process while it saves after loop step STEP
    (its file is written, the manifest is not): tests that a killed save leaves the previous one valid."""
    spec = os.environ.get("MINIZERO_FAULT", "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[2] == "kill_in_save" and int(parts[0]) == rank and int(parts[1]) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def what_is_kept(final: str) -> str:
    """After a failed save of ``final``: the checkpoint ``--resume SAVE_DIR`` would take, or that there is none."""
    save_dir = os.path.dirname(final)
    try:
        folder = resolve(save_dir)
    except (CheckpointError, OSError):
        return f"there is no complete checkpoint in {save_dir} to resume from"
    tmp = os.path.join(save_dir, TMP + os.path.basename(final))
    if os.path.abspath(folder) == os.path.abspath(final) and not os.path.exists(tmp):
        return f"this save's {folder} is complete and kept"  # it failed after its rename (``latest``, pruning)
    return f"the previous checkpoint {folder} is kept"


@contextlib.contextmanager
def previous_kept(path: str, final: str):
    """An OSError inside (a read-only or vanished --save-dir, a full disk) becomes one WriteError naming the file
    and what is kept to resume from (:func:`what_is_kept`)."""
    try:
        yield
    except OSError as e:
        why = e.strerror if isinstance(e, WriteError) else write_error(e.filename or path, e).strerror
        raise WriteError(e.errno or errno.EIO, f"{why}; {what_is_kept(final)}") from None


def rank_tensors(strategy, pruner=None, rank: int = 0):
    """This rank's ``(tensors, pieces, params)``: key -> flat host array (rank 0: also ``pruner``'s ``mask/NAME``), the
    manifest's pieces, full shapes and dtypes.

    A piece: ``{"key", "kind", "param", "tp", "lo", "hi", "dtype", "format"}`` (``"dense"``; ``"8bit"``: + block_size).
    """
    tensors, pieces, params = {}, [], {}
    for s in slots(strategy, "save"):
        if s.kind == "param":
            params[s.name] = {"shape": list(s.shape), "dtype": str(np.dtype(s.array.dtype))}
        key = f"{s.kind}/{s.name}/{s.lo}"
        arrays = host_arrays(s)
        piece = {"key": key, "kind": s.kind, "param": s.name, "tp": s.tp, "lo": s.lo, "hi": s.hi}
        if isinstance(s.array, QuantizedState):
            piece.update(format="8bit", block_size=s.array.block_size, dtype="uint8")
            tensors[key + "/codes"], tensors[key + "/absmax"] = arrays["codes"], arrays["absmax"]
        else:
            piece.update(format="dense", dtype=str(arrays[""].dtype))
            tensors[key] = arrays[""]
        pieces.append(piece)
    if pruner is not None and rank == 0:
        for name, packed in pruner.packed.items():
            tensors[f"mask/{name}"] = np.ascontiguousarray(backend.to_host(packed))
    return tensors, pieces, params


def save_checkpoint(strategy, comm, save_dir: str, step: int, state: dict, pruner=None, keep: int = 2,
                    protect: str | None = None) -> str | None:
    """Collective: write the checkpoint of ``step`` completed loop steps into ``save_dir``.

    ``state``: rank 0's manifest fields (:func:`minizero.checkpoint.manifest_state`); ``keep``: newest complete
    checkpoints kept; ``protect``: the resumed-from folder, never overwritten or removed.
    Returns the new folder (every rank), or None when it would overwrite ``protect``.
    Raises OSError: a write fails (the ``.tmp-`` folder is cleaned by the next save).
    """
    name = folder_name(step)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, TMP + name)
    if protect is not None and os.path.abspath(final) == os.path.abspath(protect):
        return None
    if comm.rank == 0:
        with previous_kept(tmp, final):
            os.makedirs(save_dir, exist_ok=True)
            clean_partial(save_dir)
            os.makedirs(tmp)
    comm.barrier()
    tensors, pieces, params = rank_tensors(strategy, pruner, comm.rank)
    path = os.path.join(tmp, rank_file(comm.rank))
    try:
        save_file(tensors, path, metadata={"rank": str(comm.rank)})  # one key: several are written in random order
    except Exception as e:  # safetensors' SafetensorError carries no errno: "... (os error 28)"
        full = getattr(e, "errno", None) == errno.ENOSPC or "os error 28" in str(e)
        raise WriteError(errno.ENOSPC if full else errno.EIO, f"could not write {path!r}: "
                         f"{'no space left on device (the disk is full)' if full else e}; {what_is_kept(final)}"
                         ) from None
    os.chmod(path, 0o666 & ~umask())  # safetensors creates it 0600: a shard others could not read beside its manifest
    fsync_path(path)
    fault_in_save(comm.rank, step - 1)
    topo = strategy.topo
    info = {"rank": comm.rank, "file": rank_file(comm.rank), "bytes": os.path.getsize(path), "sha256": sha256(path),
            "coords": [topo.dp_rank, topo.tp_rank, topo.pp_rank], "rng": get_rng_state(), "pieces": pieces,
            "params": params}
    fp8 = fp8_state(strategy.stage)  # delayed scaling's amax histories (the same on every data rank)
    if fp8:
        info["fp8"] = fp8
    routing = routing_state(strategy.stage)  # MoE's routing biases (the same on every data rank)
    if routing:
        info["routing"] = routing
    infos = gather_json(comm, info)
    if comm.rank == 0:
        manifest = dict(format=FORMAT, version=VERSION, step=step, **state)
        manifest["params"] = {k: v for i in infos for k, v in i.pop("params").items()}
        manifest["pieces"] = [dict(p, rank=i["rank"], file=i["file"]) for i in infos for p in i.pop("pieces")]
        manifest["files"] = infos
        if pruner is not None:
            manifest["pruning"] = {"sparsity": pruner.sparsity, "scope": pruner.scope,
                                   "shapes": {k: list(v) for k, v in pruner.shapes.items()}, "file": rank_file(0)}
        text = json.dumps(manifest, indent=1)
        with previous_kept(final, final):
            atomic_write(os.path.join(tmp, MANIFEST), lambda f: f.write(text), mode="w")
            fsync_path(tmp)
            trash = None
            if os.path.exists(final):  # an older run's checkpoint of the same step: replaced
                trash = os.path.join(save_dir, TRASH + name)
                os.replace(final, trash)
            os.replace(tmp, final)
            fsync_path(save_dir)
            atomic_write(os.path.join(save_dir, LATEST), lambda f: f.write(name), mode="w")
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        prune_old(save_dir, keep, protect)
    comm.barrier()
    return final


def prune_old(save_dir: str, keep: int, protect: str | None = None) -> list[str]:
    """Remove complete checkpoints beyond the newest ``keep`` (never ``protect``, never ``latest``'s)."""
    found = complete(save_dir)
    with open(os.path.join(save_dir, LATEST)) as f:
        latest = os.path.join(save_dir, f.read().strip())
    spare = {os.path.abspath(p) for p in (protect, latest) if p}
    removed = []
    for folder in found[:max(0, len(found) - keep)]:
        if os.path.abspath(folder) not in spare:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
