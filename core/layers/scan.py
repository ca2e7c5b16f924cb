"""Selective-scan kernels for Mamba-1 and Mamba-2 (SSD), a causal depthwise conv with a halo,
and segment summaries for passing state between sequence segments.

Pure PyTorch, chunked and parallel (no Python loop over time steps); the state is accumulated in
fp32 (fp64 when an input is fp64). On CUDA tensors, and only on CUDA tensors, the entry points
hand over to mamba-ssm / causal-conv1d when those import and the call fits what they support.

Mamba-1 recurrence, per channel ``d`` and state ``n`` (``A`` real, usually negative)::

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t          y_t = C_t · h_t + D u_t      (⊙ silu(z_t))

The chunked kernel splits time into chunks of ``T`` steps. Inside a chunk the log-decay is
``S_t = A · Σ_{s≤t} Δ_s``, and ``h_t = e^{S_t} (H + Σ_{s≤t} e^{-S_s} Δ_s B_s u_s)`` where ``H`` is
the state entering the chunk: one cumulative sum, no loop. ``T`` is chosen per call so that
``|S|`` stays below :data:`_SAFE_LOG_DECAY` (no overflow); the chunk-end states are the same
problem one level up (recursion), and a log-step (Hillis–Steele) scan handles a level whose
single steps already decay too fast for the factorised form.

Mamba-2 (SSD) shares one scalar decay per head, so a chunk is a masked "attention" block
``(C Bᵀ ∘ L) X`` and the chunk states pass through a small exact segment-sum matrix.

State passing across segments (what a sequence-sharded scan needs): scan each segment from zero
state, summarise it as ``(decay, contribution)`` (:func:`selective_scan_summary`,
:func:`ssd_summary`), combine summaries with :func:`exclusive_combine` to get each segment's
incoming state, and add :func:`selective_scan_correction` / :func:`ssd_correction` to its output.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

# |log-decay| allowed inside one factorised chunk: e^{±40} stays far from fp32 overflow (e^{88})
# even when multiplied by large inputs; fp64 has room for much more.
_SAFE_LOG_DECAY = {torch.float32: 40.0, torch.float64: 300.0}
_MAX_CHUNK = 64  # longest chunk the Mamba-1 kernel tries (working set vs. Python overhead)
MAX_SCAN_CHUNK = _MAX_CHUNK  # the cost model's bound on the padding of the saved states


# ---------------------------------------------------------------------------------------------
# CUDA dispatch: only CUDA tensors, only when the package imports
# ---------------------------------------------------------------------------------------------


@functools.cache
def _import_optional(module: str) -> Any | None:
    """The module if it imports, else ``None`` (cached; tests monkeypatch this)."""
    try:
        return importlib.import_module(module)
    except Exception:  # an absent or broken CUDA extension is "not available"
        return None


def cuda_kernel(module: str, name: str, *tensors: torch.Tensor | None) -> Callable | None:
    """``module.name`` when every given tensor is on CUDA and ``module`` imports, else ``None``.

    The device is checked first, so CPU tensors never reach a CUDA/Triton kernel even on a
    machine where mamba-ssm happens to import.
    """
    present = [t for t in tensors if t is not None]
    if not present or not all(t.is_cuda for t in present):
        return None
    mod = _import_optional(module)
    return getattr(mod, name, None) if mod is not None else None


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64, else fp32: the state is never accumulated in half."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_dtypes(
    fn: str,
    inputs: dict[str, torch.Tensor | None],
    state_name: str,
    state: torch.Tensor | None,
) -> None:
    """Every tensor floating point; the initial state in the dtype the scan keeps its state in.

    The state is fp32 (fp64 when an input is fp64) whatever the inputs' precision, and the final
    state is returned in it; an initial state of another dtype would silently change the compute
    precision (fp64 state, fp32 inputs) or round the state (half state), so it is refused.
    """
    for name, t in {**inputs, state_name: state}.items():
        if t is not None and not t.is_floating_point():
            raise TypeError(
                f"{fn}: {name} must be a floating-point tensor (fp16, bf16, fp32 or fp64); got "
                f"{t.dtype}. Convert it first, e.g. {name}.float()"
            )
    if state is None:
        return
    expected = _compute_dtype(*inputs.values())
    if state.dtype != expected:
        raise TypeError(
            f"{fn}: {state_name} is {state.dtype} but the scan keeps its state in {expected} for "
            f"these inputs (fp32, or fp64 when an input is fp64; the final state it returns has "
            f"that dtype); pass {state_name}.to({expected})"
        )


# ---------------------------------------------------------------------------------------------
# The diagonal linear recurrence h_t = exp(δ_t A) ⊙ h_{t-1} + x_t (Mamba-1's core)
# ---------------------------------------------------------------------------------------------


def _chunk_length(delta: torch.Tensor, a_max: torch.Tensor, limit: float) -> int:
    """Longest power-of-two chunk (≤ ``_MAX_CHUNK``) whose summed ``|δ| · max|A|`` stays ≤ ``limit``.

    ``delta``: ``[B, L, D]``; ``a_max``: ``[D]``. Returns 1 when single steps are already too steep,
    ``_MAX_CHUNK`` when ``delta`` is empty (no step to bound: an empty batch).
    """
    rate = delta.detach().abs() * a_max.detach()
    if rate.numel() == 0:
        return _MAX_CHUNK
    length = rate.shape[1]
    chunk = _MAX_CHUNK
    while chunk > 1:
        pad = (-length) % chunk
        padded = F.pad(rate, (0, 0, 0, pad))
        if padded.unflatten(1, (-1, chunk)).sum(2).amax().item() <= limit:
            return chunk
        chunk //= 2
    return 1


def _log_step_scan(
    delta: torch.Tensor, A: torch.Tensor, x: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:
    """Hillis–Steele scan (⌈log₂ L⌉ parallel steps) of ``h_t = exp(δ_t A) h_{t-1} + x_t``.

    ``delta`` ``[B, L, D]``, ``A`` ``[D, N]``, ``x`` ``[B, L, D, N]``, ``h0`` ``[B, D, N]`` →
    every state ``[B, L, D, N]``. Only products of decays: safe for any step size.
    """
    decay = torch.exp(delta.unsqueeze(-1) * A)
    state = torch.cat([x[:, :1] + decay[:, :1] * h0.unsqueeze(1), x[:, 1:]], dim=1)
    length, step = x.shape[1], 1
    while step < length:
        state = torch.cat(
            [state[:, :step], torch.addcmul(state[:, step:], decay[:, step:], state[:, :-step])], 1
        )
        decay = torch.cat([decay[:, :step], decay[:, step:] * decay[:, :-step]], 1)
        step *= 2
    return state


def _chunked_states(
    delta: torch.Tensor, A: torch.Tensor, x: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:
    """The chunked forward of :func:`diagonal_scan` (shapes there)."""
    length = x.shape[1]
    chunk = _chunk_length(delta, A.abs().amax(-1), _SAFE_LOG_DECAY[x.dtype])
    if chunk == 1:
        return _log_step_scan(delta, A, x, h0)
    chunk = min(chunk, length)
    pad = (-length) % chunk
    delta = F.pad(delta, (0, 0, 0, pad)).unflatten(1, (-1, chunk))  # [B, K, T, D]
    x = F.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, chunk))  # [B, K, T, D, N]
    growth = torch.exp(delta.cumsum(2).unsqueeze(-1) * A)  # e^{S_t}: decay from the chunk start
    # Σ_{s≤t} e^{-S_s} x_s; dividing by e^{S_s} (|S| ≤ the safe bound: no underflow) saves the
    # second exponential and the negation of a [B, L, D, N] tensor
    weighted = torch.cumsum(x / growth, dim=2)
    if weighted.shape[1] == 1:
        incoming = h0.unsqueeze(1)
    else:
        ends = _chunked_states(
            delta.sum(2), A, growth[:, :, -1] * weighted[:, :, -1], h0
        )  # chunk-end states: the same recurrence over chunks
        incoming = torch.cat([h0.unsqueeze(1), ends[:, :-1]], dim=1)  # [B, K, D, N]
    states = growth.mul_(weighted.add_(incoming.unsqueeze(2)))
    return states.flatten(1, 2)[:, :length]


class _DiagonalScan(torch.autograd.Function):
    """Chunked forward; backward is the same recurrence run in reverse (the adjoint).

    With ``g_t = ∂L/∂h_t + exp(δ_{t+1} A) g_{t+1}``: ``∂L/∂x_t = g_t``,
    ``∂L/∂(δ_t A) = g_t ⊙ exp(δ_t A) ⊙ h_{t-1}``, ``∂L/∂h_0 = exp(δ_0 A) ⊙ g_0``.
    Saves only the states (which the output contraction keeps anyway), ``δ``, ``A`` and ``h_0``.
    """

    @staticmethod
    def forward(ctx, delta, A, x, h0):
        states = _chunked_states(delta, A, x, h0)
        ctx.save_for_backward(delta, A, h0, states)
        return states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_states):
        delta, A, h0, states = ctx.saved_tensors
        next_delta = F.pad(delta[:, 1:], (0, 0, 0, 1))  # δ_{t+1}; nothing after the last step
        adjoint = _chunked_states(
            next_delta.flip(1), A, grad_states.flip(1), torch.zeros_like(h0)
        ).flip(1)
        previous = torch.cat([h0.unsqueeze(1), states[:, :-1]], dim=1)
        d_log_decay = adjoint * previous * torch.exp(delta.unsqueeze(-1) * A)
        grad_delta = (d_log_decay * A).sum(-1) if ctx.needs_input_grad[0] else None
        grad_A = (
            torch.einsum("bldn,bld->dn", d_log_decay, delta) if ctx.needs_input_grad[1] else None
        )
        grad_h0 = torch.exp(delta[:, 0].unsqueeze(-1) * A) * adjoint[:, 0]
        return grad_delta, grad_A, adjoint, grad_h0


def diagonal_scan(
    delta: torch.Tensor, A: torch.Tensor, x: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:
    """All states of ``h_t = exp(δ_t A) ⊙ h_{t-1} + x_t``, chunked, with an adjoint backward.

    Args:
        delta: ``[B, L, D]`` step sizes (compute dtype).
        A: ``[D, N]`` continuous-time decay rates.
        x: ``[B, L, D, N]`` inputs (``Δ B u`` for Mamba-1).
        h0: ``[B, D, N]`` state before the first step.

    Returns:
        ``[B, L, D, N]``: the state after every step.
    """
    return _DiagonalScan.apply(delta, A, x, h0)


# ---------------------------------------------------------------------------------------------
# Mamba-1: selective_scan
# ---------------------------------------------------------------------------------------------


def _group_count(B: torch.Tensor, C: torch.Tensor, dim: int) -> int:
    """Channel groups ``G`` shared by the input-dependent B/C (1 when neither is grouped)."""
    counts = {M.shape[1] for M in (B, C) if M.dim() == 4 and M.shape[1] > 1}
    if len(counts) > 1:
        raise ValueError(f"grouped B and C must have the same number of groups; got {counts}")
    groups = counts.pop() if counts else 1
    if dim % groups:
        raise ValueError(f"the {groups} groups of B/C must divide D={dim}")
    return groups


def _grouped_projection(M: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """B or C broadcastable against states ``[B, L, G, D/G, N]``.

    Fixed ``[D, N]`` → ``[1, 1, G, D/G, N]``; input-dependent ``[B, N, L]`` → ``[B, L, 1, 1, N]``;
    grouped ``[B, G, N, L]`` → ``[B, L, G, 1, N]``.
    """
    M = M.to(dtype)
    if M.dim() == 2:
        return M.unflatten(0, (groups, -1))[None, None]
    if M.dim() == 3:
        M = M.unsqueeze(1)
    return rearrange(M, "b g n l -> b l g 1 n")


def _check_mamba1(u, delta, A, B, C, initial_state) -> None:
    if u.dim() != 3 or delta.shape != u.shape:
        raise ValueError(
            f"u and delta must both be [B, D, L]; got {tuple(u.shape)} and {tuple(delta.shape)}"
        )
    if A.dim() != 2 or A.shape[0] != u.shape[1]:
        raise ValueError(f"A must be [D={u.shape[1]}, N]; got {tuple(A.shape)}")
    if A.is_complex():
        raise ValueError("complex A is not supported; pass a real A (Mamba's A = -exp(A_log))")
    for name, M in (("B", B), ("C", C)):
        if M.shape[-2 if M.dim() > 2 else -1] != A.shape[1]:
            raise ValueError(f"{name} must have N={A.shape[1]} states; got {tuple(M.shape)}")
        if M.dim() == 2 and M.shape[0] != u.shape[1]:
            raise ValueError(f"fixed {name} must be [D={u.shape[1]}, N]; got {tuple(M.shape)}")
        if M.dim() > 2 and (M.shape[0] != u.shape[0] or M.shape[-1] != u.shape[2]):
            raise ValueError(
                f"{name} must be [D, N], [B, N, L] or [B, G, N, L] with B={u.shape[0]}, "
                f"L={u.shape[2]}; got {tuple(M.shape)}"
            )
    if initial_state is not None and initial_state.shape != (u.shape[0], A.shape[0], A.shape[1]):
        raise ValueError(
            f"initial_state must be [B, D, N] = {(u.shape[0], A.shape[0], A.shape[1])}; "
            f"got {tuple(initial_state.shape)}"
        )


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
    reverse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1 selective scan with the semantics of mamba-ssm's ``selective_scan_fn``.

    Args:
        u: ``[B, D, L]`` input.
        delta: ``[B, D, L]`` step sizes (before ``delta_bias`` / softplus).
        A: ``[D, N]`` real decay rates.
        B, C: ``[D, N]`` (fixed), ``[B, N, L]`` (input-dependent) or ``[B, G, N, L]`` (grouped:
            channel ``d`` uses group ``d // (D / G)``).
        D: ``[D]`` skip weight; z: ``[B, D, L]`` gate (output ``· silu(z)``).
        delta_bias: ``[D]`` added to ``delta``; delta_softplus: apply softplus to ``delta``.
        initial_state: ``[B, D, N]`` state before the first step (zero when ``None``).
        return_final_state: also return the ``[B, D, N]`` state after the last step
            (differentiable, fp32/fp64).
        reverse: scan from the last step to the first (the initial state enters at step L-1).

    Returns:
        ``[B, D, L]`` output in ``u``'s dtype, and the final state when asked.
    """
    _check_mamba1(u, delta, A, B, C, initial_state)
    _check_dtypes("selective_scan", dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z,
                  delta_bias=delta_bias), "initial_state", initial_state)  # fmt: skip
    kernel = None
    if initial_state is None and not return_final_state and not reverse:
        kernel = cuda_kernel(
            "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn", u, delta, A, B, C
        )
    if kernel is not None:
        return kernel(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    if reverse:
        u, delta, z = _flip_time(u), _flip_time(delta), _flip_time(z)
        B, C = (M if M.dim() == 2 else _flip_time(M) for M in (B, C))
    out, final = _selective_scan_torch(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state
    )
    if reverse:
        out = out.flip(-1)
    return (out, final) if return_final_state else out


def _selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    """The chunked CPU path of :func:`selective_scan` (forward order)."""
    dtype = _compute_dtype(u, delta, A, B, C, initial_state)
    batch, dim, _ = u.shape
    nstate = A.shape[1]
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype).unsqueeze(-1)
    if delta_softplus:
        dt = F.softplus(dt)
    dt = dt.transpose(1, 2)  # [B, L, D]
    A = A.to(dtype)
    groups = _group_count(B, C, dim)
    Bm, Cm = (_grouped_projection(M, groups, dtype) for M in (B, C))
    drive = (dt * u.to(dtype).transpose(1, 2)).unflatten(-1, (groups, -1)).unsqueeze(-1)
    x = (drive * Bm).flatten(2, 3)  # Δ u B: [B, L, D, N]
    h0 = (
        initial_state.to(dtype)
        if initial_state is not None
        else u.new_zeros((batch, dim, nstate), dtype=dtype)
    )
    states = diagonal_scan(dt, A, x, h0)
    y = (states.unflatten(2, (groups, -1)) * Cm).sum(-1).flatten(2, 3).transpose(1, 2)
    if D is not None:
        y = y + u.to(dtype) * D.to(dtype).unsqueeze(-1)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(u.dtype), states[:, -1]


