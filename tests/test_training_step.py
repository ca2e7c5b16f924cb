"""An N-rank DSP training step gives the single-process loss and gradients (DDP over dp × sp)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dspzoo.core import SeqParallel, build_mesh, sp_mse, sp_report
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.domains.toy.model import Toy2DConfig, Toy2DTransformer

CFG = Toy2DConfig(in_channels=3, hidden=16, heads=2, depth=2)


def _data(dp_size: int, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(dp_size, 2, t, s, CFG.in_channels, generator=g, dtype=torch.float64)
    y = torch.randn(dp_size, 2, t, s, CFG.in_channels, generator=g, dtype=torch.float64)
    return x, y


def _reference(dp_size: int, t: int, s: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Toy2DTransformer(CFG).double()
    x, y = _data(dp_size, t, s)
    losses, grads = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for d in range(dp_size):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[d]), y[d])
        loss.backward()
        losses.append(loss.item())
        for n, p in model.named_parameters():
            grads[n] += p.grad / dp_size
    return losses, grads


def _parallel_step(rank: int, world: int, sp_size: int, t: int, s: int, sharded_loss: bool) -> dict:
    mesh = build_mesh(sp_size)
    sp = SeqParallel(mesh)
    torch.manual_seed(0)
    model = Toy2DTransformer(CFG).double()
    ddp = DDP(model)
    x, y = _data(mesh.dp_size, t, s)
    x, y = x[mesh.dp_rank], y[mesh.dp_rank]
    with trace_comm() as tracer:
        if sharded_loss:
            out = ddp(x, sp, gather_output=False)
            loss = sp_mse(out.tensor, sp.shard_like(y, out), sp.group)
        else:
            loss = torch.nn.functional.mse_loss(ddp(x, sp), y)
        loss.backward()
    ref_losses, ref_grads = _reference(mesh.dp_size, t, s)
    assert abs(sp_report(loss, sp.group) - ref_losses[mesh.dp_rank]) < 1e-10
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad, ref_grads[n], rtol=1e-9, atol=1e-11, msg=lambda m, n=n: f"{n}: {m}"
        )
    switches = tracer.count("all_to_all", "forward", region_prefix="")
    return {"switches": switches}


@pytest.mark.parametrize(
    ("world", "sp_size", "t", "s", "sharded_loss"),
    [
        (2, 2, 4, 6, False),  # divisible
        (2, 2, 5, 7, True),  # not divisible, loss on sharded tokens
        (4, 4, 5, 6, False),  # not divisible at 4
        (4, 4, 3, 9, True),  # T shorter than... 3 < 4: idle rank on t
        (4, 2, 5, 6, True),  # dp 2 × sp 2
    ],
)
def test_dsp_step_matches_single_process(
    world: int, sp_size: int, t: int, s: int, sharded_loss: bool
) -> None:
    results = run(world, sp_size, t, s, sharded_loss)
    # 2 layers × (temporal + back to spatial) minus the first layer's entry: 2·depth − 1
    assert all(r["switches"] == 2 * CFG.depth - 1 for r in results)


def _fsdp2_step(rank: int, world: int, t: int, s: int) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = build_mesh(world)
    sp = SeqParallel(mesh)
    torch.manual_seed(0)
    model = Toy2DTransformer(CFG).double()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x, y = _data(1, t, s)
    out = model(x[0], sp, gather_output=False)
    sp_mse(out.tensor, sp.shard_like(y[0], out), sp.group).backward()
    _, ref_grads = _reference(1, t, s)
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(),
            ref_grads[n],
            rtol=1e-9,
            atol=1e-11,
            msg=lambda m, n=n: f"{n}: {m}",
        )


def test_fsdp2_averaging_matches_single_process() -> None:
    from dspzoo.core.testing import run_distributed

    run_distributed(_fsdp2_step, 2, 5, 7)


def run(world: int, sp_size: int, t: int, s: int, sharded_loss: bool) -> list[dict]:
    from dspzoo.core.testing import run_distributed

    return run_distributed(_parallel_step, world, sp_size, t, s, sharded_loss)


def test_sp_must_divide_world() -> None:
    from dspzoo.core.testing import run_distributed

    def_msg = run_distributed(_bad_mesh, 2)
    assert all("does not divide" in m for m in def_msg)


def _bad_mesh(rank: int, world: int) -> str:
    try:
        build_mesh(3)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_single_process_needs_no_distributed() -> None:
    torch.manual_seed(0)
    model = Toy2DTransformer(CFG)
    out = model(torch.randn(1, 3, 5, CFG.in_channels))
    assert out.shape == (1, 3, 5, CFG.in_channels)
    assert dist.is_available()
    with pytest.raises(ValueError, match="input channels"):
        model(torch.randn(1, 3, 5, CFG.in_channels + 1))
