"""ZeRO: a base (units, shards, the sharded step) and three stages, each adding exactly its own work.

Read in order: ``shards.py`` (units, who owns what), ``base.py`` (the step on the owned shard),
``stage1.py`` (optimizer state sharded), ``stage2.py`` (gradients reduce-scattered in backward),
``stage3.py`` (parameters gathered before use, freed after). ``collectives.py`` (the unit
collectives and their order check) and ``overlap.py`` (prefetch, overlapped reduce-scatter) are
helpers the stages hold. Source: Rajbhandari et al., SC 2020 (arXiv:1910.02054).
"""
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
           "gather_figures", "STEP_PHASES", "PHASES"]


def zero_optimizer(model, comm, stage: int, **kwargs) -> ZeroOptimizer:
    """The ZeRO optimizer of ``stage`` (1, 2, 3) over ``comm``; ``kwargs`` as :class:`ZeroOptimizer`'s.

    Raises: ValueError for another stage, before any work.
    """
    if stage not in STAGES:
        raise ValueError(f"ZeroOptimizer: stage={stage!r}; allowed: 1, 2, 3 (stage 0 is DataParallel + AdamW)")
    return STAGES[stage](model, comm, **kwargs)
