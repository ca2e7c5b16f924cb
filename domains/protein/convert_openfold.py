"""OpenFold / AlphaFold-2 Evoformer weights ↔ this model's state dict.

This model keeps OpenFold's layer names (``mha.linear_q``, ``linear_a_p``, ``layer_norm_out``,
``input_embedder.linear_tf_z_i``, ...), so converting is a renaming of a few path segments:

=======================================================  ==========================================
OpenFold (AF2 ``openfold``; ``openfold3``)                this model
=======================================================  ==========================================
``evoformer.blocks.N.msa_att_row.*``                      ``evoformer.blocks.N.msa_att_row.*``
``….msa_att_col._msa_att.*``                              ``….msa_att_col.*``
``….core.msa_transition.{layer_norm,linear_1,linear_2}``  ``….msa_transition.*``
``….msa_transition.transition_mlp.layers.0.0`` (of3)      ``….msa_transition.linear_1``
``….msa_transition.transition_mlp.linear_out`` (of3)      ``….msa_transition.linear_2``
``….core.outer_product_mean.*`` / ``….outer_product_mean.*``  ``….outer_product_mean.*``
``….core.tri_mul_{out,in}.*`` / ``….pair_stack.tri_mul_*``    ``….tri_mul_{out,in}.*``
``….core.tri_att_{start,end}.linear``                     ``….tri_att_{start,end}.linear``
``….pair_stack.tri_att_{start,end}.linear_z`` (of3)       ``….tri_att_{start,end}.linear``
``….core.pair_transition.*`` / ``….pair_stack.pair_transition.*``  ``….pair_transition.*``
``input_embedder.*``                                      ``input_embedder.*``
``recycling_embedder.layer_norm_{m,z}``                   ``recycling_embedder.layer_norm_{m,z}``
``aux_heads.distogram.linear``                            ``distogram_head.linear``
=======================================================  ==========================================

Biases that ``openfold3``'s AF3-style defaults leave out (attention gate and output, triangle
multiplication, outer-product projections) are zero in this model: the functions are equal.
Weights this model has no use for (template and extra-MSA stacks, the structure module, other
heads, ``evoformer.linear``, ``recycling_embedder.linear``) are reported as ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ...core.errors import UsageError
from .model import Evoformer, EvoformerConfig

_BLOCK = re.compile(r"^evoformer\.blocks\.(\d+)\.(.+)$")
_PREFIXES = ("model.", "module.", "_orig_mod.")

# (pattern, replacement) on the part of a block key after "evoformer.blocks.N."
_FROM_OPENFOLD = (
    (r"^(core|pair_stack)\.", ""),
    (r"^msa_att_col\._msa_att\.", "msa_att_col."),
    (r"^(msa_transition|pair_transition)\.transition_mlp\.layers\.0\.0\.", r"\1.linear_1."),
    (r"^(msa_transition|pair_transition)\.transition_mlp\.linear_out\.", r"\1.linear_2."),
    (r"^(tri_att_start|tri_att_end)\.linear_z\.", r"\1.linear."),
)
_OUTSIDE = {
    "aux_heads.distogram.linear.": "distogram_head.linear.",
}
_IGNORED = (
    "template_",
    "extra_msa_",
    "structure_module.",
    "aux_heads.",
    "evoformer.linear.",
    "recycling_embedder.linear.",
)
_CORE = ("msa_transition", "outer_product_mean", "tri_mul_out", "tri_mul_in", "tri_att_start",
         "tri_att_end", "pair_transition")  # fmt: skip


@dataclass
class Conversion:
    """The converted state dict and what was left out."""

    state_dict: dict[str, torch.Tensor]
    ignored: list[str] = field(default_factory=list)
    zero_filled: list[str] = field(default_factory=list)


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    # an EvoformerStack's own state dict: "blocks.N..." and "linear..."
    if key.startswith("blocks.") or key.startswith("linear."):
        key = "evoformer." + key
    return key


def openfold_to_ours_key(key: str) -> str | None:
    """This model's name for an OpenFold key, or ``None`` if this model does not use it."""
    key = _strip(key)
    hit = _BLOCK.match(key)
    if hit:
        rest = hit.group(2)
        for pattern, repl in _FROM_OPENFOLD:
            rest = re.sub(pattern, repl, rest)
        return f"evoformer.blocks.{hit.group(1)}.{rest}"
    for src, dst in _OUTSIDE.items():
        if key.startswith(src):
            return dst + key[len(src) :]
    if any(key.startswith(p) for p in _IGNORED):
        return None
    return key


