"""dspzoo.core: the parallel layer (mesh, collectives, layouts, planner, strategies, accounting).

Knows nothing about any domain. The paper's four-function API is :func:`sp_dataloader`,
:func:`split`, :func:`gather` and :func:`switch`; :class:`SeqParallel` adds named dims, plans
and strategies on top.
"""

from .comm import gather, gather_for_local_use, set_debug, split, switch, switch_async
from .data import sp_dataloader
from .layout import SeqSpec, shard_sizes
from .loss import sp_mean, sp_mse, sp_report
from .mesh import SPMesh, build_mesh, seed_everything, single_process_mesh, sp_generator
from .plan import Plan, Stage, plan_stages
from .runtime import SeqParallel, SeqTensor
from .sharded_rng import ShardBlock, shard_block, sharded_dropout, sharded_uniform
from .trace import SavedTensorMeter, comm_region, trace_comm

__all__ = [
    "Plan",
    "SPMesh",
    "SavedTensorMeter",
    "SeqParallel",
    "SeqSpec",
    "SeqTensor",
    "ShardBlock",
    "Stage",
    "build_mesh",
    "comm_region",
    "gather",
    "gather_for_local_use",
    "plan_stages",
    "seed_everything",
    "set_debug",
    "shard_block",
    "shard_sizes",
    "sharded_dropout",
    "sharded_uniform",
    "single_process_mesh",
    "sp_dataloader",
    "sp_generator",
    "sp_mean",
    "sp_mse",
    "sp_report",
    "split",
    "switch",
    "switch_async",
    "trace_comm",
]
