"""Cost model and planner: exact bytes, FLOPs and memory per strategy and SP size, predicted
step time on a described cluster, the recommendation, and ``strategy="auto"``.

See ``docs/cost_model.md``.
"""

from .formulas import (
    CommCount,
    Flops,
    comm_bytes,
    comm_bytes_all_ranks,
    flops_per_rank,
    forward_flops,
    make_plan,
    model_state_bytes,
    ulysses_flat_bytes,
)
from .workload import StageSpec, Workload, text_workload, video_workload, workload_for

__all__ = [
    "CommCount",
    "Flops",
    "StageSpec",
    "Workload",
    "comm_bytes",
    "comm_bytes_all_ranks",
    "flops_per_rank",
    "forward_flops",
    "make_plan",
    "model_state_bytes",
    "text_workload",
    "ulysses_flat_bytes",
    "video_workload",
    "workload_for",
]
