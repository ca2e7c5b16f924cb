"""A weather Mamba forecaster: the weather transformer with axial selective scans for attention.

:class:`WeatherMamba` is :class:`~dspzoo.domains.weather.model.WeatherTransformer` (its
tokenizer, static fields, lead-time adaLN, head, input checks and interface, so the weather
trainer and forecaster take it) whose layers scan along time, latitude and longitude
(``axial(t)``, ``axial(y)``, ``axial(x)``, one stage each, DSP-native) instead of attending.

Longitude wraps around the globe (``periodic_lon``): the longitude scan is **circular** — the
output at column ``i`` is the scan's output at ``i`` over the whole ring read from a start
``a`` columns before ``i`` (``a = X−1`` for a one-way scan: every other column precedes ``i``;
``a = ⌊X/2⌋`` for a bidirectional one: as many columns on each side). Every column sees the ring
the same way, so rolling the input by whole patches rolls the forecast (the weather
transformer's roll test), at ``X`` times the cost of one longitude scan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from dspzoo.core.parallel.plan import Stage
from dspzoo.domains.weather.model import SEQ_DIMS, WeatherBlock, WeatherConfig, WeatherTransformer

from .layers import build_mixer, run_scan, scan_stage

AXES = (("temporal", "t"), ("lat", "y"), ("lon", "x"))


@dataclass(frozen=True)
class WeatherMambaConfig(WeatherConfig):
    """:class:`WeatherConfig` plus the scan mixers (``spatial`` must stay ``"axial"``;
    ``heads`` is unused by the scans but kept for the shared checks)."""

    mixer: str = "mamba2"
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    head_dim: int = 16
    chunk_size: int = 64
    bidirectional: bool = True

    def mixer_options(self) -> dict:
        options = dict(state_size=self.state_size, expand=self.expand,
                       conv_kernel=self.conv_kernel, bidirectional=self.bidirectional)  # fmt: skip
        if self.mixer == "mamba2":
            inner = self.expand * self.hidden
            if inner % self.head_dim:
                raise ValueError(
                    f"expand × hidden ({inner}) must divide by head_dim {self.head_dim}"
                )
            options.update(num_heads=inner // self.head_dim, head_dim=self.head_dim,
                           chunk_size=self.chunk_size)  # fmt: skip
        return options


def weather_mamba_stages(config: WeatherMambaConfig) -> tuple[Stage, ...]:
    """One scan stage per axis (``temporal``, ``lat``, ``lon``), then ``mlp``."""
    circular = {"x": config.periodic_lon}  # a ring has no segments: its stage stays generic
    scans = (scan_stage(name, f"axial({d})", not circular.get(d, False)) for name, d in AXES)
    return (*scans, Stage("mlp"))


def circular_windows(length: int, anchor: int) -> torch.Tensor:
    """``[L, L]`` indices: row ``i`` reads the ring from ``i − anchor``, so ``i`` sits at
    position ``anchor`` of its window."""
    start = torch.arange(length)[:, None] - anchor
    return (start + torch.arange(length)[None]) % length


def circular_scan(mixer: nn.Module, seq: torch.Tensor, bidirectional: bool) -> torch.Tensor:
    """``seq`` ``[B', X, C]`` on a ring → ``[B', X, C']``: the output at every column is the
    mixer's at that column over the whole ring read from ``anchor`` columns before it."""
    length = seq.shape[1]
    anchor = length // 2 if bidirectional else length - 1
    windows = seq[:, circular_windows(length, anchor).to(seq.device)]  # [B', X, X, C]
    out = mixer(rearrange(windows, "b i k c -> (b i) k c"))[:, anchor]
    return rearrange(out, "(b i) c -> b i c", i=length)


class AxialScan(nn.Module):
    """A scan along one weather axis with the attention's call signature (``rope`` unused)."""

    def __init__(self, config: WeatherMambaConfig, dim: str) -> None:
        super().__init__()
        self.dim = dim
        self.circular = dim == "x" and config.periodic_lon
        self.bidirectional = config.bidirectional
        self.mixer = build_mixer(config.mixer, config.hidden, **config.mixer_options())

    def forward(self, x: torch.Tensor, spec=None, sp=None, rope=None) -> torch.Tensor:
        """``x`` local ``[B, T_l, Y_l, X_l, C]`` laid out as ``spec`` → same shape."""
        if self.circular:  # a generic stage: the ring is whole
            return run_scan(lambda s: circular_scan(self.mixer, s, self.bidirectional), x,
                            SEQ_DIMS, (self.dim,))  # fmt: skip
        return run_scan(self.mixer, x, SEQ_DIMS, (self.dim,), sp, spec)


class WeatherMambaBlock(WeatherBlock):
    """:class:`WeatherBlock` with :class:`AxialScan` in place of its attentions."""

    def __init__(self, config: WeatherMambaConfig, index: int) -> None:
        super().__init__(config, index)
        self.names = tuple(name for name, _ in AXES)
        self.attentions = nn.ModuleList(AxialScan(config, dim) for _, dim in AXES)


class WeatherMamba(WeatherTransformer):
    """Weather forecaster with axial Mamba scans; see the module docstring."""

    def __init__(self, config: WeatherMambaConfig) -> None:
        if config.spatial != "axial":
            raise ValueError(
                f"WeatherMamba scans axially: spatial must be 'axial', got {config.spatial!r}"
            )
        super().__init__(config)
        self.STAGES = weather_mamba_stages(config)
        self.blocks = nn.ModuleList(WeatherMambaBlock(config, i) for i in range(config.depth))
        for block in self.blocks:
            block.zero_init()

    def rope_tables(self, device: torch.device, dtype: torch.dtype) -> None:
        """No rotary tables: the circular longitude scan carries the periodicity."""
        return None


__all__ = ["AxialScan", "WeatherMamba", "WeatherMambaConfig", "circular_scan", "circular_windows"]