def ours_to_openfold_key(key: str) -> str:
    """The OpenFold (AF2 ``openfold`` layout, with ``core.``) name of one of this model's keys."""
    hit = _BLOCK.match(key)
    if hit:
        rest = hit.group(2)
        head = rest.split(".", 1)[0]
        if head in _CORE:
            rest = "core." + rest
        elif head == "msa_att_col":
            rest = "msa_att_col._msa_att." + rest.split(".", 1)[1]
        return f"evoformer.blocks.{hit.group(1)}.{rest}"
    for dst, src in _OUTSIDE.items():
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def to_openfold(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This model's state dict under OpenFold's (AF2) names."""
    return {ours_to_openfold_key(k): v for k, v in state_dict.items()}


def infer_config(
    state_dict: Mapping[str, torch.Tensor], base: EvoformerConfig | None = None
) -> EvoformerConfig:
    """An :class:`EvoformerConfig` with the sizes of an OpenFold Evoformer state dict.

    Sizes not visible in the weights (dropout rates, recycles, chunking) come from ``base``
    (default: the AF2 config).
    """
    sd = {openfold_to_ours_key(k): v for k, v in state_dict.items()}
    sd = {k: v for k, v in sd.items() if k is not None}
    pre = "evoformer.blocks.0."
    need = f"{pre}msa_att_row.linear_z.weight"
    if need not in sd:
        raise UsageError(
            f"not an Evoformer state dict: no {ours_to_openfold_key(need)!r} (keys start "
            f"{sorted(state_dict)[:3]})"
        )
    blocks = {int(m.group(1)) for k in sd if (m := _BLOCK.match(k))}
    msa_heads, c_z = sd[need].shape
    pair_heads = sd[f"{pre}tri_att_start.linear.weight"].shape[0]
    c_m = sd[f"{pre}msa_att_row.layer_norm_m.weight"].shape[0]
    changes = dict(
        c_m=c_m,
        c_z=c_z,
        num_blocks=max(blocks) + 1,
        msa_heads=msa_heads,
        pair_heads=pair_heads,
        c_hidden_msa_att=sd[f"{pre}msa_att_row.mha.linear_q.weight"].shape[0] // msa_heads,
        c_hidden_pair_att=sd[f"{pre}tri_att_start.mha.linear_q.weight"].shape[0] // pair_heads,
        c_hidden_opm=sd[f"{pre}outer_product_mean.linear_1.weight"].shape[0],
        c_hidden_mul=sd[f"{pre}tri_mul_out.linear_a_p.weight"].shape[0],
        transition_n=sd[f"{pre}msa_transition.linear_1.weight"].shape[0] // c_m,
    )
    if "input_embedder.linear_tf_m.weight" in sd:
        changes["tf_dim"] = sd["input_embedder.linear_tf_m.weight"].shape[1]
        changes["msa_dim"] = sd["input_embedder.linear_msa_m.weight"].shape[1]
        changes["max_relative_position"] = (
            sd["input_embedder.linear_relpos.weight"].shape[1] - 1
        ) // 2
    if "distogram_head.linear.weight" in sd:
        changes["distogram_bins"] = sd["distogram_head.linear.weight"].shape[0]
    return replace(base or EvoformerConfig(), **changes)


def from_openfold(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module, stack_only: bool = False
) -> Conversion:
    """Convert an OpenFold state dict to ``model``'s names and check it fits.

    Every parameter of ``model`` must be found (biases openfold3 leaves out are filled with
    zeros); with ``stack_only`` the embedders and the head may be absent (they keep ``model``'s
    values). Unknown names inside the Evoformer blocks and shape mismatches raise
    ``ValueError`` naming the key.
    """
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    conv = Conversion(out)
    for key, value in state_dict.items():
        name = openfold_to_ours_key(key)
        if name is None:
            conv.ignored.append(key)
            continue
        if name not in ours:
            if _BLOCK.match(name) or not stack_only:
                raise UsageError(
                    f"OpenFold key {key!r} (as {name!r}) has no place in this model; is it an "
                    f"AF2 Evoformer with fuse_projection_weights=False and ReLU transitions?"
                )
            conv.ignored.append(key)
            continue
        if tuple(value.shape) != tuple(ours[name].shape):
            raise UsageError(
                f"OpenFold key {key!r}: shape {tuple(value.shape)} but this model's {name!r} is "
                f"{tuple(ours[name].shape)}; build the model with infer_config(state_dict)"
            )
        out[name] = value.detach().clone()
    for name, value in ours.items():
        if name in out:
            continue
        if name.endswith(".bias") and name.replace(".bias", ".weight") in out:
            out[name] = torch.zeros_like(value)
            conv.zero_filled.append(name)
        elif stack_only and not name.startswith("evoformer."):
            out[name] = value.detach().clone()
        else:
            raise UsageError(f"the OpenFold state dict has no weights for {name!r} "
                             f"(OpenFold name {ours_to_openfold_key(name)!r})")  # fmt: skip
    return conv


def load_openfold(
    state_dict: Mapping[str, torch.Tensor], config: EvoformerConfig | None = None
) -> tuple[Evoformer, Conversion]:
    """A new :class:`Evoformer` (sized by :func:`infer_config`) holding OpenFold weights."""
    config = infer_config(state_dict, config)
    model = Evoformer(config)
    conv = from_openfold(state_dict, model, stack_only=True)
    model.load_state_dict(conv.state_dict)
    return model, conv
