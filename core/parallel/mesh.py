"""The dp × sp process mesh, its groups, and seeding that respects it.

Built on :func:`torch.distributed.device_mesh.init_device_mesh`. Ranks are laid out with
sequence parallelism innermost: SP group ``d`` is the consecutive ranks
``[d·sp, …, d·sp + sp − 1]`` (consecutive ranks usually share a node, where the all-to-alls of
a switch are cheapest), and DP group ``i`` is the ranks with SP rank ``i``. For USP the SP
axis is itself a ``ring × ulysses`` sub-mesh with Ulysses innermost: SP rank
``= ring_rank · ulysses_size + ulysses_rank``.

Every group is its own communicator (``dist.new_group``), at every layout: the SP group, the DP
group, the USP sub-groups, and the ``grad_group`` over all ranks that DDP averages gradients
on. None of them is the default group (``dist.group.WORLD``), even at dp = 1 where the SP group
spans the whole world, so DDP's bucket all-reduces, the SP switches and whatever else runs on
the default group (barriers, reports) never share a communicator and need no common issue order.

The mesh knows the job's machines (:mod:`dspzoo.core.parallel.nodes`): :func:`build_mesh`
all-gathers what the launcher told each process (``GROUP_RANK``/``NODE_RANK``/``SLURM_NODEID``,
``LOCAL_WORLD_SIZE``, the host name), checks that every SP group lies on one node (SP's
all-to-alls on the intra-node link, DP's gradient all-reduce across nodes) and raises on every
rank when one cannot, unless SP across nodes is asked for (warned; ``mesh.sp_is_node_local``
is then ``False`` and the cost model prices the SP traffic on the inter-node link).
"""

from __future__ import annotations

