"""The Evoformer's layers (AlphaFold 2, Algorithms 7-15), written on local shards.

Every layer takes this rank's shard of the activation it updates (``m`` ``[B, S, R, c_m]`` or
``z`` ``[B, R, R, c_z]`` in the layout the plan gave it) and the *whole* masks; inside the
region the trunk opens (:mod:`dspzoo.core.parallel.context`) it slices the masks for the current layout
(``local(mask, "m")``) and all-gathers an operand it needs whole
(``gather_for_local_use(t, "z")``: backward reduce-scatters). Outside a region both are the
identity, so the same code is the single-device model (OpenFold's calling convention).

Each layer returns its *update* ``[B, *local dims, C]``; with ``residual=`` (no-grad inference)
it instead adds the update into ``residual`` in place, ``chunk`` rows at a time, so that peak
memory stays near one activation plus one chunk. ``chunk=None`` runs whole; chunked results
equal unchunked ones (the rows are independent).

Parameter names follow OpenFold (``mha.linear_q``, ``linear_a_p``, ``layer_norm_out``, ...), so
that :mod:`.convert_openfold` is a renaming.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from dspzoo.core.parallel.context import gather_for_local_use, local, sharded


def chunked(
    fn: Callable[[int, int], torch.Tensor],
    n: int,
    chunk: int | None,
    axis: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``fn(start, stop)`` over ``[0, n)`` in chunks along tensor axis ``axis``.

    Returns the concatenated outputs, or, with ``residual``, adds each chunk into the matching
    slice of ``residual`` in place and returns ``residual``.
    """
    step = n if chunk is None or chunk <= 0 else min(chunk, max(n, 1))
    parts = []
    for start in range(0, n, max(step, 1)):
        stop = min(n, start + step)
        out = fn(start, stop)
        if residual is None:
            parts.append(out)
        else:
            residual.narrow(axis, start, stop - start).add_(out)
    if residual is not None:
        return residual
    if not parts:
        return fn(0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, axis)


def mask_bias(mask: torch.Tensor, inf: float) -> torch.Tensor:
    """``inf·(mask − 1)``: 0 where attended, ``−inf`` (large) where masked."""
    return inf * (mask - 1.0)


class GatedAttention(nn.Module):
    """Multi-head attention with a sigmoid gate (AF2's, OpenFold's ``Attention``).

    ``linear_q/k/v``: no bias; ``linear_g``: gate with bias; ``linear_o``: output with bias.
    """

    def __init__(self, c_in: int, c_hidden: int, heads: int) -> None:
        super().__init__()
        self.c_hidden, self.heads = c_hidden, heads
        self.linear_q = nn.Linear(c_in, c_hidden * heads, bias=False)
        self.linear_k = nn.Linear(c_in, c_hidden * heads, bias=False)
        self.linear_v = nn.Linear(c_in, c_hidden * heads, bias=False)
        self.linear_g = nn.Linear(c_in, c_hidden * heads)
        self.linear_o = nn.Linear(c_hidden * heads, c_in)

    def forward(self, x: torch.Tensor, biases: list[torch.Tensor]) -> torch.Tensor:
        """``x`` ``[B, A, L, C]``: attention over ``L`` for every ``(B, A)`` row.

        ``biases`` broadcast to ``[B, A, H, L, L]``. Returns ``[B, A, L, C]``.
        """
        split = "b a l (h d) -> b a h l d"
        q = rearrange(self.linear_q(x), split, h=self.heads) / math.sqrt(self.c_hidden)
        k = rearrange(self.linear_k(x), split, h=self.heads)
        v = rearrange(self.linear_v(x), split, h=self.heads)
        logits = q @ k.transpose(-1, -2)
        if torch.is_grad_enabled():
            for b in biases:
                logits = logits + b
            weights = torch.softmax(logits, dim=-1)
        else:  # inference: one buffer for logits and weights
            for b in biases:
                logits.add_(b)
            weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
            weights.div_(weights.sum(-1, keepdim=True))
        o = weights @ v
        o = rearrange(o, "b a h l d -> b a l (h d)")
        return self.linear_o(o * torch.sigmoid(self.linear_g(x)))


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of axis 1, unless ``t`` broadcasts there (size 1)."""
    return t if t.shape[1] == 1 else t[:, start:stop]


class MSARowAttentionWithPairBias(nn.Module):
    """AF2 Algorithm 7: attention along residues within each MSA row, biased by the pair."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, heads: int, inf: float) -> None:
        super().__init__()
        self.inf = inf
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, heads, bias=False)
        self.mha = GatedAttention(c_m, c_hidden, heads)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``m`` ``[B, S_loc, R, c_m]`` (sharded on ``s``), ``z`` the local pair shard, ``mask``
        the MSA mask ``[B, S, R]``. Returns the update ``[B, S_loc, R, c_m]``."""
        axis = 1 if sharded("z") != "j" else 2
        part = chunked(
            lambda a, b: self.linear_z(self.layer_norm_z(z.narrow(axis, a, b - a))),
            z.shape[axis],
            chunk,
            axis,
        )
        bias = gather_for_local_use(part, "z")  # [B, R, R, H]: the whole pair bias
        bias = rearrange(bias, "b i j h -> b 1 h i j")
        keys = mask_bias(local(mask, "m"), self.inf)[:, :, None, None, :]  # [B, S_loc, 1, 1, R]

        def run(a: int, b: int) -> torch.Tensor:
            return self.mha(self.layer_norm_m(m[:, a:b]), [_rows(keys, a, b), bias])

        return chunked(run, m.shape[1], chunk, 1, residual)


class MSAColumnAttention(nn.Module):
    """AF2 Algorithm 8: attention along the MSA sequences within each residue column."""

    def __init__(self, c_m: int, c_hidden: int, heads: int, inf: float) -> None:
        super().__init__()
        self.inf = inf
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.mha = GatedAttention(c_m, c_hidden, heads)

    def forward(
        self,
        m: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``m`` ``[B, S, R_loc, c_m]`` (sharded on ``r``), ``mask`` ``[B, S, R]``."""
        mt = m.transpose(1, 2)  # [B, R_loc, S, C]
        keys = mask_bias(local(mask, "m").transpose(1, 2), self.inf)[:, :, None, None, :]

        def run(a: int, b: int) -> torch.Tensor:
            out = self.mha(self.layer_norm_m(mt[:, a:b]), [_rows(keys, a, b)])
            return out.transpose(1, 2)

        return chunked(run, mt.shape[1], chunk, 2, residual)


