"""The SP, DP and gradient (DDP) groups are communicators of their own at every layout.

At dp = 1 the SP group spans the world, at sp = 1 the DP group does, and the gradient group
always does; none of them may be the default group, and none may share a communicator with
another. A communicator is identified by its name and by its own collective sequence counter:
a collective on one group must advance that group's counter and no other's. Collectives issued
in a different order on different ranks must complete with the right values (they would
deadlock or exchange the wrong buffers on one shared communicator). DDP built by
``setup_accelerate`` + ``accelerator.prepare`` averages on the gradient group. After
``release_communicators`` no communication thread is left.

The mesh's node layout: from fake launcher environments (no processes), the nodes torchrun,
accelerate, SLURM or the host name describe, every disagreement and every SP size that cannot
stay on one node raising a clear error, SP across nodes on request; and ``build_mesh`` on four
processes that say they are two nodes of two: SP groups node-local at sp 2, at sp 4 the same
error on every rank, or a warned mesh with ``sp_is_node_local`` false when asked for.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.parallel.mesh import SPMesh, build_mesh
from dspzoo.core.parallel.nodes import (
    NodeLayout,
    RankPlace,
    agreed_sp_across_nodes,
    check_sp_placement,
    code_fingerprint,
    node_layout,
    sp_across_nodes_requested,
    this_place,
)
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


# -- node layout ---------------------------------------------------------------------------------


def _torchrun_env(node: int, local: int, per_node: int) -> dict[str, str]:
    """What torchrun (and accelerate launch, through it) sets on one process."""
    return {
        "GROUP_RANK": str(node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "RANK": str(node * per_node + local),
    }


def _places(nodes: int, per_node: int, hosts: list[str] | None = None) -> list[RankPlace]:
    """Places of a ``nodes × per_node`` torchrun job (host ``host<node>`` unless given)."""
    places = []
    for node in range(nodes):
        for local in range(per_node):
            env = _torchrun_env(node, local, per_node)
            place = this_place(node * per_node + local, env)
            host = hosts[node] if hosts else f"host{node}"
            places.append(RankPlace(**{**vars(place), "host": host}))
    return places


def test_this_place_reads_the_launchers_variables() -> None:
    torchrun = this_place(5, {"GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (torchrun.node_var, torchrun.node_id) == ("GROUP_RANK", "1")
    assert (torchrun.local_rank, torchrun.local_world_size) == (1, 4)
    slurm = this_place(3, {"SLURM_NODEID": "2", "NODE_RANK": ""})
    assert (slurm.node_var, slurm.node_id, slurm.local_rank) == ("SLURM_NODEID", "2", None)
    assert this_place(0, {}).node_var is None
    # a malformed variable never raises before the gather: it travels in the record and
    # node_layout raises it on every rank
    bad = this_place(1, {"LOCAL_WORLD_SIZE": "two"})
    assert "LOCAL_WORLD_SIZE='two' in the environment" in bad.problem
    with pytest.raises(ValueError, match=r"rank 1 \(host .*\): LOCAL_WORLD_SIZE='two'"):
        node_layout([this_place(0, {}), bad])


def test_node_layout_of_a_torchrun_job() -> None:
    layout = node_layout(_places(2, 4)[::-1])  # any order of records
    assert layout.nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.hosts == ("host0", "host1") and layout.source == "GROUP_RANK"
    assert layout.sizes == (4, 4) and layout.world_size == 8
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "2 node(s) × 4 processes (nodes from GROUP_RANK, on 2 hosts" in layout.describe()


def test_two_launchers_on_one_host_are_two_nodes() -> None:
    layout = node_layout(_places(2, 2, hosts=["box", "box"]))
    assert layout.nodes == ((0, 1), (2, 3)) and "on one host: box" in layout.describe()


def test_without_a_launcher_the_host_name_names_the_node() -> None:
    places = [RankPlace(rank=r, host="ab"[r // 3]) for r in range(6)]
    layout = node_layout(places)
    assert layout.nodes == ((0, 1, 2), (3, 4, 5)) and layout.source == "hostname"


@pytest.mark.parametrize(
    ("sp", "local", "per_node_ranks"),
    [(1, True, 1), (2, True, 2), (4, True, 4), (8, False, 4)],
)
def test_sp_groups_inside_a_node(sp: int, local: bool, per_node_ranks: int) -> None:
    layout = node_layout(_places(2, 4))
    assert check_sp_placement(layout, sp, across_nodes=True) is local
    blocks = [list(range(d * sp, (d + 1) * sp)) for d in range(8 // sp)]
    assert min(layout.ranks_per_node_of(b) for b in blocks) == per_node_ranks
    if local:
        assert check_sp_placement(layout, sp) is True


@pytest.mark.parametrize(
    ("layout", "sp", "cause", "choices"),
    [
        (NodeLayout(((0, 1), (2, 3)), ("a", "b"), "GROUP_RANK"), 4, "larger than the 2", "[1, 2]"),
        (
            NodeLayout(((0, 1, 2), (3, 4, 5)), ("a", "b"), "GROUP_RANK"),
            2,
            "sp=2 does not divide the 3 processes",
            "[1, 3]",
        ),
        (
            NodeLayout(((0, 1, 2), (3,)), ("a", "b"), "NODE_RANK"),
            2,
            "different numbers of processes [3, 1]",
            "[1]",
        ),
        (
            NodeLayout(((0, 2), (1, 3)), ("a", "b"), "SLURM_NODEID"),
            2,
            "ranks of a node are not consecutive",
            "[1, 2]",
        ),
    ],
)
def test_sp_groups_that_cannot_stay_on_a_node_raise(
    layout: NodeLayout, sp: int, cause: str, choices: str
) -> None:
    with pytest.raises(ValueError, match="SP groups must lie inside one node") as err:
        check_sp_placement(layout, sp)
    message = str(err.value)
    assert cause in message and f"Choose --sp among {choices}" in message
    assert "DSPZOO_SP_ACROSS_NODES=1" in message
    assert check_sp_placement(layout, sp, across_nodes=True) is False


def test_disagreeing_launchers_raise() -> None:
    same_rank_twice = _places(2, 2, hosts=["a", "a"])
    same_rank_twice[2:] = [
        RankPlace(**{**vars(p), "node_id": "0"}) for p in same_rank_twice[2:]
    ]  # both launchers got --node_rank 0
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE says \\[2\\].*same node rank"):
        node_layout(same_rank_twice)
    two_hosts = _places(1, 2, hosts=["a"])
    two_hosts[1] = RankPlace(**{**vars(two_hosts[1]), "host": "b"})
    with pytest.raises(ValueError, match="runs? on hosts \\['a', 'b'\\]"):
        node_layout(two_hosts)
    mixed = [RankPlace(0, "a", "GROUP_RANK", "0"), RankPlace(1, "a", "SLURM_NODEID", "0")]
    with pytest.raises(ValueError, match="disagree on how they name nodes"):
        node_layout(mixed)
    with pytest.raises(ValueError, match="one record per rank"):
        node_layout([RankPlace(0, "a"), RankPlace(2, "a")])
    local_ranks = [RankPlace(r, "a", "GROUP_RANK", "0", 0, 2) for r in range(2)]
    with pytest.raises(ValueError, match="LOCAL_RANK values \\[0, 0\\]"):
        node_layout(local_ranks)


def test_machines_running_different_code_raise() -> None:
    places = _places(2, 2)
    assert {p.code for p in places} == {code_fingerprint()} and "torch" in code_fingerprint()
    places[2:] = [
        RankPlace(**{**vars(p), "code": "dspzoo 000000000000, torch 2.0"}) for p in places[2:]
    ]
    with pytest.raises(ValueError, match="run different code") as err:
        node_layout(places)
    assert "on rank(s) [2, 3] (host(s) ['host1'])" in str(err.value)
    assert "same dspzoo commit and torch version" in str(err.value)


def test_sp_across_nodes_setting() -> None:
    assert sp_across_nodes_requested({}) is False
    assert sp_across_nodes_requested({"DSPZOO_SP_ACROSS_NODES": "1"}) is True
    assert sp_across_nodes_requested({"DSPZOO_SP_ACROSS_NODES": "off"}) is False
    with pytest.raises(ValueError, match="DSPZOO_SP_ACROSS_NODES='maybe'"):
        sp_across_nodes_requested({"DSPZOO_SP_ACROSS_NODES": "maybe"})


def test_sp_across_nodes_is_agreed_from_every_ranks_record() -> None:
    def places(*values: str) -> list[RankPlace]:
        env = "DSPZOO_SP_ACROSS_NODES"
        return [this_place(r, {env: v} if v else {}) for r, v in enumerate(values)]

    assert agreed_sp_across_nodes(places("1", "yes")) is True
    assert agreed_sp_across_nodes(places("", "0")) is False
    with pytest.raises(ValueError, match=r"ranks \[0\] allow it, ranks \[1\] do not"):
        agreed_sp_across_nodes(places("1", ""))  # exported on one machine only
    with pytest.raises(ValueError, match="rank 1 .*'maybe'"):
        agreed_sp_across_nodes(places("1", "maybe"))
    explicit = [this_place(r, {}, sp_across_nodes=True) for r in range(2)]
    assert agreed_sp_across_nodes(explicit) is True


def _simulated_nodes(rank: int, world: int) -> dict[str, Any]:
    """Two nodes of two, as two torchrun launchers on this host would say; meshes at sp 2,
    sp 4 (an error), sp 4 across nodes on purpose."""
    os.environ.update(_torchrun_env(rank // 2, rank % 2, 2))
    mesh = build_mesh(2, timeout_s=30)
    found: dict[str, Any] = {
        "nodes": mesh.nodes,
        "node_rank": mesh.node_rank,
        "sp_local": mesh.sp_is_node_local,
        "sp_per_node": mesh.sp_ranks_per_node,
        "summary": mesh.describe_topology(),
    }
    try:
        build_mesh(4, timeout_s=30)
    except ValueError as exc:
        found["error"] = str(exc)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        across = build_mesh(4, timeout_s=30, sp_across_nodes=True)
    found["across"] = (across.sp_is_node_local, across.sp_ranks_per_node)
    found["spanned"] = (mesh.sp_nodes_spanned, across.sp_nodes_spanned)
    found["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # records that only some ranks get wrong still raise on every rank (nobody hangs)
    if rank < 2:
        os.environ["DSPZOO_SP_ACROSS_NODES"] = "1"  # exported on node 0 only
    try:
        build_mesh(4, timeout_s=30)
    except ValueError as exc:
        found["disagree"] = str(exc)
    os.environ.pop("DSPZOO_SP_ACROSS_NODES", None)
    if rank == 3:
        os.environ["LOCAL_RANK"] = "x"
    try:
        build_mesh(2, timeout_s=30)
    except ValueError as exc:
        found["unreadable"] = str(exc)
    return found


def test_build_mesh_on_two_simulated_nodes() -> None:
    results = run_distributed(_simulated_nodes, 4, timeout=180)
    for rank, found in enumerate(results):
        assert found["nodes"] == ((0, 1), (2, 3)) and found["node_rank"] == rank // 2
        assert found["sp_local"] is True and found["sp_per_node"] == 2
        assert "sp 2 on 2 node(s) × 2 processes" in found["summary"]
        assert (
            "SP groups node-local ([0, 1] on node 0, [2, 3] on node 1), DP groups across nodes"
            in found["summary"]
        )
        assert "sp=4 is larger than the 2 processes of a node" in found["error"]  # every rank
        assert found["across"] == (False, 2) and found["spanned"] == (1, 2)
        assert "ranks [0, 1] allow it, ranks [2, 3] do not" in found["disagree"]
        assert "rank 3 (host " in found["unreadable"] and "LOCAL_RANK='x'" in found["unreadable"]
        assert len(found["warned"]) == (1 if rank == 0 else 0)  # said once, by rank 0
    assert "inter-node link" in results[0]["warned"][0]
