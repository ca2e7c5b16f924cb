"""Workloads of zoo models by name: the cost model's view of a registered model (``dspzoo
plan``, the benchmark). Lives in the zoo because it resolves names and loads families; the
cost model itself (``dspzoo.core.costmodel``) only describes what a domain's builder returns.
"""

from __future__ import annotations

from typing import Any

from dspzoo.core.costmodel.workload import Workload, workload_builder

from ..core.errors import UsageError
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
    dims: dict[str, int] | None = None,
) -> Workload:
    """The workload of zoo model ``name`` (e.g. ``"stdit-720M"``, ``"bytelm-lss-12l"``).

    Video models take ``frames`` (latent frames) and ``spatial`` (latent size); text models
    ``seq_len``. ``overrides`` replace config fields (as ``create_model`` does). ``dims`` sets
    token lengths (after patching) by the model's own dim names, e.g. ``{"h": 64, "w": 64}``,
    on top of the sizes above; a family's builder reads only those sizes, so with ``dims`` and
    no sizes the builder is asked for its smallest workload and ``dims`` must name every dim.
    """
    name = resolve_name(name)
    config = override_config(get_config(name), **(overrides or {}))
    params = count_params(name, **(overrides or {}))
    builder = workload_builder(name.split("-", 1)[0])
    common = {"batch": batch, "context": context, "itemsize": itemsize, "params": params}
    sizes = {"frames": frames, "spatial": spatial, "seq_len": seq_len}
    try:
        wl = builder(name, config, **sizes, **common)
    except ValueError as exc:
        if not dims or any(v is not None for v in sizes.values()):
            raise
        wl = _smallest(builder, name, config, common, exc)
        missing = [d for d in wl.dims if d not in dims]
        if missing:
            raise UsageError(
                f"{name} has token dims {list(wl.dims)}: with dims alone name all of them "
                f"(missing {missing}), or give its sizes ({exc})"
            ) from None
    return with_dims(wl, dims) if dims else wl


def _smallest(builder: Any, name: str, config: Any, common: dict, error: ValueError) -> Workload:
    """The builder's workload at the smallest sizes it accepts (one frame of one pixel, or one
    token): the dim names and everything but the lengths, which ``dims`` then sets."""
    for sizes in ({"frames": 1, "spatial": 1, "seq_len": None}, {"seq_len": 1}):
        try:
            return builder(name, config, **{"frames": None, "spatial": None, **sizes}, **common)
        except ValueError:
            continue
    raise error


def with_dims(wl: Workload, dims: dict[str, int]) -> Workload:
    """``wl`` with the token lengths of the named dims replaced (a clear error for a dim the
    model does not have, or a length below 1)."""
    unknown = sorted(set(dims) - set(wl.dims))
    if unknown:
        raise UsageError(f"{wl.name} has token dims {list(wl.dims)}; dims names {unknown}")
    bad = {d: n for d, n in dims.items() if not isinstance(n, int) or n < 1}
    if bad:
        raise UsageError(f"token lengths must be integers >= 1, got {bad}")
    return wl.with_(lengths=tuple(dims.get(d, n) for d, n in zip(wl.dims, wl.lengths)))
