"""Protein domain: an AlphaFold-2 Evoformer trunk with a distogram head under DSP.

Registers the zoo family ``evoformer`` with configs ``tiny`` (tests), ``small`` (CPU training)
and ``af2`` (48 blocks, c_m 256, c_z 128, AF2's head counts; build it on the meta device to
count parameters). Only model classes are imported here, so ``import dspzoo.domains.protein``
stays light; data, training and prediction live in their own modules.
"""

from dspzoo.zoo import register_config, register_family

from .model import Evoformer, EvoformerConfig, evoformer_plan, evoformer_stages

CONFIGS = {
    "tiny": EvoformerConfig(
        c_m=16,
        c_z=8,
        num_blocks=2,
        msa_heads=2,
        pair_heads=2,
        c_hidden_msa_att=4,
        c_hidden_pair_att=4,
        c_hidden_opm=4,
        c_hidden_mul=8,
        transition_n=2,
        distogram_bins=16,
        num_recycles=1,
        mul_channel_chunk=3,
    ),
    "small": EvoformerConfig(
        c_m=64,
        c_z=32,
        num_blocks=4,
        msa_heads=4,
        pair_heads=4,
        c_hidden_msa_att=16,
        c_hidden_pair_att=8,
        c_hidden_opm=16,
        c_hidden_mul=32,
        transition_n=2,
        num_recycles=1,
        msa_dropout=0.1,
        pair_dropout=0.1,
    ),
    "af2": EvoformerConfig(),
}

register_family("evoformer", Evoformer, EvoformerConfig)
for _name, _config in CONFIGS.items():
    register_config("evoformer", _name, _config)

__all__ = ["CONFIGS", "Evoformer", "EvoformerConfig", "evoformer_plan", "evoformer_stages"]
