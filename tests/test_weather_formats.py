"""Weather files in every format a fresh install reads (NetCDF3 classic and 64-bit offset,
NetCDF4/HDF5, Zarr), the format named by its magic bytes, the hint naming the package that is
really missing, GRIB's convert-or-install message, and two training steps on a NetCDF3 file."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from dspzoo.domains.weather import data as weather_data
from dspzoo.domains.weather.data import WeatherDataError, file_format, load_fields

xr = pytest.importorskip("xarray")


def _dataset(years: int = 12, lat: int = 9, lon: int = 12) -> xr.Dataset:
    """Annual fields ``t`` (time, lat, lon) on a 360-day calendar with a trend and a wave."""
    rng = np.random.default_rng(0)
    yy, xx = np.meshgrid(np.linspace(0, 1, lat), np.linspace(0, 1, lon), indexing="ij")
    values = np.stack([280 + 0.1 * i + 3 * np.sin(6 * xx + i) * yy for i in range(years)])
    values = values + rng.normal(0, 0.2, values.shape)
    coords = {
        "time": (
            "time",
            np.arange(years) * 360.0 + 180.0,
            {"units": "days since 2000-01-01", "calendar": "360_day"},
        ),
        "lat": np.linspace(-40, 40, lat),
        "lon": np.linspace(0, 330, lon),
    }
    return xr.Dataset(
        {"t": (("time", "lat", "lon"), values.astype(np.float32), {"units": "K"})}, coords=coords
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same data written as NetCDF3 classic, NetCDF3 64-bit offset, NetCDF4 and Zarr."""
    folder = tmp_path_factory.mktemp("formats")
    ds = _dataset()
    paths = {
        "classic": folder / "classic.nc",
        "offset64": folder / "offset64.nc",
        "netcdf4": folder / "netcdf4.nc",
        "zarr": folder / "store.zarr",
    }
    ds.to_netcdf(paths["classic"], format="NETCDF3_CLASSIC", engine="scipy")
    ds.to_netcdf(paths["offset64"], format="NETCDF3_64BIT", engine="scipy")
    ds.to_netcdf(paths["netcdf4"], engine="h5netcdf")
    with warnings.catch_warnings():  # zarr 3 notes that consolidated metadata is an extension
        warnings.simplefilter("ignore")
        ds.to_zarr(paths["zarr"])
    return paths


def test_the_format_is_named_by_the_files_magic_bytes(files, tmp_path: Path) -> None:
    assert files["classic"].read_bytes()[:4] == b"CDF\x01"
    assert files["offset64"].read_bytes()[:4] == b"CDF\x02"
    assert file_format(files["classic"]) == "netcdf3"
    assert file_format(files["offset64"]) == "netcdf3"
    assert file_format(files["netcdf4"]) == "netcdf4"
    assert file_format(files["zarr"]) == "zarr"
    grib = tmp_path / "era5.grib"
    grib.write_bytes(b"GRIB" + bytes(60))
    assert file_format(grib) == "grib"
    assert file_format(tmp_path) is None  # a directory that is no Zarr store


def test_every_format_loads_the_same_fields(files) -> None:
    ref = load_fields(str(files["netcdf4"]), ["t"])
    assert ref.values.shape == (1, 12, 1, 9, 12)
    for kind in ("classic", "offset64", "zarr"):
        got = load_fields(str(files[kind]), ["t"])
        np.testing.assert_array_equal(got.values, ref.values, err_msg=kind)
        np.testing.assert_array_equal(got.years, ref.years, err_msg=kind)
        assert got.grid.shape == ref.grid.shape and got.channels == ref.channels


def test_a_missing_backend_is_named_for_the_files_format(files, monkeypatch) -> None:
    installed = weather_data._installed
    absent = {"scipy", "netCDF4", "zarr", "h5netcdf"}
    monkeypatch.setattr(weather_data, "_installed", lambda m: m not in absent and installed(m))
    with pytest.raises(WeatherDataError) as exc:
        load_fields(str(files["classic"]), ["t"])
    msg = str(exc.value)
    assert "classic.nc is a NetCDF3 (classic / 64-bit offset) file" in msg
    assert "pip install scipy or pip install netCDF4" in msg and "h5netcdf" not in msg
    with pytest.raises(WeatherDataError, match=r"NetCDF4/HDF5 file.*pip install h5netcdf h5py"):
        load_fields(str(files["netcdf4"]), ["t"])
    with pytest.raises(WeatherDataError, match=r"store.zarr is a Zarr store.*pip install zarr"):
        load_fields(str(files["zarr"]), ["t"])


def test_a_grib_file_says_convert_it_or_install_cfgrib(tmp_path: Path, monkeypatch) -> None:
    installed = weather_data._installed
    monkeypatch.setattr(weather_data, "_installed", lambda m: m != "cfgrib" and installed(m))
    grib = tmp_path / "era5.grib2"
    grib.write_bytes(b"GRIB" + bytes(200))
    with pytest.raises(WeatherDataError) as exc:
        load_fields(str(grib), ["t2m"])
    msg = str(exc.value)
    assert "era5.grib2 is a GRIB file, which needs cfgrib" in msg
    assert "grib_to_netcdf -o out.nc in.grib" in msg and "pip install cfgrib" in msg


def test_corrupt_netcdf3_names_its_format_and_engine(files, tmp_path: Path) -> None:
    cut = tmp_path / "cut.nc"
    cut.write_bytes(files["classic"].read_bytes()[:300])
    with pytest.raises(WeatherDataError, match=r"cut.nc: cannot be read as NetCDF3 .*'scipy'"):
        load_fields(str(cut), ["t"])
    empty = tmp_path / "empty.zarr"
    empty.mkdir()
    with pytest.raises(WeatherDataError, match=r"empty.zarr: cannot be read: a directory"):
        load_fields(str(empty), ["t"])


def test_an_unreadable_file_is_named_before_the_missing_variables(tmp_path: Path) -> None:
    """--data of a file that is no known format, and no --variables: the file is what to fix
    first, so the error says it cannot be read (it asked for --variables before)."""
    from dspzoo.domains.weather.training import WeatherTrainConfig

    bad = tmp_path / "bad.nc"
    bad.write_bytes(b"garbage")
    cfg = WeatherTrainConfig(model="weathertx-tiny", sp=1, data=str(bad))
    with pytest.raises(WeatherDataError, match=r"bad.nc: cannot be read: not a NetCDF3"):
        cfg.channel_variables()


def test_two_training_steps_on_a_netcdf3_file(files, tmp_path: Path) -> None:
    import dspzoo.domains.weather  # noqa: F401  (registers weathertx)
    from dspzoo.domains.weather.training import WeatherTrainConfig, train

    result = train(
        WeatherTrainConfig(
            model="weathertx-tiny",
            sp=1,
            data=str(files["offset64"]),
            variables="t",
            history=2,
            leads="1",
            holdout_from=2009,
            steps=2,
            global_batch=2,
            warmup=1,
            eval_every=0,
            log_every=1,
            save_every=0,
            output_dir=str(tmp_path / "run"),
        )
    )
    losses = result["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert (tmp_path / "run" / "final").is_dir()
