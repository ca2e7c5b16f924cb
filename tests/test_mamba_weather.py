"""The weather Mamba (domains/mamba/weather.py): circular longitude scans make the forecast
roll with the input (the weather transformer's roll test), and under DSP at SP 2/3/4 on uneven
grids it equals one process (outputs, every gradient, traced bytes = plan)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspzoo.core.harness import check_model
from dspzoo.domains.mamba import WEATHER_CONFIGS, WeatherMamba
from dspzoo.domains.mamba.weather import circular_windows
from dspzoo.domains.mamba.workload import weather_mamba_workload

# two variables: with one, the variable aggregation's softmax is constant and its query's
# gradient is zero up to rounding, which no relative tolerance can compare
SMALL = replace(WEATHER_CONFIGS["tiny"], grid=(10, 12), patch=2, hidden=16, depth=1,
                head_dim=8, chunk_size=8, history=3, num_static=2,
                variables=("t2m", "u10"))  # fmt: skip


def _perturbed(config) -> WeatherMamba:
    torch.manual_seed(0)
    model = WeatherMamba(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def make_model() -> WeatherMamba:
    return _perturbed(SMALL)


def make_inputs(config=SMALL, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(
            2, config.history, len(config.variables), *config.grid, generator=g, dtype=dtype
        ),
        "lead_time": torch.tensor([1.0, 3.0], dtype=dtype),
        "static": torch.randn(2, config.num_static, *config.grid, generator=g, dtype=dtype),
    }


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def test_circular_windows_put_each_column_at_the_anchor():
    w = circular_windows(5, 2)
    assert w.tolist()[0] == [3, 4, 0, 1, 2] and torch.equal(w[:, 2], torch.arange(5))
    assert torch.equal(circular_windows(4, 3)[:, -1], torch.arange(4))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_rolling_by_a_lon_patch_rolls_the_forecast(bidirectional):
    """A roll by whole lon patches rolls the forecast (periodic_lon), and does not without."""
    for periodic in (True, False):
        config = replace(SMALL, periodic_lon=periodic, bidirectional=bidirectional, history=2)
        model = _perturbed(config).double().eval()
        inputs = make_inputs(config, torch.float64)
        rolled = {k: v.roll(2, dims=-1) if k != "lead_time" else v for k, v in inputs.items()}
        with torch.no_grad():
            out, out_rolled = model(**inputs), model(**rolled)
        error = _relative_error(out_rolled, out.roll(2, dims=-1))
        if periodic:
            assert error < 1e-12, error
            assert _relative_error(out_rolled, out) > 1e-2  # the forecast does vary in lon
        else:
            assert error > 1e-3, error


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="spatial must be 'axial'"):
        WeatherMamba(replace(SMALL, spatial="full"))


@pytest.mark.timeout(600)
def test_weather_mamba_under_dsp_equals_one_process():
    """History 3, 5 × 6 patches: no SP size divides every dim; at SP 4 ``t`` leaves a rank empty."""
    workload = weather_mamba_workload("weathermamba", SMALL, batch=2)
    check_model(make_model, make_inputs, strategies=["dsp"], workload=workload, timeout=560)


def test_weather_mamba_trains_with_the_weather_task(tmp_path) -> None:
    """The weather Mamba has the weather transformer's interface: the weather Task trains it."""
    import math

    from dspzoo.domains.weather.forecast import forecast_from
    from dspzoo.domains.weather.training import WeatherTrainConfig, data_from_extra, train
    from dspzoo.zoo import from_pretrained, load_extra

    cfg = WeatherTrainConfig(model="weathermamba-tiny", sp=1, data="a1b", history=2, leads="1",
                             holdout_from=2090, steps=2, global_batch=2, warmup=1, eval_every=0,
                             eval_batch=8, log_every=1, save_every=0, output_dir=str(tmp_path))  # fmt: skip
    result = train(cfg)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    model = from_pretrained(tmp_path / "final", expected_family="weathermamba").eval()
    data = data_from_extra(load_extra(tmp_path / "final"))
    fc = forecast_from(model, data, trajectory=0, t0=197, steps=2, lead=1)  # the forecaster
    assert (
        fc.forecast.shape == (2, 1, 37, 49) and torch.isfinite(torch.as_tensor(fc.forecast)).all()
    )
