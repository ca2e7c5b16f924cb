"""Mamba-1 and Mamba-2 mixer blocks over ``[B, L, C]`` sequences.

Parameter names and shapes follow transformers' ``MambaMixer`` / ``Mamba2Mixer`` (``in_proj``,
``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``; Mamba-2's ``dt_bias`` and
gated ``norm``), so their state dicts load unchanged. Both take an optional incoming
:class:`MixerState` (the conv halo and the SSM state) and can return the outgoing one: what
passing state between sequence segments needs. ``bidirectional=True`` adds a second, reversed
scan with its own conv/SSM parameters (suffix ``_b``, as Vision Mamba names them) and averages
the two directions before ``out_proj``.

Under sequence parallelism a model calls :func:`scan_along` (``sp.scan`` inside the open region)
instead of the mixer itself; the runtime runs the mixer locally (DSP axial) or through the
stage's scan method, which calls :meth:`forward_segment` (state passing) or
:meth:`forward_heads` (head all-to-all) with the communication as a link
(:mod:`dspzoo.core.parallel.methods.scan`). The outputs and gradients are those of ``forward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from dspzoo.core.layers.scan import (
    MAX_SCAN_CHUNK,
    causal_conv1d,
    exclusive_combine,
    selective_scan,
    selective_scan_correction,
    selective_scan_decay,
    ssd_correction,
    ssd_decay,
    ssd_scan,
)
from dspzoo.core.parallel import context
from dspzoo.core.parallel.methods.scan import HeadLink, ScanShape, SegmentLink


@dataclass
class MixerState:
    """What one scan direction carries across a segment boundary.

    ``conv``: ``[B, conv channels, K-1]`` the last inputs of the conv (its halo);
    ``ssm``: ``[B, D, N]`` (Mamba-1) or ``[B, H, P, N]`` (Mamba-2) recurrent state.
    """

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class Mamba1Config:
    """transformers' ``MambaConfig`` fields that shape one mixer."""

    hidden_size: int
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    time_step_rank: int | str = "auto"  # "auto": ceil(hidden_size / 16)
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_scale: float = 1.0
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    bidirectional: bool = False

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @property
    def dt_rank(self) -> int:
        if self.time_step_rank == "auto":
            return math.ceil(self.hidden_size / 16)
        return int(self.time_step_rank)


@dataclass
class Mamba2Config:
    """transformers' ``Mamba2Config`` fields that shape one mixer."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int = 128
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    use_conv_bias: bool = True
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    bidirectional: bool = False

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"num_heads × head_dim ({self.num_heads} × {self.head_dim}) must equal "
                f"expand × hidden_size ({self.intermediate_size})"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must divide num_heads={self.num_heads}")


def _inverse_softplus_dt(
    count: int, t_min: float, t_max: float, floor: float, generator=None
) -> torch.Tensor:
    """Mamba's Δ-bias init: softplus⁻¹ of ``dt`` log-uniform in ``[t_min, t_max]``."""
    dt = torch.exp(
        torch.rand(count, generator=generator) * (math.log(t_max) - math.log(t_min))
        + math.log(t_min)
    ).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


def _depthwise_conv(channels: int, width: int, bias: bool) -> nn.Conv1d:
    """``nn.Conv1d`` laid out as transformers stores it (weight ``[C, 1, K]``)."""
    return nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1, bias=bias)


def _check_input(x: torch.Tensor, hidden: int, name: str) -> None:
    if x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"{name} expects [B, L, C={hidden}]; got {tuple(x.shape)}")


