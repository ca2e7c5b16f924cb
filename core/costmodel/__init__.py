"""Cost model and planner: exact bytes, FLOPs and memory per strategy and SP size, predicted
step time on a described cluster, the recommendation, and ``strategy="auto"``.

See ``docs/cost_model.md``.
"""

from .cluster import CLUSTERS, PRESETS, Cluster, get_cluster, measure_this_cpu
from .formulas import (
    CommCount,
    Flops,
    activation_bytes,
    comm_bytes,
    comm_bytes_all_ranks,
    flops_per_rank,
    forward_flops,
    make_plan,
    model_state_bytes,
    ulysses_flat_bytes,
)
from .predict import (
    DEFAULT_STRATEGIES,
    Prediction,
    auto_plan,
    format_table,
    predict,
    predict_table,
    recommend,
)
from .workload import StageSpec, Workload, text_workload, video_workload, workload_for

__all__ = [
    "CLUSTERS",
    "DEFAULT_STRATEGIES",
    "PRESETS",
    "Cluster",
    "CommCount",
    "Flops",
    "Prediction",
    "StageSpec",
    "Workload",
    "activation_bytes",
    "auto_plan",
    "comm_bytes",
    "comm_bytes_all_ranks",
    "flops_per_rank",
    "format_table",
    "forward_flops",
    "get_cluster",
    "make_plan",
    "measure_this_cpu",
    "model_state_bytes",
    "predict",
    "predict_table",
    "recommend",
    "text_workload",
    "ulysses_flat_bytes",
    "video_workload",
    "workload_for",
]
