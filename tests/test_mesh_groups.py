"""The SP, DP and gradient (DDP) groups are communicators of their own at every layout.

At dp = 1 the SP group spans the world, at sp = 1 the DP group does, and the gradient group
always does; none of them may be the default group, and none may share a communicator with
another. A communicator is identified by its name and by its own collective sequence counter:
a collective on one group must advance that group's counter and no other's. Collectives issued
in a different order on different ranks must complete with the right values (they would
deadlock or exchange the wrong buffers on one shared communicator). DDP built by
``setup_accelerate`` + ``accelerator.prepare`` averages on the gradient group. After
``release_communicators`` no communication thread is left.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.parallel.mesh import SPMesh, build_mesh
from dspzoo.core.testing import run_distributed


def _groups(mesh: SPMesh) -> dict[str, Any]:
    groups = {"sp": mesh.sp_group, "dp": mesh.dp_group, "grad": mesh.grad_group}
    return {name: g for name, g in groups.items() if g is not None}


def _expected_ranks(mesh: SPMesh) -> dict[str, list[int]]:
    return {
        "sp": list(mesh.sp_ranks),
        "dp": list(range(mesh.sp_rank, mesh.world_size, mesh.sp_size)),
        "grad": list(range(mesh.world_size)),
    }


def _sequence_numbers(groups: dict[str, Any]) -> dict[str, int]:
    everyone = {**groups, "default": dist.group.WORLD}
    return {name: g._get_sequence_number_for_group() for name, g in everyone.items()}


def _check_own_communicators(mesh: SPMesh) -> None:
    groups = _groups(mesh)
    expected = {"grad"} | ({"sp"} if mesh.sp_size > 1 else set())
    assert set(groups) == expected | ({"dp"} if mesh.dp_size > 1 else set()), mesh
    names = [g.group_name for g in groups.values()] + [dist.group.WORLD.group_name]
    assert len(set(names)) == len(names), f"{mesh}: groups share a communicator: {names}"
    for name, group in groups.items():
        assert group is not dist.group.WORLD, f"{mesh}: the {name} group is the default group"
        assert dist.get_process_group_ranks(group) == _expected_ranks(mesh)[name], name
    for name, group in groups.items():
        before = _sequence_numbers(groups)
        dist.all_reduce(torch.ones(1), group=group)
        after = _sequence_numbers(groups)
        assert after[name] == before[name] + 1, (mesh, name, before, after)
        untouched = {n: v for n, v in after.items() if n != name}
        assert untouched == {n: v for n, v in before.items() if n != name}, (mesh, name)


def _check_interleaved(mesh: SPMesh) -> None:
    """Each rank issues its collectives (async) in its own order; all complete, values right."""
    rank, groups = mesh.rank, _groups(mesh)
    summed = {name: torch.full((3,), float(rank + 1)) for name in groups if name != "sp"}
    exchanged = torch.empty(mesh.sp_size)

    def issue(name: str) -> Any:
        if name == "sp":
            send = rank * 100.0 + torch.arange(mesh.sp_size, dtype=torch.float32)
            return dist.all_to_all_single(exchanged, send, group=groups["sp"], async_op=True)
        return dist.all_reduce(summed[name], group=groups[name], async_op=True)

    order = sorted(groups)
    order = order[rank % len(order) :] + order[: rank % len(order)]
    if rank % 2:
        order.reverse()
    for work in [issue(name) for name in order]:
        work.wait()
    for name, tensor in summed.items():
        expected = float(sum(r + 1 for r in _expected_ranks(mesh)[name]))
        assert torch.equal(tensor, torch.full((3,), expected)), (mesh, name, order, tensor)
    if "sp" in groups:
        expected = torch.tensor([r * 100.0 + mesh.sp_rank for r in mesh.sp_ranks])
        assert torch.equal(exchanged, expected), (mesh, order, exchanged)


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (``pt_gloo_runloop`` workers, ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return [name for name in names if "gloo" in name]


def _layouts(rank: int, world: int, sp_sizes: tuple[int, ...]) -> int:
    from dspzoo.core.entry import release_communicators

    for sp_size in sp_sizes:
        mesh = build_mesh(sp_size)
        _check_own_communicators(mesh)
        _check_interleaved(mesh)
        del mesh
    assert _gloo_threads()  # the groups' communication threads, while they exist
    release_communicators()
    assert not dist.is_initialized()
    assert _gloo_threads() == [], "a communicator's threads outlived release_communicators"
    return len(sp_sizes)


pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task"
)


def test_groups_are_own_communicators_at_dp1_sp2_and_dp2_sp1() -> None:
    assert run_distributed(_layouts, 2, (2, 1), timeout=180) == [2, 2]


def test_groups_are_own_communicators_at_dp2_sp2() -> None:
    assert run_distributed(_layouts, 4, (2,), timeout=180) == [1] * 4


def _ddp_on_grad_group(rank: int, world: int) -> bool:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    from dspzoo.core.accelerate import setup_accelerate

    accelerator, mesh, _ = setup_accelerate(sp_size=world, cpu=True, keep_freed_memory=False)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    assert model.process_group is mesh.grad_group
    before = _sequence_numbers(_groups(mesh))
    model(torch.full((4, 3), float(rank))).sum().backward()
    after = _sequence_numbers(_groups(mesh))
    assert after["grad"] > before["grad"] and after["sp"] == before["sp"], (before, after)
    assert after["default"] == before["default"], (before, after)
    grads = model.module.weight.grad.clone()
    dist.all_reduce(grads, group=mesh.grad_group)  # DDP averaged: every rank holds the same
    return torch.allclose(grads, world * model.module.weight.grad)


def test_accelerate_ddp_averages_on_the_grad_group() -> None:
    assert run_distributed(_ddp_on_grad_group, 2, timeout=180) == [True, True]


def test_group_ddp_kwargs_keep_the_users_ddp_settings() -> None:
    from accelerate.utils import DistributedDataParallelKwargs

    from dspzoo.core.accelerate import GroupDDPKwargs

    class Group:  # like a process group, it cannot be deep-copied; the handler must not try
        def __deepcopy__(self, memo: dict) -> Group:
            raise TypeError("cannot pickle 'ProcessGroup' object")

    group = Group()
    users = DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=5)
    kwargs = GroupDDPKwargs.on_group(group, users).to_kwargs()
    assert kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5, "process_group": group}
    assert kwargs["process_group"] is group
    assert GroupDDPKwargs.on_group(group).to_kwargs() == {"process_group": group}
