"""A bad input on one rank, anywhere in a model, raises the same clear error on every rank.

Debug mode is off. Each case gives one rank (rank 1) a wrong shard, dtype, shape, length or
argument for one public primitive or attention method — inside a small two-stage model, not
only at its entry — and checks that *every* rank raises a ``CollectiveInputError`` naming rank
1, the primitive and the comm region, with the same message on every rank. The mesh's
collective timeout is 5 s (``build_mesh(timeout_s=5)``): a regression that lets one rank go on
alone fails fast with a ``CollectiveTimeoutError`` instead of hanging. After all the failures
the group is still in step: the model's good forward and backward match one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dspzoo.core import build_mesh, comm
from dspzoo.core.parallel.layout import shard_offset, shard_sizes
from dspzoo.core.parallel.methods import (
    lss_attention,
    ring_attention,
    ulysses_attention,
    usp_attention,
    zigzag_gather,
    zigzag_lengths,
)
from dspzoo.core.parallel.trace import comm_region
from dspzoo.core.testing import run_distributed

BAD = 1  # the rank that gets the bad input
B, T, S, C = 2, 5, 7, 3  # lengths not divisible by 2 or 3


def _slice(t: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    return t.narrow(dim, shard_offset(t.shape[dim], n, r), shard_sizes(t.shape[dim], n)[r])


class TwoStage(nn.Module):
    """``[B, T, S, C]`` sharded on T: a temporal MLP, a switch to S, a spatial MLP, a gather.

    ``corrupt(h, rank)`` (a test hook) changes the activation between the stages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.temporal = nn.Linear(C, C)
        self.spatial = nn.Linear(C, C)

    def forward(
        self,
        x: torch.Tensor,
        group: Any,
        corrupt: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        rank = dist.get_rank(group)
        with comm_region("block0"):
            h = torch.tanh(self.temporal(x))
            if corrupt is not None:
                h = corrupt(h, rank)
            with comm_region("spatial"):
                h = comm.switch(h, 1, 2, group, src_length=T)  # sharded on T → on S
                h = torch.tanh(self.spatial(h))
        with comm_region("head"):
            return comm.gather(h, 2, group, length=S)


def _extra_row(h: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.cat([h, h[:, :1]], dim=1) if rank == BAD else h


def _wrong_dtype(h: torch.Tensor, rank: int) -> torch.Tensor:
    return h.double() if rank == BAD else h


def _extra_channel(h: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.cat([h, h[..., :1]], dim=-1) if rank == BAD else h


def _model_case(corrupt: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable[..., None]:
    def run(model: TwoStage, x: torch.Tensor, group: Any, n: int, r: int) -> None:
        model(_slice(x, 1, n, r), group, corrupt)

    return run


def _mine(r: int, good: Any, bad: Any) -> Any:
    return bad if r == BAD else good


def _gather_extra_row(model, x, group, n, r) -> None:
    h = _slice(x, 2, n, r)
    with comm_region("head"):
        comm.gather(_mine(r, h, torch.cat([h, h[:, :, :1]], dim=2)), 2, group, length=S)


def _gather_wrong_length(model, x, group, n, r) -> None:
    with comm_region("head"):
        comm.gather(_slice(x, 2, n, r), 2, group, length=_mine(r, S, S + n))


def _local_use_wrong_dtype(model, x, group, n, r) -> None:
    h = _slice(x, 1, n, r)
    with comm_region("pair"):
        comm.gather_for_local_use(_mine(r, h, h.half()), 1, group, length=T)


def _split_other_length(model, x, group, n, r) -> None:
    with comm_region("embed"):
        comm.split(_mine(r, x, x[:, 1:]), 1, group)


def _switch_async_other_channels(model, x, group, n, r) -> None:
    h = _extra_channel(_slice(x, 1, n, r), r)
    with comm_region("block0/spatial"):
        comm.switch_async(h, 1, 2, group, src_length=T).wait()


def _diverged(model, x, group, n, r) -> None:
    with comm_region("block0"):
        if r == BAD:
            comm.gather(_slice(x, 1, n, r), 1, group, length=T)
        else:
            comm.switch(_slice(x, 1, n, r), 1, 2, group, src_length=T)


def _qkv(n: int, r: int, heads: int = 2, length: int = T) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, length, heads, 4, generator=gen) for _ in range(3)]
    return [_slice(t, 1, n, r) for t in full]


def _ring_lengths_differ(model, x, group, n, r) -> None:
    lengths = shard_sizes(T, n)
    bad = [*lengths[:-1], lengths[-1] + 1]
    q, k, v = _qkv(n, r)
    with comm_region("attn"):
        ring_attention(q, k, v, group=group, seq_lengths=_mine(r, lengths, bad), causal=True)


def _ring_extra_token(model, x, group, n, r) -> None:
    q, k, v = _qkv(n, r)
    if r == BAD:
        q, k, v = (torch.cat([t, t[:, :1]], dim=1) for t in (q, k, v))
    with comm_region("attn"):
        ring_attention(q, k, v, group=group, seq_lengths=shard_sizes(T, n), causal=False)


def _ulysses_other_heads(model, x, group, n, r) -> None:
    q, k, v = _qkv(n, r, heads=_mine(r, 2, 4))
    with comm_region("attn"):
        ulysses_attention(q, k, v, group=group, seq_lengths=shard_sizes(T, n))


def _lss_wrong_dtype(model, x, group, n, r) -> None:
    q, k, v = _qkv(n, r)
    with comm_region("attn"):
        lss_attention(q, _mine(r, k, k.double()), v, group=group, seq_lengths=shard_sizes(T, n))


def _usp_extra_token(model, x, group, n, r) -> None:
    q, k, v = _qkv(n, r)
    if r == BAD:
        q = torch.cat([q, q[:, :1]], dim=1)
    with comm_region("attn"):  # a ring of n slots, one Ulysses rank each
        usp_attention(
            q,
            k,
            v,
            ulysses_group=None,
            ring_group=group,
            seq_lengths=shard_sizes(T, n),
            causal=True,
        )


def _ring_exchange_wrong_recv(model, x, group, n, r) -> None:
    h = _slice(x, 1, n, r)
    recv = list(_slice(x, 1, n, (r - 1) % n).shape)
    recv[1] += int(r == BAD)
    with comm_region("p2p"):
        comm.ring_exchange(h, group, shift=1, recv_shape=recv)


def _zigzag_extra_row(model, x, group, n, r) -> None:
    rows = zigzag_lengths(T, n)[r] + int(r == BAD)
    with comm_region("lm_head"):
        zigzag_gather(torch.zeros(1, rows, 2), 1, group, T)


def _check_consistent_args(model, x, group, n, r) -> None:
    with comm_region("user"):
        comm.check_consistent(x, group, "my_op", args=(_mine(r, 3, 4),), free_axes=(1,))


# name → (the bad call, the primitive its error names, the region, words the message has)
CASES: dict[str, tuple[Callable[..., None], str, str, str]] = {
    "model: extra row before the switch": (
        _model_case(_extra_row),
        "switch",
        "block0/spatial",
        "rows of dim 1",
    ),
    "model: wrong dtype before the switch": (
        _model_case(_wrong_dtype),
        "switch",
        "block0/spatial",
        "x.dtype differs",
    ),
    "model: extra channel before the switch": (
        _model_case(_extra_channel),
        "switch",
        "block0/spatial",
        "x.shape differs",
    ),
    "gather: extra row": (_gather_extra_row, "gather", "head", "rows of dim 2"),
    "gather: other length": (_gather_wrong_length, "gather", "head", "length differs"),
    "gather_for_local_use: wrong dtype": (
        _local_use_wrong_dtype,
        "gather_for_local_use",
        "pair",
        "x.dtype differs",
    ),
    "split: other length": (_split_other_length, "split", "embed", "x.shape differs"),
    "switch_async: extra channel": (
        _switch_async_other_channels,
        "switch_async",
        "block0/spatial",
        "x.shape differs",
    ),
    "diverged control flow": (_diverged, "switch/gather", "block0", "different collectives"),
    "ring: other seq_lengths": (_ring_lengths_differ, "ring_attention", "attn", "seq_lengths"),
    "ring: extra token": (_ring_extra_token, "ring_attention", "attn", "should hold"),
    "ulysses: other head count": (
        _ulysses_other_heads,
        "ulysses_attention",
        "attn",
        "q.shape differs",
    ),
    "lss: wrong dtype": (_lss_wrong_dtype, "lss_attention", "attn", "k.dtype differs"),
    "usp: extra token": (_usp_extra_token, "usp_attention", "attn", "should hold"),
    "ring_exchange: wrong recv_shape": (
        _ring_exchange_wrong_recv,
        "ring_exchange",
        "p2p",
        "recv_shape",
    ),
    "zigzag_gather: extra row": (_zigzag_extra_row, "zigzag_gather", "lm_head", "zigzag layout"),
    "check_consistent: other argument": (
        _check_consistent_args,
        "check_consistent",
        "user",
        "my_op arg 0 differs",
    ),
}


def _every_rank_raises(rank: int, world: int) -> dict[str, str]:
    mesh = build_mesh(world, timeout_s=5)
    group = mesh.sp_group
    torch.manual_seed(0)
    model = TwoStage()
    x = torch.randn(B, T, S, C)
    messages = {}
    for name, (case, primitive, region, words) in CASES.items():
        with pytest.raises(comm.CollectiveInputError) as info:
            case(model, x, group, world, rank)
        text = str(info.value)
        assert text.startswith(f"{primitive} (comm region '{region}', group of {world} ranks)"), (
            name,
            text,
        )
        assert f"rank {BAD}" in text and words in text, (name, text)
        assert "Raised on every rank of the group" in text, (name, text)
        messages[name] = text
    # still in step: the model's forward and backward equal one process's
    x_local = _slice(x, 1, world, rank).requires_grad_(True)
    out = model(x_local, group)
    (out.sum() / world).backward()  # replicated output: the mean of the ranks' losses
    ref_model = TwoStage()
    ref_model.load_state_dict(model.state_dict())
    x_ref = x.clone().requires_grad_(True)
    ref = torch.tanh(ref_model.spatial(torch.tanh(ref_model.temporal(x_ref))))
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x_local.grad, _slice(x_ref.grad, 1, world, rank))
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_one_bad_rank_raises_the_same_error_on_every_rank(world: int) -> None:
    results = run_distributed(_every_rank_raises, world, timeout=180)
    for name in CASES:
        texts = {r: results[r][name] for r in range(world)}
        assert len(set(texts.values())) == 1, (name, texts)


def _reference(model: TwoStage, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(model.spatial(torch.tanh(model.temporal(x))))


def _usp_grid_extra_token(rank: int, world: int) -> str:
    """USP on a 2 × 2 grid: SP rank 1 (ring slot 0, Ulysses rank 1) holds one token too many."""
    mesh = build_mesh(world, ulysses_size=2, timeout_s=5)
    lengths = shard_sizes(T, mesh.ring_size)  # tokens per ring slot
    slot, u = divmod(rank, 2)
    full = _qkv(1, 0, heads=2, length=T)
    start = sum(lengths[:slot]) + shard_offset(lengths[slot], 2, u)
    q, k, v = (t[:, start : start + shard_sizes(lengths[slot], 2)[u]] for t in full)
    if rank == BAD:
        q = torch.cat([q, q[:, :1]], dim=1)
    with comm_region("attn"), pytest.raises(comm.CollectiveInputError) as info:
        usp_attention(
            q,
            k,
            v,
            ulysses_group=mesh.ulysses_group,
            ring_group=mesh.ring_group,
            seq_lengths=lengths,
            causal=True,
        )
    return str(info.value)


def test_usp_grid_failure_reaches_every_rank() -> None:
    texts = run_distributed(_usp_grid_extra_token, 4, timeout=120)
    assert len(set(texts)) == 1, texts
    assert "ring slot 0 (SP ranks 0…1)" in texts[0] and "Ulysses rank 1" in texts[0], texts[0]


def _debug_mode_compares_replicated_data(rank: int, world: int) -> str:
    """Debug mode: a replicated input that differs in its values (not its shape) is caught too."""
    group = build_mesh(world, timeout_s=5).sp_group
    x = torch.zeros(2, T, C) + (rank == BAD)
    comm.split(x, 1, group)  # debug mode off: only shapes, dtypes and devices agree
    comm.set_debug(True)
    try:
        with pytest.raises(
            comm.CollectiveInputError, match=f"rank {BAD}.*checksum differs"
        ) as info:
            comm.split(x, 1, group)
    finally:
        comm.set_debug(False)
    return str(info.value)


def test_debug_mode_compares_the_data_of_replicated_inputs() -> None:
    texts = run_distributed(_debug_mode_compares_replicated_data, 3, timeout=60)
    assert len(set(texts)) == 1, texts


def _one_rank_skips_a_switch(rank: int, world: int) -> str:
    mesh = build_mesh(world, timeout_s=2)
    if rank == BAD:
        time.sleep(4)  # never joins; rank 0 must give up after 2 s with a clear message
        return ""
    x = torch.randn(1, shard_sizes(4, world)[rank], 6)
    with comm_region("block3/temporal"):
        with pytest.raises(comm.CollectiveTimeoutError) as info:
            comm.switch(x, 1, 2, mesh.sp_group, src_length=4)
    return str(info.value)


def test_a_timeout_names_the_collective_the_region_and_the_timeout() -> None:
    text = run_distributed(_one_rank_skips_a_switch, 2, timeout=60)[0]
    assert text.startswith("switch (comm region 'block3/temporal', group of 2 ranks"), text
    assert "timeout of 2 s" in text and "DSPZOO_COLLECTIVE_TIMEOUT" in text, text


def test_mesh_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dspzoo.core.parallel.mesh import collective_timeout_s

    monkeypatch.delenv("DSPZOO_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout_s() == 300
    monkeypatch.setenv("DSPZOO_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout_s() == 12.5
    assert collective_timeout_s(3) == 3
    with pytest.raises(ValueError, match="> 0"):
        collective_timeout_s(0)
