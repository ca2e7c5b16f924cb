"""WeatherTransformer: a spatio-temporal transformer that forecasts gridded fields under DSP.

Input: a window of ``T`` past states ``[B, T, V, H, W]`` (normalised, NaN-free), the lead
time ``[B]`` and optional static fields ``[B, K, H, W]``. Output: the state ``lead_time``
ahead of the last input state, ``[B, V, H, W]`` (the last state plus a predicted increment).

1. **Tokens.** The grid is zero-padded to whole ``p × p`` patches (37 × 49 at ``p = 4`` →
   10 × 13 patches) and cut into raw patches ``[B, T, Y, X, V, p·p]`` by a pure
   rearrangement, so the sequence-parallel split happens on raw data. Each variable has its own
   patch embedding; a learned query aggregates the ``V`` variable tokens of a patch into one
   (:class:`~.layers.VariableTokenizer`). Static fields are embedded per patch and added to
   every time step; fixed sin-cos tables encode the time step and the latitude row.
2. **Layers** over the sequence dims ``t`` (time), ``y`` (lat patches), ``x`` (lon patches):
   attention along ``t``, then over space — *axial* (``y``, then ``x``) or *full* (``y·x``
   jointly) — then an MLP, each sub-block adaLN-modulated by the lead-time embedding and gated
   (adaLN-Zero).
3. **Longitude is periodic**: attention over ``x`` rotates queries and keys by circular rotary
   angles ``2π·k·j/X`` (integer harmonics ``k``), so scores depend on the lon distance modulo
   the globe and the model is exactly equivariant to rolling the input by whole lon patches
   (:func:`~.layers.periodic_rope_tables`). ``periodic_lon=False`` (regional grids) uses an
   absolute sin-cos table along ``x`` instead.
4. **Head**: adaLN LayerNorm + linear to ``V·p·p`` per token (zero at init: the initial
   forecast is persistence), applied to the last time step's tokens only (the forecast reads
   nothing else; the exit gathers that step alone), unpatchified, cropped and added to the last
   input state.

Under DSP the plan shards a dim the current stage does not attend over and switches between
stages (axial: 2 switches per layer); a full-spatial stage whose free dim ``t`` is shorter than
the SP size (e.g. a 2-state window at SP 8) runs an embedded method instead (hybrid plan).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.layers.embeddings import TimestepEmbedder, sincos_1d
from dspzoo.core.layers.mlp import FinalLayer, Mlp, gated, modulate
from dspzoo.core.parallel.layout import SeqSpec, shard_offset
from dspzoo.core.parallel.methods.ring import zigzag_positions
from dspzoo.core.parallel.rng import mix_key

from .layers import (
    VariableTokenizer,
    WeatherAttention,
    patch_grid,
    patchify,
    patchify_static,
    periodic_rope_tables,
    unpatchify,
)

SEQ_DIMS = ("t", "y", "x")
SPATIAL_MODES = ("axial", "full")


@dataclass(frozen=True)
class WeatherConfig:
    """Architecture and data layout of a :class:`WeatherTransformer`.

    Attributes:
        variables: channel names in input order (``"z@500"`` style for pressure levels).
        grid: ``(lat, lon)`` points of the input grid; need not divide by ``patch``.
        history: input states ``T`` per sample.
        patch: lat/lon patch size ``p`` (the grid is padded internally, cropped on output).
        hidden, depth, heads, mlp_ratio: transformer width, layers, heads, MLP expansion.
        spatial: ``"axial"`` (attend over lat, then lon) or ``"full"`` (lat·lon jointly).
        num_static: static channels (land-sea mask, orography, lat/lon encodings; 0: none).
        max_lead: largest accepted lead time, in the dataset's unit (the weather data layer
            uses time steps of the data).
        periodic_lon: the grid wraps around the globe in longitude (circular positions).
        dropout: dropout on every residual branch (keyed: pass ``dropout_key`` in training).
    """

    variables: tuple[str, ...] = ("t2m",)
    grid: tuple[int, int] = (32, 64)
    history: int = 2
    patch: int = 2
    hidden: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    spatial: str = "axial"
    num_static: int = 0
    max_lead: float = 1000.0
    periodic_lon: bool = True
    dropout: float = 0.0

    @property
    def patch_grid(self) -> tuple[int, int]:
        """Patch rows and columns ``(Y, X)``."""
        return patch_grid(self.grid, self.patch)

    @property
    def attention_stages(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(stage name, attended dims)`` of one layer's attention sub-blocks, in order."""
        if self.spatial == "axial":
            return (("temporal", ("t",)), ("lat", ("y",)), ("lon", ("x",)))
        return (("temporal", ("t",)), ("spatial", ("y", "x")))