import datetime
import os
import random
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..entry import release_communicators_at_exit
from .comm.group import moves_cpu_tensors, register_control_group
from .nodes import (
    NodeLayout,
    RankPlace,
    agreed_sp_across_nodes,
    check_sp_placement,
    node_layout,
    sp_placement_warning,
    this_place,
)

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass(frozen=True)
class SPMesh:
    """A dp × sp mesh seen from one rank.

    Attributes:
        world_size, rank: the whole job.
        dp_size, sp_size: mesh shape, ``dp_size * sp_size == world_size``.
        dp_rank, sp_rank: this rank's coordinates.
        sp_group: process group of this rank's SP group (``None`` when ``sp_size == 1``).
        dp_group: process group of this rank's DP group (``None`` when ``dp_size == 1``).
        device_mesh: the ``torch.distributed.DeviceMesh`` with dims ``("dp", "sp")`` (or
            ``("dp", "ring", "ulysses")`` plus a flattened ``"sp"``), ``None`` on one process.
        ulysses_size: ranks of the Ulysses axis inside the SP group (USP); the ring axis has
            ``sp_size // ulysses_size``.
        ulysses_group, ring_group: the USP sub-groups (``None`` when of size 1 or not built).
        grad_group: all ranks, on a communicator of its own, for gradient averaging (DDP's
            ``process_group``); ``None`` on one process.
        node_layout: the job's machines (:class:`~dspzoo.core.parallel.nodes.NodeLayout`);
            ``None`` on one process.
        sp_is_node_local: every SP group lies on one node (``False`` only when SP across
            nodes was asked for).
    """

    world_size: int
    rank: int
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    sp_group: Any = None
    dp_group: Any = None
    device_mesh: Any = None
    ulysses_size: int = 1
    ulysses_group: Any = None
    ring_group: Any = None
    grad_group: Any = None
    node_layout: NodeLayout | None = None
    sp_is_node_local: bool = True

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Global ranks of each node (one node of every rank when the layout is unknown)."""
        if self.node_layout is None:
            return (tuple(range(self.world_size)),)
        return self.node_layout.nodes

    @property
    def node_rank(self) -> int:
        """Index of this rank's node in :attr:`nodes`."""
        return next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def sp_ranks_per_node(self) -> int:
        """The fewest ranks of an SP group that share a node (``sp_size`` when node-local);
        what :meth:`dspzoo.core.costmodel.cluster.Cluster.placed` prices the SP link with."""
        if self.node_layout is None:
            return self.sp_size
        blocks = [range(d * self.sp_size, (d + 1) * self.sp_size) for d in range(self.dp_size)]
        return min(self.node_layout.ranks_per_node_of(list(b)) for b in blocks)

    @property
    def sp_nodes_spanned(self) -> int:
        """The most nodes one SP group spans (1 when node-local); what
        :meth:`~dspzoo.core.costmodel.cluster.Cluster.placed` counts a collective's
        inter-node ring steps with."""
        if self.node_layout is None:
            return 1
        node_of = self.node_layout.node_of
        blocks = [range(d * self.sp_size, (d + 1) * self.sp_size) for d in range(self.dp_size)]
        return max(len({node_of(r) for r in b}) for b in blocks)

    def describe_topology(self) -> str:
        """One line for a run's start-up summary: nodes, and where the SP and DP groups lie."""
        nodes = self.nodes
        where = "one node" if len(nodes) == 1 else f"{len(nodes)} nodes"
        layout = self.node_layout.describe() if self.node_layout else "1 node (single process)"
        sp = "node-local" if self.sp_is_node_local else "ACROSS NODES"
        if self.dp_size == 1:
            dp = "none (dp 1)"
        else:
            dp = "across nodes" if len(nodes) > 1 else f"on {where}"
        node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}
        groups = [
            f"{list(block)} on node{'s' if len({node_of[r] for r in block}) > 1 else ''} "
            + "+".join(str(n) for n in sorted({node_of[r] for r in block}))
            for block in (
                range(d * self.sp_size, (d + 1) * self.sp_size) for d in range(self.dp_size)
            )
        ]
        shown = ", ".join(groups[:8]) + (f", … ({len(groups)} groups)" if len(groups) > 8 else "")
        return (
            f"mesh dp {self.dp_size} × sp {self.sp_size} on {layout}; SP groups {sp} "
            f"({shown}), DP groups {dp}"
        )

    @property
    def ring_size(self) -> int:
        """Ranks of the ring axis of the SP group (USP)."""
        return self.sp_size // self.ulysses_size

    @property
    def sp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's SP group."""
        start = self.dp_rank * self.sp_size
        return tuple(range(start, start + self.sp_size))

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (for logging and saving)."""
        return self.rank == 0

    def __str__(self) -> str:
        return (
            f"SPMesh(world={self.world_size}, dp={self.dp_size}, sp={self.sp_size}, "
            f"rank={self.rank} -> dp_rank={self.dp_rank}, sp_rank={self.sp_rank})"
        )


def single_process_mesh() -> SPMesh:
    """The trivial mesh of a job without ``torch.distributed``."""
    return SPMesh(world_size=1, rank=0, dp_size=1, sp_size=1, dp_rank=0, sp_rank=0)


DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def collective_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``DSPZOO_COLLECTIVE_TIMEOUT`` (seconds), else 300."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("DSPZOO_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    return float(timeout_s)


def build_mesh(
    sp_size: int,
    accelerator: Accelerator | None = None,
    *,
    ulysses_size: int | None = None,
    timeout_s: float | None = None,
    sp_across_nodes: bool | None = None,
) -> SPMesh:
    """Build the dp × sp mesh over the current world on a ``DeviceMesh``.

    Args:
        sp_size: ranks per sequence-parallel group; must divide the world size.
        accelerator: optional ``accelerate.Accelerator``; only used to make sure the process
            group is initialised (Accelerate does that on construction).
        ulysses_size: for USP, the Ulysses degree inside the SP group (must divide
            ``sp_size``); the SP axis becomes a ``ring × ulysses`` sub-mesh.
        timeout_s: how long a collective of the mesh's groups waits for a missing peer before
            it raises (default ``DSPZOO_COLLECTIVE_TIMEOUT`` or 300 s); the error names the
            primitive and comm region.
        sp_across_nodes: allow SP groups that span nodes (default: the
            ``DSPZOO_SP_ACROSS_NODES`` environment variable, else ``False``: such a layout
            raises ``ValueError`` on every rank, naming the cause and the sp sizes that fit).

    Must be called on every rank, in the same order, since it creates process groups.
    """
    if accelerator is not None:
        _ = accelerator.state  # Accelerator() has initialised torch.distributed when launched
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    if ulysses_size is not None and (
        not isinstance(ulysses_size, int) or ulysses_size < 1 or sp_size % ulysses_size
    ):
        raise ValueError(
            f"ulysses_size={ulysses_size!r} must be a positive divisor of sp_size={sp_size}; "
            f"choose among {[d for d in range(1, sp_size + 1) if sp_size % d == 0]}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        if sp_size != 1:
            raise ValueError(
                f"sp_size={sp_size} needs torch.distributed: launch with "
                f"`accelerate launch --multi_gpu --num_processes {sp_size} ...` or `torchrun "
                f"--nproc_per_node {sp_size} ...` (got a single process), or pass --sp 1 to "
                "run on this one process"
            )
        return single_process_mesh()
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size != 0:
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world}; choose an sp size among "
            f"{[d for d in range(1, world + 1) if world % d == 0]}"
        )
    dp_size = world // sp_size
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ulysses = ulysses_size or 1
    if ulysses_size is None:
        mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    else:
        mesh = init_device_mesh(
            device_type,
            (dp_size, sp_size // ulysses, ulysses),
            mesh_dim_names=("dp", "ring", "ulysses"),
        )
        mesh["ring", "ulysses"]._flatten("sp")
    # after the DeviceMesh, which selects this process's GPU (the gather's device under NCCL)
    # every rank's record, validated after the gather so that every rank raises the same error
    places = gather_places(sp_across_nodes)
    layout = node_layout(places)
    node_local = check_sp_placement(layout, sp_size, across_nodes=agreed_sp_across_nodes(places))
    if not node_local and rank == 0:
        warnings.warn(sp_placement_warning(layout, sp_size), RuntimeWarning, stacklevel=2)
    sp_blocks = [list(range(d * sp_size, (d + 1) * sp_size)) for d in range(dp_size)]
    dp_blocks = [list(range(s, world, sp_size)) for s in range(sp_size)]
    ulysses_blocks = [b[i : i + ulysses] for b in sp_blocks for i in range(0, sp_size, ulysses)]
    ring_blocks = [b[u::ulysses] for b in sp_blocks for u in range(ulysses)]
    use_usp = ulysses_size is not None
    timeout = collective_timeout_s(timeout_s)
    release_communicators_at_exit()
    return SPMesh(
        world_size=world,
        rank=rank,
        dp_size=dp_size,
        sp_size=sp_size,
        dp_rank=rank // sp_size,
        sp_rank=rank % sp_size,
        sp_group=own_group(sp_blocks, timeout) if sp_size > 1 else None,
        dp_group=own_group(dp_blocks, timeout) if dp_size > 1 else None,
        device_mesh=mesh,
        ulysses_size=ulysses,
        ulysses_group=own_group(ulysses_blocks, timeout) if use_usp and ulysses > 1 else None,
        ring_group=(
            own_group(ring_blocks, timeout) if use_usp and sp_size // ulysses > 1 else None
        ),
        grad_group=own_group([list(range(world))], timeout),
        node_layout=layout,
        sp_is_node_local=node_local,
    )


def gather_places(sp_across_nodes: bool | None = None) -> list[RankPlace]:
    """Every rank's :class:`RankPlace` (launcher environment, host name, code fingerprint,
    its SP-across-nodes setting), all-gathered on the default group (collective: call on
    every rank). Nothing is validated before the gather: :func:`node_layout` and
    :func:`agreed_sp_across_nodes` check the records on every rank alike."""
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, this_place(dist.get_rank(), sp_across_nodes=sp_across_nodes))
    return places


def gather_node_layout() -> NodeLayout:
    """The job's :class:`NodeLayout` from :func:`gather_places` (collective)."""
    return node_layout(gather_places())


