"""SeqParallel runtime: specs, bad input, lockstep slicing (1, 2 and 3 processes), accounting."""

from __future__ import annotations

import pytest
import torch

from dspzoo.core import SavedTensorMeter, SeqParallel, SeqSpec, Stage, build_mesh, shard_sizes
from dspzoo.core.parallel.layout import shard_offset
from dspzoo.core.testing import run_distributed
from dspzoo.domains.toy.model import Toy2DConfig, Toy2DTransformer

STAGES = (Stage("spatial", ("s",)), Stage("temporal", ("t",)))


def test_shard_sizes_are_balanced_and_unpadded() -> None:
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(3, 4) == [1, 1, 1, 0]
    assert sum(shard_sizes(1001, 7)) == 1001
    assert shard_offset(10, 4, 2) == 6


def test_spec_errors_name_the_problem() -> None:
    x = torch.randn(2, 3, 4, 5)
    spec = SeqSpec.of(x, ("t", "s"))
    assert spec.lengths == (3, 4) and spec.axis("s") == 2
    with pytest.raises(ValueError, match="unknown sequence dim 'h'"):
        spec.axis("h")
    with pytest.raises(ValueError, match="too few"):
        SeqSpec.of(torch.randn(2, 3), ("t", "s"))
    with pytest.raises(ValueError, match="does not match"):
        spec.with_sharded("t").check_local(torch.randn(2, 3, 4, 5), rank=0, world=2)


def test_enter_with_unknown_stage_dim_raises() -> None:
    sp = SeqParallel()
    with pytest.raises(ValueError, match="unknown dim"):
        sp.enter(torch.randn(1, 4, 4, 2), ("t", "s"), (Stage("a", ("h",)),))


def test_attention_rejects_wrong_rank() -> None:
    sp = SeqParallel()
    act = sp.enter(torch.randn(1, 4, 6, 8), ("t", "s"), STAGES)
    q = torch.randn(1, 4, 6, 8)  # missing the heads axis
    with pytest.raises(ValueError, match="heads, head_dim"):
        sp.attention(q, q, q, act.spec, over="s")


def test_shard_like_single_process_is_identity() -> None:
    sp = SeqParallel()
    act = sp.enter(torch.randn(1, 4, 6, 8), ("t", "s"), STAGES)
    pos = torch.randn(1, 4, 6, 8)
    assert sp.shard_like(pos, act) is pos  # single process: nothing to slice


def _shard_like_worker(rank: int, world: int) -> int:
    """Every branch of ``shard_like`` on a real SP group (T = 4, S = 7: uneven at 2 and 3)."""
    sp = SeqParallel(build_mesh(world))
    x = torch.randn(2, 4, 7, 3, generator=torch.Generator().manual_seed(0))
    act = sp.enter(x, ("t", "s"), STAGES)
    checks = 0
    for dim in ("t", "s"):
        act = sp.switch(act, dim)
        axis, full = act.axis(dim), act.spec.length(dim)
        size, start = shard_sizes(full, world)[rank], shard_offset(full, world, rank)
        # a correct tensor is sliced in lockstep with the activation
        assert torch.equal(sp.shard_like(x, act), act.tensor), dim
        pos = torch.arange(4 * 7, dtype=torch.float32).reshape(1, 4, 7, 1)
        assert torch.equal(sp.shard_like(pos, act), pos.narrow(axis, start, size)), dim
        # a size-1 axis broadcasts and is left alone
        bcast = pos.narrow(axis, 0, 1)
        assert sp.shard_like(bcast, act) is bcast
        # another layout via ``axes``: per-frame [B, T] / per-token [B, S] conditioning
        per = torch.randn(2, full)
        assert torch.equal(sp.shard_like(per, act, axes={dim: 1}), per[:, start : start + size])
        other = "s" if dim == "t" else "t"
        assert sp.shard_like(per, act, axes={other: 1}) is per  # no sharded dim: unchanged
        # the length check: reached on every rank, raised locally (no collective to hang in)
        wrong = torch.randn(*(full + 1 if a == axis else n for a, n in enumerate(x.shape)))
        with pytest.raises(
            ValueError, match=rf"has size {full + 1}, but sequence dim '{dim}' has length {full}"
        ):
            sp.shard_like(wrong, act)
        with pytest.raises(ValueError, match=f"dim '{dim}' has length {full}"):
            sp.shard_like(torch.randn(2, full - 1), act.spec, axes={dim: 1})
        checks += 1
    # a sequence of length 1 (shorter than the group: one rank holds it, the others nothing):
    # its size-1 axis is the dim itself, sliced with the activation, not broadcast
    one = sp.enter(torch.randn(2, 1, 3), ("l",), (Stage("attn", ("l",)),))
    targets = torch.tensor([[5], [7]])
    mine = sp.shard_like(targets, one)
    assert mine.shape == (2, one.tensor.shape[1]) and mine.shape[1] == (rank == 0)
    return checks


