"""``TrainConfig``: everything one training run is asked to do, typed, in one object.

The command line (:mod:`minizero.flags`, one ``add_argument`` per flag) is the one table of flags and
their defaults; each flag has one field here of the same name, whose default is read from that table,
so adding a flag is one table entry plus one field. :func:`minizero.args.parse_args` fills the fields
the flags leave open (dp/tp/pp, grad_accum, batch_size, warmup, min_lr, json, save_dir, comm),
``world_size`` and ``derived`` (which of those it computed); the loop, the strategy and the report read
attributes, never ``getattr`` with a default.
"""
from __future__ import annotations

import argparse
import dataclasses

from minizero.flags import flag_defaults
from minizero.parallel.expert_parallel import MoEConfig

_D = flag_defaults()  # the flag table's defaults (LATE_DEFAULTS' for the flags the parser leaves None)


@dataclasses.dataclass
class TrainConfig:
    # model and numbers
    model: str = _D["model"]
    block_size: int | None = _D["block_size"]
    dropout: float | None = _D["dropout"]
    dtype: str = _D["dtype"]
    device: str = _D["device"]
    # steps and batch: B = micro_batch_size x dp x grad_accum
    steps: int = _D["steps"]
    micro_batch_size: int = _D["micro_batch_size"]
    grad_accum: int | None = _D["grad_accum"]
    batch_size: int | None = _D["batch_size"]
    # layout
    dp: int | None = _D["dp"]
    tp: int | None = _D["tp"]
    sequence_parallel: bool = _D["sequence_parallel"]
    cp: int = _D["cp"]
    cp_attention: str = _D["cp_attention"]
    ulysses: int | None = _D["ulysses"]
    pp: int | None = _D["pp"]
    micro_batches: int | None = _D["micro_batches"]
    schedule: str = _D["schedule"]
    virtual_stages: int = _D["virtual_stages"]
    pp_verbose: bool = _D["pp_verbose"]
    # optimizer and schedule
    lr: float = _D["lr"]
    min_lr: float | None = _D["min_lr"]
    warmup: int | None = _D["warmup"]
    weight_decay: float = _D["weight_decay"]
    grad_clip: float = _D["grad_clip"]
    seed: int = _D["seed"]
    data: str | None = _D["data"]
    documents: str = _D["documents"]  # --pack | --pad
    eval_every: int = _D["eval_every"]
    eval_batches: int = _D["eval_batches"]
    # communication
    bucket_mb: float = _D["bucket_mb"]
    overlap: bool = _D["overlap"]
    trace: str | None = _D["trace"]
    native_comm: bool = _D["native_comm"]
    comm: str | None = _D["comm"]
    comm_timeout: float = _D["comm_timeout"]
    allreduce: str = _D["allreduce"]
    flight_records: int = _D["flight_records"]  # debugging (minizero.debug)
    debug_collectives: bool = _D["debug_collectives"]
    check_replicas: int | None = _D["check_replicas"]
    detect_anomaly: bool = _D["detect_anomaly"]
    loss_spike: float = _D["loss_spike"]
    # memory
    zero: int = _D["zero"]
    dp_shard: int | None = _D["dp_shard"]  # None until resolve_parallel_args: dp
    show_shards: bool = _D["show_shards"]
    precision: str = _D["precision"]
    fp8_scaling: str = _D["fp8_scaling"]
    initial_loss_scale: float = _D["initial_loss_scale"]
    loss_scale_window: int = _D["loss_scale_window"]
    hysteresis: int = _D["hysteresis"]
    min_loss_scale: float = _D["min_loss_scale"]
    recompute: str = _D["recompute"]
    recompute_every: int = _D["recompute_every"]
    attention: str = _D["attention"]
    attention_block: int = _D["attention_block"]
    offload_activations: str = _D["offload_activations"]
    offload_optimizer: str = _D["offload_optimizer"]
    offload_dir: str | None = _D["offload_dir"]
    optimizer: str = _D["optimizer"]
    adam8bit_block_size: int = _D["adam8bit_block_size"]
    quantized_comm: bool = _D["quantized_comm"]
    moe_experts: int = _D["moe_experts"]
    moe_top_k: int = _D["moe_top_k"]
    moe_capacity_factor: float = _D["moe_capacity_factor"]
    moe_every: int = _D["moe_every"]
    moe_aux_loss: float = _D["moe_aux_loss"]
    moe_z_loss: float = _D["moe_z_loss"]
    moe_bias_update: float = _D["moe_bias_update"]
    ep: int = _D["ep"]
    prune_sparsity: float = _D["prune_sparsity"]
    prune_scope: str = _D["prune_scope"]
    prune_step: int = _D["prune_step"]
    # outputs and checkpoints
    out: str = _D["out"]
    json: str | None = _D["json"]
    sample_tokens: int = _D["sample_tokens"]
    prompt: str = _D["prompt"]
    progress: str = _D["progress"]
    log_every: int | None = _D["log_every"]
    no_progress: bool = _D["no_progress"]
    no_save: bool = _D["no_save"]
    tracemalloc: bool = _D["tracemalloc"]
    no_tracemalloc: bool = _D["no_tracemalloc"]
    default_malloc: bool = _D["default_malloc"]
    save_every: int = _D["save_every"]
    save_dir: str | None = _D["save_dir"]
    keep: int = _D["keep"]
    resume: str | None = _D["resume"]
    # filled by parse_args
    world_size: int = 1
    derived: tuple = ()  # of batch_size, warmup, min_lr: those parse_args computed, their flag not given

    def hybrid_sharding(self) -> bool:
        """Whether ZeRO shards over groups of --dp-shard data ranks and replicates across them (zero/hybrid.py)."""
        return self.dp_shard is not None and self.dp_shard < self.dp

    def moe_config(self) -> MoEConfig | None:
        """The --moe-* flags as a :class:`MoEConfig`; None with --moe-experts 0 (dense MLPs)."""
        if not self.moe_experts:
            return None
        return MoEConfig(self.moe_experts, self.moe_top_k, self.moe_capacity_factor, self.moe_every,
                         self.moe_aux_loss, self.moe_z_loss, self.moe_bias_update)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "TrainConfig":
        """The parser's result as a TrainConfig. Raises TypeError naming a flag that has no field."""
        missing = sorted(set(vars(ns)) - {f.name for f in dataclasses.fields(cls)})
        if missing:
            raise TypeError(f"flag(s) {missing} have no TrainConfig field: add one to minizero/config.py")
        return cls(**vars(ns))
