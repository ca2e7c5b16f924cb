r"""Train a weather transformer on gridded fields under sequence parallelism.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_weather.py --sp 2 \
        --model weathertx-small --data a1b,e1 --history 4 --leads 1 --steps 600

--data a1b,e1 (the default) is real climate-model output shipped by iris-sample-data (annual
mean near-surface air temperature over North America, 1860-2099, under the A1B and E1
scenarios, two trajectories); any NetCDF/Zarr files work (--data path.nc, or u.nc+v.nc to merge
files) with --variables naming the fields. Lead times are in time steps of the data (years
here); the times from --holdout-from (a year, or a date such as 2000-06-01) on are held out,
or the last --holdout-fraction of them. Checkpoints go to <output-dir>/checkpoints/step_N
(written aside, fsynced, swapped in), the final model with its normalisation statistics, grid
and window settings to <output-dir>/final, and the evaluation table (model, persistence,
climatology: RMSE and ACC per variable and lead on the held-out times) to
<output-dir>/evaluation.md and .json. --resume latest continues a run exactly, at
any layout.
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.domains.weather.training import WeatherTask, WeatherTrainConfig, train

CLI = TrainingCLI(
    WeatherTrainConfig, train, __doc__, "dspzoo.weather.train", "mse", task=WeatherTask
)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_weather.py"))
