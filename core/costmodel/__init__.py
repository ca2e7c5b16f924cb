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
    elementwise_bytes,
    flops_per_rank,
    forward_flops,
    layout_copy_bytes,
    make_plan,
    model_state_bytes,
    ulysses_flat_bytes,
    unfused_score_bytes,
)
from .predict import (
    DEFAULT_STRATEGIES,
    TABLE_LEGEND,
    Prediction,
    auto_plan,
    default_strategies,
    format_table,
    merge_same_plans,
    micro_batches,
    predict,
    predict_table,
    recommend,
    stage_methods,
)
from .validation import FIGURES, format_validation, plain_alpha_beta, validation_table
from .workload import StageSpec, Workload, register_workload, workload_builder

__all__ = [
    "CLUSTERS",
    "DEFAULT_STRATEGIES",
    "default_strategies",
    "FIGURES",
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
    "elementwise_bytes",
    "flops_per_rank",
    "TABLE_LEGEND",
    "format_table",
    "format_validation",
    "forward_flops",
    "get_cluster",
    "layout_copy_bytes",
    "make_plan",
    "measure_this_cpu",
    "merge_same_plans",
    "stage_methods",
    "micro_batches",
    "model_state_bytes",
    "plain_alpha_beta",
    "predict",
    "predict_table",
    "recommend",
    "ulysses_flat_bytes",
    "unfused_score_bytes",
    "validation_table",
    "register_workload",
    "workload_builder",
]

_MOVED = {
    "workload_for": "dspzoo.zoo.workloads.workload_for",
    "video_workload": "dspzoo.domains.video.workload.video_workload",
    "text_workload": "dspzoo.domains.text.workload.text_workload",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(
            f"dspzoo.core.costmodel.{name} moved to {_MOVED[name]} (the cost model no longer "
            f"imports the zoo or the domains)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
