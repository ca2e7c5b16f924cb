"""Forecast scores as WeatherBench 2 defines them, and the persistence/climatology baselines.

* **Latitude weights** ``w(φ_i) ∝ sin φ_i⁺ − sin φ_i⁻``: the area of each latitude band between
  its cell edges, normalised to mean 1 over the latitudes. Inner edges are the midpoints
  between neighbouring latitudes; the outer edges lie half a spacing beyond the first and last
  latitude, clipped to ±90°. On a global equiangular grid (poles included or not) that puts the
  outer edges at ±90°, exactly WeatherBench 2's weights; a regional grid gets its own bands.
* **Spatial mean** of a field: ``Σ w·m·x / Σ w·m`` over (lat, lon), ``m`` the 0/1 mask of valid
  points (missing values do not count).
* **RMSE** per channel: ``sqrt( mean over forecast times of the weighted spatial MSE )``
  (the square root is taken after the time mean).
* **ACC** per channel: per forecast time the weighted, uncentred correlation of the forecast and
  observed anomalies from the climatology, ``⟨f′·o′⟩ / sqrt(⟨f′²⟩·⟨o′²⟩)`` with ``⟨·⟩`` the
  spatial mean, then the mean over forecast times. The climatology is the per-grid-point mean
  over the training years (per calendar month when the data has several steps a year). A
  forecast equal to the climatology has no anomaly: its ACC is undefined (NaN).

All arrays are ``numpy`` float, ``[N, C, lat, lon]`` (N forecast times, C channels).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def latitude_cell_edges(lat: Sequence[float]) -> np.ndarray:
    """``[len(lat) + 1]`` cell edges in degrees of ascending or descending latitudes."""
    lat = np.asarray(lat, dtype=np.float64)
    if lat.ndim != 1 or lat.size < 1:
        raise ValueError(f"latitudes must be a non-empty 1-D array, got shape {lat.shape}")
    if lat.size == 1:
        return np.array([-90.0, 90.0])
    mid = (lat[:-1] + lat[1:]) / 2
    first = lat[0] - (lat[1] - lat[0]) / 2
    last = lat[-1] + (lat[-1] - lat[-2]) / 2
    return np.clip(np.concatenate([[first], mid, [last]]), -90.0, 90.0)


def latitude_weights(lat: Sequence[float]) -> np.ndarray:
    """``[lat]`` area weights ``|sin(upper edge) − sin(lower edge)|``, normalised to mean 1."""
    edges = np.deg2rad(latitude_cell_edges(lat))
    area = np.abs(np.sin(edges[1:]) - np.sin(edges[:-1]))
    return area / area.mean()


def spatial_mean(x: np.ndarray, weights: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Weighted mean over the last two dims (lat, lon) of ``x`` ``[..., lat, lon]``.

    ``weights`` ``[lat]``; ``mask`` (0/1, broadcastable to ``x``) drops missing points. Where a
    field has no valid point the result is NaN.
    """
    w = np.broadcast_to(weights[:, None], x.shape[-2:]).astype(np.float64)
    m = np.ones_like(x, dtype=np.float64) if mask is None else np.broadcast_to(mask, x.shape)
    wm = w * m
    total = wm.sum(axis=(-2, -1))
    num = np.where(wm > 0, x * wm, 0.0).sum(axis=(-2, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, num / np.where(total > 0, total, 1.0), np.nan)


def rmse(
    forecast: np.ndarray, truth: np.ndarray, lat: Sequence[float], mask: np.ndarray | None = None
) -> np.ndarray:
    """``[C]`` WeatherBench-2 RMSE: sqrt of the time mean of the weighted spatial MSE."""
    _check(forecast, truth, lat)
    mse = spatial_mean((forecast.astype(np.float64) - truth) ** 2, latitude_weights(lat), mask)
    return np.sqrt(np.nanmean(mse, axis=0))


def acc(
    forecast: np.ndarray,
    truth: np.ndarray,
    climatology: np.ndarray,
    lat: Sequence[float],
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """``[C]`` WeatherBench-2 ACC: time mean of the weighted uncentred anomaly correlation.

    ``climatology`` ``[N, C, lat, lon]`` (or broadcastable): the climatology at each forecast's
    valid time.
    """
    _check(forecast, truth, lat)
    w = latitude_weights(lat)
    fa = forecast.astype(np.float64) - climatology
    oa = truth.astype(np.float64) - climatology
    num = spatial_mean(fa * oa, w, mask)
    den = np.sqrt(spatial_mean(fa * fa, w, mask) * spatial_mean(oa * oa, w, mask))
    with np.errstate(invalid="ignore", divide="ignore"):
        per_time = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
    if np.isnan(per_time).all(axis=0).any():
        # a channel with no defined correlation at any time (e.g. the climatology forecast)
        out = np.full(per_time.shape[1:], np.nan)
        ok = ~np.isnan(per_time).all(axis=0)
        out[ok] = np.nanmean(per_time[:, ok], axis=0)
        return out
    return np.nanmean(per_time, axis=0)


def _check(forecast: np.ndarray, truth: np.ndarray, lat: Sequence[float]) -> None:
    if forecast.shape != truth.shape:
        raise ValueError(f"forecast {forecast.shape} and truth {truth.shape} differ")
    if forecast.ndim != 4 or forecast.shape[-2] != len(lat):
        raise ValueError(
            f"expected [N, C, lat, lon] with lat = {len(lat)}, got {tuple(forecast.shape)}"
        )


# -- climatology ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Climatology:
    """Per-grid-point mean of the training years, per calendar month or for the whole year.

    ``values`` float64 ``[K, C, lat, lon]`` with K = 12 (``by_month``) or 1.
    """

    values: np.ndarray
    by_month: bool

    def at(self, months: np.ndarray) -> np.ndarray:
        """``[N, C, lat, lon]`` the climatology at valid times with these months (1–12)."""
        months = np.asarray(months)
        return self.values[months - 1] if self.by_month else self.values[np.zeros_like(months)]


def fit_climatology(
    values: np.ndarray, years: np.ndarray, months: np.ndarray, time_index: np.ndarray
) -> Climatology:
    """The climatology of ``values`` ``[S, N, C, lat, lon]`` over the times ``time_index``
    (the training years) of every trajectory, missing values ignored.

    Data with one step a year (annual means) gets one climatological state; data with several
    steps a year gets one per calendar month.
    """
    steps_per_year = np.bincount(years[time_index] - years.min()).max()
    subset = values[:, time_index].astype(np.float64)
    if steps_per_year <= 1:
        with np.errstate(invalid="ignore"):
            clim = np.nanmean(subset.reshape(-1, *subset.shape[2:]), axis=0)[None]
        return Climatology(clim, by_month=False)
    clim = np.full((12, *subset.shape[2:]), np.nan)
    for month in range(1, 13):
        sel = months[time_index] == month
        if sel.any():
            with np.errstate(invalid="ignore"):
                clim[month - 1] = np.nanmean(subset[:, sel].reshape(-1, *subset.shape[2:]), axis=0)
    return Climatology(clim, by_month=True)


# -- the evaluation table ---------------------------------------------------------------------


FORECASTS = ("model", "persistence", "climatology")


def score_table(
    forecasts: dict[str, np.ndarray],
    truth: np.ndarray,
    climatology: np.ndarray,
    mask: np.ndarray,
    leads: np.ndarray,
    channels: Sequence[str],
    lat: Sequence[float],
) -> list[dict[str, Any]]:
    """Rows ``{"forecast", "variable", "lead", "rmse", "acc", "n"}`` for every forecast,
    channel and lead time.

    ``forecasts``: name → ``[N, C, lat, lon]`` in physical units; ``truth``, ``climatology``
    (at each valid time), ``mask`` the same shape; ``leads`` ``[N]`` the lead of each row.
    """
    rows = []
    for lead in sorted(set(int(v) for v in leads)):
        sel = leads == lead
        for name, fc in forecasts.items():
            r = rmse(fc[sel], truth[sel], lat, mask[sel])
            a = acc(fc[sel], truth[sel], climatology[sel], lat, mask[sel])
            for c, channel in enumerate(channels):
                rows.append(
                    {
                        "forecast": name,
                        "variable": channel,
                        "lead": lead,
                        "rmse": float(r[c]),
                        "acc": None if math.isnan(a[c]) else float(a[c]),
                        "n": int(sel.sum()),
                    }
                )
    return rows


def markdown_table(rows: list[dict[str, Any]], units: dict[str, str] | None = None) -> str:
    """The rows as a markdown table (one line per variable, lead and forecast)."""
    units = units or {}
    lines = [
        "| variable | lead (steps) | forecast | RMSE | ACC | forecasts |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in sorted(
        rows,
        key=lambda r: (
            r["variable"],
            r["lead"],
            FORECASTS.index(r["forecast"]) if r["forecast"] in FORECASTS else 9,
        ),
    ):
        unit = units.get(row["variable"], "")
        acc_text = "n/a" if row["acc"] is None else f"{row['acc']:.3f}"
        lines.append(
            f"| {row['variable']} | {row['lead']} | {row['forecast']} | "
            f"{row['rmse']:.4f}{(' ' + unit) if unit else ''} | {acc_text} | {row['n']} |"
        )
    return "\n".join(lines)


def metric_dict(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Flat ``{"<forecast>/<variable>/lead<k>/<rmse|acc>": value}`` (for model cards)."""
    out = {}
    for row in rows:
        key = f"{row['forecast']}/{row['variable']}/lead{row['lead']}"
        out[f"{key}/rmse"] = row["rmse"]
        if row["acc"] is not None:
            out[f"{key}/acc"] = row["acc"]
    return out


def write_report(rows: list[dict[str, Any]], path_stem: Any, units: dict[str, str]) -> None:
    """Write ``<stem>.json`` and ``<stem>.md``."""
    from pathlib import Path

    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    stem.with_suffix(".md").write_text(markdown_table(rows, units) + "\n")