def own_group(blocks: list[list[int]], timeout_s: float | None = None) -> Any:
    """This rank's group among ``blocks`` (disjoint rank lists covering the world), each block
    on a new communicator of its own, never the default group's (even for all ranks).

    Where the job's backend moves no CPU tensors (NCCL alone), each block also gets a gloo
    group beside it, registered as its control side group: the collectives' agreements (a few
    words on the host) travel there, never on the NCCL communicator
    (:func:`dspzoo.core.parallel.comm.register_control_group`).

    Collective over the world: every rank must call it with the same blocks, in the same order.
    ``timeout_s``: the groups' collective timeout (default: the collective timeout setting).
    """
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=collective_timeout_s(timeout_s))
    side = not moves_cpu_tensors(str(dist.get_backend()))
    mine = control = None
    for block in blocks:
        group = dist.new_group(block, timeout=timeout)
        beside = dist.new_group(block, timeout=timeout, backend="gloo") if side else None
        if rank in block:
            mine, control = group, beside
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {blocks}")
    if control is not None:
        register_control_group(mine, control)
    return mine


def mix_dp_rank(seed: int, dp_rank: int) -> int:
    """``seed`` combined with a DP rank: equal for equal ranks, distinct across DP groups."""
    return (seed * 1_000_003 + dp_rank * 7_919) % (2**63 - 1)


def dp_seed(mesh: SPMesh, seed: int) -> int:
    """A seed identical inside an SP group and different across DP groups."""
    return mix_dp_rank(seed, mesh.dp_rank)


def seed_everything(mesh: SPMesh, seed: int) -> int:
    """Seed python, numpy and torch so RNG is identical inside an SP group, distinct across DP.

    Diffusion noise, timesteps, dropout masks and augmentation drawn from the global RNGs are
    then the same on every rank of an SP group, as the replicated parts of a model require.
    Returns the seed used on this rank.

    ``PYTHONHASHSEED`` is deliberately not set: Python reads it once at interpreter start-up,
    so setting it here would change nothing in this process (only leak into children). For
    reproducible ``str`` hashing (set iteration order), export it before launching, e.g.
    ``PYTHONHASHSEED=0 accelerate launch ...``; dspzoo itself does not depend on it.
    """
    value = dp_seed(mesh, seed)
    random.seed(value)
    np.random.seed(value % (2**32))
    torch.manual_seed(value)
    return value


def sp_generator(mesh: SPMesh, seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` identical across the SP group and distinct across DP groups."""
    gen = torch.Generator(device=device)
    gen.manual_seed(dp_seed(mesh, seed))
    return gen
