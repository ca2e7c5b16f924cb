"""Workloads of zoo models by name: the cost model's view of a registered model (``dspzoo
plan``, the benchmark). Lives in the zoo because it resolves names and loads families; the
cost model itself (``dspzoo.core.costmodel``) only describes what a domain's builder returns.
"""

from __future__ import annotations

from typing import Any

from dspzoo.core.costmodel.workload import Workload, workload_builder

from .registry import count_parameters, create_model, get_config, override_config, resolve_name


def count_params(name: str, **overrides: Any) -> int:
    """Parameters of zoo model ``name`` (built on the meta device: no memory)."""
    return count_parameters(create_model(name, device="meta", **overrides))


def workload_for(
    name: str,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    seq_len: int | None = None,
    context: int = 0,
    itemsize: int = 4,
    overrides: dict[str, Any] | None = None,
) -> Workload:
    """The workload of zoo model ``name`` (e.g. ``"stdit-720M"``, ``"bytelm-lss-12l"``).

    Video models take ``frames`` (latent frames) and ``spatial`` (latent size); text models
    ``seq_len``. ``overrides`` replace config fields (as ``create_model`` does).
    """
    name = resolve_name(name)
    config = override_config(get_config(name), **(overrides or {}))
    params = count_params(name, **(overrides or {}))
    family = name.split("-", 1)[0]
    return workload_builder(family)(
        name,
        config,
        batch=batch,
        frames=frames,
        spatial=spatial,
        seq_len=seq_len,
        context=context,
        itemsize=itemsize,
        params=params,
    )
