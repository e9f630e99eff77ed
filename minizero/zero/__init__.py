"""ZeRO: a base (units, shards, the sharded step) and three stages, each adding exactly its own work.

Read ``shards.py``, ``base.py``, ``stage1.py``, ``stage2.py``, ``stage3.py``; ``collectives.py`` and
``overlap.py`` are helpers the stages hold; ``hybrid.py`` shards over groups of N data ranks and replicates across
them (``--dp-shard``). Source: Rajbhandari et al., SC 2020 (arXiv:1910.02054).
"""
import numbers

from minizero.zero.base import ZeroOptimizer, gather_figures, model_state_bytes
from minizero.zero.collectives import PHASES, STEP_PHASES, ZeroOrderError
from minizero.zero.shards import Piece, ShardMap, Unit, find_units, model_state_formula, traffic_formula
from minizero.zero.stage1 import ZeroStage1
from minizero.zero.stage2 import ZeroStage2
from minizero.zero.stage3 import ZeroStage3

#: the class of each ZeRO stage (stage 0 is DataParallel + AdamW)
STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}

__all__ = ["ZeroOptimizer", "ZeroStage1", "ZeroStage2", "ZeroStage3", "STAGES", "zero_optimizer", "ZeroOrderError",
           "ShardMap", "Unit", "Piece", "find_units", "model_state_formula", "traffic_formula", "model_state_bytes",
           "gather_figures", "STEP_PHASES", "PHASES", "stage_class", "shards_parameters"]


def stage_class(stage: int):
    """The class of ZeRO ``stage`` (its ``shards``, ``holds_full_parameters``, ``quantized_collectives`` say what the
    stage does, for the header and the report); None for stage 0 (no ZeRO)."""
    return STAGES.get(stage)


def shards_parameters(stage: int) -> bool:
    """Whether ZeRO ``stage`` keeps only a shard of the parameters between steps (stage 3; not 0, no ZeRO)."""
    return stage in STAGES and not STAGES[stage].holds_full_parameters


def zero_optimizer(model, comm, stage: int, **kwargs) -> ZeroOptimizer:
    """The ZeRO optimizer of ``stage`` (1, 2, 3) over ``comm`` (``kwargs``: :class:`ZeroOptimizer`'s);
    else ValueError."""
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in STAGES:  # True: stage 1
        raise ValueError(f"ZeroOptimizer: stage={stage!r}; allowed: 1, 2, 3 (stage 0 is DataParallel + AdamW)")
    return STAGES[stage](model, comm, **kwargs)
