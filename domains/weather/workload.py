"""The cost model's view of a WeatherTransformer step (``dspzoo plan``, ``comm_bytes``).

Registered with :func:`dspzoo.core.costmodel.workload.register_workload` by the package, so
``workload_for("weathertx-global-1.40625", frames=2, spatial=(128, 256))`` and
``dspzoo plan weathertx-global-1.40625 --sp 8 --history 2 --grid 128x256`` describe it.
"""

from __future__ import annotations

from typing import Any

from dspzoo.core.costmodel.workload import StageSpec, Workload

from ...core.errors import UsageError
from .layers import patch_grid
from .model import WeatherConfig, layer_stages


def weather_workload(
    name: str,
    config: WeatherConfig,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """Workload of one step on ``frames`` input states (default ``config.history``) of a
    ``spatial`` ``(lat, lon)`` grid (default ``config.grid``).

    Token dims ``(t, y, x)`` = states and lat/lon patches; every layer is the model's own
    stages (:func:`~.model.layer_stages`: attention along ``t``, over ``y`` and ``x`` or
    ``y·x`` jointly, MLP); the head runs on, and the exit gathers, the ``V·p·p`` outputs of
    the last time step's tokens alone (``exit_last``, see :class:`~.model.WeatherTransformer`).
    The variable tokenisation before the first
    layer communicates nothing; its activations are not in :func:`activation_bytes` (measured
    in docs/weather_model.md).
    """
    if unused.get("seq_len") is not None:
        raise UsageError(
            f"{name} is a weather model: give --history (states) and --grid, not --seq-len"
        )
    grid = config.grid if spatial is None else spatial
    grid = (grid, grid) if isinstance(grid, int) else tuple(grid)
    history = frames or config.history
    period = layer_stages(config)
    layer = tuple(
        StageSpec(st, attention=st.mixes, tp_pairs=1)
        if st.mixes
        else StageSpec(st, mlp=True, tp_pairs=1)
        for st in period
    )
    pixels = config.patch * config.patch
    return Workload(
        name=name,
        family="weathertx",
        batch=batch,
        dims=("t", "y", "x"),
        lengths=(history, *patch_grid(grid, config.patch)),
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=tuple(layer for _ in range(config.depth)),
        period=period,
        in_width=(len(config.variables) + config.num_static) * pixels,
        exit_width=len(config.variables) * pixels,
        params=params,
        itemsize=itemsize,
        exit_last=("t",),
        extra={"grid": grid},
    )
