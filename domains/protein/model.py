"""An AlphaFold-2 Evoformer trunk with a distogram head, under DSP over two activations.

The trunk carries the MSA activation ``m`` ``[B, S, R, c_m]`` (dims ``s``, ``r``) and the pair
activation ``z`` ``[B, R, R, c_z]`` (dims ``i``, ``j``); ``r``, ``i`` and ``j`` are the same
residues. :data:`STAGES` declares what each layer of a block needs whole, and
:func:`~dspzoo.core.parallel.multiplan.plan_multi` decides where each activation is sharded: ``m`` on
``s`` for row attention and on ``r`` for column attention, the transition and the outer
product mean; ``z`` on ``i`` for the outgoing update and starting-node attention, on ``j`` for
the incoming update and ending-node attention — six switches per block, the MSA's switch back to
``s`` overlapping the pair stack (``switch_async``). The model is written as if on one device;
with one process every collective is the identity.

Forward: ``model(batch, sp=None, num_recycles=None, rng_key=None, batch_offset=0,
outputs=None)`` with the features of the protein contract; returns, full on every rank, the
``outputs`` asked for (:data:`OUTPUTS`): ``distogram_logits`` ``[B, R, R, bins]`` (symmetrised as
AF2), ``pair`` ``[B, R, R, c_z]`` and ``msa_first_row`` ``[B, R, c_m]``. By default all three in
eval mode and only ``distogram_logits`` (the loss's input) in training mode: each output is one
all-gather, so training does not gather a pair it never uses. Recycling sends nothing: the MSA's
row 0 stays on the ranks that hold it (the plan leaves ``m`` and ``z`` in their entry layouts).
Dropout (training mode, AF2's row-/column-shared masks) is keyed: pass ``rng_key`` (e.g.
``mix_key(seed, step)``) and ``batch_offset`` (the global index of the batch's first sample);
the masks are then the one-process masks bit for bit on any sharding.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dspzoo.core.parallel.context import current_stage, dropout, stage
from dspzoo.core.parallel.layout import SeqSpec
from dspzoo.core.parallel.multiplan import ActShape, Gather, MultiParallel, MultiStage, plan_multi
from dspzoo.core.parallel.rng import mix_key
from dspzoo.core.parallel.runtime import SeqParallel, SeqTensor
from dspzoo.core.parallel.trace import comm_region

from .ops import (
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    Transition,
    TriangleAttention,
    TriangleMultiplication,
)

MSA_DIMS = ("s", "r")
PAIR_DIMS = ("i", "j")
SAME_AXIS = (("m.r", "z.i", "z.j"),)
FEATURES = ("aatype", "target_feat", "msa_feat", "residue_index", "seq_mask", "msa_mask")
OUTPUTS = ("distogram_logits", "pair", "msa_first_row")
TRAINING_OUTPUTS = ("distogram_logits",)


@dataclass(frozen=True)
class EvoformerConfig:
    """Sizes of the Evoformer trunk (defaults: AlphaFold 2's published Evoformer)."""

    c_m: int = 256
    c_z: int = 128
    num_blocks: int = 48
    msa_heads: int = 8
    pair_heads: int = 4
    c_hidden_msa_att: int = 32
    c_hidden_pair_att: int = 32
    c_hidden_opm: int = 32
    c_hidden_mul: int = 128
    transition_n: int = 4
    tf_dim: int = 22
    msa_dim: int = 49
    max_relative_position: int = 32
    distogram_bins: int = 64
    first_break: float = 2.3125
    last_break: float = 21.6875
    num_recycles: int = 3
    msa_dropout: float = 0.15
    pair_dropout: float = 0.25
    chunk_size: int | None = None
    mul_channel_chunk: int = 32
    inf: float = 1e9
    opm_eps: float = 1e-3


def evoformer_stages(config: EvoformerConfig) -> tuple[MultiStage, ...]:
    """One block's stages: what each needs whole, what it gathers (AF2 order)."""
    c = config
    return (
        MultiStage(
            "msa_row",
            {"m": "r", "z": ()},
            gathers=(Gather("z", c.msa_heads, "pair bias"),),
        ),
        MultiStage("msa_col", {"m": "s"}),
        MultiStage("msa_transition", {"m": ()}),
        MultiStage(
            "outer_product_mean",
            {"m": "s", "z": ()},
            aligned=("m", "z"),
            gathers=(Gather("m", c.c_hidden_opm, "opm operand"),),
        ),
        MultiStage(
            "tri_mul_out", {"z": "j"}, gathers=(Gather("z", c.c_hidden_mul, "mul operand"),)
        ),
        MultiStage("tri_mul_in", {"z": "i"}, gathers=(Gather("z", c.c_hidden_mul, "mul operand"),)),
        MultiStage(
            "tri_att_start", {"z": "j"}, gathers=(Gather("z", c.pair_heads, "triangle bias"),)
        ),
        MultiStage(
            "tri_att_end", {"z": "i"}, gathers=(Gather("z", c.pair_heads, "triangle bias"),)
        ),
        MultiStage("pair_transition", {"z": ()}),
    )


def evoformer_plan(config: EvoformerConfig, residues: int, msa_depth: int, sp_size: int):
    """The :class:`~dspzoo.core.parallel.multiplan.MultiPlan` of one block at these sizes."""
    shapes = {
        "m": ActShape(MSA_DIMS, (msa_depth, residues), config.c_m),
        "z": ActShape(PAIR_DIMS, (residues, residues), config.c_z),
    }
    return plan_multi(shapes, evoformer_stages(config), sp_size, SAME_AXIS)


@dataclass
class Residual:
    """How one pass adds a layer's update to its activation: ``add(x, op, *inputs)`` is
    ``x + dropout(op(*inputs))``.

    Dropout (training mode, ``p > 0``) is AF2's row- or column-shared mask (``shared_along``
    names the dim it is shared along, which also names the activation), keyed by
    ``(rng_key, *prefix, stage)`` so that it is the one-process mask on any sharding. In
    no-grad inference without dropout the layer adds its update into ``x`` in place, ``chunk``
    rows at a time (peak memory: one activation plus one chunk).
    """

    chunk: int | None = None
    training: bool = False
    rng_key: int | None = None
    batch_offset: int = 0
    prefix: tuple[int, ...] = ()

    def __call__(
        self,
        x: torch.Tensor,
        op: nn.Module,
        *inputs: torch.Tensor,
        p: float = 0.0,
        shared_along: str = "",
    ) -> torch.Tensor:
        dropping = self.training and p > 0
        if not torch.is_grad_enabled() and not dropping:
            return op(*inputs, chunk=self.chunk, residual=x)
        update = op(*inputs, chunk=self.chunk)
        if dropping:
            if self.rng_key is None:
                raise ValueError("Evoformer dropout needs rng_key (see Evoformer.forward)")
            key = mix_key(self.rng_key, *self.prefix, current_stage() or "")
            update = dropout(update, p, key, shared_along, batch_offset=self.batch_offset)
        return x + update


class EvoformerBlock(nn.Module):
    """One AF2 Evoformer block (Algorithm 6), on local shards placed by the plan."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.msa_att_row = MSARowAttentionWithPairBias(
            c.c_m, c.c_z, c.c_hidden_msa_att, c.msa_heads, c.inf
        )
        self.msa_att_col = MSAColumnAttention(c.c_m, c.c_hidden_msa_att, c.msa_heads, c.inf)
        self.msa_transition = Transition(c.c_m, c.transition_n, "m")
        self.outer_product_mean = OuterProductMean(c.c_m, c.c_z, c.c_hidden_opm, c.opm_eps)
        mul = c.mul_channel_chunk
        self.tri_mul_out = TriangleMultiplication(c.c_z, c.c_hidden_mul, True, mul)
        self.tri_mul_in = TriangleMultiplication(c.c_z, c.c_hidden_mul, False, mul)
        self.tri_att_start = TriangleAttention(
            c.c_z, c.c_hidden_pair_att, c.pair_heads, starting=True, inf=c.inf
        )
        self.tri_att_end = TriangleAttention(
            c.c_z, c.c_hidden_pair_att, c.pair_heads, starting=False, inf=c.inf
        )
        self.pair_transition = Transition(c.c_z, c.transition_n, "z")

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        add: Residual,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """AF2 Algorithm 6 on this rank's shards of ``m`` and ``z``; the masks ``[B, S, R]`` and
        ``[B, R, R]`` whole. Each ``stage`` line moves the activations as planned
        (:func:`evoformer_stages`); ``add(x, op, *inputs)`` is ``x + dropout(op(*inputs))``."""
        pm, pz = self.config.msa_dropout, self.config.pair_dropout
        m, z = stage("msa_row", m=m, z=z)
        m = add(m, self.msa_att_row, m, z, msa_mask, p=pm, shared_along="s")
        m = stage("msa_col", m=m)
        m = add(m, self.msa_att_col, m, msa_mask)
        m = stage("msa_transition", m=m)
        m = add(m, self.msa_transition, m, msa_mask)
        m, z = stage("outer_product_mean", m=m, z=z)
        z = add(z, self.outer_product_mean, m, msa_mask)
        z = stage("tri_mul_out", z=z)
        z = add(z, self.tri_mul_out, z, pair_mask, p=pz, shared_along="i")
        z = stage("tri_mul_in", z=z)
        z = add(z, self.tri_mul_in, z, pair_mask, p=pz, shared_along="i")
        z = stage("tri_att_start", z=z)
        z = add(z, self.tri_att_start, z, pair_mask, p=pz, shared_along="i")
        z = stage("tri_att_end", z=z)
        z = add(z, self.tri_att_end, z, pair_mask, p=pz, shared_along="j")
        z = stage("pair_transition", z=z)
        z = add(z, self.pair_transition, z, pair_mask)
        return m, z


class InputEmbedder(nn.Module):
    """AF2 Algorithms 3-4: target and MSA features → ``m``; target features and relative
    positions → ``z`` (OpenFold's names). Computes only this rank's shards."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        c = config
        self.max_rel = c.max_relative_position
        self.linear_tf_z_i = nn.Linear(c.tf_dim, c.c_z)
        self.linear_tf_z_j = nn.Linear(c.tf_dim, c.c_z)
        self.linear_tf_m = nn.Linear(c.tf_dim, c.c_m)
        self.linear_msa_m = nn.Linear(c.msa_dim, c.c_m)
        self.linear_relpos = nn.Linear(2 * c.max_relative_position + 1, c.c_z)

    def msa(self, target_feat: torch.Tensor, msa_feat: torch.Tensor) -> torch.Tensor:
        """``[B, R', 22]``, ``[B, S', R', 49]`` (any slices) → ``m`` ``[B, S', R', c_m]``."""
        return self.linear_msa_m(msa_feat) + self.linear_tf_m(target_feat)[:, None]

    def pair(
        self, target_feat: torch.Tensor, residue_index: torch.Tensor, rows: slice, cols: slice
    ) -> torch.Tensor:
        """Rows ``rows`` and columns ``cols`` of ``z`` ``[B, R, R, c_z]``."""
        tf_i = self.linear_tf_z_i(target_feat[:, rows])
        tf_j = self.linear_tf_z_j(target_feat[:, cols])
        d = residue_index[:, rows, None] - residue_index[:, None, cols]
        idx = torch.clamp(d, -self.max_rel, self.max_rel) + self.max_rel
        # one-hot(idx) @ W^T + b, as a lookup
        rel = F.embedding(idx, self.linear_relpos.weight.t()) + self.linear_relpos.bias
        return tf_i[:, :, None] + tf_j[:, None] + rel


class RecyclingEmbedder(nn.Module):
    """AF2 Algorithm 32 without the structure term: LayerNorm of the previous first MSA row and
    pair, added to the new ones (zeros before the first iteration, as AF2)."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(config.c_m)
        self.layer_norm_z = nn.LayerNorm(config.c_z)


class EvoformerStack(nn.Module):
    """The blocks (OpenFold: ``evoformer.blocks``)."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EvoformerBlock(config) for _ in range(config.num_blocks))


class DistogramHead(nn.Module):
    """AF2 §1.9.8: ``linear(z)`` symmetrised, ``logits + logitsᵀ``."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.c_z, config.distogram_bins)


def _check_features(batch: dict[str, torch.Tensor], config: EvoformerConfig) -> None:
    """Raise ``ValueError`` naming the feature and the fix for inconsistent inputs."""
    missing = [k for k in FEATURES if k not in batch]
    if missing:
        raise ValueError(
            f"Evoformer batch is missing feature(s) {missing}; expected {list(FEATURES)}"
        )
    aatype, tf, msa = batch["aatype"], batch["target_feat"], batch["msa_feat"]
    if aatype.dim() != 2:
        raise ValueError(f"aatype must be [B, R], got shape {tuple(aatype.shape)}")
    b, r = aatype.shape
    if tf.dim() != 3 or tf.shape[-1] != config.tf_dim:
        raise ValueError(
            f"target_feat must be [B, R, {config.tf_dim}] (AF2 layout), got {tuple(tf.shape)}"
        )
    if msa.dim() != 4 or msa.shape[-1] != config.msa_dim:
        raise ValueError(
            f"msa_feat must be [B, S, R, {config.msa_dim}] (AF2 layout), got {tuple(msa.shape)}"
        )
    s = msa.shape[1]
    want = {
        "target_feat": (b, r, config.tf_dim),
        "msa_feat": (b, s, r, config.msa_dim),
        "residue_index": (b, r),
        "seq_mask": (b, r),
        "msa_mask": (b, s, r),
    }
    for key, shape in want.items():
        got = tuple(batch[key].shape)
        if got != shape:
            raise ValueError(
                f"{key} has shape {got} but aatype [B={b}, R={r}] and msa_feat (S={s}) need "
                f"{shape}: every feature must have the same residue count R (crop/pad them together)"
            )
    if s < 1 or r < 1:
        raise ValueError(f"Evoformer needs at least one residue and one MSA row, got R={r}, S={s}")
    for key in ("aatype", "residue_index"):
        if batch[key].is_floating_point():
            raise ValueError(f"{key} must be an integer tensor, got {batch[key].dtype}")


def _recycled_row(m: SeqTensor, entry: SeqSpec, mp: MultiParallel) -> torch.Tensor:
    """Row 0 of the MSA ``m`` as the next pass's embedding reads it, without communication:
    this rank's residues of the entry layout where it holds MSA row 0, zeros elsewhere (where
    the embedding does not add it) ``[B, R_local, c_m]``. The plan is periodic, so ``m`` leaves
    the blocks in its entry layout."""
    if m.spec.sharded != entry.sharded:
        raise RuntimeError(
            f"Evoformer plan leaves m sharded on {m.spec.sharded!r} but enters it on "
            f"{entry.sharded!r}; recycling needs the plan to end where it starts"
        )
    s_axis = m.axis("s")
    if mp.local_range(m.spec, "s")[0] == 0 and m.tensor.shape[s_axis] > 0:
        return m.tensor.select(s_axis, 0)
    shape = list(m.tensor.shape)
    del shape[s_axis]
    return m.tensor.new_zeros(shape)  # a rank with other MSA rows, or none (S < SP size)


def _msa_first_row(m: SeqTensor, mp: MultiParallel) -> torch.Tensor:
    """Row 0 of the MSA ``m`` full on every rank ``[B, R, c_m]``, gathering only that row: from
    the rank that holds it when ``m`` is sharded on ``s``, its residues from each when on ``r``."""
    spec, s_axis = m.spec, m.axis("s")
    holds_row0 = mp.local_range(spec, "s")[0] == 0 and m.tensor.shape[s_axis] > 0
    rows = m.tensor.narrow(s_axis, 0, 1 if holds_row0 else 0)
    lengths = tuple(1 if n == "s" else n_len for n, n_len in zip(spec.names, spec.lengths))
    return mp.sp.exit(SeqTensor(rows, replace(spec, lengths=lengths))).select(s_axis, 0)


def _check_strategy(sp: SeqParallel) -> None:
    if sp.size > 1 and sp.strategy.name != "dsp":
        raise ValueError(
            f"the Evoformer runs under the 'dsp' strategy only (core.multiplan plans its MSA and "
            f"pair activations together); got {sp.strategy.name!r}"
        )


def _masks(msa_mask: torch.Tensor, seq_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole MSA mask ``[B, S, R]`` and pair mask ``seq_mask_i · seq_mask_j`` ``[B, R, R]``
    (the layers slice them for the current layout), as floats."""
    seq_mask = seq_mask.float()
    return msa_mask.float(), seq_mask[:, :, None] * seq_mask[:, None, :]


class Evoformer(nn.Module):
    """Input embedder, recycling embedder, Evoformer stack and distogram head (zoo family
    ``evoformer``); see the module docstring for the forward contract."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.config = config
        self.input_embedder = InputEmbedder(config)
        self.recycling_embedder = RecyclingEmbedder(config)
        self.evoformer = EvoformerStack(config)
        self.distogram_head = DistogramHead(config)

    def plan(self, residues: int, msa_depth: int, sp_size: int):
        """The block plan this model runs at these sizes (print it for the table)."""
        return evoformer_plan(self.config, residues, msa_depth, sp_size)

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        sp: SeqParallel | None = None,
        num_recycles: int | None = None,
        rng_key: int | None = None,
        batch_offset: int = 0,
        chunk_size: int | None = None,
        outputs: Collection[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        sp = sp or SeqParallel()
        cfg = self.config
        _check_strategy(sp)
        sp.agree_entry(
            {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)},
            "Evoformer",
            check=lambda: _check_features(batch, cfg),
            what="Evoformer inputs",
        )
        dropout_on = self.training and (cfg.msa_dropout > 0 or cfg.pair_dropout > 0)
        if dropout_on and rng_key is None:
            raise ValueError(
                "Evoformer in training mode with dropout needs rng_key (e.g. "
                "dspzoo.core.parallel.rng.mix_key(seed, step)) so that the masks are exact under sharding; "
                "or call model.eval()"
            )
        recycles = cfg.num_recycles if num_recycles is None else int(num_recycles)
        if recycles < 0:
            raise ValueError(f"num_recycles must be >= 0, got {recycles}")
        wanted = self._outputs(outputs)
        b, s, r, _ = batch["msa_feat"].shape
        mp = MultiParallel(sp, self.plan(r, s, sp.size), switch_chunk=cfg.c_z // 4 or None)
        msa_mask, pair_mask = _masks(batch["msa_mask"], batch["seq_mask"])
        chunk = cfg.chunk_size if chunk_size is None else chunk_size
        add = Residual(chunk, self.training, rng_key, batch_offset)
        m_entry = mp.spec("m", mp.plan.entry("m"))
        prev_row = batch["msa_feat"].new_zeros(b, mp.local_range(m_entry, "r")[1], cfg.c_m)
        prev_z: SeqTensor | None = None
        out: dict[str, torch.Tensor] = {}
        for it in range(recycles + 1):
            last = it == recycles
            with (
                torch.set_grad_enabled(last and torch.is_grad_enabled()),
                comm_region(f"recycle{it}"),
            ):
                m, z = self._embed(batch, mp, prev_row, prev_z)
                with mp.region(m=m, z=z) as region:
                    for k, block in enumerate(self.evoformer.blocks):
                        with comm_region(f"block{k}"):
                            add.prefix = (it, k)
                            m, z = block(m, z, msa_mask, pair_mask, add)
                    m_act, z_act = region.seq("m", m), region.seq("z", z)
                prev_row = _recycled_row(m_act, m_entry, mp).detach()
                prev_z = SeqTensor(z_act.tensor.detach(), z_act.spec)
                if last:
                    with comm_region("exit"):
                        out = self._gather_outputs(wanted, m_act, z_act, mp)
        return out

    def _outputs(self, outputs: Collection[str] | None) -> tuple[str, ...]:
        """The outputs to gather: ``outputs``, or the mode's default (see the module docstring)."""
        if outputs is None:
            return TRAINING_OUTPUTS if self.training else OUTPUTS
        unknown = sorted(set(outputs) - set(OUTPUTS))
        if unknown or not outputs:
            raise ValueError(
                f"Evoformer outputs must be a non-empty subset of {list(OUTPUTS)}, got "
                f"{list(outputs)}" + (f" ({unknown} unknown)" if unknown else "")
            )
        return tuple(k for k in OUTPUTS if k in outputs)

    def _gather_outputs(
        self, wanted: tuple[str, ...], m: SeqTensor, z: SeqTensor, mp: MultiParallel
    ) -> dict[str, torch.Tensor]:
        """The ``wanted`` outputs, full on every rank: one all-gather each, of what they use."""
        sp, out = mp.sp, {}
        if "distogram_logits" in wanted:
            logits = sp.exit(z.with_tensor(self.distogram_head.linear(z.tensor)))
            out["distogram_logits"] = logits + logits.transpose(1, 2)
        if "pair" in wanted:
            out["pair"] = sp.exit(z)
        if "msa_first_row" in wanted:
            out["msa_first_row"] = _msa_first_row(m, mp)
        return out

    def trunk(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        seq_mask: torch.Tensor,
        sp: SeqParallel | None = None,
        chunk_size: int | None = None,
        rng_key: int | None = None,
        batch_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Evoformer blocks alone on replicated ``m`` ``[B, S, R, c_m]`` and ``z``
        ``[B, R, R, c_z]`` (no embedders, no recycling); returns the full ``(m, z)``."""
        sp = sp or SeqParallel()
        _check_strategy(sp)
        b, s, r, _ = m.shape
        mp = MultiParallel(sp, self.plan(r, s, sp.size))
        msa_mask, pair_mask = _masks(msa_mask, seq_mask)
        chunk = self.config.chunk_size if chunk_size is None else chunk_size
        add = Residual(chunk, self.training, rng_key, batch_offset)
        mp.agree_entry(m=m, z=z)
        # copies: the no-grad path adds updates in place
        m = sp.shard(m.clone(), mp.spec("m", None), mp.plan.entry("m")).tensor
        z = sp.shard(z.clone(), mp.spec("z", None), mp.plan.entry("z")).tensor
        with mp.region(m=m, z=z) as region:
            for k, block in enumerate(self.evoformer.blocks):
                with comm_region(f"block{k}"):
                    add.prefix = (0, k)
                    m, z = block(m, z, msa_mask, pair_mask, add)
            with comm_region("exit"):
                return sp.exit(region.seq("m", m)), sp.exit(region.seq("z", z))

    def _embed(
        self,
        batch: dict[str, torch.Tensor],
        mp: MultiParallel,
        prev_row: torch.Tensor,
        prev_z: SeqTensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of the embedded ``m`` and ``z`` (plus recycling); ``prev_row``:
        the last pass's MSA row 0 as :func:`_recycled_row` keeps it ``[B, R_local, c_m]``."""
        emb, rec = self.input_embedder, self.recycling_embedder
        m_spec = mp.spec("m", mp.plan.entry("m"))
        z_spec = mp.spec("z", mp.plan.entry("z"))
        s0, sn = mp.local_range(m_spec, "s")
        r0, rn = mp.local_range(m_spec, "r")
        tf = batch["target_feat"].float()
        m = emb.msa(tf[:, r0 : r0 + rn], batch["msa_feat"][:, s0 : s0 + sn, r0 : r0 + rn].float())
        row = rec.layer_norm_m(prev_row)
        # row 0 of the MSA only, written so that every rank uses the layer (DDP sees a gradient)
        first = (torch.arange(s0, s0 + sn, device=m.device) == 0).to(m.dtype)
        m = m + first[None, :, None, None] * row[:, None]
        i0, ni = mp.local_range(z_spec, "i")
        j0, nj = mp.local_range(z_spec, "j")
        ri = batch["residue_index"].long()
        z = emb.pair(tf, ri, slice(i0, i0 + ni), slice(j0, j0 + nj))
        if prev_z is None:
            z = z + rec.layer_norm_z(torch.zeros_like(z))
        else:
            z = z + rec.layer_norm_z(mp.switch(prev_z, z_spec.sharded).tensor)
        return m, z
