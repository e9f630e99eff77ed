"""Interleaved 1F1B: each rank holds v non-adjacent chunks of layers (virtual stage c*p + r is chunk c of rank r).

This file places the chunks; ``pipeline.PipelineEngine`` runs them, every send non-blocking (``comm.isend``);
bubble (p-1)/(v m) of the ideal time at v times the messages. Source: Narayanan et al., arXiv:2104.04473, section
2.2.2, figure 4; Megatron-LM ``forward_backward_pipelining_with_interleaving``.
"""
from __future__ import annotations

from minizero.nn.module import Module, ModuleDict
from minizero.parallel.pipeline import PipelineStage, _Layers, stage_layers


def virtual_stages_of(rank: int, pp: int, v: int, v_shape: bool = False) -> list:
    """Rank ``rank``'s virtual stages of pp*v: c*pp + rank (round robin), or rank and 2pp-1-rank (ZB-V's V, v = 2)."""
    return [rank, 2 * pp - 1 - rank] if v_shape else [c * pp + rank for c in range(v)]


def rank_of_virtual_stage(k: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank holding virtual stage ``k`` (the inverse of :func:`virtual_stages_of`)."""
    return (k if k < pp else 2 * pp - 1 - k) if v_shape else k % pp


def rank_of_layer(n_layer: int, pp: int, v: int, layer: int, v_shape: bool = False) -> int:
    """The pipeline rank holding block ``layer`` when pp*v virtual stages are dealt round-robin (or in a V)."""
    n = pp * (2 if v_shape else v)
    return rank_of_virtual_stage(next(k for k in range(n) if layer in stage_layers(n_layer, n, k)), pp, v_shape)


class InterleavedStage(Module):
    """One rank's v chunks of a GPT (:func:`virtual_stages_of`), as one Module with the model's names.

    ``chunks``: its v :class:`PipelineStage` s, in chunk order. Attributes as :class:`PipelineStage`, plus
    ``virtual_stages`` (v) and ``v_shape`` (chunks placed in a V, as ZB-V).
    """

    def __init__(self, chunks: list, num_stages: int, v_shape: bool = False):
        super().__init__()
        first, last = chunks[0], chunks[-1]
        self.config, self.num_stages, self.virtual_stages = first.config, num_stages, len(chunks)
        self.v_shape = v_shape
        self.stage = first.stage % num_stages
        self.is_first, self.is_last = first.is_first, last.is_last
        self.layers = [i for c in chunks for i in c.layers]
        mods = {k: first.transformer[k] for k in ("wte", "wpe", "drop")} if first.is_first else {}
        mods["h"] = _Layers({str(i): blk for c in chunks for i, blk in zip(c.layers, c.transformer["h"])})
        if last.is_last:
            mods["ln_f"] = last.transformer["ln_f"]
        self.transformer = ModuleDict(mods)
        if last.is_last:
            self.lm_head, self.loss = last.lm_head, last.loss
        self.chunks = list(chunks)  # a list, not submodules: their modules are registered above

    @property
    def sequence_shards(self) -> int:
        return self.chunks[0].sequence_shards

    def activation_shape(self, idx_shape) -> tuple:
        return self.chunks[0].activation_shape(idx_shape)

    def rank_of_layer(self, layer: int) -> int:
        """The pipeline rank holding block ``layer`` under this stage's placement."""
        return rank_of_layer(self.config.n_layer, self.num_stages, self.virtual_stages, layer, self.v_shape)

    def swap_modules(self, fn, memo=None) -> list[str]:
        """:meth:`Module.swap_modules`, the chunks' own references replaced too (by the same new modules)."""
        memo = {} if memo is None else memo
        done = super().swap_modules(fn, memo)
        for chunk in self.chunks:
            chunk.swap_modules(fn, memo)
        return done

    def forward(self, x, targets=None):  # pragma: no cover - the engine runs the chunks
        raise TypeError("an InterleavedStage runs chunk by chunk: use PipelineEngine")


def refuse_interleaved(stage, what: str) -> None:
    """Raise TypeError for a built :class:`InterleavedStage`: ``what`` replaces a stage's own embedding and head
    (not by ``swap_modules``) and sets its attributes, which its chunks would not see."""
    if isinstance(stage, InterleavedStage):
        raise TypeError(f"{what} splits one pipeline stage, not an InterleavedStage: call it on each of its chunks "
                        "before building the InterleavedStage (as three_d.build_stage does)")


def interleave(model, rank: int, pp: int, v: int, v_shape: bool = False) -> list:
    """The :class:`PipelineStage` chunks of ``model`` for pipeline rank ``rank``,
    each with ``prev_rank``/``next_rank``."""
    ks = virtual_stages_of(rank, pp, v, v_shape)
    chunks = [PipelineStage(model, k, len(ks) * pp) for k in ks]
    for k, chunk in zip(ks, chunks):
        chunk.prev_rank = None if chunk.is_first else rank_of_virtual_stage(k - 1, pp, v_shape)
        chunk.next_rank = None if chunk.is_last else rank_of_virtual_stage(k + 1, pp, v_shape)
    return chunks


def tie_ends(chunks: list) -> None:
    """In a V rank 0 holds both ends: its last chunk's head takes the first chunk's embedding Parameter (tied).

    Call after tensor/vocabulary splitting and ``attach_inits``.
    """
    if len(chunks) > 1 and chunks[0].is_first and chunks[-1].is_last:
        chunks[-1].lm_head.weight = chunks[0].transformer["wte"].weight
