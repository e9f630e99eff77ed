"""Loading a checkpoint onto any layout: for each slot this rank holds, read the saved pieces it overlaps.

Memory: one slot and its overlapping pieces. 8-bit Adam state is copied exactly when block size and tensor
split are unchanged, else requantized. Mirrors: DeepSpeed's universal checkpoint; PyTorch DCP's ``DefaultLoadPlanner``.
"""
from __future__ import annotations

import collections
import math
import os

import numpy as np
from safetensors import safe_open

from minizero import backend
from minizero.autograd.functional import manual_seed, set_rng_state
from minizero.checkpoint.format import CheckpointError, read_manifest, resolve
from minizero.checkpoint.layout import full_index, same_split, slots
from minizero.ledger import MemoryLedger
from minizero.memory.fp8 import load_fp8_state
from minizero.memory.sparsity import Pruner
from minizero.optim.adam8bit import QuantizedState, make_codes
from minizero.optim.adamw import state_dtype
from minizero.parallel.expert_parallel import load_routing_state
from minizero.quantization import dequantize_blockwise


class ShardReader:
    """Reads logical slices of a checkpoint's tensors from the pieces that hold them.

    ``ledger`` counts the buffers read (``peak_total``: the transient peak). Attributes: folder, manifest, by_param
    ((kind, name) -> its saved pieces), reads, bytes_read, requantized (some 8-bit state went onto another grid).
    """

    def __init__(self, path: str, ledger: MemoryLedger | None = None):
        self.folder = resolve(path)
        self.manifest = read_manifest(self.folder)
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.by_param = collections.defaultdict(list)
        for pc in self.manifest["pieces"]:
            pc["tp"] = None if pc["tp"] is None else tuple(pc["tp"])
            self.by_param[(pc["kind"], pc["param"])].append(pc)
        self._open = {}
        self.reads, self.bytes_read = 0, 0
        self.requantized = False  # set by load_into
        self._codes = make_codes(self.manifest["layout"].get("adam8bit_code", "dynamic"), device=False)

    def shape(self, name: str) -> tuple:
        """The full shape of parameter ``name``. Raises CheckpointError for an unknown name."""
        if name not in self.manifest["params"]:
            raise CheckpointError(f"{self.folder}: the checkpoint has no parameter {name!r}")
        return tuple(self.manifest["params"][name]["shape"])

    def _tensor(self, file: str, key: str):
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="numpy")
        a = self._open[file].get_tensor(key)
        self.ledger.track(a, "comm_buffers")
        self.reads, self.bytes_read = self.reads + 1, self.bytes_read + a.nbytes
        return a

    def pruning_masks(self) -> dict:
        """``{parameter name: packed uint8 mask}`` as save wrote them (manifest ``pruning``); {} when none."""
        pr = self.manifest.get("pruning")
        return {k: self._tensor(pr["file"], f"mask/{k}") for k in pr["shapes"]} if pr else {}

    def _fetch(self, pc, what: str, dtype):
        """A saved piece, element-wise: ``"values"`` (8-bit dequantized), ``"codes"`` or ``"absmax"`` per element."""
        if pc["format"] == "dense":
            return self._tensor(pc["file"], pc["key"]).astype(dtype, copy=False)
        codes = self._tensor(pc["file"], pc["key"] + "/codes")
        absmax = self._tensor(pc["file"], pc["key"] + "/absmax")
        b, lo = pc["block_size"], pc["lo"]
        if what == "codes":
            return codes
        if what == "absmax":
            return absmax[(lo % b + np.arange(codes.size)) // b]
        code = self._codes[0] if pc["kind"] == "m" else self._codes[1]
        return dequantize_blockwise(codes, absmax, code, b, lo, dtype)

    def gather(self, kind: str, name: str, tp, lo: int, hi: int, dtype, what: str = "values"):
        """Elements ``[lo, hi)`` of slot (``kind``, ``name``, ``tp``) as a flat ``dtype`` array.

        Raises CheckpointError: the parameter or kind is not saved, or some element is in no saved piece.
        """
        shape = self.shape(name)
        pieces = self.by_param.get((kind, name))
        if not pieces:
            raise CheckpointError(f"{self.folder}: no saved {kind!r} of {name!r}")
        out = np.empty(hi - lo, dtype)
        self.ledger.track(out, "comm_buffers")
        filled = np.zeros(hi - lo, bool)
        want = None  # full-tensor indices of the target, made only if some piece is split differently
        for pc in pieces:
            if same_split(pc["tp"], tp):
                if pc["tp"] != tp or pc["hi"] <= lo or pc["lo"] >= hi:
                    continue  # another tensor rank's shard, or no overlap
                a, b = max(lo, pc["lo"]), min(hi, pc["hi"])
                out[a - lo:b - lo] = self._fetch(pc, what, dtype)[a - pc["lo"]:b - pc["lo"]]
                filled[a - lo:b - lo] = True
                continue
            if want is None:
                want = full_index(tp, shape, lo, hi)
                self.ledger.track(want, "comm_buffers")
            have = full_index(pc["tp"], shape, pc["lo"], pc["hi"])
            if have.size == 0 or have.max() < want.min() or have.min() > want.max():
                continue
            order = np.argsort(have, kind="stable")  # look each wanted index up among the piece's, sorted
            pos = np.minimum(np.searchsorted(have[order], want), have.size - 1)
            hit = have[order][pos] == want
            if hit.any():
                out[hit] = self._fetch(pc, what, dtype)[order[pos[hit]]]
                filled |= hit
        if not filled.all():
            raise CheckpointError(f"{self.folder}: {kind} of {name!r}: {int((~filled).sum())} element(s) of "
                                  f"[{lo}, {hi}) are in no saved piece")
        return out

    def sources(self, kind: str, name: str, tp, lo: int, hi: int) -> dict:
        """Which saved ranks feed elements ``[lo, hi)`` of a slot: ``{rank: elements}`` (metadata only, no reads)."""
        want, out = full_index(tp, self.shape(name), lo, hi), {}
        for pc in self.by_param.get((kind, name), ()):
            n = int(np.isin(full_index(pc["tp"], self.shape(name), pc["lo"], pc["hi"]), want).sum())
            if n:
                out[pc["rank"]] = out.get(pc["rank"], 0) + n
        return out

    def exact_8bit(self, kind: str, name: str, tp, block_size: int) -> bool:
        """True when every saved piece of (kind, name) is 8-bit with this block size and this split."""
        return all(pc["format"] == "8bit" and pc["block_size"] == block_size and same_split(pc["tp"], tp)
                   for pc in self.by_param[(kind, name)])

    def load_into(self, slot) -> None:
        """Fill a :class:`~minizero.checkpoint.layout.Slot`'s array in place from the checkpoint."""
        a, args = slot.array, (slot.kind, slot.name, slot.tp, slot.lo, slot.hi)
        if not isinstance(a, QuantizedState):
            _assign(a, self.gather(*args, np.dtype(a.dtype)))
            return
        if self.exact_8bit(slot.kind, slot.name, slot.tp, a.block_size):
            a.codes[...] = backend.to_device(self.gather(*args, np.uint8, "codes"))
            per_element = self.gather(*args, np.float32, "absmax")
            b = a.block_size
            first = (np.arange(a.absmax.size) + slot.lo // b) * b  # each block's first element
            a.absmax[...] = backend.to_device(per_element[np.maximum(first, slot.lo) - slot.lo])
        else:  # another block grid: logical values, requantized
            self.requantized = True
            a.requantize(backend.to_device(self.gather(*args, state_dtype(np.float32))))


def _assign(dest, values) -> None:
    dest[...] = backend.to_device(values).reshape(dest.shape) if not isinstance(dest, np.ndarray) \
        else values.reshape(dest.shape)


def restore(path: str, strategy, comm, scaler=None, ledger: MemoryLedger | None = None) -> dict:
    """Load a checkpoint into a built ``strategy`` on this rank (no collective: every rank reads its part).

    Restores parameters, m, v, masters, step counts, the loss scaler, the dropout generator, pruning masks and
    MoE's routing biases.
    Returns ``{"folder", "step", "applied", "pruner", "notes", "load_peak", "bytes_read", "manifest"}``.
    Raises CheckpointError: a piece is missing, or the model/optimizer do not match.
    """
    ledger = ledger if ledger is not None else MemoryLedger()
    reader = ShardReader(path, ledger)
    man, notes = reader.manifest, []
    for slot in slots(strategy, "load"):
        reader.load_into(slot)
    strategy.opt.set_step(man["applied"])
    if scaler is not None and man.get("scaler"):
        scaler.load_state_dict(man["scaler"])
    fp8 = {name: h for f in man["files"] for name, h in f.get("fp8", {}).items()}  # by layer name, any layout
    if load_fp8_state(strategy.stage, fp8):
        notes.append("FP8 delayed scaling: no saved amax history for some layers; they start afresh")
    routing = {name: b for f in man["files"] for name, b in f.get("routing", {}).items()}
    if load_routing_state(strategy.stage, routing):
        raise CheckpointError(f"{reader.folder}: no saved routing biases for some MoE layers (a checkpoint of "
                              "a model without them)")
    topo = strategy.topo
    lay = man["layout"]  # topo.dp: the data group, dp x cp ranks
    same = [lay["dp"] * lay.get("cp", 1), lay["tp"], lay["pp"]] == [topo.dp, topo.tp, topo.pp]
    states = [f.get("rng") for f in man["files"]]
    # a checkpoint written before the counter-based generator holds NumPy PCG64's state: no (key, offset)
    earlier = not all(isinstance(r, dict) and "key" in r for r in states)
    state = None
    if not earlier and all(r == states[0] for r in states):
        state = states[0]  # one generator on every rank (masks addressed by site and row): any layout
    elif not earlier and same:  # per-rank states (saved before the addressing): each rank its own
        state = next((f["rng"] for f in man["files"] if f["rank"] == comm.rank), None)
        if strategy.stage.config.dropout > 0:
            notes.append("dropout generator: each rank's own state restored (saved before masks were addressed by "
                         "site and row), so the masks are not one process's")
    if state is not None:
        set_rng_state(state)  # the counter-based generator's (key, offset): plain ints, exact through JSON
    else:
        manual_seed(int(np.random.SeedSequence([man["train"]["seed"], man["step"]]).generate_state(1)[0]))
        if strategy.stage.config.dropout > 0:
            why = ("the checkpoint holds the earlier PCG64 dropout generator's state" if earlier
                   else "the layout changed and its ranks hold different states (saved before masks were addressed)")
            notes.append(f"dropout generator re-seeded from (seed, step): {why}, "
                         "so the masks differ from the uninterrupted run's")
    pruner = None
    if man.get("pruning"):
        pr = man["pruning"]
        shapes = {k: tuple(v) for k, v in pr["shapes"].items()}
        pruner = Pruner.from_masks(strategy.stage, reader.pruning_masks(), shapes, pr["sparsity"], pr["scope"])
    if (not same or reader.requantized) and any(pc["format"] == "8bit" for pc in man["pieces"]):  # or block size
        notes.append("8-bit Adam state: copied exactly where the block grid is unchanged, else dequantized and "
                     "requantized")
    return {"folder": reader.folder, "step": man["step"], "applied": man["applied"], "pruner": pruner,
            "notes": notes, "load_peak": ledger.peak_total, "bytes_read": reader.bytes_read,
            "manifest": man}


def full_tensor(reader: ShardReader, name: str, kind: str = "param"):
    """The whole parameter ``name`` (its full shape) in its saved dtype, assembled from every piece."""
    shape = reader.shape(name)
    dtype = np.dtype(reader.by_param[(kind, name)][0]["dtype"]) if reader.by_param.get((kind, name)) else None
    if dtype is None or dtype == np.uint8:
        dtype = np.dtype(reader.manifest["params"][name]["dtype"])
    return reader.gather(kind, name, None, 0, math.prod(shape), dtype).reshape(shape)
