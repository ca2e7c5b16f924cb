"""One mesh per SP layout, built once and shared by every strategy of a run.

Building a mesh creates process groups (collective on every rank, and they live until the
process group is destroyed), so the benchmark builds each layout it needs exactly once: the
plain ``dp × sp`` mesh that every strategy but USP runs on, and, when USP runs, the
``dp × ring × ulysses`` mesh with USP's Ulysses degree.
"""

from __future__ import annotations

from typing import Any

from ..parallel.mesh import SPMesh

# methods that run on a ring × ulysses sub-mesh (the registry has no attribute for it yet)
SUB_MESH_METHODS = frozenset({"usp"})


def ulysses_size_for(strategy: str, sp_size: int) -> int | None:
    """USP's Ulysses degree at ``sp_size`` (the default, as ``setup_accelerate`` picks it);
    ``None`` for a strategy that runs on the plain mesh."""
    from ..accelerate import default_ulysses_size

    return default_ulysses_size(sp_size) if strategy in SUB_MESH_METHODS else None


class MeshCache:
    """Meshes keyed by layout ``(sp_size, ulysses_size)``, built on first use.

    Every rank must ask for the same layouts in the same order (building is collective);
    the benchmark does, since all ranks run the same strategy list.
    """

    def __init__(self, accelerator: Any = None, built: tuple[SPMesh, ...] = ()) -> None:
        """``built``: meshes the caller already has (e.g. the world mesh of SP 1), reused."""
        self.accelerator = accelerator
        self._meshes: dict[tuple[int, int | None], SPMesh] = {}
        for mesh in built:
            ulysses = mesh.ulysses_size if mesh.ulysses_group is not None else None
            self._meshes[(mesh.sp_size, ulysses)] = mesh

    def get(self, sp_size: int, ulysses_size: int | None = None) -> SPMesh:
        """The mesh of ``sp_size`` ranks per SP group (``ulysses_size``: USP's sub-mesh)."""
        from ..parallel.mesh import build_mesh

        key = (sp_size, ulysses_size)
        if key not in self._meshes:
            self._meshes[key] = build_mesh(sp_size, self.accelerator, ulysses_size=ulysses_size)
        return self._meshes[key]

    def for_strategy(self, strategy: str, sp_size: int) -> SPMesh:
        """The mesh ``strategy`` runs on: USP's ``ring × ulysses`` layout, else the plain one."""
        return self.get(sp_size, ulysses_size_for(strategy, sp_size))

    def __len__(self) -> int:
        return len(self._meshes)