def layer_stages(config: WeatherConfig) -> tuple[Stage, ...]:
    """The planner's stages of one layer (every layer is the same)."""
    attention = tuple(
        Stage(name, over, heads=config.heads, embed_if_underfilled=True)
        for name, over in config.attention_stages
    )
    return (*attention, Stage("mlp"))


@lru_cache(maxsize=32)
def _sincos(length: int, dim: int) -> torch.Tensor:
    """Fixed float32 CPU ``[length, dim]`` table (built on the CPU under any default device)."""
    with torch.device("cpu"):
        return sincos_1d(length, dim)


class WeatherBlock(nn.Module):
    """One layer over ``[B, T, Y, X, C]``: attention along ``t``, over space, then an MLP.

    Every sub-block is pre-norm, adaLN-modulated by the lead-time embedding (shift, scale)
    and gated; the modulation is zero at init, so the block starts as the identity.
    """

    def __init__(self, config: WeatherConfig, index: int) -> None:
        super().__init__()
        c = config.hidden
        self.index, self.dropout = index, config.dropout
        self.names = tuple(name for name, _ in config.attention_stages)
        self.attentions = nn.ModuleList(
            WeatherAttention(c, config.heads, over) for _, over in config.attention_stages
        )
        self.norm = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(c, config.mlp_ratio)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(c, 3 * (len(self.names) + 1) * c))

    def zero_init(self) -> None:
        """adaLN-Zero: shift, scale and gate all start at zero."""
        nn.init.zeros_(self.ada[-1].weight)
        nn.init.zeros_(self.ada[-1].bias)

    def _residual(
        self, act: SeqTensor, branch: torch.Tensor, gate: torch.Tensor, sp: SeqParallel, key
    ) -> SeqTensor:
        out = act.with_tensor(gated(branch, gate))
        if self.dropout > 0 and key is not None:
            out = sp.dropout(out, self.dropout, key=key)
        return act.with_tensor(act.tensor + out.tensor)

    def forward(
        self,
        act: SeqTensor,
        cond: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        sp: SeqParallel,
        dropout_key: int | None = None,
    ) -> SeqTensor:
        """``act`` ``[B, T_l, Y_l, X_l, C]``, ``cond`` the lead-time embedding ``[B, C]``."""
        mods = self.ada(cond).chunk(3 * (len(self.names) + 1), dim=-1)

        def key(part: str) -> int | None:
            return None if dropout_key is None else mix_key(dropout_key, self.index, part)

        for j, (name, attention) in enumerate(zip(self.names, self.attentions)):
            act = sp.to_stage(act, name)
            shift, scale, gate = mods[3 * j : 3 * j + 3]
            branch = attention(modulate(self.norm(act.tensor), shift, scale), act.spec, sp, rope)
            act = self._residual(act, branch, gate, sp, key(name))

        act = sp.to_stage(act, "mlp")
        shift, scale, gate = mods[-3:]
        branch = self.mlp(modulate(self.norm(act.tensor), shift, scale), act.spec, sp)
        return self._residual(act, branch, gate, sp, key("mlp"))


def _with_length(spec: SeqSpec, dim: str, length: int) -> tuple[int, ...]:
    """``spec``'s lengths with ``dim``'s replaced by ``length``."""
    return tuple(length if n == dim else v for n, v in zip(spec.names, spec.lengths))


def _t_positions(spec: SeqSpec, n: int, rank: int) -> torch.Tensor:
    """Global time steps ``rank`` holds when ``spec`` is sharded on ``t`` (either layout)."""
    length = spec.length("t")
    if spec.layout == "zigzag":
        return zigzag_positions(length, n, rank)
    return torch.arange(shard_offset(length, n, rank), shard_offset(length, n, rank + 1))


