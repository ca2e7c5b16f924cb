r"""Roll out an autoregressive forecast from a trained weather model, with DSP across processes.

    dspzoo forecast weathertx-small-a1b-e1 --init-year 2059 --steps 20 --out outputs/forecast/
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        -m dspzoo forecast weathertx-small-a1b-e1 --sp 2 --steps 20 --out outputs/forecast/

The model (``--model-dir`` when the script runs as ``python scripts/forecast_weather.py``) is
a folder written by training (its final/) or a shipped model's name. The initial state is the
data the model was trained on (its config.json records it; --data replaces the source, e.g.
--data e1 for the other scenario) at the time step in --init-year (default: the last training
year, so the forecast runs into the held-out years). Every rank of the SP group
runs the same rollout, the model sharding each step over the group. The main process writes
<out>/forecast.nc (CF-1.8: the forecast and the truth per variable), <out>/maps_<var>.png
(forecast, truth, error at the first, middle and last step), <out>/rmse_vs_lead.png and
<out>/rmse.json (latitude-weighted RMSE per lead for the model, persistence, climatology).
The command line of :func:`dspzoo.zoo.inference.forecast_weather` (the Python API).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import numpy as np

from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.strategies import STRATEGIES

logger = logging.getLogger("dspzoo.weather.forecast")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name "
        "(dspzoo list --pretrained)",
    )
    parser.add_argument(
        "--sp", type=int, default=None, help="ranks per SP group (default: all processes)"
    )
    parser.add_argument(
        "--sp-strategy",
        default="dsp",
        choices=sorted(STRATEGIES),
        help="sequence-parallel strategy (default: dsp)",
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
    parser.add_argument(
        "--out",
        default=None,
        help="output folder (default: forecast/ beside a folder's model, "
        "outputs/<name>/forecast for a shipped name)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.domains.weather.forecast import plot_maps, plot_rmse, write_netcdf
    from dspzoo.zoo import inference

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sp is None:
        args.sp = int(os.environ.get("WORLD_SIZE", 1))
    if args.steps < 1 or args.sp < 1:
        parser.error("--steps and --sp must be >= 1")
    try:
        accelerator, mesh, sp = setup_accelerate(args.sp, strategy=args.sp_strategy)
        # on the accelerator's device (a GPU where there is one), as sample and predict do
        model = inference.load(args.model_dir, inference.WEATHER_FAMILIES, accelerator.device)
        fc = inference.forecast_weather(
            model,
            steps=args.steps,
            init_year=args.init_year,
            trajectory=args.trajectory,
            lead=args.lead,
            data=args.data,
            sp=sp,
        )
    except (FileNotFoundError, KeyError, ValueError) as exc:  # WeatherDataError: a ValueError
        parser.error(str(exc.args[0]) if exc.args else str(exc))
    result = fc.summary()
    if mesh.is_main:
        data, forecast = fc.data, fc.forecast
        default = inference.default_output_folder(args.model_dir) / "forecast"
        out = Path(args.out) if args.out else default
        write_netcdf(data, forecast, out / "forecast.nc")
        for c, name in enumerate(data.fields.channels):
            plot_maps(data, forecast, out / f"maps_{name.replace('@', '_')}.png", channel=c)
        plot_rmse(data, forecast, out / "rmse_vs_lead.png")
        (out / "rmse.json").write_text(json.dumps(result, indent=2))
        logger.info(
            "forecast of %d steps from %s on %s written to %s (model RMSE at lead %d: %s)",
            args.steps,
            result["init"],
            accelerator.device.type,
            out,
            fc.lead,
            np.round(forecast.rmse["model"][0], 4).tolist(),
        )
    return result


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "forecast_weather.py"))
