"""Autoregressive forecasts from a trained weather model, their files and pictures.

:func:`rollout` feeds the model its own predictions: from the observed states up to ``t0`` it
predicts ``t0 + lead``, appends it, slides the window and repeats. Every rank of an SP group
passes the same full window and gets the same full state back (the model shards and gathers
inside), so the rollout under DSP equals the one-process rollout. :func:`forecast_from` runs it
from one initial time of the data the model was trained on and scores every step against the
truth, persistence and the climatology; :func:`write_netcdf` stores it with CF attributes and
:func:`plot_maps` / :func:`plot_rmse` draw the maps (forecast, truth, error) and the RMSE
against lead time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import WeatherDataError
from .metrics import rmse
from .training import WeatherData


@torch.no_grad()
def rollout(
    model: torch.nn.Module,
    observed: torch.Tensor,
    steps: int,
    lead: int,
    stride: int,
    static: torch.Tensor | None = None,
    sp: Any = None,
) -> torch.Tensor:
    """Autoregressive forecast ``[steps, C, lat, lon]`` (normalised) at ``t0 + k·lead``.

    Args:
        model: a weather model taking ``(x [B, T, C, lat, lon], lead_time [B], static, sp)``.
        observed: normalised, NaN-free states ``[P, C, lat, lon]`` at every time step up to and
            including ``t0``, ``P >= (history − 1)·stride + 1``.
        steps: how many forecasts of ``lead`` steps to chain.
        lead, stride: the model's lead time and its window's stride, in time steps; the
            windows of later steps reuse forecasts only when ``stride`` is a multiple of
            ``lead``.
        static: ``[K, lat, lon]`` static fields or ``None``.
        sp: the SP context (``None``: one process).
    """
    history = model.config.history
    span = (history - 1) * stride
    if observed.shape[0] < span + 1:
        raise WeatherDataError(
            f"the rollout needs {span + 1} observed states (history {history}, stride {stride}); "
            f"got {observed.shape[0]}"
        )
    if stride % lead:
        raise WeatherDataError(
            f"an autoregressive rollout with lead {lead} needs a window stride that is a multiple "
            f"of it (the model's stride is {stride}); use --lead {stride} or a divisor of it"
        )
    known = {t - (observed.shape[0] - 1): observed[t] for t in range(observed.shape[0])}
    lead_time = torch.full((1,), float(lead), dtype=observed.dtype, device=observed.device)
    static_b = None if static is None else static[None]
    out = []
    for k in range(steps):
        now = k * lead  # time of the last input state, relative to t0
        window = torch.stack([known[now - (history - 1 - j) * stride] for j in range(history)])
        nxt = model(window[None], lead_time, static_b, sp=sp)[0]
        known[now + lead] = nxt
        out.append(nxt)
    return torch.stack(out)


@dataclass
class Forecast:
    """One rollout in physical units and its scores.

    Attributes:
        t0: index of the initial time in the data; ``valid``: indices of the valid times
            ``[steps]`` (may run past the data's end).
        leads: ``[steps]`` lead in time steps.
        forecast, truth, persistence, climatology: ``[steps, C, lat, lon]`` (truth NaN past
            the end of the data or where missing).
        rmse: name → ``[steps, C]`` latitude-weighted RMSE of each forecast (NaN without truth).
    """

    trajectory: int
    t0: int
    valid: np.ndarray
    leads: np.ndarray
    forecast: np.ndarray
    truth: np.ndarray
    persistence: np.ndarray
    climatology: np.ndarray
    rmse: dict[str, np.ndarray]


def forecast_from(
    model: torch.nn.Module,
    data: WeatherData,
    trajectory: int,
    t0: int,
    steps: int,
    lead: int,
    sp: Any = None,
) -> Forecast:
    """Roll ``model`` out from time index ``t0`` of ``trajectory`` and score every step."""
    f, w = data.fields, data.window
    span = (w.history - 1) * w.stride
    if not 0 <= trajectory < f.values.shape[0]:
        raise WeatherDataError(
            f"trajectory {trajectory} does not exist; the data has {f.values.shape[0]} "
            f"({', '.join(f.names)})"
        )
    if not span <= t0 < f.values.shape[1]:
        raise WeatherDataError(
            f"initial time index {t0} ({f.years[min(max(t0, 0), len(f.years) - 1)]}) leaves no room "
            f"for {w.history} input states {w.stride} step(s) apart; the first possible is {span}"
        )
    normed = data.test.normed[trajectory, t0 - span : t0 + 1]
    device = next(model.parameters()).device
    static = torch.from_numpy(data.test.static).to(device) if data.test.num_static else None
    pred = rollout(model, torch.from_numpy(normed).to(device), steps, lead, w.stride, static, sp)
    phys = data.normalizer.denormalise(pred.float().cpu().numpy()).astype(np.float64)
    valid = t0 + lead * np.arange(1, steps + 1)
    inside = valid < f.values.shape[1]
    truth = np.full_like(phys, np.nan)
    truth[inside] = f.values[trajectory, valid[inside]]
    months = np.where(inside, f.months[np.minimum(valid, len(f.months) - 1)], 0)
    if not inside.all():  # months past the end of the data continue the calendar cycle
        step_months = (f.months[-1] - f.months[-2]) % 12 if len(f.months) > 1 else 0
        for k in np.flatnonzero(~inside):
            months[k] = (f.months[-1] - 1 + step_months * (valid[k] - len(f.months) + 1)) % 12 + 1
    clim = data.climatology.at(months)
    persistence = np.broadcast_to(f.values[trajectory, t0].astype(np.float64), phys.shape).copy()
    mask = np.isfinite(truth).astype(np.float64)
    scores = {}
    for name, fc in (("model", phys), ("persistence", persistence), ("climatology", clim)):
        per_step = np.full((steps, phys.shape[1]), np.nan)
        for k in np.flatnonzero(inside):
            per_step[k] = rmse(
                fc[k : k + 1], np.nan_to_num(truth[k : k + 1]), f.grid.lat, mask[k : k + 1]
            )
        scores[name] = per_step
    return Forecast(
        trajectory,
        t0,
        valid,
        lead * np.arange(1, steps + 1),
        phys,
        truth,
        persistence,
        clim,
        scores,
    )


def rollout_skill(
    model: torch.nn.Module,
    data: WeatherData,
    init_years: tuple[int, int],
    steps: int,
    lead: int = 1,
    sp: Any = None,
) -> dict[str, np.ndarray]:
    """RMSE per lead ``[steps, C]`` of rollouts from every initial year in ``init_years``
    (inclusive) of every trajectory: the square root of the mean MSE over initial times, as
    WeatherBench 2 averages; steps past the data's end are left out."""
    f = data.fields
    starts = np.flatnonzero((f.years >= init_years[0]) & (f.years <= init_years[1]))
    if starts.size == 0:
        raise WeatherDataError(f"no initial time in the years {init_years}")
    sums: dict[str, np.ndarray] = {}
    counts = np.zeros((steps, 1))
    for s in range(f.values.shape[0]):
        for t0 in starts:
            fc = forecast_from(model, data, s, int(t0), steps, lead, sp)
            seen = np.isfinite(fc.rmse["model"][:, :1])
            counts += seen
            for name, r in fc.rmse.items():
                sums[name] = sums.get(name, 0.0) + np.nan_to_num(r**2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {name: np.sqrt(total / counts) for name, total in sums.items()}


def _valid_times(data: WeatherData, fc: Forecast) -> np.ndarray:
    """Decoded valid times; past the data's end they continue with the data's last step."""
    times = data.fields.times
    step = times[-1] - times[-2] if len(times) > 1 else None
    out = []
    for v in fc.valid:
        out.append(times[v] if v < len(times) else times[-1] + step * int(v - len(times) + 1))
    return np.array(out)


def write_netcdf(data: WeatherData, fc: Forecast, path: str | Path) -> Path:
    """Write the forecast (and the truth where known) as CF-1.8 NetCDF with xarray.

    Variables: one per channel (``<channel>`` with ``@`` written ``_``) ``[time, lat, lon]``,
    and ``<channel>_truth``; coordinates ``time`` (valid time, the data's calendar), ``lead``
    (steps), ``lat``/``lon`` (ascending) and the initial time ``forecast_reference_time``.
    """
    import xarray as xr

    f = data.fields
    times = _valid_times(data, fc)
    coords = {
        "time": ("time", times, {"standard_name": "time", "long_name": "valid time"}),
        "lead": ("time", fc.leads.astype(np.int32), {"long_name": "lead time", "units": "1",
                                                      "comment": "in time steps of the data"}),
        "lat": ("lat", np.asarray(f.grid.lat), {"standard_name": "latitude", "units": "degrees_north"}),
        "lon": ("lon", np.asarray(f.grid.lon), {"standard_name": "longitude", "units": "degrees_east"}),
        "forecast_reference_time": ((), f.times[fc.t0], {"standard_name": "forecast_reference_time"}),
    }  # fmt: skip
    variables = {}
    for c, name in enumerate(f.channels):
        var = name.replace("@", "_")
        attrs = {"units": f.units[c], "long_name": f"forecast of {f.long_names[c]}"}
        variables[var] = (("time", "lat", "lon"), fc.forecast[:, c].astype(np.float32), attrs)
        tattrs = {"units": f.units[c], "long_name": f"{f.long_names[c]} (truth)"}
        variables[f"{var}_truth"] = (
            ("time", "lat", "lon"),
            fc.truth[:, c].astype(np.float32),
            tattrs,
        )
    ds = xr.Dataset(
        variables,
        coords=coords,
        attrs={
            "Conventions": "CF-1.8",
            "title": "dspzoo weathertx autoregressive forecast",
            "source": ", ".join(f.names),
            "trajectory": f.names[fc.trajectory],
        },
    )
    encoding = {}
    if f.time_attrs.get("calendar"):
        encoding["time"] = {
            "calendar": f.time_attrs["calendar"],
            "units": f.time_attrs.get("units", "days since 1970-01-01"),
        }
        encoding["forecast_reference_time"] = dict(encoding["time"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_netcdf(path, engine="h5netcdf", encoding=encoding)
    return path


def plot_maps(
    data: WeatherData,
    fc: Forecast,
    path: str | Path,
    channel: int = 0,
    steps: list[int] | None = None,
) -> Path:
    """PNG: rows = chosen forecast steps, columns = forecast, truth, error (forecast − truth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = data.fields
    n = len(fc.leads)
    steps = steps or sorted({0, n // 2, n - 1})
    lon, lat = np.asarray(f.grid.lon), np.asarray(f.grid.lat)
    extent = (lon[0], lon[-1], lat[0], lat[-1])
    fig, axes = plt.subplots(len(steps), 3, figsize=(9.6, 2.6 * len(steps)), squeeze=False)
    both = np.concatenate([fc.forecast[steps, channel].ravel(), fc.truth[steps, channel].ravel()])
    lo, hi = np.nanpercentile(both, [1, 99])
    err = fc.forecast[steps, channel] - fc.truth[steps, channel]
    bound = float(np.nanmax(np.abs(err))) if np.isfinite(err).any() else 1.0
    unit = f.units[channel]
    years = [str(t)[:10] for t in _valid_times(data, fc)]
    for row, k in enumerate(steps):
        panels = (
            (fc.forecast[k, channel], f"forecast, lead {fc.leads[k]} ({years[k]})", "viridis", lo, hi),
            (fc.truth[k, channel], "truth", "viridis", lo, hi),
            (err[row], f"error (RMSE {fc.rmse['model'][k, channel]:.2f} {unit})", "RdBu_r", -bound, bound),
        )  # fmt: skip
        for col, (field, title, cmap, vmin, vmax) in enumerate(panels):
            ax = axes[row, col]
            im = ax.imshow(
                field, origin="lower", extent=extent, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto"
            )
            ax.set_title(title, fontsize=8)
            ax.tick_params(labelsize=6)
            fig.colorbar(im, ax=ax, shrink=0.8).ax.tick_params(labelsize=6)
    fig.suptitle(
        f"{f.channels[channel]} [{unit}] from {str(f.times[fc.t0])[:10]} ({f.names[fc.trajectory]})",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_rmse(data: WeatherData, fc: Forecast, path: str | Path, channel: int = 0) -> Path:
    """PNG: latitude-weighted RMSE against lead time for the model, persistence, climatology."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, style in (("model", "o-"), ("persistence", "s--"), ("climatology", "^:")):
        ax.plot(fc.leads, fc.rmse[name][:, channel], style, label=name, markersize=3)
    unit = data.fields.units[channel]
    ax.set_xlabel("lead time (time steps of the data)")
    ax.set_ylabel(f"RMSE [{unit}]")
    ax.set_title(f"{data.fields.channels[channel]}: autoregressive rollout", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
