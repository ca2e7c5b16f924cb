"""A minimal 2-D axial transformer: the smallest complete example of a dspzoo model."""

from dspzoo.core.costmodel.workload import register_workload
from dspzoo.zoo import register_config, register_family

from .model import Toy2DConfig, Toy2DTransformer
from .workload import toy_workload

register_family("toy2d", Toy2DTransformer, Toy2DConfig)
register_config("toy2d", "tiny", Toy2DConfig())
register_config("toy2d", "small", Toy2DConfig(hidden=128, heads=8, depth=4))
register_workload("toy2d", toy_workload)

__all__ = ["Toy2DConfig", "Toy2DTransformer"]
