"""Text domain: byte-level causal language models over one ultra-long sequence dim (the LSS
enwik8 setting).

Registers the zoo family ``bytelm`` with configs ``tiny`` (tests), ``small`` (CPU training),
``lss-12l`` (12 layers, hidden 512, 8 heads: the LSS paper's enwik8 model) and ``gpt2-small``
(12 layers, hidden 768, 12 heads).
"""

from dspzoo.core.costmodel.workload import register_workload
from dspzoo.zoo import register_config, register_family

from .model import STAGES, ByteLM, ByteLMConfig, lm_loss
from .workload import lm_workload, text_workload

CONFIGS = {
    "tiny": ByteLMConfig(hidden=64, depth=2, heads=4, max_len=512),
    "small": ByteLMConfig(hidden=256, depth=8, heads=4, max_len=2048),
    "lss-12l": ByteLMConfig(hidden=512, depth=12, heads=8, max_len=65536),
    "gpt2-small": ByteLMConfig(hidden=768, depth=12, heads=12, max_len=65536),
}

register_family("bytelm", ByteLM, ByteLMConfig)
for _name, _config in CONFIGS.items():
    register_config("bytelm", _name, _config)

__all__ = ["CONFIGS", "STAGES", "ByteLM", "ByteLMConfig", "lm_loss", "text_workload"]
register_workload("bytelm", lm_workload)
