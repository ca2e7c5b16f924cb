"""Which processes share a machine, learnt from the launcher, and where the SP groups fall.

Every launcher of a multi-machine job tells each process its machine ("node"):

* ``torchrun`` (and ``accelerate launch``, which runs torchrun's agent) sets ``GROUP_RANK``
  (the node's index, ``--node_rank``), ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (processes on
  this node, ``--nproc_per_node``);
* launchers in the Lightning style set ``NODE_RANK``; SLURM's ``srun`` sets ``SLURM_NODEID``.

The first of :data:`NODE_ENV_VARS` that is set names the node; without any, the host name
does. The processes all-gather what they see (:class:`RankPlace`) and
:func:`node_layout` turns the records into a :class:`NodeLayout`, checking that they agree:
ranks one launcher puts on one node run on one host, and each node has as many processes as
its ``LOCAL_WORLD_SIZE`` says, and every process runs the same code (:func:`code_fingerprint`: a
hash of dspzoo's sources and the torch version). Several nodes on one host are allowed (two launchers on one
machine simulate a 2-node job, as ``tests/test_multinode.py`` does).

SP groups are blocks of ``sp`` consecutive ranks (:mod:`dspzoo.core.parallel.mesh`).
:func:`check_sp_placement` says whether each lies on one node (its all-to-alls then stay on the
intra-node link, DP's gradient all-reduce crosses nodes) and raises a clear error when one does
not, unless SP across nodes is asked for (``DSPZOO_SP_ACROSS_NODES=1`` or
``build_mesh(..., sp_across_nodes=True)``, agreed by every rank: :func:`agreed_sp_across_nodes`).
Reading a record never raises (what a rank cannot read travels in the record); everything
after the gather is a pure function of the records, so every rank reaches the same verdict and
raises the same error.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

NODE_ENV_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
SP_ACROSS_NODES_ENV = "DSPZOO_SP_ACROSS_NODES"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class RankPlace:
    """What one process knows about its machine.

    Attributes:
        rank: global rank.
        host: ``socket.gethostname()``.
        node_var: the variable that named the node (one of :data:`NODE_ENV_VARS`), or ``None``.
        node_id: its value (``None`` without one).
        local_rank, local_world_size: ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` when set.
        code: :func:`code_fingerprint` (``""``: not compared).
        sp_across_nodes: this rank's SP-across-nodes setting as given: ``"True"``/``"False"``
            from ``build_mesh(sp_across_nodes=...)``, else the raw ``DSPZOO_SP_ACROSS_NODES``
            value (parsed after the gather, :func:`agreed_sp_across_nodes`).
        problem: what this rank could not read (a malformed variable, unreadable sources);
            :func:`node_layout` raises it on every rank after the gather.
    """

    rank: int
    host: str
    node_var: str | None = None
    node_id: str | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    code: str = ""
    sp_across_nodes: str = ""
    problem: str = ""


@functools.cache
def code_fingerprint() -> str:
    """``"dspzoo <hash>, torch <version>"``: a SHA-256 (12 hex digits) of dspzoo's Python
    sources (``core``, ``domains``, ``zoo``, the package ``__init__``) and torch's version.

    Machines whose checkouts or installs differ compute different fingerprints; the mesh then
    refuses to start instead of training with ranks that disagree on the model or the plan.
    """
    import torch

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    files = [root / "__init__.py"] + [
        path for sub in ("core", "domains", "zoo") for path in sorted((root / sub).rglob("*.py"))
    ]
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return f"dspzoo {digest.hexdigest()[:12]}, torch {torch.__version__}"


def _int_or_none(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer") from None


def this_place(
    rank: int, environ: Mapping[str, str] | None = None, *, sp_across_nodes: bool | None = None
) -> RankPlace:
    """This process's :class:`RankPlace` from ``environ`` (default ``os.environ``), its
    :func:`code_fingerprint` and its SP-across-nodes setting (``sp_across_nodes`` when given,
    else ``DSPZOO_SP_ACROSS_NODES``).

    Never raises: it runs before the all-gather, where an error on one rank would leave the
    others waiting; what it cannot read goes into ``problem``, raised by :func:`node_layout`
    on every rank.
    """
    env = os.environ if environ is None else environ
    node_var = next((v for v in NODE_ENV_VARS if env.get(v, "") != ""), None)
    problems: list[str] = []

    def read_int(name: str) -> int | None:
        try:
            return _int_or_none(env, name)
        except ValueError as exc:
            problems.append(str(exc))
            return None

    local_rank, local_world_size = read_int("LOCAL_RANK"), read_int("LOCAL_WORLD_SIZE")
    try:
        code = code_fingerprint()
    except OSError as exc:
        problems.append(f"cannot read dspzoo's sources for the code check: {exc}")
        code = ""
    across = (
        str(sp_across_nodes) if sp_across_nodes is not None else env.get(SP_ACROSS_NODES_ENV, "")
    )
    return RankPlace(
        rank=rank,
        host=socket.gethostname(),
        node_var=node_var,
        node_id=env[node_var] if node_var else None,
        local_rank=local_rank,
        local_world_size=local_world_size,
        code=code,
        sp_across_nodes=across,
        problem="; ".join(problems),
    )


@dataclass(frozen=True)
class NodeLayout:
    """The job's nodes.

    Attributes:
        nodes: global ranks of each node, nodes ordered by their lowest rank.
        hosts: host name of each node.
        source: what identified the nodes: a variable of :data:`NODE_ENV_VARS` or ``"hostname"``.
    """

    nodes: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]
    source: str

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Processes per node."""
        return tuple(len(n) for n in self.nodes)

    @functools.cached_property
    def _node_index(self) -> dict[int, int]:
        return {rank: index for index, ranks in enumerate(self.nodes) for rank in ranks}

    def node_of(self, rank: int) -> int:
        """Index of the node running ``rank``."""
        if rank not in self._node_index:
            raise ValueError(f"rank {rank} is on none of the nodes {self.nodes}")
        return self._node_index[rank]

    def ranks_per_node_of(self, block: Sequence[int]) -> int:
        """The fewest ranks of ``block`` that share a node with one of its ranks."""
        counts = Counter(self.node_of(r) for r in block)
        return min(counts.values())

    def describe(self) -> str:
        sizes = set(self.sizes)
        shape = (
            f"{len(self.nodes)} node(s) × {self.sizes[0]} process"
            + ("" if self.sizes[0] == 1 else "es")
            if len(sizes) == 1
            else f"{len(self.nodes)} nodes of {list(self.sizes)} processes"
        )
        hosts = sorted(set(self.hosts))
        where = "one host" if len(hosts) == 1 else f"{len(hosts)} hosts"
        return f"{shape} (nodes from {self.source}, on {where}: {', '.join(hosts)})"


def node_layout(places: Sequence[RankPlace]) -> NodeLayout:
    """The :class:`NodeLayout` of every rank's :class:`RankPlace` (module docstring).

    Raises ``ValueError`` naming the ranks and variables when the records disagree.
    """
    places = sorted(places, key=lambda p: p.rank)
    ranks = [p.rank for p in places]
    if ranks != list(range(len(places))):
        raise ValueError(
            f"node layout: expected one record per rank 0..{len(places) - 1}, got {ranks}"
        )
    troubled = [p for p in places if p.problem]
    if troubled:
        raise ValueError(
            "some processes could not read their launcher environment: "
            + "; ".join(f"rank {p.rank} (host {p.host}): {p.problem}" for p in troubled)
            + ". Fix the variables the launcher (or the job script) sets on those machines"
        )
    codes = {p.code for p in places if p.code}
    if len(codes) > 1:
        runs = {c: [(p.rank, p.host) for p in places if p.code == c] for c in sorted(codes)}
        raise ValueError(
            "the processes run different code: "
            + "; ".join(
                f"{code} on rank(s) {[r for r, _ in who]} (host(s) {sorted({h for _, h in who})})"
                for code, who in runs.items()
            )
            + ". Install the same dspzoo commit and torch version on every machine"
        )
    variables = {p.node_var for p in places}
    if len(variables) > 1:
        by_var = {v: [p.rank for p in places if p.node_var == v] for v in variables}
        raise ValueError(
            "the launchers disagree on how they name nodes: "
            + "; ".join(f"{v or 'no node variable'} on ranks {r}" for v, r in by_var.items())
            + ". Launch every machine with the same launcher (torchrun, accelerate launch or srun)"
        )
    (variable,) = variables
    source = variable or "hostname"
    keys: dict[str, list[RankPlace]] = {}
    for p in places:
        keys.setdefault(p.node_id if variable else p.host, []).append(p)
    groups = sorted(keys.items(), key=lambda kv: kv[1][0].rank)
    for key, members in groups:
        hosts = sorted({p.host for p in members})
        if len(hosts) > 1:
            raise ValueError(
                f"{source}={key} puts ranks {[p.rank for p in members]} on one node, but they run "
                f"on hosts {hosts}: give each machine its own node rank (torchrun --node_rank, "
                f"accelerate launch --machine_rank)"
            )
        declared = {p.local_world_size for p in members if p.local_world_size is not None}
        if declared and declared != {len(members)}:
            raise ValueError(
                f"node {source}={key} runs {len(members)} processes (ranks "
                f"{[p.rank for p in members]}) but LOCAL_WORLD_SIZE says {sorted(declared)}: "
                f"two launchers were given the same node rank; give each machine its own "
                f"(--node_rank / --machine_rank 0 .. nodes − 1)"
            )
        local = sorted(p.local_rank for p in members if p.local_rank is not None)
        if local and local != list(range(len(members))):
            raise ValueError(
                f"node {source}={key}: LOCAL_RANK values {local} are not 0..{len(members) - 1}; "
                f"two launchers were given the same node rank"
            )
    return NodeLayout(
        nodes=tuple(tuple(p.rank for p in members) for _, members in groups),
        hosts=tuple(members[0].host for _, members in groups),
        source=source,
    )


def sp_blocks(world_size: int, sp_size: int) -> list[list[int]]:
    """The SP groups of the mesh: blocks of ``sp_size`` consecutive ranks."""
    return [list(range(d * sp_size, (d + 1) * sp_size)) for d in range(world_size // sp_size)]


def sp_across_nodes_requested(environ: Mapping[str, str] | None = None) -> bool:
    """``DSPZOO_SP_ACROSS_NODES`` read as a boolean (unset: ``False``)."""
    env = os.environ if environ is None else environ
    value = env.get(SP_ACROSS_NODES_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{SP_ACROSS_NODES_ENV}={value!r}: expected one of {list(_TRUE + _FALSE[1:])}")


def agreed_sp_across_nodes(places: Sequence[RankPlace]) -> bool:
    """The job's SP-across-nodes setting from every rank's record: each parsed as
    :func:`sp_across_nodes_requested` does; ``ValueError`` (the same on every rank) naming the
    ranks when a value is malformed or the ranks disagree (e.g. the variable exported on one
    machine only)."""
    parsed: dict[int, bool] = {}
    bad: list[str] = []
    for p in places:
        try:
            parsed[p.rank] = sp_across_nodes_requested({SP_ACROSS_NODES_ENV: p.sp_across_nodes})
        except ValueError as exc:
            bad.append(f"rank {p.rank} (host {p.host}): {exc}")
    if bad:
        raise ValueError("; ".join(bad))
    values = set(parsed.values())
    if len(values) > 1:
        on = [r for r, v in parsed.items() if v]
        off = [r for r, v in parsed.items() if not v]
        raise ValueError(
            f"the processes disagree on SP across nodes: ranks {on} allow it, ranks {off} do "
            f"not; set {SP_ACROSS_NODES_ENV} the same on every machine (or pass the same "
            f"build_mesh(sp_across_nodes=...) everywhere)"
        )
    return values.pop() if values else False


def _why_not_local(layout: NodeLayout, sp_size: int) -> str:
    sizes = layout.sizes
    if len(set(sizes)) > 1:
        return (
            f"the nodes run different numbers of processes {list(sizes)}; launch the same "
            f"--nproc_per_node (--num_processes / --num_machines) on every machine"
        )
    per_node = sizes[0]
    if sp_size > per_node:
        return f"sp={sp_size} is larger than the {per_node} processes of a node"
    if per_node % sp_size:
        return f"sp={sp_size} does not divide the {per_node} processes of a node"
    return (
        f"the ranks of a node are not consecutive ({[list(n) for n in layout.nodes]}); "
        f"the launcher numbered them across machines"
    )


def check_sp_placement(layout: NodeLayout, sp_size: int, *, across_nodes: bool = False) -> bool:
    """``True`` when every SP group (:func:`sp_blocks`) lies on one node.

    When one does not: ``False`` if ``across_nodes`` (the caller warns), else ``ValueError``
    saying why (uneven nodes, sp larger than or not dividing the processes per node) and how
    to fix it (an sp size that fits, or SP across nodes on purpose).
    """
    blocks = sp_blocks(layout.world_size, sp_size)
    spanning = [b for b in blocks if len({layout.node_of(r) for r in b}) > 1]
    if not spanning:
        return True
    if across_nodes:
        return False
    fitting = math.gcd(*layout.sizes)
    choices = [d for d in range(1, fitting + 1) if fitting % d == 0]
    block = spanning[0]
    raise ValueError(
        f"SP groups must lie inside one node, but SP group {block} spans nodes "
        f"{sorted({layout.node_of(r) for r in block})} of {layout.describe()}: "
        f"{_why_not_local(layout, sp_size)}. Choose --sp among {choices} (SP inside a node, "
        f"DP across nodes), or set {SP_ACROSS_NODES_ENV}=1 to run SP across nodes on purpose "
        f"(its all-to-alls then cross the inter-node link, every layer)"
    )


def sp_placement_warning(layout: NodeLayout, sp_size: int) -> str:
    """The warning for a job that runs SP across nodes on purpose."""
    return (
        f"SP groups of sp={sp_size} span nodes of {layout.describe()} ({SP_ACROSS_NODES_ENV}=1): "
        f"{_why_not_local(layout, sp_size)}. Every SP all-to-all crosses the inter-node link; "
        f"the cost model prices it so (Cluster.placed(mesh))"
    )
