"""The strategy the estimator takes: how a job is laid out for one optimizer step (the model: ``model.py``)."""
from __future__ import annotations

import dataclasses
import numbers

from minizero.memory.estimator.model import (ATTENTIONS, CP_ATTENTIONS, OFFLOAD, OFFLOAD_TIERS, OPTIMIZERS,
                                             PRECISIONS, QUANT_BLOCK, RECOMPUTE, SCHEDULES, ZERO_STAGES, ModelShape,
                                             as_shape)


# ---- the strategy -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the training job is laid out, for one optimizer step.

    World size = dp * cp * tp * pp; each rank runs ``micro_batches`` (m) of ``micro_batch`` (b) sequences per step.

    Fields:
        dp, tp, pp, cp: parallel sizes (gradients averaged and ZeRO sharded over :attr:`data_ranks` = dp x cp).
        zero: ZeRO stage 0-3 over the data ranks.  sequence_parallel: needs tp > 1.
        recompute: "none", "selective" or "full".  precision: "mixed" (K = 12), "fp32" (K = 8), "fp64" (K = 16),
            "bf16" or "fp8" (K = 8; float32 weights, narrow Linear saves: :data:`LINEAR_SAVES`).
        optimizer: "adam" or "adam8bit".  attention: "dense" or "flash".
        offload: "none", "optimizer" (optimizer state; ZeRO-Offload) or "params" (needs zero 3; ZeRO-Infinity).
        offload_activations: saved activations in host memory.  offload_tier: "cpu" or "nvme".
        schedule: "1f1b", "gpipe" or "interleaved" (``virtual_stages`` chunks per rank).
        cp_attention: "ring" or "ulysses" (all-to-all to head shards: cp must divide n_head / tp and n_kv_head / tp).
        bucket_bytes: gradient reduce buffer size; None: one flat buffer of all gradients.
        overlap: ZeRO 2-3 overlapped (two gradient buckets, ZeRO-3 prefetch), counted by "minizero" when dp > 1.
        ep: E/ep routed experts per rank, reduced and ZeRO-sharded over data_ranks / ep (``--ep``; divides dp, E).
        dp_shard: hybrid sharding's group in dp ranks (ZeRO over dp_shard x cp ranks; ``--dp-shard``; None: all).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "mixed"
    optimizer: str = "adam"
    offload: str = "none"
    offload_activations: bool = False
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    bucket_bytes: int | None = None
    offload_tier: str = "cpu"
    overlap: bool = False
    cp: int = 1
    attention: str = "dense"
    cp_attention: str = "ring"
    ep: int = 1
    dp_shard: int | None = None

    @property
    def world_size(self) -> int:
        """dp * cp * tp * pp ranks."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """dp * cp: the ranks one parameter shard is replicated on (gradient average, ZeRO's shards)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """N: the ranks ZeRO shards over (``dp_shard`` below dp: its data ranks x cp; else all :attr:`data_ranks`)."""
        return self.dp_shard * self.cp if self.dp_shard is not None and self.dp_shard < self.dp else self.data_ranks

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks ZeRO shards a routed expert over: N/ep, the shard ranks that hold it (DeepSpeed-MoE)."""
        return self.shard_ranks // self.ep

    @property
    def replicas(self) -> int:
        """R = data_ranks / N: the shard groups each ZeRO shard is replicated on (1 without hybrid sharding)."""
        return self.data_ranks // self.shard_ranks

    def validate(self, model: ModelShape | None = None) -> "Strategy":
        """Check every field (and divisibility by ``model``'s shape); return self.

        Raises:
            ValueError: naming the bad field, its value, and what is allowed.
        """
        for f in ("dp", "tp", "pp", "cp", "micro_batch", "micro_batches", "virtual_stages", "ep"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # dp=True was one data rank
                raise ValueError(f"Strategy.{f} must be a positive integer, got {v!r}")
        choices = [("zero", ZERO_STAGES), ("recompute", RECOMPUTE), ("precision", tuple(PRECISIONS)),
                   ("optimizer", OPTIMIZERS), ("offload", OFFLOAD), ("schedule", SCHEDULES),
                   ("offload_tier", OFFLOAD_TIERS), ("attention", ATTENTIONS),
                   ("cp_attention", CP_ATTENTIONS)]
        for f, allowed in choices:
            if getattr(self, f) not in allowed:
                raise ValueError(f"Strategy.{f}={getattr(self, f)!r} is not one of {allowed}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it splits along s over the tensor group)")
        if self.offload == "params" and self.zero != 3:
            raise ValueError(f"offload='params' needs zero=3 (ZeRO-Infinity), got zero={self.zero}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved'")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"Strategy.overlap must be True or False, got {self.overlap!r}")
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 or None, got {self.bucket_bytes}")
        if self.dp % self.ep:
            raise ValueError(f"Strategy.ep={self.ep} must divide dp={self.dp} (an expert group is ep data ranks)")
        if self.dp_shard is not None:
            n = self.dp_shard
            if not isinstance(n, int) or n < 1 or self.dp % n:
                raise ValueError(f"Strategy.dp_shard={n!r} must be None or a positive divisor of dp={self.dp}")
            if n < self.dp and (self.zero < 1 or n * self.cp % self.ep):
                raise ValueError(f"Strategy.dp_shard={n} < dp={self.dp} (hybrid sharding) needs zero >= 1 and "
                                 f"dp_shard x cp a multiple of ep; got zero={self.zero}, cp={self.cp}, ep={self.ep}")
        if model is not None:
            chunks = self.pp * self.virtual_stages
            if model.n_layer % chunks:
                raise ValueError(f"{model.n_layer} layers do not split into pp x virtual_stages = {chunks} "
                                 f"equal pipeline chunks")
            for f in ("n_head", "n_kv_head", "ffn_hidden"):
                if getattr(model, f) % self.tp:
                    raise ValueError(f"tp={self.tp} does not divide {f}={getattr(model, f)}")
            if self.ep > 1 and (not model.experts or model.experts % self.ep):
                raise ValueError(f"Strategy.ep={self.ep} must divide {model.name}'s {model.experts} experts per MoE "
                                 f"layer" + ("" if model.experts else " (a dense model: use ep=1)"))
            if self.cp_attention == "ulysses" and ((model.n_head // self.tp) % self.cp
                                                   or (model.n_kv_head // self.tp) % self.cp):
                raise ValueError(f"cp_attention='ulysses' needs cp={self.cp} to divide the {model.n_head // self.tp} "
                                 f"heads and {model.n_kv_head // self.tp} KV heads per tensor rank")
        return self


def element_bytes(strategy: Strategy) -> tuple[int, int, int, float]:
    """(param, grad, activation, optimizer-state K) bytes per element for the strategy's precision."""
    p, g, act, master, moment = PRECISIONS[strategy.precision]
    if strategy.optimizer == "adam8bit":
        k = master + 2 * (1 + 4 / QUANT_BLOCK)
    else:
        k = master + 2 * moment
    return p, g, act, k


def expert_tp(strategy: Strategy, accounting: str) -> int:
    """The tensor ranks an expert is split over: t in the paper accounting (Megatron-Core's expert tensor
    parallelism), 1 in ``"minizero"``'s (its trainer replicates the MoE layer in the tensor group)."""
    return strategy.tp if accounting == "paper" else 1


def seq_len_at(model, strategy: Strategy, seq_len, stage) -> int:
    """``seq_len`` (None: the model's), after ValueError naming a bad ``seq_len`` or ``stage`` (None: every stage)."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1):
        raise ValueError(f"seq_len={seq_len!r}; allowed: an int >= 1, or None for the model's {model.seq_len}")
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, numbers.Integral)
                              or not 0 <= stage < strategy.pp):
        raise ValueError(f"stage must be in [0, {strategy.pp}), got {stage!r}")
    return model.seq_len if seq_len is None else int(seq_len)


def layer_shape_and_seq_len(model, seq_len, **fields) -> tuple[ModelShape, int]:
    """(``model``'s shape, :func:`seq_len_at`) once ``Strategy(**fields)`` validates: ``layer_activation_bytes``'s
    check (micro_batch=-1, recompute='x' and tp=0 gave numbers or ZeroDivisionError there before)."""
    m = as_shape(model)
    return m, seq_len_at(m, Strategy(**fields).validate(), seq_len, None)