def _flip_time(t: torch.Tensor | None) -> torch.Tensor | None:
    """Reverse the last (time) dim."""
    return None if t is None else t.flip(-1)


def _mamba1_steps(
    delta: torch.Tensor,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Effective step sizes ``[B, D, L]``: ``softplus?(delta + delta_bias)`` in ``dtype``."""
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype).unsqueeze(-1)
    return F.softplus(dt) if delta_softplus else dt


# ---------------------------------------------------------------------------------------------
# Mamba-2: ssd_scan (state-space duality, chunked)
# ---------------------------------------------------------------------------------------------


def _segment_sum(log_decay: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = Σ_{s<r≤t} log_decay[..., r]`` for ``s ≤ t``, ``-inf`` above the diagonal.

    ``[..., T]`` → ``[..., T, T]``: the difference ``cum_t − cum_s`` of one cumulative sum taken
    in fp64 (exact to ~1e-16 of the sum; then rounded once to the input's dtype), so long
    chunks keep their precision without a cumulative sum over every ``[T, T]`` block — that
    ``T²`` sum and its flipped backward were a third of the SSD scan's time.
    """
    length = log_decay.shape[-1]
    cum = log_decay.double().cumsum(-1)
    sums = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).to(log_decay.dtype)
    causal = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


def _ssd_steps(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Effective step sizes ``[B, L, H]``: ``clamp(softplus?(dt + dt_bias), *dt_limit)``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _check_ssd(x, dt, A, B, C, chunk_size, initial_states) -> None:
    if x.dim() != 4:
        raise ValueError(f"x must be [B, L, H, P]; got {tuple(x.shape)}")
    batch, length, heads, headdim = x.shape
    if dt.shape != (batch, length, heads):
        raise ValueError(f"dt must be [B, L, H] = {(batch, length, heads)}; got {tuple(dt.shape)}")
    if A.shape != (heads,):
        raise ValueError(f"A must be [H={heads}]; got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length) or C.shape != B.shape:
        raise ValueError(
            f"B and C must both be [B={batch}, L={length}, G, N]; got {tuple(B.shape)} "
            f"and {tuple(C.shape)}"
        )
    if heads % B.shape[2]:
        raise ValueError(f"the {B.shape[2]} groups of B/C must divide the {heads} heads")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    expected = (batch, heads, headdim, B.shape[3])
    if initial_states is not None and initial_states.shape != expected:
        raise ValueError(
            f"initial_states must be [B, H, P, N] = {expected}; got {tuple(initial_states.shape)}"
        )


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    reverse: bool = False,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD scan with the semantics of mamba-ssm's ``mamba_chunk_scan_combined``.

    Per head ``h`` (group ``g = h // (H / G)``): ``S_t = exp(Δ_t A_h) S_{t-1} + Δ_t x_t ⊗ B_t``
    (``S``: ``[P, N]``), ``y_t = S_t C_t + D_h x_t``, then ``· silu(z_t)``.

    Args:
        x: ``[B, L, H, P]``; dt: ``[B, L, H]`` (before ``dt_bias`` / softplus / ``dt_limit``);
        A: ``[H]``; B, C: ``[B, L, G, N]``; chunk_size: any positive length (need not divide L).
        D: ``[H]`` or ``[H, P]``; z: ``[B, L, H, P]``; dt_bias: ``[H]``.
        initial_states: ``[B, H, P, N]``; return_final_states: also return the final
            ``[B, H, P, N]`` state (fp32/fp64, differentiable).
        reverse: scan from the last step to the first.

    Returns:
        ``[B, L, H, P]`` in ``x``'s dtype, and the final states when asked.
    """
    _check_ssd(x, dt, A, B, C, chunk_size, initial_states)
    _check_dtypes("ssd_scan", dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias),
                  "initial_states", initial_states)  # fmt: skip
    kernel = None
    if not reverse:
        kernel = cuda_kernel(
            "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", x, dt, A, B, C
        )
    if kernel is not None:
        return kernel(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_final_states=return_final_states,
        )  # fmt: skip
    if reverse:
        x, dt, B, C, z = (None if t is None else t.flip(1) for t in (x, dt, B, C, z))
    dtype = _compute_dtype(x, dt, A, B, C, initial_states)
    steps = _ssd_steps(dt, dt_bias, dt_softplus, dt_limit, dtype)
    out, final = _ssd_chunked(x.to(dtype), steps, A.to(dtype), B.to(dtype), C.to(dtype),
                              chunk_size, initial_states)  # fmt: skip
    if D is not None:
        skip = D.to(dtype) if D.dim() == 2 else D.to(dtype).unsqueeze(-1)
        out = out + x.to(dtype) * skip
    if z is not None:
        out = out * F.silu(z.to(dtype))
    out = out.to(x.dtype)
    if reverse:
        out = out.flip(1)
    return (out, final) if return_final_states else out


def _ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD without skip/gate: ``x`` ``[B, L, H, P]``, ``dt`` ``[B, L, H]`` (effective), ``A``
    ``[H]``, ``B``/``C`` ``[B, L, G, N]`` → output ``[B, L, H, P]`` and final ``[B, H, P, N]``."""
    length, groups = x.shape[1], B.shape[2]
    chunk = min(chunk_size, length)
    pad = (-length) % chunk  # padded steps have dt = 0: no decay, no input

    def chunks(t: torch.Tensor, pattern: str) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return rearrange(t, pattern, t=chunk, g=groups)

    xs = chunks(x * dt.unsqueeze(-1), "b (k t) (g e) p -> b k t g e p")  # Δ x
    log_decay = chunks(dt * A, "b (k t) (g e) -> b k g e t")
    Bs = chunks(B, "b (k t) g n -> b k t g n")
    Cs = chunks(C, "b (k t) g n -> b k t g n")
    cum = log_decay.cumsum(-1)  # [B, K, G, E, T]

    # 1. inside each chunk: a causal, decaying "attention" C_t·B_s
    scores = torch.einsum("bktgn,bksgn->bkgts", Cs, Bs)
    mixing = scores.unsqueeze(3) * torch.exp(_segment_sum(log_decay))  # [B, K, G, E, T, S]
    y_diag = torch.einsum("bkgets,bksgep->bktgep", mixing, xs)

    # 2. each chunk's own end state (from zero)
    to_end = torch.exp(cum[..., -1:] - cum)  # [B, K, G, E, T]
    chunk_states = torch.einsum("bktgn,bkget,bktgep->bkgepn", Bs, to_end, xs)

    # 3. states entering each chunk: exact segment-sum recurrence over chunks
    if initial_states is None:
        start = chunk_states.new_zeros(chunk_states[:, :1].shape)
    else:
        start = rearrange(initial_states.to(x.dtype), "b (g e) p n -> b 1 g e p n", g=groups)
    stacked = torch.cat([start, chunk_states], dim=1)  # [B, K+1, G, E, P, N]
    chunk_decay = torch.exp(_segment_sum(F.pad(cum[..., -1], (0, 0, 0, 0, 1, 0)).movedim(1, -1)))
    passed = torch.einsum("bgezc,bcgepn->bzgepn", chunk_decay, stacked)
    entering, final = passed[:, :-1], passed[:, -1]

    # 4. entering state → output, decayed from the chunk start
    y_off = torch.einsum("bktgn,bkgepn->bktgep", Cs, entering) * rearrange(
        torch.exp(cum), "b k g e t -> b k t g e 1"
    )
    out = rearrange(y_diag + y_off, "b k t g e p -> b (k t) (g e) p")[:, :length]
    return out, rearrange(final, "b g e p n -> b (g e) p n")


# ---------------------------------------------------------------------------------------------
# Causal depthwise conv with a halo
# ---------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    halo: torch.Tensor | None = None,
    return_halo: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv: ``y_t = act(b + Σ_k w_k x_{t-K+1+k})`` per channel.

    Args:
        x: ``[B, C, L]``; weight: ``[C, K]`` (or ``[C, 1, K]`` as ``nn.Conv1d`` stores it);
        bias: ``[C]``; activation: ``None`` or ``"silu"``/``"swish"``.
        halo: ``[B, C, K-1]``, the inputs just before ``x`` (zeros when ``None``): the tail of
            the previous segment, so that ``conv(x) == cat(conv(x1), conv(x2, halo=tail(x1)))``.
        return_halo: also return the ``[B, C, K-1]`` tail to feed the next segment.
    """
    weight = weight.squeeze(1) if weight.dim() == 3 else weight
    channels, width = weight.shape
    if x.dim() != 3 or x.shape[1] != channels:
        raise ValueError(f"x must be [B, C={channels}, L]; got {tuple(x.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
    expected = (x.shape[0], channels, width - 1)
    if halo is not None and halo.shape != expected:
        raise ValueError(f"halo must be [B, C, K-1] = {expected}; got {tuple(halo.shape)}")
    kernel = None
    if halo is None and not return_halo:
        kernel = cuda_kernel("causal_conv1d", "causal_conv1d_fn", x, weight)
    if kernel is not None:
        return kernel(x, weight, bias, activation=activation)
    if halo is None:
        halo = x.new_zeros(expected)
    padded = torch.cat([halo.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded, weight.unsqueeze(1).to(x.dtype), bias, groups=channels)
    if activation is not None:
        y = F.silu(y)
    if not return_halo:
        return y
    return y, padded[..., padded.shape[-1] - (width - 1) :]


# ---------------------------------------------------------------------------------------------
# Segment summaries: passing state between segments scanned from zero
# ---------------------------------------------------------------------------------------------


def selective_scan_decay(
    delta: torch.Tensor,
    A: torch.Tensor,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> torch.Tensor:
    """A segment's total Mamba-1 decay ``exp(A · Σ_t Δ_t)``: ``delta`` ``[B, D, L]`` → ``[B, D, N]``.

    With the segment's final state from zero (``selective_scan(..., return_final_state=True)``),
    this is the segment's summary ``(decay, contribution)``.
    """
    dtype = _compute_dtype(delta, A)
    steps = _mamba1_steps(delta, delta_bias, delta_softplus, dtype)
    return torch.exp(steps.sum(-1).unsqueeze(-1) * A.to(dtype))


def ssd_decay(
    dt: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """A segment's total SSD decay per head ``exp(A_h Σ_t Δ_t)``: ``dt`` ``[B, L, H]`` →
    ``[B, H, 1, 1]`` (broadcastable against ``[B, H, P, N]`` states)."""
    dtype = _compute_dtype(dt, A)
    steps = _ssd_steps(dt, dt_bias, dt_softplus, dt_limit, dtype)
    return torch.exp(steps.sum(1) * A.to(dtype))[..., None, None]


def exclusive_combine(
    decays: torch.Tensor, contributions: torch.Tensor, initial: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exclusive scan of segment summaries along dim 0 (the segment/rank index).

    Segment ``r`` maps an incoming state ``h`` to ``decays[r] · h + contributions[r]``.

    Args:
        decays: ``[R, ...]`` (broadcastable against ``contributions``).
        contributions: ``[R, ...]``: each segment's final state from zero.
        initial: the state before segment 0 (zero when ``None``).

    Returns:
        ``(incoming, final)``: ``[R, ...]`` state entering each segment and the state after the
        last one. Log-step (Hillis–Steele) over ``R``: ⌈log₂ R⌉ tensor steps, no loop over ranks.
    """
    decays = decays.expand_as(contributions)
    if initial is not None:
        contributions = torch.cat(
            [contributions[:1] + decays[:1] * initial, contributions[1:]], dim=0
        )
    segments, step = contributions.shape[0], 1
    inclusive, carry = contributions, decays
    while step < segments:
        inclusive = torch.cat(
            [inclusive[:step], torch.addcmul(inclusive[step:], carry[step:], inclusive[:-step])]
        )
        carry = torch.cat([carry[:step], carry[step:] * carry[:-step]])
        step *= 2
    start = inclusive.new_zeros(inclusive[:1].shape) if initial is None else initial.unsqueeze(0)
    incoming = torch.cat([start.to(inclusive.dtype), inclusive[:-1]], dim=0)
    return incoming, inclusive[-1]


def selective_scan_correction(
    delta: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    incoming: torch.Tensor,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    reverse: bool = False,
) -> torch.Tensor:
    """What an incoming state adds to a segment's Mamba-1 output (scanned from zero).

    ``y_t += (C_t · (exp(A Σ_{s≤t} Δ_s) ⊙ h_in)) · silu(z_t)``; ``delta`` ``[B, D, L]``, ``A``
    ``[D, N]``, ``C`` as in :func:`selective_scan`, ``incoming`` ``[B, D, N]`` → ``[B, D, L]``
    (compute dtype). ``reverse`` accumulates the decay from the last step.
    """
    dtype = _compute_dtype(delta, A, C, incoming)
    steps = _mamba1_steps(delta, delta_bias, delta_softplus, dtype)
    cum = (steps.flip(-1).cumsum(-1).flip(-1) if reverse else steps.cumsum(-1)).transpose(1, 2)
    groups = _group_count(C, C, delta.shape[1])
    Cm = _grouped_projection(C, groups, dtype)
    out = _DecayedReadout.apply(cum, A.to(dtype), Cm, incoming.to(dtype), groups).transpose(1, 2)
    return out * F.silu(z.to(dtype)) if z is not None else out


_READOUT_BLOCK = 1 << 21  # elements of one [B, T, D, N] block in the decayed read-out


class _DecayedReadout(torch.autograd.Function):
    """``y[b, t, d] = Σ_n C[b, t, g(d), n] · exp(A[d, n] · S[b, t, d]) · h[b, d, n]``.

    ``S`` (``cum``) ``[B, L, D]``, ``A`` ``[D, N]``, ``Cm`` broadcastable to
    ``[B, L, G, D/G, N]`` (:func:`_grouped_projection`), ``h`` ``[B, D, N]`` → ``[B, L, D]``.
    The ``[B, L, D, N]`` decays are never kept: forward and backward run over blocks of time
    steps and recompute them, so the read-out saves only its inputs.
    """

    @staticmethod
    def forward(ctx, cum, A, Cm, h, groups):
        ctx.save_for_backward(cum, A, Cm, h)
        ctx.groups = groups
        out = cum.new_empty(cum.shape)
        for t0, t1, c_block in _readout_blocks(cum, A, Cm):
            decayed = torch.exp(cum[:, t0:t1, :, None] * A) * h[:, None]
            out[:, t0:t1] = (decayed.unflatten(2, (groups, -1)) * c_block).sum(-1).flatten(2)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cum, A, Cm, h = ctx.saved_tensors
        groups = ctx.groups
        grad_cum = torch.empty_like(cum)
        grad_A, grad_h = torch.zeros_like(A), torch.zeros_like(h)
        grad_C = torch.zeros_like(Cm)
        for t0, t1, c_block in _readout_blocks(cum, A, Cm):
            decay = torch.exp(cum[:, t0:t1, :, None] * A)  # [B, T, D, N]
            g = grad[:, t0:t1, :, None]
            c_full = c_block.expand(*g.shape[:2], groups, A.shape[0] // groups, A.shape[1])
            g_c = g * c_full.flatten(2, 3)  # ∂y/∂(decay · h)
            grad_h += (g_c * decay).sum(1)
            weighted = g_c.mul_(h[:, None]).mul_(decay)  # ∂y/∂(A · S)
            grad_cum[:, t0:t1] = (weighted * A).sum(-1)
            grad_A += torch.einsum("btdn,btd->dn", weighted, cum[:, t0:t1])
            g_cm = (g * decay * h[:, None]).unflatten(2, (groups, -1))
            if Cm.shape[1] == 1:
                grad_C += g_cm.sum_to_size(Cm.shape)
            else:
                grad_C[:, t0:t1] = g_cm.sum_to_size(c_block.shape)
        return grad_cum, grad_A, grad_C, grad_h, None


def _readout_blocks(cum: torch.Tensor, A: torch.Tensor, Cm: torch.Tensor):
    """``(t0, t1, Cm's block)`` over time blocks of about :data:`_READOUT_BLOCK` elements."""
    batch, length, dim = cum.shape
    step = max(1, _READOUT_BLOCK // max(1, batch * dim * A.shape[1]))
    for t0 in range(0, length, step):
        t1 = min(length, t0 + step)
        yield t0, t1, Cm if Cm.shape[1] == 1 else Cm[:, t0:t1]


def ssd_correction(
    dt: torch.Tensor,
    A: torch.Tensor,
    C: torch.Tensor,
    incoming: torch.Tensor,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    reverse: bool = False,
) -> torch.Tensor:
    """What an incoming state adds to a segment's SSD output (scanned from zero).

    ``y_t += exp(A_h Σ_{s≤t} Δ_s) (h_in C_t) · silu(z_t)``; ``dt`` ``[B, L, H]``, ``C``
    ``[B, L, G, N]``, ``incoming`` ``[B, H, P, N]`` → ``[B, L, H, P]`` (compute dtype).
    """
    dtype = _compute_dtype(dt, A, C, incoming)
    steps = _ssd_steps(dt, dt_bias, dt_softplus, dt_limit, dtype)
    cum = steps.flip(1).cumsum(1).flip(1) if reverse else steps.cumsum(1)
    groups = C.shape[2]
    state_out = torch.einsum(
        "blgn,bgepn->blgep",
        C.to(dtype),
        rearrange(incoming.to(dtype), "b (g e) p n -> b g e p n", g=groups),
    ).flatten(2, 3)
    out = state_out * torch.exp(cum * A.to(dtype)).unsqueeze(-1)
    return out * F.silu(z.to(dtype)) if z is not None else out
