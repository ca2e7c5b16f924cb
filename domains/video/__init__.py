"""Video domain: spatial-temporal diffusion transformers (STDiT, Latte-like) under DSP.

Registers the zoo families ``stdit`` and ``latte`` with configs ``tiny`` (CPU tests),
``mini`` (the CPU demo), ``small``, ``720M`` (28 layers, hidden 1152, 16 heads) and ``3B`` (36 layers,
hidden 2048, 32 heads), all with patch (1, 2, 2).

Also registers ``latte1``, the exact architecture of diffusers' ``LatteTransformer3DModel``
(:mod:`.latte1`), with configs ``tiny`` (tests) and ``latte-1`` (the published Latte-1 size).
"""

from dspzoo.core.costmodel.workload import register_workload
from dspzoo.zoo import register_config, register_family

from .dit import VideoDiT, VideoDiTConfig, patchify, unpatchify
from .latte import Latte
from .latte1 import Latte1, Latte1Config
from .stdit import STDiT
from .workload import dit_workload, latte1_workload

_BIG = dict(in_channels=4, patch=(1, 2, 2), max_frames=1024, input_size=(64, 64), cond_dim=4096)
CONFIGS = {
    "tiny": VideoDiTConfig(hidden=64, depth=2, heads=4, cond_dim=32, num_classes=8),
    "mini": VideoDiTConfig(hidden=128, depth=4, heads=4, cond_dim=64, num_classes=8),
    "small": VideoDiTConfig(hidden=384, depth=12, heads=6, cond_dim=512, num_classes=8),
    "720M": VideoDiTConfig(hidden=1152, depth=28, heads=16, **_BIG),
    "3B": VideoDiTConfig(hidden=2048, depth=36, heads=32, **_BIG),
}

for _family, _cls in (("stdit", STDiT), ("latte", Latte)):
    register_family(_family, _cls, VideoDiTConfig)
    for _name, _config in CONFIGS.items():
        register_config(_family, _name, _config)

LATTE1_CONFIGS = {
    "tiny": Latte1Config(
        heads=4, head_dim=4, depth=2, sample_size=8, video_length=5, caption_channels=12
    ),
    "latte-1": Latte1Config(),
}
register_family("latte1", Latte1, Latte1Config)
for _name, _config in LATTE1_CONFIGS.items():
    register_config("latte1", _name, _config)
register_workload("latte1", latte1_workload)
register_workload("stdit", dit_workload)
register_workload("latte", dit_workload)

__all__ = [
    "CONFIGS",
    "LATTE1_CONFIGS",
    "Latte",
    "Latte1",
    "Latte1Config",
    "STDiT",
    "VideoDiT",
    "VideoDiTConfig",
    "patchify",
    "unpatchify",
]
