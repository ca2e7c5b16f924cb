"""Weather domain: a spatio-temporal transformer over gridded fields under DSP.

Registers the zoo family ``weathertx`` (:class:`WeatherTransformer`, :class:`WeatherConfig`)
with configs ``tiny`` (tests), ``small`` (CPU training on the built-in data; ``variables``,
``grid``, ``num_static`` and ``periodic_lon`` are set from the data at training time) and
``global-1.40625`` (a published-scale global model: 128 × 256 grid at 1.40625°, 69 variables =
4 surface + 5 atmospheric × 13 pressure levels, 7 static channels, width 1024, 24 layers,
full spatial attention, as Stormer/ClimaX-scale ViTs).
"""

from dspzoo.core.costmodel.workload import register_workload
from dspzoo.zoo import register_config, register_family

from .model import WeatherConfig, WeatherTransformer, layer_stages
from .workload import weather_workload

LEVELS = (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)
ERA5_VARIABLES = (
    "t2m",
    "u10",
    "v10",
    "msl",
    *(f"{name}@{level}" for name in ("z", "t", "u", "v", "q") for level in LEVELS),
)

CONFIGS = {
    "tiny": WeatherConfig(
        variables=("z@500", "t@850"),
        grid=(37, 49),
        history=3,
        patch=4,
        hidden=32,
        depth=2,
        heads=4,
        mlp_ratio=2.0,
    ),
    "small": WeatherConfig(
        variables=("air_temperature",),
        grid=(37, 49),
        history=2,
        patch=4,
        hidden=128,
        depth=4,
        heads=4,
        periodic_lon=False,
    ),
    "global-1.40625": WeatherConfig(
        variables=ERA5_VARIABLES,
        grid=(128, 256),
        history=2,
        patch=2,
        hidden=1024,
        depth=24,
        heads=16,
        spatial="full",
        num_static=7,
        max_lead=1000.0,
    ),
}

register_family("weathertx", WeatherTransformer, WeatherConfig)
for _name, _config in CONFIGS.items():
    register_config("weathertx", _name, _config)
register_workload("weathertx", weather_workload)

__all__ = ["CONFIGS", "ERA5_VARIABLES", "WeatherConfig", "WeatherTransformer", "layer_stages"]