class Transition(nn.Module):
    """AF2 Algorithms 9 and 15: LayerNorm, ``linear_1`` (×n), ReLU, ``linear_2``; masked.

    ``activation``: the activation it updates (``"m"`` or ``"z"``), whose layout the mask takes.
    """

    def __init__(self, c: int, n: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.layer_norm = nn.LayerNorm(c)
        self.linear_1 = nn.Linear(c, n * c)
        self.linear_2 = nn.Linear(n * c, c)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[B, A, L, C]`` (any local shard), ``mask`` ``[B, A, L]`` whole."""
        mask = local(mask, self.activation)

        def run(a: int, b: int) -> torch.Tensor:
            h = self.linear_1(self.layer_norm(x[:, a:b]))
            return self.linear_2(torch.relu(h)) * _rows(mask, a, b)[..., None]

        return chunked(run, x.shape[1], chunk, 1, residual)


class OuterProductMean(nn.Module):
    """AF2 Algorithm 10: the MSA → pair update ``Σ_s a_si ⊗ b_sj / Σ_s mask_si·mask_sj``.

    Reads ``m`` sharded on ``r`` and writes a pair update sharded on ``i`` (its own ``a``,
    gathered ``b``) or on ``j`` (gathered ``a``, its own ``b``).
    """

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1 = nn.Linear(c_m, c_hidden)
        self.linear_2 = nn.Linear(c_m, c_hidden)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(
        self,
        m: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``m`` ``[B, S, R_loc, c_m]``; ``mask`` the MSA mask ``[B, S, R]``.

        Returns the pair update ``[B, R_loc, R, c_z]`` (``z`` sharded on ``i``) or
        ``[B, R, R_loc, c_z]`` (on ``j``).
        """
        mask_loc = local(mask, "m")
        mn = self.layer_norm(m)
        a = self.linear_1(mn) * mask_loc[..., None]
        b = self.linear_2(mn) * mask_loc[..., None]
        if sharded("z") != "j":
            b = gather_for_local_use(b, "m")
            mask_a, mask_b = mask_loc, mask
        else:
            a = gather_for_local_use(a, "m")
            mask_a, mask_b = mask, mask_loc

        def run(lo: int, hi: int) -> torch.Tensor:
            outer = torch.einsum("bsix,bsjy->bijxy", a[:, :, lo:hi], b)
            outer = self.linear_out(rearrange(outer, "b i j x y -> b i j (x y)"))
            norm = torch.einsum("bsi,bsj->bij", mask_a[:, :, lo:hi], mask_b)[..., None]
            return outer / (norm + self.eps)

        return chunked(run, a.shape[2], chunk, 1, residual)


class TriangleMultiplication(nn.Module):
    """AF2 Algorithms 11 (outgoing) and 12 (incoming): the triangle multiplicative update.

    Outgoing, ``z`` sharded on ``i``: ``p_ij = Σ_k a_ik b_jk`` with ``b`` gathered whole.
    Incoming, ``z`` sharded on ``j``: ``p_ij = Σ_k a_ki b_kj`` with ``a`` gathered whole.
    The gathered operand travels ``channel_chunk`` channels at a time when chunking.
    """

    def __init__(
        self, c_z: int, c_hidden: int, outgoing: bool, channel_chunk: int | None = None
    ) -> None:
        super().__init__()
        self.outgoing, self.channel_chunk = outgoing, channel_chunk
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.linear_a_p = nn.Linear(c_z, c_hidden)
        self.linear_a_g = nn.Linear(c_z, c_hidden)
        self.linear_b_p = nn.Linear(c_z, c_hidden)
        self.linear_b_g = nn.Linear(c_z, c_hidden)
        self.layer_norm_out = nn.LayerNorm(c_hidden)
        self.linear_g = nn.Linear(c_z, c_z)
        self.linear_z = nn.Linear(c_hidden, c_z)

    def _operand(
        self, z: torch.Tensor, mask: torch.Tensor, which: str, c0: int, c1: int, chunk: int | None
    ) -> torch.Tensor:
        """Channels ``c0:c1`` of the gated, masked operand ``a`` or ``b``, ``[B, A, L, c]``."""
        proj, gate = (
            (self.linear_a_p, self.linear_a_g)
            if which == "a"
            else (self.linear_b_p, self.linear_b_g)
        )

        def run(lo: int, hi: int) -> torch.Tensor:
            zn = self.layer_norm_in(z[:, lo:hi])
            g = F.linear(zn, gate.weight[c0:c1], gate.bias[c0:c1])
            p = F.linear(zn, proj.weight[c0:c1], proj.bias[c0:c1])
            return torch.sigmoid(g) * p * mask[:, lo:hi, :, None]

        return chunked(run, z.shape[1], chunk, 1)

    def forward(
        self,
        z: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``z`` the local pair shard (``[B, R_loc, R, C]`` outgoing, ``[B, R, R_loc, C]``
        incoming), ``mask`` the pair mask ``[B, R, R]``. Returns the update."""
        mask = local(mask, "z")
        c_hidden = self.linear_a_p.out_features
        channel_chunk = self.channel_chunk
        step = c_hidden if chunk is None or channel_chunk is None else channel_chunk
        parts = []
        p = None if torch.is_grad_enabled() else z.new_empty((*z.shape[:-1], c_hidden))
        for c0 in range(0, c_hidden, step):
            c1 = min(c_hidden, c0 + step)
            a = self._operand(z, mask, "a", c0, c1, chunk)
            b = self._operand(z, mask, "b", c0, c1, chunk)
            if self.outgoing:  # rows i local, b's rows j gathered
                b = gather_for_local_use(b, "z")
                part = torch.einsum("bikc,bjkc->bijc", a, b)
            else:  # columns j local, a's columns i gathered
                a = gather_for_local_use(a, "z")
                part = torch.einsum("bkic,bkjc->bijc", a, b)
            del a, b
            if p is None:
                parts.append(part)
            else:  # inference: straight into the product buffer
                p[..., c0:c1] = part
            del part
        if p is None:
            p = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        del parts

        def run(lo: int, hi: int) -> torch.Tensor:
            g = torch.sigmoid(self.linear_g(self.layer_norm_in(z[:, lo:hi])))
            return g * self.linear_z(self.layer_norm_out(p[:, lo:hi]))

        return chunked(run, z.shape[1], chunk, 1, residual)


class TriangleAttention(nn.Module):
    """AF2 Algorithms 13 (starting node) and 14 (ending node).

    Starting node, ``z`` sharded on ``i``: row ``i`` attends over ``j`` with bias ``b_jk``.
    Ending node, ``z`` sharded on ``j``: column ``j`` attends over ``i`` with bias ``b_ki``.
    The bias ``[B, R, R, H]`` is gathered whole.
    """

    def __init__(self, c_z: int, c_hidden: int, heads: int, starting: bool, inf: float) -> None:
        super().__init__()
        self.starting, self.inf = starting, inf
        self.layer_norm = nn.LayerNorm(c_z)
        self.linear = nn.Linear(c_z, heads, bias=False)
        self.mha = GatedAttention(c_z, c_hidden, heads)

    def forward(
        self,
        z: torch.Tensor,
        mask: torch.Tensor,
        chunk: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``z`` ``[B, R_loc, R, C]`` (starting) or ``[B, R, R_loc, C]`` (ending); ``mask`` the
        pair mask ``[B, R, R]``. Returns the update laid out like ``z``."""
        mask = local(mask, "z")
        axis = 1 if self.starting else 2
        part = chunked(
            lambda a, b: self.linear(self.layer_norm(z.narrow(axis, a, b - a))),
            z.shape[axis],
            chunk,
            axis,
        )
        full = gather_for_local_use(part, "z")  # [B, R, R, H]
        if self.starting:  # query j, key k: b_jk
            bias = rearrange(full, "b q k h -> b 1 h q k")
            x, keys = z, mask_bias(mask, self.inf)[:, :, None, None, :]
        else:  # column j, query i, key k: b_ki
            bias = rearrange(full, "b k q h -> b 1 h q k")
            x = z.transpose(1, 2)
            keys = mask_bias(mask.transpose(1, 2), self.inf)[:, :, None, None, :]

        def run(a: int, b: int) -> torch.Tensor:
            out = self.mha(self.layer_norm(x[:, a:b]), [_rows(keys, a, b), bias])
            return out if self.starting else out.transpose(1, 2)

        return chunked(run, x.shape[1], chunk, axis, residual)
