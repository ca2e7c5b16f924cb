r"""Roll out an autoregressive forecast from a trained weather model, with DSP across processes.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/forecast_weather.py --sp 2 \
        --model-dir weathertx-small-a1b --init-year 2059 --steps 20 --out forecast/

    python scripts/forecast_weather.py --sp 1 --model-dir outputs/weathertx-small/final

--model-dir is a folder written by training (its final/) or a shipped model's name. The initial
state is the data the model was trained on (its config.json records it; --data replaces the
source, e.g. --data e1 for the other scenario) at the time step in --init-year (default: the
last training year, so the forecast runs into the held-out years). Every rank of the SP group
runs the same rollout, the model sharding each step over the group. The main process writes
<out>/forecast.nc (CF-1.8: the forecast and the truth per variable), <out>/maps_<var>.png
(forecast, truth, error at the first, middle and last step), <out>/rmse_vs_lead.png and
<out>/rmse.json (latitude-weighted RMSE per lead for the model, persistence, climatology).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger("dspzoo.weather.forecast")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name "
        "(dspzoo list --pretrained)",
    )
    parser.add_argument("--sp", type=int, default=1, help="ranks per SP group (default: 1)")
    parser.add_argument(
        "--sp-strategy", default="dsp", help="sequence-parallel strategy (default: dsp)"
    )
    parser.add_argument(
        "--data", default=None, help="data to start from (default: what the model trained on)"
    )
    parser.add_argument(
        "--trajectory", type=int, default=0, help="which trajectory of the data (default: 0)"
    )
    parser.add_argument(
        "--init-year",
        type=int,
        default=None,
        help="year of the initial state (default: the last training year)",
    )
    parser.add_argument("--steps", type=int, default=20, help="forecast steps (default: 20)")
    parser.add_argument(
        "--lead", type=int, default=None, help="lead time per step (default: the shortest trained)"
    )
    parser.add_argument("--out", default="forecast", help="output folder (default: forecast)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    import torch

    import dspzoo.domains.weather  # noqa: F401  (registers weathertx)
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.domains.weather.data import WeatherDataError
    from dspzoo.domains.weather.forecast import forecast_from, plot_maps, plot_rmse, write_netcdf
    from dspzoo.domains.weather.training import data_from_extra
    from dspzoo.zoo import from_pretrained, load_extra
    from dspzoo.zoo.shipped import resolve_pretrained

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.sp < 1:
        parser.error("--steps and --sp must be >= 1")
    try:
        folder = resolve_pretrained(args.model_dir)
        model = from_pretrained(folder, expected_family="weathertx").float().eval()
        extra = load_extra(folder)
        if "weather" not in extra:
            raise WeatherDataError(f"{folder}: no 'weather' settings in its config.json extra")
        if args.data:
            extra["weather"] = {**extra["weather"], "data": args.data}
        data = data_from_extra(extra)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))
    w = data.window
    lead = args.lead or min(w.leads)
    year = args.init_year if args.init_year is not None else w.holdout_from - 1
    matches = np.flatnonzero(data.fields.years == year)
    if matches.size == 0:
        parser.error(
            f"--init-year {year} is not in the data ({data.fields.years.min()}–"
            f"{data.fields.years.max()})"
        )
    t0 = int(matches[-1])
    _, mesh, sp = setup_accelerate(args.sp, strategy=args.sp_strategy)
    with torch.no_grad():
        fc = forecast_from(model, data, args.trajectory, t0, args.steps, lead, sp)
    result = {
        "init": str(data.fields.times[t0]),
        "trajectory": data.fields.names[args.trajectory],
        "leads": fc.leads.tolist(),
        "rmse": {k: np.where(np.isnan(v), None, v).tolist() for k, v in fc.rmse.items()},
    }
    if mesh.is_main:
        out = Path(args.out)
        write_netcdf(data, fc, out / "forecast.nc")
        for c, name in enumerate(data.fields.channels):
            plot_maps(data, fc, out / f"maps_{name.replace('@', '_')}.png", channel=c)
        plot_rmse(data, fc, out / "rmse_vs_lead.png")
        (out / "rmse.json").write_text(json.dumps(result, indent=2))
        logger.info(
            "forecast of %d steps from %s written to %s (model RMSE at lead %d: %s)",
            args.steps,
            result["init"],
            out,
            lead,
            np.round(fc.rmse["model"][0], 4).tolist(),
        )
    return result


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "forecast_weather.py"))