def scan_along(mixer: nn.Module, x: torch.Tensor, over: str | tuple[str, ...]) -> torch.Tensor:
    """``mixer`` (a Mamba mixer) along the sequence dim(s) ``over`` of ``x``, in that order.

    Inside an open sharded region: ``sp.scan(mixer, x, layout, over)`` (``x``:
    ``[B, *seq_local, C]`` in the region's current layout): local when the scanned dims are
    whole, else the stage's scan method. Outside a region ``x`` is ``[B, L, C]`` and this is
    ``mixer(x)``.
    """
    region = context.active()
    if region is None:
        return mixer(x)
    return region.sp.scan(mixer, x, region.spec(), over)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or fp64 when it is fp64 (the SSM parameters enter the scan in full precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _summary_itemsize(itemsize: int) -> int:
    """Bytes of a segment summary's items: the scan state is fp32 (fp64 for fp64 inputs)."""
    return 8 if itemsize == 8 else 4


def _check_heads(units: int, link: HeadLink, what: str) -> None:
    if units < link.size:
        raise ValueError(
            f"head_a2a: {what} has {units} heads (channels), fewer than the {link.size} ranks of "
            f"the SP group; use state passing (method 'state_passing') for this scan"
        )


def _check_state(state: MixerState | None, conv_shape: tuple, ssm_shape: tuple, name: str) -> None:
    if state is None:
        return
    if tuple(state.conv.shape) != conv_shape or tuple(state.ssm.shape) != ssm_shape:
        raise ValueError(
            f"{name} state must be conv {conv_shape} and ssm {ssm_shape}; got conv "
            f"{tuple(state.conv.shape)} and ssm {tuple(state.ssm.shape)}"
        )


def _check_step(mixer: nn.Module, x: torch.Tensor) -> None:
    """A recurrent step takes one token per line of a causal (one-direction) mixer."""
    name = type(mixer).__name__
    if mixer.config.bidirectional:
        raise ValueError(
            f"{name}.step: a bidirectional mixer reads the future (its reversed scan); it has "
            f"no recurrent step. Run forward on the whole sequence"
        )
    if x.dim() != 2 or x.shape[-1] != mixer.config.hidden_size:
        raise ValueError(
            f"{name}.step expects one token per line, [B, C={mixer.config.hidden_size}]; "
            f"got {tuple(x.shape)}"
        )


def _conv_step(
    conv: nn.Conv1d, halo: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the causal depthwise conv + SiLU: ``halo`` ``[B, D, K-1]`` (the last inputs),
    ``x`` ``[B, D]`` → output ``[B, D]`` and the next halo ``[B, D, K-1]``."""
    window = torch.cat([halo.to(x.dtype), x[..., None]], dim=-1)  # [B, D, K]
    out = (window * conv.weight[:, 0, :].to(x.dtype)).sum(-1)
    if conv.bias is not None:
        out = out + conv.bias.to(x.dtype)
    return F.silu(out), window[..., 1:]


def _zero_state(mixer: nn.Module, x: torch.Tensor) -> MixerState:
    conv_shape, ssm_shape = mixer.state_shapes(x.shape[0])
    return MixerState(
        conv=x.new_zeros(conv_shape),
        ssm=torch.zeros(ssm_shape, dtype=_wide(x).dtype, device=x.device),
    )


class Mamba1Mixer(nn.Module):
    """Mamba-1 selective-SSM mixer: ``[B, L, C]`` → ``[B, L, C]``.

    in_proj → (x, z); x → causal depthwise conv → SiLU → x_proj → (Δ low-rank, B, C);
    Δ = softplus(dt_proj(Δ)); y = selective_scan(x, Δ, -exp(A_log), B, C, D, z); out_proj(y).
    """

    def __init__(self, config: Mamba1Config) -> None:
        super().__init__()
        self.config = config
        inner, nstate, rank = config.intermediate_size, config.state_size, config.dt_rank
        self.in_proj = nn.Linear(config.hidden_size, 2 * inner, bias=config.use_bias)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=config.use_bias)
        for suffix in ("", "_b") if config.bidirectional else ("",):
            setattr(
                self,
                "conv1d" + suffix,
                _depthwise_conv(inner, config.conv_kernel, config.use_conv_bias),
            )
            setattr(self, "x_proj" + suffix, nn.Linear(inner, rank + 2 * nstate, bias=False))
            setattr(self, "dt_proj" + suffix, nn.Linear(rank, inner, bias=True))
            a_name = "A_log" if not suffix else "A_b_log"
            setattr(self, a_name, nn.Parameter(torch.empty(inner, nstate)))
            setattr(self, "D" + suffix, nn.Parameter(torch.empty(inner)))
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba's init: S4D-real ``A``, ``D = 1``, Δ bias log-uniform in [t_min, t_max]."""
        c = self.config
        for suffix in ("", "_b") if c.bidirectional else ("",):
            a_log = self.A_log if not suffix else self.A_b_log
            a_log.copy_(torch.log(torch.arange(1, c.state_size + 1.0)).expand_as(a_log))
            getattr(self, "D" + suffix).fill_(1.0)
            dt_proj = getattr(self, "dt_proj" + suffix)
            std = c.dt_rank**-0.5 * c.time_step_scale
            nn.init.uniform_(dt_proj.weight, -std, std)
            dt_proj.bias.copy_(
                _inverse_softplus_dt(
                    c.intermediate_size, c.time_step_min, c.time_step_max, c.time_step_floor
                )
            )

    def state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of :class:`MixerState`'s ``conv`` and ``ssm`` for a batch of ``batch``."""
        c = self.config
        return (batch, c.intermediate_size, c.conv_kernel - 1), (
            batch,
            c.intermediate_size,
            c.state_size,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        state: MixerState | None = None,
        backward_state: MixerState | None = None,
        return_state: bool = False,
    ):
        """``hidden_states`` ``[B, L, C]`` → ``[B, L, C]``.

        ``state``: what enters the forward scan at step 0; ``backward_state`` (bidirectional
        only): what enters the reversed scan at step L-1. With ``return_state`` also returns the
        outgoing state(s): ``MixerState`` (or ``(forward, backward)`` when bidirectional).
        """
        _check_input(hidden_states, self.config.hidden_size, type(self).__name__)
        if backward_state is not None and not self.config.bidirectional:
            raise ValueError("backward_state is only for bidirectional=True mixers")
        conv_shape, ssm_shape = self.state_shapes(hidden_states.shape[0])
        _check_state(state, conv_shape, ssm_shape, type(self).__name__)
        _check_state(backward_state, conv_shape, ssm_shape, type(self).__name__)
        x, gate = self.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # [B, D, L]
        y, out_state = self._direction(x, gate, "", state, reverse=False)
        if not self.config.bidirectional:
            out = self.out_proj(y.transpose(1, 2))
            return (out, out_state) if return_state else out
        y_b, out_state_b = self._direction(x, gate, "_b", backward_state, reverse=True)
        out = self.out_proj(((y + y_b) / 2).transpose(1, 2))
        return (out, (out_state, out_state_b)) if return_state else out

    def step(
        self, hidden_states: torch.Tensor, state: MixerState | None = None
    ) -> tuple[torch.Tensor, MixerState]:
        """One recurrent step (autoregressive decoding): ``hidden_states`` ``[B, C]`` is the
        token after the ones ``state`` summarises (``None``: the first token) → its output
        ``[B, C]`` and the state after it. Equals ``forward`` on the whole sequence, token by
        token: ``forward(x, return_state=True)`` gives the state to continue from. Causal
        mixers only; the state is fp32 (fp64 for fp64 inputs)."""
        _check_step(self, hidden_states)
        c = self.config
        conv_shape, ssm_shape = self.state_shapes(hidden_states.shape[0])
        _check_state(state, conv_shape, ssm_shape, type(self).__name__)
        state = state or _zero_state(self, hidden_states)
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, D]
        xc, halo = _conv_step(self.conv1d, state.conv, x)
        dt, B, C = self.x_proj(xc).split([c.dt_rank, c.state_size, c.state_size], dim=-1)
        wide = _wide(xc).dtype
        delta = F.softplus((dt @ self.dt_proj.weight.T).to(wide) + _wide(self.dt_proj.bias))
        A = -torch.exp(_wide(self.A_log))  # [D, N]
        u = xc.to(wide)
        ssm = torch.exp(delta[..., None] * A) * state.ssm + (
            delta[..., None] * B.to(wide)[:, None, :] * u[..., None]
        )  # [B, D, N]
        y = (ssm * C.to(wide)[:, None, :]).sum(-1) + _wide(self.D) * u
        y = y * F.silu(gate.to(wide))
        return self.out_proj(y.to(hidden_states.dtype)), MixerState(conv=halo, ssm=ssm)

    def _directions(self, link: SegmentLink) -> list[tuple[str, SegmentLink]]:
        """``(parameter suffix, link)`` of every scan direction."""
        both = [("", link.direction(False)), ("_b", link.direction(True))]
        return both if self.config.bidirectional else both[:1]

    def forward_segment(self, hidden_states: torch.Tensor, link: SegmentLink) -> torch.Tensor:
        """State passing: ``hidden_states`` ``[B, L_r, C]`` is this rank's segment of the
        sequence → its ``[B, L_r, C]`` of ``forward`` on the whole sequence."""
        _check_input(hidden_states, self.config.hidden_size, type(self).__name__)
        x, gate = self.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # [B, D, L_r]
        ys = [
            self._direction(x, gate, suffix, None, lk.reverse, lk)[0]
            for suffix, lk in self._directions(link)
        ]
        return self.out_proj((sum(ys) / len(ys)).transpose(1, 2))

    def forward_heads(self, hidden_states: torch.Tensor, link: HeadLink) -> torch.Tensor:
        """Head all-to-all: ``hidden_states`` ``[B, L_r, C]`` is this rank's segment; each rank
        scans the whole sequence for its channels (the scan's "heads") → its ``[B, L_r, C]``."""
        _check_input(hidden_states, self.config.hidden_size, type(self).__name__)
        c = self.config
        inner = c.intermediate_size
        _check_heads(inner, link, type(self).__name__)
        mine = link.heads(inner)
        x, gate = self.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # [B, D, L_r]
        ys = []
        for suffix, lk in self._directions(link):
            conv = getattr(self, "conv1d" + suffix)
            flip = (lambda t: t.flip(-1)) if lk.reverse else (lambda t: t)
            conv_in = flip(x)
            xc = flip(
                causal_conv1d(
                    conv_in, conv.weight, conv.bias, "silu", lk.halo(conv_in, c.conv_kernel - 1)
                )
            ).transpose(1, 2)  # [B, L_r, D]
            dt, B, C = getattr(self, "x_proj" + suffix)(xc).split(
                [c.dt_rank, c.state_size, c.state_size], dim=-1
            )
            dt_proj = getattr(self, "dt_proj" + suffix)
            u, delta = lk.to_heads(torch.stack([xc, dt @ dt_proj.weight.T], -1)).unbind(-1)
            BC = lk.gather(torch.cat([B, C], dim=-1)).transpose(1, 2)  # [B, 2N, L]
            y = selective_scan(
                u.transpose(1, 2), delta.transpose(1, 2),
                -torch.exp(_wide((self.A_log if not suffix else self.A_b_log)[mine])),
                BC[:, : c.state_size], BC[:, c.state_size :],
                D=_wide(getattr(self, "D" + suffix)[mine]),
                delta_bias=_wide(dt_proj.bias[mine]), delta_softplus=True, reverse=lk.reverse,
            )  # fmt: skip
            ys.append(y.to(torch.promote_types(y.dtype, torch.float32)))  # gate in fp32+
        y = link.from_heads((sum(ys) / len(ys)).transpose(1, 2).unsqueeze(-1), inner)
        y = y.squeeze(-1) * F.silu(gate.to(y.dtype).transpose(1, 2))  # [B, L_r, D]
        return self.out_proj(y.to(hidden_states.dtype))

    def scan_shape(self, batch: int, seq: tuple[int, ...], itemsize: int = 4) -> ScanShape:
        """What the scan methods send for this mixer over ``batch`` lines split ``seq``."""
        c = self.config
        inner = c.intermediate_size
        return ScanShape(
            seq=tuple(seq), batch=batch, directions=2 if c.bidirectional else 1,
            conv_channels=inner, conv_halo=c.conv_kernel - 1,
            summary=2 * inner * c.state_size, summary_itemsize=_summary_itemsize(itemsize),
            heads=inner, head_in=2, head_out=1, gathered=2 * c.state_size, itemsize=itemsize,
            decay=inner * c.state_size, correction=5 * inner, **self._saved_fields(),
        )  # fmt: skip

    def _saved_fields(self) -> dict[str, float]:
        """What :meth:`forward` saves for backward (:class:`ScanShape`'s ``saved_*``), with
        ``C`` hidden, ``D`` inner, ``N`` state, ``R`` the Δ rank, ``K`` the conv width:
        shared by the directions per token the input ``C``, ``in_proj``'s output ``2D`` and
        ``out_proj``'s input ``D``; per direction and token the conv's padded input, output
        and its transposed copy, Δ before and after softplus, the scan input ``u``, ``Δ·u``,
        the output before the skip and ``silu(z)`` (``9D``), ``x_proj``'s output ``R + 2N``
        and the scan's states ``D·N`` per token of the line padded to whole chunks of at most
        ``MAX_SCAN_CHUNK`` (the adjoint backward keeps no more); the reversed direction also
        its flipped gate, ``B`` and ``C`` (``D + 2N``); per line and direction the conv halo
        ``D·(K−1)`` and the initial state ``D·N``."""
        c = self.config
        d, n, directions = c.intermediate_size, c.state_size, 2 if c.bidirectional else 1
        per_direction = 9 * d + c.dt_rank + 2 * n
        return dict(
            saved_token=c.hidden_size + 3 * d + directions * per_direction
            + (directions - 1) * (d + 2 * n),
            saved_line=directions * (d * (c.conv_kernel - 1) + d * n),
            chunk=MAX_SCAN_CHUNK,
            saved_padded=directions * d * n,
        )  # fmt: skip

    def _direction(
        self, x: torch.Tensor, gate: torch.Tensor, suffix: str, state: MixerState | None,
        reverse: bool, link: SegmentLink | None = None,
    ) -> tuple[torch.Tensor, MixerState]:  # fmt: skip
        """One scan direction: ``x``/``gate`` ``[B, D, L]`` → ``y`` ``[B, D, L]`` and its state.

        With a ``link`` (state passing) ``x`` is one segment: the conv halo comes from the
        previous segment, the scan starts from zero and the incoming state's part is added;
        the returned state is the one after the whole sequence.
        """
        conv = getattr(self, "conv1d" + suffix)
        flip = (lambda t: t.flip(-1)) if reverse else (lambda t: t)
        conv_in = flip(x)
        if link is not None:
            halo = link.halo(conv_in, self.config.conv_kernel - 1)
        else:
            halo = state.conv if state is not None else None
        xc, halo = causal_conv1d(
            conv_in, conv.weight, conv.bias, "silu", halo=halo, return_halo=True
        )
        xc = flip(xc)
        rank, nstate = self.config.dt_rank, self.config.state_size
        dt, B, C = getattr(self, "x_proj" + suffix)(xc.transpose(1, 2)).split(
            [rank, nstate, nstate], dim=-1
        )
        dt_proj = getattr(self, "dt_proj" + suffix)
        dt = (dt @ dt_proj.weight.T).transpose(1, 2)  # [B, D, L]; its bias goes in as delta_bias
        A = -torch.exp(_wide(self.A_log if not suffix else self.A_b_log))
        y, ssm = selective_scan(
            xc, dt, A, B.transpose(1, 2), C.transpose(1, 2),
            D=_wide(getattr(self, "D" + suffix)), z=gate,
            delta_bias=_wide(dt_proj.bias), delta_softplus=True,
            initial_state=state.ssm if state is not None else None,
            return_final_state=True, reverse=reverse,
        )  # fmt: skip
        if link is not None:
            decay = selective_scan_decay(dt, A, _wide(dt_proj.bias), True)
            incoming, ssm = exclusive_combine(*link.summaries(decay, ssm))
            y = y + selective_scan_correction(
                dt, A, C.transpose(1, 2), incoming[link.position], z=gate,
                delta_bias=_wide(dt_proj.bias), delta_softplus=True, reverse=reverse,
            ).to(y.dtype)  # fmt: skip
        return y, MixerState(conv=halo, ssm=ssm)


class GatedRMSNorm(nn.Module):
    """Mamba-2's norm: ``RMSNorm(y · silu(gate))`` per group of ``group_size`` channels."""

    def __init__(self, hidden: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``y``, ``gate``: ``[..., hidden]`` → ``[..., hidden]`` (computed in fp32, fp64 for fp64 inputs)."""
        dtype = y.dtype
        y = _wide(y)
        if gate is not None:
            y = y * F.silu(_wide(gate))
        grouped = y.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 (SSD) mixer: ``[B, L, C]`` → ``[B, L, C]``.

    in_proj → (z, xBC, Δ); xBC → causal depthwise conv → SiLU → (x, B, C) with ``n_groups``
    groups of B/C shared by ``num_heads / n_groups`` heads; y = ssd_scan(...); gated RMSNorm
    with z; out_proj.
    """

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.config = config
        c = config
        inner = c.intermediate_size
        self.conv_dim = inner + 2 * c.n_groups * c.state_size
        self.in_proj = nn.Linear(
            c.hidden_size, inner + self.conv_dim + c.num_heads, bias=c.use_bias
        )
        for suffix in ("", "_b") if c.bidirectional else ("",):
            setattr(
                self,
                "conv1d" + suffix,
                _depthwise_conv(self.conv_dim, c.conv_kernel, c.use_conv_bias),
            )
            setattr(self, "dt_bias" + suffix, nn.Parameter(torch.empty(c.num_heads)))
            setattr(
                self, "A_log" if not suffix else "A_b_log", nn.Parameter(torch.empty(c.num_heads))
            )
            setattr(self, "D" + suffix, nn.Parameter(torch.empty(c.num_heads)))
        self.norm = GatedRMSNorm(inner, inner // c.n_groups, c.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, c.hidden_size, bias=c.use_bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba-2's init: ``A = 1..H``, ``D = 1``, Δ bias log-uniform in [t_min, t_max]."""
        c = self.config
        for suffix in ("", "_b") if c.bidirectional else ("",):
            a_log = self.A_log if not suffix else self.A_b_log
            a_log.copy_(torch.log(torch.arange(1, c.num_heads + 1.0)))
            getattr(self, "D" + suffix).fill_(1.0)
            getattr(self, "dt_bias" + suffix).copy_(
                _inverse_softplus_dt(
                    c.num_heads, c.time_step_min, c.time_step_max, c.time_step_floor
                )
            )

    def state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of :class:`MixerState`'s ``conv`` and ``ssm`` for a batch of ``batch``."""
        c = self.config
        return (batch, self.conv_dim, c.conv_kernel - 1), (
            batch, c.num_heads, c.head_dim, c.state_size,
        )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        state: MixerState | None = None,
        backward_state: MixerState | None = None,
        return_state: bool = False,
    ):
        """``hidden_states`` ``[B, L, C]`` → ``[B, L, C]``; states as in :class:`Mamba1Mixer`."""
        _check_input(hidden_states, self.config.hidden_size, type(self).__name__)
        if backward_state is not None and not self.config.bidirectional:
            raise ValueError("backward_state is only for bidirectional=True mixers")
        conv_shape, ssm_shape = self.state_shapes(hidden_states.shape[0])
        _check_state(state, conv_shape, ssm_shape, type(self).__name__)
        _check_state(backward_state, conv_shape, ssm_shape, type(self).__name__)
        c = self.config
        gate, xBC, dt = self.in_proj(hidden_states).split(
            [c.intermediate_size, self.conv_dim, c.num_heads], dim=-1
        )
        y, out_state = self._direction(xBC, dt, "", state, reverse=False)
        if c.bidirectional:
            y_b, out_state_b = self._direction(xBC, dt, "_b", backward_state, reverse=True)
            y, out_state = (y + y_b) / 2, (out_state, out_state_b)
        out = self.out_proj(self.norm(y, gate).to(hidden_states.dtype))
        return (out, out_state) if return_state else out

    def step(
        self, hidden_states: torch.Tensor, state: MixerState | None = None
    ) -> tuple[torch.Tensor, MixerState]:
        """One recurrent step; see :meth:`Mamba1Mixer.step` (``hidden_states`` ``[B, C]`` →
        ``[B, C]`` and the state after it, ``ssm`` ``[B, H, P, N]``)."""
        _check_step(self, hidden_states)
        c = self.config
        conv_shape, ssm_shape = self.state_shapes(hidden_states.shape[0])
        _check_state(state, conv_shape, ssm_shape, type(self).__name__)
        state = state or _zero_state(self, hidden_states)
        gate, xBC, dt = self.in_proj(hidden_states).split(
            [c.intermediate_size, self.conv_dim, c.num_heads], dim=-1
        )
        xc, halo = _conv_step(self.conv1d, state.conv, xBC)
        groups_n = c.n_groups * c.state_size
        x, B, C = xc.split([c.intermediate_size, groups_n, groups_n], dim=-1)
        wide = _wide(xc).dtype
        steps = F.softplus(dt.to(wide) + _wide(self.dt_bias))  # [B, H]
        if tuple(c.time_step_limit) != (0.0, float("inf")):
            steps = steps.clamp(min=c.time_step_limit[0], max=c.time_step_limit[1])
        A = -torch.exp(_wide(self.A_log))  # [H]
        per_group = c.num_heads // c.n_groups
        B, C = (
            rearrange(t.to(wide), "b (g n) -> b g n", g=c.n_groups).repeat_interleave(per_group, 1)
            for t in (B, C)
        )  # [B, H, N]
        xh = rearrange(x.to(wide), "b (h p) -> b h p", p=c.head_dim)
        ssm = torch.exp(steps * A)[..., None, None] * state.ssm + (
            steps[..., None, None] * xh[..., None] * B[:, :, None, :]
        )  # [B, H, P, N]
        y = (ssm * C[:, :, None, :]).sum(-1) + _wide(self.D)[:, None] * xh
        y = rearrange(y, "b h p -> b (h p)")
        out = self.out_proj(self.norm(y, gate).to(hidden_states.dtype))
        return out, MixerState(conv=halo, ssm=ssm)

    def _directions(self, link: SegmentLink) -> list[tuple[str, SegmentLink]]:
        """``(parameter suffix, link)`` of every scan direction."""
        both = [("", link.direction(False)), ("_b", link.direction(True))]
        return both if self.config.bidirectional else both[:1]

    def _split_in(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        _check_input(hidden_states, c.hidden_size, type(self).__name__)
        return self.in_proj(hidden_states).split(
            [c.intermediate_size, self.conv_dim, c.num_heads], dim=-1
        )

    def forward_segment(self, hidden_states: torch.Tensor, link: SegmentLink) -> torch.Tensor:
        """State passing: ``hidden_states`` ``[B, L_r, C]`` is this rank's segment of the
        sequence → its ``[B, L_r, C]`` of ``forward`` on the whole sequence."""
        gate, xBC, dt = self._split_in(hidden_states)
        ys = [
            self._direction(xBC, dt, suffix, None, lk.reverse, lk)[0]
            for suffix, lk in self._directions(link)
        ]
        y = ys[0] if len(ys) == 1 else (ys[0] + ys[1]) / 2
        return self.out_proj(self.norm(y, gate).to(hidden_states.dtype))

    def forward_heads(self, hidden_states: torch.Tensor, link: HeadLink) -> torch.Tensor:
        """Head all-to-all: ``hidden_states`` ``[B, L_r, C]`` is this rank's segment; each rank
        scans the whole sequence for its heads → its ``[B, L_r, C]``."""
        c = self.config
        _check_heads(c.num_heads, link, type(self).__name__)
        gate, xBC, dt = self._split_in(hidden_states)
        mine = link.heads(c.num_heads)
        group_of = torch.arange(c.num_heads, device=xBC.device)[mine] // (c.num_heads // c.n_groups)
        groups_n = c.n_groups * c.state_size
        ys = []
        for suffix, lk in self._directions(link):
            conv = getattr(self, "conv1d" + suffix)
            flip = (lambda t: t.flip(1)) if lk.reverse else (lambda t: t)
            conv_in = flip(xBC).transpose(1, 2)
            xc = causal_conv1d(
                conv_in, conv.weight, conv.bias, "silu", lk.halo(conv_in, c.conv_kernel - 1)
            )
            x, BC = flip(xc.transpose(1, 2)).split([c.intermediate_size, 2 * groups_n], dim=-1)
            packed = torch.cat(
                [rearrange(x, "b l (h p) -> b l h p", p=c.head_dim), dt[..., None]], -1
            )
            xh, dth = lk.to_heads(packed).split([c.head_dim, 1], dim=-1)  # [B, L, H_r, *]
            B, C = rearrange(lk.gather(BC), "b l (two g n) -> two b l g n", two=2, g=c.n_groups)
            y = ssd_scan(
                xh, dth.squeeze(-1), -torch.exp(_wide((self.A_log if not suffix else self.A_b_log)[mine])),
                B.index_select(2, group_of), C.index_select(2, group_of), c.chunk_size,
                D=getattr(self, "D" + suffix)[mine], dt_bias=getattr(self, "dt_bias" + suffix)[mine],
                reverse=lk.reverse, dt_softplus=True, dt_limit=c.time_step_limit,
            )  # fmt: skip
            ys.append(y)
        y = ys[0] if len(ys) == 1 else (ys[0] + ys[1]) / 2
        y = rearrange(link.from_heads(y, c.num_heads), "b l h p -> b l (h p)")
        return self.out_proj(self.norm(y, gate).to(hidden_states.dtype))

    def scan_shape(self, batch: int, seq: tuple[int, ...], itemsize: int = 4) -> ScanShape:
        """What the scan methods send for this mixer over ``batch`` lines split ``seq``."""
        c = self.config
        return ScanShape(
            seq=tuple(seq), batch=batch, directions=2 if c.bidirectional else 1,
            conv_channels=self.conv_dim, conv_halo=c.conv_kernel - 1,
            summary=c.num_heads * (1 + c.head_dim * c.state_size),
            summary_itemsize=_summary_itemsize(itemsize), heads=c.num_heads,
            head_in=c.head_dim + 1, head_out=c.head_dim, gathered=2 * c.n_groups * c.state_size,
            itemsize=itemsize, decay=c.num_heads, correction=c.intermediate_size + 6 * c.num_heads,
            chunk=c.chunk_size, **self._saved_fields(),
        )  # fmt: skip

    def _saved_fields(self) -> dict[str, float]:
        """What :meth:`forward` saves for backward (:class:`ScanShape`'s ``saved_*``), with
        ``C`` hidden, ``D`` inner, ``N`` state, ``G`` B/C groups, ``H`` heads, ``K`` the conv
        width, ``W = D + 2GN`` the conv's channels. Shared by the directions, per token: the
        input ``C``, ``in_proj``'s output ``D + W + H``, the gated norm's ``4D + G`` and
        ``out_proj``'s input ``D``. Per direction: per token the conv's padded input, output
        and SiLU output ``3W`` and Δ before and after softplus ``2H``; per line the conv halo
        ``W·(K−1)``; the SSD's chunked tensors per padded token (``B``/``C`` copies ``2GN``,
        ``Δ·x`` and the off-diagonal output ``2D``, the cumulative decays ``2H``, ``B``
        spread over the heads ``HN``; with more than one chunk the einsums' copies of ``B``,
        ``C`` and ``Δ·x``, ``2GN + D``), per padded token and chunk position (``Q'``) the decay
        blocks twice and the scores ``2H + G``, per chunk state ``D·N`` and per pair of chunk
        boundaries ``H``."""
        c = self.config
        d, n, g, h = c.intermediate_size, c.state_size, c.n_groups, c.num_heads
        w, directions = self.conv_dim, 2 if c.bidirectional else 1
        return dict(
            saved_token=c.hidden_size + (d + w + h) + (4 * d + g) + d
            + directions * (3 * w + 2 * h),
            saved_line=directions * w * (c.conv_kernel - 1),
            saved_padded=directions * (2 * g * n + 2 * d + 2 * h + h * n),
            saved_batched=directions * (2 * g * n + d),
            saved_square=directions * (2 * h + g),
            saved_state=directions * d * n,
            saved_decay=directions * h,
        )  # fmt: skip

    def _direction(
        self, xBC: torch.Tensor, dt: torch.Tensor, suffix: str, state: MixerState | None,
        reverse: bool, link: SegmentLink | None = None,
    ) -> tuple[torch.Tensor, MixerState]:  # fmt: skip
        """One direction: ``xBC`` ``[B, L, conv_dim]``, ``dt`` ``[B, L, H]`` → ``y`` ``[B, L, D]``.

        With a ``link`` (state passing): as :meth:`Mamba1Mixer._direction`.
        """
        c = self.config
        conv = getattr(self, "conv1d" + suffix)
        flip = (lambda t: t.flip(1)) if reverse else (lambda t: t)
        conv_in = flip(xBC).transpose(1, 2)
        if link is not None:
            halo = link.halo(conv_in, c.conv_kernel - 1)
        else:
            halo = state.conv if state is not None else None
        xc, halo = causal_conv1d(
            conv_in, conv.weight, conv.bias, "silu", halo=halo, return_halo=True
        )
        xc = flip(xc.transpose(1, 2))
        groups_n = c.n_groups * c.state_size
        x, B, C = xc.split([c.intermediate_size, groups_n, groups_n], dim=-1)
        A = -torch.exp(_wide(self.A_log if not suffix else self.A_b_log))
        y, ssm = ssd_scan(
            rearrange(x, "b l (h p) -> b l h p", p=c.head_dim), dt, A,
            rearrange(B, "b l (g n) -> b l g n", g=c.n_groups),
            rearrange(C, "b l (g n) -> b l g n", g=c.n_groups),
            c.chunk_size, D=getattr(self, "D" + suffix), dt_bias=getattr(self, "dt_bias" + suffix),
            initial_states=state.ssm if state is not None else None, return_final_states=True,
            reverse=reverse, dt_softplus=True, dt_limit=c.time_step_limit,
        )  # fmt: skip
        if link is not None:
            dt_bias = getattr(self, "dt_bias" + suffix)
            decay = ssd_decay(dt, A, dt_bias, True, c.time_step_limit)
            incoming, ssm = exclusive_combine(*link.summaries(decay, ssm))
            y = y + ssd_correction(
                dt, A, rearrange(C, "b l (g n) -> b l g n", g=c.n_groups), incoming[link.position],
                dt_bias=dt_bias, dt_softplus=True, dt_limit=c.time_step_limit, reverse=reverse,
            ).to(y.dtype)  # fmt: skip
        return rearrange(y, "b l h p -> b l (h p)"), MixerState(conv=halo, ssm=ssm)
