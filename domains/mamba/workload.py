"""The cost model's view of a Mamba step (``dspzoo plan``, the harness's bytes), registered with
:func:`~dspzoo.core.costmodel.workload.register_workload` by the package.

A scan stage is described by its :class:`~dspzoo.core.parallel.plan.Stage` (the dims it mixes,
its op kind): the switches and gathers the plan makes around it are what the cost model counts.
A ``scan`` stage's :class:`StageSpec` also carries the dims it scans (``scan_over``) and its
mixer's :class:`~dspzoo.core.parallel.methods.scan.ScanShape` (``scan``, from a mixer built on
the meta device: no memory), so the scan methods' bytes over a sharded dim (state passing, head
all-to-all) are priced by the scan op kind's formulas; ``extra["scan"]`` summarises the shape.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from dspzoo.core.costmodel.workload import HeadScanSaved, StageSpec, Workload
from dspzoo.core.layers.mamba import Mamba1Config, Mamba2Config
from dspzoo.core.layers.scan import MAX_SCAN_CHUNK
from dspzoo.core.parallel.plan import Stage

from ...core.errors import UsageError
from .hybrid import HybridLMConfig, hybrid_stages
from .layers import build_mixer
from .lm import MambaLMConfig, lm_stages
from .orders import parse_order
from .video import SEQ_DIMS as VIDEO_DIMS
from .video import VideoMambaConfig, layer_stages
from .weather import SEQ_DIMS as WEATHER_DIMS
from .weather import WeatherMambaConfig, weather_mamba_stages


def _scan_shape(hidden: int, state: int, expand: int, conv: int, heads: int, routes: int) -> dict:
    return {"inner": expand * hidden, "state": state, "heads": heads, "conv": conv,
            "routes": routes}  # fmt: skip


def mixer_flops_per_token(config: Mamba1Config | Mamba2Config) -> dict[str, float]:
    """Forward FLOPs of one Mamba mixer per token of a line, by part (``2·m·n`` per matmul):

    * ``projections``: ``in_proj`` and ``out_proj`` (Mamba-1 also ``x_proj`` and ``dt_proj``
      per direction);
    * ``conv``: the depthwise causal conv, ``2·K`` per channel per direction;
    * ``scan``: Mamba-1's selective scan, ``9·D·N`` per direction (mamba-ssm's count: the
      discretisation, the recurrence and the ``C`` readout); Mamba-2's SSD in chunks of ``Q``
      per direction: ``C·Bᵀ`` within a chunk ``2·Q·G·N``, its scores times ``x``
      ``2·Q·D``, the chunk states ``2·D·N`` and the output from the states ``2·D·N``.

    ``D`` = expand·hidden, ``N`` the state size, ``G`` the B/C groups. Elementwise work (gates,
    norms, softplus) is left out, as the cost model leaves it out everywhere.
    """
    c, inner, state = config.hidden_size, config.intermediate_size, config.state_size
    directions = 2 if config.bidirectional else 1
    if isinstance(config, Mamba1Config):
        rank = config.dt_rank
        per_direction = 2 * inner * (rank + 2 * state) + 2 * rank * inner
        return {
            "projections": float(2 * c * 2 * inner + 2 * inner * c + directions * per_direction),
            "conv": float(directions * 2 * config.conv_kernel * inner),
            "scan": float(directions * 9 * inner * state),
        }
    groups, heads, chunk = config.n_groups, config.num_heads, config.chunk_size
    in_width = 2 * inner + 2 * groups * state + heads
    ssd = 2 * chunk * groups * state + 2 * chunk * inner + 4 * inner * state
    return {
        "projections": float(2 * c * in_width + 2 * inner * c),
        "conv": float(directions * 2 * config.conv_kernel * (inner + 2 * groups * state)),
        "scan": float(directions * ssd),
    }


def scan_spec(
    stage: Stage, kind: str, hidden: int, options: dict, itemsize: int, routes: int = 1,
    **fields: Any,
) -> StageSpec:  # fmt: skip
    """The :class:`StageSpec` of a scan stage: a ``kind`` mixer of width ``hidden``
    (``options``: its config fields), whose shape the formulas need.

    A ``scan`` stage scans its dims in order (``scan_over``: the scan methods' bytes over a
    sharded dim). A ``generic`` one (``cross``'s routes, ``zigzag``, a circular scan) gets its
    dims whole and has no scan bytes, but its mixers still compute: ``routes`` scans of every
    token (4 for ``cross``; a ring of ``X`` columns scanned from every column: ``X``).
    """
    with torch.device("meta"):
        mixer = build_mixer(kind, hidden, **options)
    flops = routes * sum(mixer_flops_per_token(mixer.config).values())
    shape = replace(mixer.scan_shape(1, (), itemsize), flops_per_token=flops)
    over = stage.mixes if stage.op == "scan" else ()
    heads_saved = head_a2a_saved(mixer.config)
    return StageSpec(stage, scan_over=over, scan=shape, scan_routes=routes,
                     scan_heads_saved=heads_saved, **fields)  # fmt: skip


def mamba_lm_workload(
    name: str,
    config: MambaLMConfig,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step of a Mamba LM on ``batch`` sequences of ``seq_len`` tokens."""
    if seq_len is None:
        raise UsageError(f"{name} is a language model: give seq_len (--seq-len)")
    heads = config.num_heads if config.version == 2 else 1
    stages = lm_stages(config)
    layer = (
        scan_spec(stages[0], f"mamba{config.version}", config.hidden_size,
                  config.mixer_options(), itemsize, adaln=False),
    )  # fmt: skip
    return Workload(
        name=name,
        family="mambalm" if config.version == 1 else "mamba2lm",
        batch=batch,
        dims=("l",),
        lengths=(seq_len,),
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=heads,
        mlp_hidden=0,
        layers=(layer,) * config.num_hidden_layers,
        period=stages,
        in_width=1,
        exit_width=config.vocab_size,
        loss_on_shard=True,  # training's cross-entropy runs on each rank's logits
        causal=True,
        params=params,
        itemsize=itemsize,
        extra={
            "checkpoint": config.checkpoint,
            "vocab": config.vocab_size,
            "mixer": f"mamba{config.version}",
            "scan": _scan_shape(
                config.hidden_size, config.state_size, config.expand, config.conv_kernel, heads, 1
            ),
        },  # fmt: skip
    )


def video_mamba_workload(
    name: str,
    config: VideoMambaConfig,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step on ``frames`` latent frames of a ``spatial`` latent ``(H, W)`` (or square)."""
    if frames is None or spatial is None:
        raise UsageError(f"{name} is a video model: give frames and spatial (latent size)")
    h, w = (spatial, spatial) if isinstance(spatial, int) else spatial
    pt, ph, pw = config.patch
    stages = layer_stages(config)
    options = config.mixer_options()
    routes = [parse_order(order).route_count() for order in config.orders]
    layer = tuple(
        StageSpec(s, mlp=True) if s.name == "mlp"
        else scan_spec(s, config.mixer, config.hidden, options, itemsize, routes=routes[i])
        for i, s in enumerate(stages)
    )  # fmt: skip
    heads = config.expand * config.hidden // config.head_dim if config.mixer == "mamba2" else 1
    return Workload(
        name=name,
        family="videomamba",
        batch=batch,
        dims=VIDEO_DIMS,
        lengths=(frames // pt, h // ph, w // pw),
        hidden=config.hidden,
        heads=heads,
        kv_heads=heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=(layer,) * config.depth,
        period=stages,
        in_width=config.in_channels * pt * ph * pw,
        exit_width=config.out_channels * pt * ph * pw,
        loss_on_shard=True,  # training's flow MSE runs on each rank's tokens
        params=params,
        itemsize=itemsize,
        extra={
            "mixer": config.mixer,
            "scan": _scan_shape(
                config.hidden, config.state_size, config.expand, config.conv_kernel, heads, 1
            ),
        },  # fmt: skip
    )


def weather_mamba_workload(
    name: str,
    config: WeatherMambaConfig,
    *,
    batch: int = 1,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step of a weather Mamba on its configured grid and history."""
    stages = weather_mamba_stages(config)
    rows, cols = config.patch_grid
    heads = config.expand * config.hidden // config.head_dim if config.mixer == "mamba2" else 1
    pixels = config.patch * config.patch
    options = config.mixer_options()
    # the circular longitude scan reads the whole ring from every column: cols scans per token
    routes = {"lon": cols if config.periodic_lon else 1}
    layer = tuple(
        StageSpec(s, mlp=True) if s.name == "mlp"
        else scan_spec(s, config.mixer, config.hidden, options, itemsize,
                       routes=routes.get(s.name, 1))
        for s in stages
    )  # fmt: skip
    return Workload(
        name=name,
        family="weathermamba",
        batch=batch,
        dims=WEATHER_DIMS,
        lengths=(config.history, rows, cols),
        hidden=config.hidden,
        heads=heads,
        kv_heads=heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=(layer,) * config.depth,
        period=stages,
        in_width=len(config.variables) * pixels,
        exit_width=len(config.variables) * pixels,
        exit_last=("t",),  # the weather transformer's head: the last history step only
        params=params,
        itemsize=itemsize,
        extra={
            "mixer": config.mixer,
            "scan": _scan_shape(
                config.hidden, config.state_size, config.expand, config.conv_kernel, heads, 1
            ),
        },  # fmt: skip
    )


def hybrid_lm_workload(
    name: str,
    config: HybridLMConfig,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step of a hybrid LM on ``batch`` sequences of ``seq_len`` tokens: per layer a scan
    stage (Mamba layers) or an attention and an MLP stage (attention layers)."""
    if seq_len is None:
        raise UsageError(f"{name} is a language model: give seq_len (--seq-len)")
    stages = {s.name: s for s in hybrid_stages(config)}
    attention = config.attention_config()
    scan_heads = config.num_heads if config.version == 2 else 1
    layers = []
    for i in range(config.num_hidden_layers):
        if config.is_attention(i):
            layers.append(
                (StageSpec(stages["attn"], attention=("l",), tp_pairs=1, adaln=False,
                           pre_norm=True),
                 StageSpec(stages["mlp"], mlp=True, tp_pairs=1, adaln=False, pre_norm=True))
            )  # fmt: skip
        else:
            layers.append(
                (scan_spec(stages["scan"], f"mamba{config.version}", config.hidden_size,
                           config.mixer_options(), itemsize, adaln=False),)
            )  # fmt: skip
    return Workload(
        name=name,
        family="hybridlm",
        batch=batch,
        dims=("l",),
        lengths=(seq_len,),
        hidden=config.hidden_size,
        heads=attention.heads,
        kv_heads=attention.num_kv_heads,
        mlp_hidden=int(config.hidden_size * config.mlp_ratio),
        layers=tuple(layers),
        period=tuple(stages.values()),
        in_width=1,
        exit_width=config.vocab_size,
        loss_on_shard=True,  # training's cross-entropy runs on each rank's logits
        causal=True,
        params=params,
        itemsize=itemsize,
        extra={
            "checkpoint": config.checkpoint,
            "vocab": config.vocab_size,
            "mixer": f"mamba{config.version}",
            "attention_layers": config.attention_layers,
            "scan": _scan_shape(
                config.hidden_size,
                config.state_size,
                config.expand,
                config.conv_kernel,
                scan_heads,
                1,
            ),
        },  # fmt: skip
    )


def head_a2a_saved(config: Mamba1Config | Mamba2Config) -> HeadScanSaved:
    """What a mixer's ``forward_heads`` saves for backward (see :class:`HeadScanSaved`).

    Mamba-1 (``C`` hidden, ``D`` inner = its scan heads, ``N`` state, ``R`` the Δ rank, ``K``
    the conv width): per local token the input ``C``, ``in_proj``'s output ``2D``, the gated
    output, ``silu(z)`` and ``out_proj``'s input ``3D``, per direction the conv's padded input,
    its output and ``x_proj``'s input ``3D`` and ``x_proj``'s output ``R + 2N``; per line and
    direction the conv halo ``D·(K−1)``; per whole token and direction the gathered (or, reversed,
    flipped) ``B`` and ``C`` ``2N``; per whole token and channel of the rank the all-to-all's
    output ``u, Δ`` and the scan's copies (5 one way, 9 both ways); per channel the initial
    state ``N`` and the states ``N`` per token padded to chunks of ``MAX_SCAN_CHUNK``, per
    direction.
    """
    d, n = config.intermediate_size, config.state_size
    directions = 2 if config.bidirectional else 1
    if isinstance(config, Mamba1Config):
        return HeadScanSaved(
            token=config.hidden_size + 5 * d + directions * (3 * d + config.dt_rank + 2 * n),
            line=directions * d * (config.conv_kernel - 1),
            whole=directions * 2 * n,
            whole_head=5 + 4 * (directions - 1),
            line_head=directions * n,
            chunk=MAX_SCAN_CHUNK,
            padded_head=directions * n,
        )
    g, h, p = config.n_groups, config.num_heads, config.head_dim
    w = d + 2 * g * n
    return HeadScanSaved(
        token=config.hidden_size + (d + w + h) + (4 * d + g) + d + directions * (2 * w),
        line=directions * w * (config.conv_kernel - 1),
        whole=0,
        whole_head=directions * (p + 3),
        chunk=config.chunk_size,
        padded_head=directions * (2 * n + 2 * p + 2 + n),
        batched_head=directions * (2 * n + p),
        square_head=directions * 3,
        state_head=directions * p * n,
        decay_head=directions,
    )