class WeatherTransformer(nn.Module):
    """The weather forecasting transformer; see the module docstring.

    ``STAGES`` (per instance, from the config) are the planner's stages of one layer.
    """

    def __init__(self, config: WeatherConfig) -> None:
        super().__init__()
        c = config
        if c.spatial not in SPATIAL_MODES:
            raise ValueError(f"spatial must be one of {SPATIAL_MODES}, got {c.spatial!r}")
        if not c.variables:
            raise ValueError("variables must name at least one input channel")
        if c.hidden % c.heads or (c.hidden // c.heads) % 2:
            raise ValueError(
                f"hidden {c.hidden} must split into {c.heads} heads of an even size "
                f"(rotary positions along longitude)"
            )
        if c.hidden % 2:
            raise ValueError(f"hidden {c.hidden} must be even for the sin-cos tables")
        if c.patch < 1 or c.history < 1 or min(c.grid) < 1 or c.num_static < 0:
            raise ValueError(
                f"patch, history and grid must be positive and num_static >= 0, got "
                f"patch={c.patch}, history={c.history}, grid={c.grid}, num_static={c.num_static}"
            )
        self.config = config
        self.STAGES = layer_stages(config)
        pixels = c.patch * c.patch
        self.tokenizer = VariableTokenizer(len(c.variables), c.patch, c.hidden, c.heads)
        self.static_embed = nn.Linear(c.num_static * pixels, c.hidden) if c.num_static else None
        self.lead_embed = TimestepEmbedder(c.hidden)
        self.blocks = nn.ModuleList(WeatherBlock(c, i) for i in range(c.depth))
        self.final = FinalLayer(c.hidden, len(c.variables) * pixels)
        self.initialize_weights()

    # -- init -----------------------------------------------------------------------------
    def initialize_weights(self) -> None:
        """Xavier linears; adaLN-Zero blocks; a zero head (the initial forecast is persistence)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for m in self.lead_embed.mlp:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:
            block.zero_init()
        for m in (self.final.ada[-1], self.final.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    # -- inputs ---------------------------------------------------------------------------
    def check_inputs(
        self, x: torch.Tensor, lead_time: torch.Tensor, static: torch.Tensor | None
    ) -> None:
        """Raise a clear ``ValueError`` for inputs this model cannot take."""
        c = self.config
        if x.dim() != 5:
            raise ValueError(
                f"x must be [B, T, V, lat, lon] = [B, {c.history}, {len(c.variables)}, "
                f"{c.grid[0]}, {c.grid[1]}], got shape {tuple(x.shape)}"
            )
        b, t, v, h, w = x.shape
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
        if v != len(c.variables):
            raise ValueError(
                f"x has {v} variables but the model was built for {len(c.variables)}: "
                f"{list(c.variables)} (config field 'variables')"
            )
        if (h, w) != tuple(c.grid):
            raise ValueError(
                f"x is on a {h} x {w} (lat x lon) grid but the model was built for "
                f"{c.grid[0]} x {c.grid[1]} (config field 'grid'); regrid the data or build "
                f"the model with grid=({h}, {w})"
            )
        if t != c.history:
            raise ValueError(
                f"x holds {t} input states but the model was built for history={c.history} "
                f"(config field 'history')"
            )
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise ValueError(
                f"x contains {bad} NaN/inf values; fill missing values (0 after normalisation) "
                f"and pass their mask to the loss instead"
            )
        if lead_time.shape != (b,):
            raise ValueError(f"lead_time must be [B={b}], got shape {tuple(lead_time.shape)}")
        if not torch.isfinite(lead_time).all() or (lead_time < 0).any():
            raise ValueError(f"lead_time must be finite and >= 0, got {lead_time.tolist()}")
        if (lead_time > c.max_lead).any():
            raise ValueError(
                f"lead_time {lead_time.max().item()} is beyond max_lead={c.max_lead} of this "
                f"model (config field 'max_lead')"
            )
        if static is None:
            if c.num_static:
                raise ValueError(
                    f"the model was built with num_static={c.num_static} static channels; "
                    f"pass static [B, {c.num_static}, {h}, {w}]"
                )
            return
        if not c.num_static:
            raise ValueError(
                "static fields given, but the model was built with num_static=0 "
                "(config field 'num_static')"
            )
        if static.shape != (b, c.num_static, h, w):
            raise ValueError(
                f"static must be [B, num_static, lat, lon] = {(b, c.num_static, h, w)}, "
                f"got shape {tuple(static.shape)}"
            )
        if not torch.isfinite(static).all():
            raise ValueError("static fields contain NaN/inf values; fill them before the model")

    # -- forward --------------------------------------------------------------------------
    def position_tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Additive sin-cos tables: time ``[1, T, 1, 1, C]``, lat ``[1, 1, Y, 1, C]`` and, for a
        non-periodic grid, lon ``[1, 1, 1, X, C]`` (each sliced with the tokens it is added to)."""
        c = self.config
        rows, cols = c.patch_grid
        tables = [
            _sincos(c.history, c.hidden)[None, :, None, None],
            _sincos(rows, c.hidden)[None, None, :, None],
        ]
        if not c.periodic_lon:
            tables.append(_sincos(cols, c.hidden)[None, None, None, :])
        return tuple(t.to(device=device, dtype=dtype) for t in tables)

    def rope_tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Circular rotary tables along longitude (``None`` for a non-periodic grid)."""
        c = self.config
        if not c.periodic_lon:
            return None
        return periodic_rope_tables(c.patch_grid[1], c.hidden // c.heads, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        lead_time: torch.Tensor,
        static: torch.Tensor | None = None,
        sp: SeqParallel | None = None,
        dropout_key: int | None = None,
    ) -> torch.Tensor:
        """Forecast the state ``lead_time`` after the last input state.

        Args:
            x: normalised input states ``[B, T, V, lat, lon]``, NaN-free, identical on every
                rank of the SP group.
            lead_time: ``[B]`` lead times in the dataset's unit (``0 ≤ lead ≤ max_lead``).
            static: ``[B, num_static, lat, lon]`` static fields, or ``None``.
            sp: the sequence-parallel context (``None``: one process).
            dropout_key: with ``config.dropout > 0`` in training, the key of this step's
                dropout masks (e.g. ``mix_key(seed, step, dp_rank)``); equal inside an SP
                group. Without it no dropout is applied.

        Returns the forecast ``[B, V, lat, lon]``, replicated on every rank. Inputs are
        validated on all ranks of the SP group together, so a bad input raises the same
        error on every rank.
        """
        sp = sp or SeqParallel()
        c = self.config
        sp.agree_entry(
            {"x": x},
            check=lambda: self.check_inputs(x, lead_time, static),
            what=f"{type(self).__name__} inputs",
        )
        act = sp.enter(patchify(x, c.patch), SEQ_DIMS, self.STAGES)  # [B, T, Y, X, V, p·p]
        tokens = self.tokenizer(act.tensor)  # [B, T_l, Y_l, X_l, C]
        for table in self.position_tables(x.device, tokens.dtype):
            tokens = tokens + sp.shard_like(table, act)
        if static is not None:
            raw = sp.shard_like(patchify_static(static.to(tokens.dtype), c.patch), act)
            tokens = tokens + self.static_embed(raw)
        act = act.with_tensor(tokens)
        cond = self.lead_embed(lead_time)  # [B, C]
        rope = self.rope_tables(x.device, tokens.dtype)
        key = dropout_key if self.training else None
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, cond, rope, sp, key)
        out = self._last_state_outputs(act, cond, sp)  # [B, Y, X, V·p·p]
        return x[:, -1] + unpatchify(out, c.patch, c.grid)

    def _last_state_outputs(
        self, act: SeqTensor, cond: torch.Tensor, sp: SeqParallel
    ) -> torch.Tensor:
        """The head's outputs for the last input state's tokens ``[B, Y, X, V·p·p]``, full on
        every rank: the head runs on, and the exit gathers, that state alone.

        Sharded on ``t``, one rank holds the state: every rank sends one candidate row through
        the head (the holder that state, the others a row of their own, or zeros when they
        hold no step, so that every rank's layers and head stay in the graph with a zero
        gradient) and the holder's is kept: the bytes of a one-row gather. Otherwise every
        rank holds its share of the state and the exit gathers that share.
        """
        spec, t_axis = act.spec, act.axis("t")
        last = spec.length("t") - 1
        if spec.sharded != "t" or sp.size == 1:
            rows = self.final(act.tensor.narrow(t_axis, last, 1), cond)
            one_step = replace(spec, lengths=_with_length(spec, "t", 1))
            return sp.exit(SeqTensor(rows, one_step)).select(t_axis, 0)
        held = [_t_positions(spec, sp.size, r) for r in range(sp.size)]
        holder = next(r for r, pos in enumerate(held) if last in pos.tolist())
        local_steps = act.tensor.shape[t_axis]
        if sp.rank == holder:
            mine = act.tensor.narrow(t_axis, held[holder].tolist().index(last), 1)
        else:  # any row of its own (discarded), so that its blocks stay in the graph
            mine = act.tensor.narrow(t_axis, 0, min(1, local_steps))
        if mine.shape[t_axis] == 0:  # a rank with no time step: a zero row
            shape = list(mine.shape)
            shape[t_axis] = 1
            mine = torch.cat([mine, mine.new_zeros(shape)], dim=t_axis)
        one_per_rank = replace(spec, lengths=_with_length(spec, "t", sp.size), layout="contiguous")
        candidates = sp.exit(SeqTensor(self.final(mine, cond), one_per_rank))
        return candidates.select(t_axis, holder)