@pytest.mark.parametrize("world", [2, 3])
def test_shard_like_checks_lengths(world: int) -> None:
    """On 2 and 3 processes, where the length check is reached (and slicing is uneven)."""
    assert run_distributed(_shard_like_worker, world, timeout=120) == [2] * world


def _undeclared_dim_worker(rank: int, world: int) -> str:
    """A stage declared as mixing ``t`` whose attention runs over ``s``, which its plan keeps
    sharded: the runtime refuses on every rank, naming the stage and what it declared."""
    sp = SeqParallel(build_mesh(world), "dsp")
    act = sp.to_stage(sp.enter(torch.randn(1, 5, 7, 2, 4), ("t", "s"), STAGES), "temporal")
    assert act.spec.sharded == "s"
    try:
        sp.attention(act.tensor, act.tensor, act.tensor, act.spec, over="s")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_attention_over_an_undeclared_dim_names_the_stage() -> None:
    messages = run_distributed(_undeclared_dim_worker, 2, timeout=60)
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "dsp: attention over ('s',) with stage 'temporal' in force (declared as mixing t) while "
        "'s' is sharded"
    ), messages[0]


def test_with_tensor_keeps_sequence_sizes() -> None:
    sp = SeqParallel()
    act = sp.enter(torch.randn(1, 4, 6, 8), ("t", "s"), STAGES)
    assert act.with_tensor(torch.randn(1, 4, 6, 3)).tensor.shape[-1] == 3
    with pytest.raises(ValueError, match="changed"):
        act.with_tensor(torch.randn(1, 5, 6, 8))


@pytest.mark.parametrize("over", ["t", "h", "w"])
def test_axial_attention_mixes_only_its_dim(over: str) -> None:
    """Perturbing one token changes exactly the tokens on its line along ``over``.

    SP-vs-single comparisons cannot catch an attention that mixes the wrong axis (both paths
    would share the bug); this pins the semantics of one process.
    """
    sp = SeqParallel()
    names = ("t", "h", "w")
    spec = sp.enter(torch.randn(1, 3, 4, 5, 8), names, (Stage("a", (over,)),)).spec
    q, k, v = (torch.randn(1, 3, 4, 5, 2, 4) for _ in range(3))
    base = sp.attention(q, k, v, spec, over=over)
    k2, v2 = k.clone(), v.clone()
    k2[0, 1, 2, 3] += 1.0
    v2[0, 1, 2, 3] += 1.0
    changed = (sp.attention(q, k2, v2, spec, over=over) - base).abs().amax(dim=(0, -2, -1)) > 0
    expected = torch.zeros(3, 4, 5, dtype=torch.bool)
    index: list = [1, 2, 3]
    index[names.index(over)] = slice(None)
    expected[tuple(index)] = True
    assert torch.equal(changed, expected)


def test_saved_tensor_meter_counts_activations_not_parameters() -> None:
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    with SavedTensorMeter(lin.parameters()) as meter:
        y = torch.relu(lin(x))
    # the linear saves its input x; relu saves its output y
    assert meter.bytes == x.numel() * 4 + y.numel() * 4


def test_meter_scales_with_tokens() -> None:
    torch.manual_seed(0)
    model = Toy2DTransformer(Toy2DConfig(in_channels=2, hidden=16, heads=2, depth=1))
    sizes = []
    for t in (4, 8):
        with SavedTensorMeter(model.parameters()) as meter:
            model(torch.randn(1, t, 16, 2))
        sizes.append(meter.bytes)
    assert 1.8 < sizes[1] / sizes[0] < 2.2
