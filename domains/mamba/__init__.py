"""Mamba domain: multi-dimensional Mamba models and Mamba LMs under DSP.

Registers the zoo families

* ``mambalm`` (Mamba-1) and ``mamba2lm`` (Mamba-2): transformers' ``MambaForCausalLM`` /
  ``Mamba2ForCausalLM`` (:mod:`.lm`, checkpoints via :mod:`.convert`), configs ``tiny`` (tests),
  ``small`` (byte-level, CPU training) and ``130m`` (mamba-130m / mamba2-130m shapes);
* ``weathermamba``: the weather transformer with axial scans (circular in longitude),
  configs ``tiny`` and ``small`` (:mod:`.weather`);
* ``hybridlm``: a hybrid LM, Mamba layers with an attention layer every k-th (:mod:`.hybrid`),
  configs ``tiny``, ``small`` (byte-level) and ``130m`` (mamba2-130m shapes, every 6th layer
  attention); the planner picks a scan method for its scans and an attention method for its
  attention layers;
* ``videomamba``: a video Mamba DiT with configurable scan orders (:mod:`.video`), configs
  ``tiny``, ``small``, and the order variants ``tiny-raster``, ``tiny-cross``, ``tiny-zigzag``;

with their cost-model workloads (:mod:`.workload`). Scan orders: :mod:`.orders`.
"""

from dspzoo.core.costmodel.workload import register_workload
from dspzoo.zoo import register_config, register_family

from .hybrid import HybridLM, HybridLMConfig, hybrid_stages
from .layers import SCAN_OP, OrderedScan, run_scan, scan_stage
from .lm import Mamba2LM, MambaLM, MambaLMConfig, lm_class
from .orders import ScanOrder, parse_order
from .video import VideoMamba, VideoMambaConfig
from .weather import WeatherMamba, WeatherMambaConfig
from .workload import (
    hybrid_lm_workload,
    mamba_lm_workload,
    video_mamba_workload,
    weather_mamba_workload,
)

LM_CONFIGS = {
    "mambalm": {
        "tiny": MambaLMConfig(version=1, hidden_size=32, num_hidden_layers=2, state_size=4),
        # bytelm-tiny's parameter count (115K), for the shipped mambalm-mini-stdlib
        "mini": MambaLMConfig(version=1, hidden_size=64, num_hidden_layers=3, state_size=16),
        "small": MambaLMConfig(version=1, hidden_size=128, num_hidden_layers=4, state_size=16),
        "130m": MambaLMConfig(version=1, vocab_size=50280, hidden_size=768, num_hidden_layers=24),
    },
    "mamba2lm": {
        "tiny": MambaLMConfig(
            version=2,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            num_heads=4,
            head_dim=16,
            chunk_size=16,
        ),  # fmt: skip
        "small": MambaLMConfig(
            version=2,
            hidden_size=128,
            num_hidden_layers=4,
            state_size=32,
            num_heads=8,
            head_dim=32,
            chunk_size=64,
        ),  # fmt: skip
        "130m": MambaLMConfig(
            version=2,
            vocab_size=50288,
            hidden_size=768,
            num_hidden_layers=24,
            state_size=128,
            num_heads=24,
            head_dim=64,
            chunk_size=256,
            tie_word_embeddings=True,
        ),  # fmt: skip
    },
}
for _family, _cls in (("mambalm", MambaLM), ("mamba2lm", Mamba2LM)):
    register_family(_family, _cls, MambaLMConfig)
    for _name, _config in LM_CONFIGS[_family].items():
        register_config(_family, _name, _config)
    register_workload(_family, mamba_lm_workload)

HYBRID_CONFIGS = {
    # Mamba-2 layers with attention every other layer (4 heads over 2 K/V heads)
    "tiny": HybridLMConfig(
        version=2, hidden_size=32, num_hidden_layers=4, state_size=8, num_heads=4, head_dim=16,
        chunk_size=16, attn_layer_period=2, attn_layer_offset=1, num_attention_heads=4,
        num_key_value_heads=2, mlp_ratio=2.0,
    ),
    "small": HybridLMConfig(
        version=2, hidden_size=128, num_hidden_layers=8, state_size=32, num_heads=8,
        head_dim=32, chunk_size=64, attn_layer_period=4, attn_layer_offset=3,
        num_attention_heads=4,
    ),
    # mamba2-130m's Mamba layers, every 6th layer attention (12 heads of 64, as GPT-2 small)
    "130m": HybridLMConfig(
        version=2, vocab_size=50288, hidden_size=768, num_hidden_layers=24, state_size=128,
        num_heads=24, head_dim=64, chunk_size=256, attn_layer_period=6, attn_layer_offset=5,
        num_attention_heads=12,
    ),
}  # fmt: skip
register_family("hybridlm", HybridLM, HybridLMConfig)
for _name, _config in HYBRID_CONFIGS.items():
    register_config("hybridlm", _name, _config)
register_workload("hybridlm", hybrid_lm_workload)

# width 64 >= the 48 values of a (1, 2, 2) patch of the video trainer's 12 latent channels (at
# width 32 the final layer reached 32 of them: flow loss floor ~0.36, see docs/mamba.md)
_TINY = dict(hidden=64, depth=2, state_size=4, head_dim=16, chunk_size=16, num_classes=8)
VIDEO_CONFIGS = {
    "tiny": VideoMambaConfig(**_TINY),
    "tiny-raster": VideoMambaConfig(**_TINY, orders=("raster(t,h,w)",)),
    "tiny-cross": VideoMambaConfig(**_TINY, orders=("axial(t)", "cross(h,w)")),
    "tiny-zigzag": VideoMambaConfig(**_TINY, orders=("zigzag(t,h,w)",)),
    "small": VideoMambaConfig(hidden=128, depth=6, state_size=16, head_dim=32, num_classes=8),
}
register_family("videomamba", VideoMamba, VideoMambaConfig)
for _name, _config in VIDEO_CONFIGS.items():
    register_config("videomamba", _name, _config)
register_workload("videomamba", video_mamba_workload)

WEATHER_CONFIGS = {
    "tiny": WeatherMambaConfig(
        grid=(16, 32),
        patch=2,
        hidden=32,
        depth=2,
        heads=2,
        state_size=4,
        head_dim=16,
        chunk_size=16,
        mlp_ratio=2.0,
    ),  # fmt: skip
    "small": WeatherMambaConfig(
        grid=(32, 64), patch=2, hidden=96, depth=4, heads=4, state_size=16, head_dim=32
    ),  # fmt: skip
}
register_family("weathermamba", WeatherMamba, WeatherMambaConfig)
for _name, _config in WEATHER_CONFIGS.items():
    register_config("weathermamba", _name, _config)
register_workload("weathermamba", weather_mamba_workload)

__all__ = [
    "HYBRID_CONFIGS",
    "HybridLM",
    "HybridLMConfig",
    "LM_CONFIGS",
    "SCAN_OP",
    "VIDEO_CONFIGS",
    "Mamba2LM",
    "MambaLM",
    "MambaLMConfig",
    "OrderedScan",
    "ScanOrder",
    "VideoMamba",
    "VideoMambaConfig",
    "WEATHER_CONFIGS",
    "WeatherMamba",
    "WeatherMambaConfig",
    "hybrid_stages",
    "lm_class",
    "parse_order",
    "run_scan",
    "scan_stage",
]
