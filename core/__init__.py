"""dspzoo.core: everything below the zoo, in folders that show the architecture.

=============  ====================================================================================
``parallel/``  the DSP layer: mesh, collectives, layouts, the planner, the runtime, the method
               registry and strategies, keyed randomness, tracing
``layers/``    attention, MLP, modulation and embedding layers (CPU kernels; GPU ones when present)
``train/``     the Trainer and the domain Task protocol, checkpoints, resume, EMA
``costmodel/`` byte / FLOP / memory formulas read from the method registry, clusters, prediction
``bench/``     the one benchmark (every strategy and a DeepSpeed peer on the same weights)
``harness``    the public equivalence harness for new architectures
=============  ====================================================================================

Knows nothing about any domain. The paper's four-function API is :func:`sp_dataloader`,
:func:`split`, :func:`gather` and :func:`switch`; :class:`SeqParallel` adds named dims, plans
and strategies on top. The parallel layer's modules moved into ``parallel/`` and the training
harness's into ``train/``; their old paths (``dspzoo.core.plan``, ``dspzoo.core.runtime``,
``dspzoo.core.loop``, ``dspzoo.core.configflags``, …) are aliases of the moved modules.
"""

import importlib as _importlib
import importlib.abc  # noqa: F401  (the finder below)
import importlib.machinery  # noqa: F401
import sys as _sys
import types as _types
from typing import Any as _Any

#: the public API, by the module that defines it: imported on first use (``dspzoo --help``
#: imports :mod:`dspzoo.core.argparser`, and with it this package, but not torch)
_API = {
    "sp_dataloader": ".data",
    **dict.fromkeys(("sp_mean", "sp_mse", "sp_report"), ".loss"),
    **dict.fromkeys(
        ("gather", "gather_for_local_use", "set_debug", "split", "switch", "switch_async"),
        ".parallel.comm",
    ),
    **dict.fromkeys(("SeqSpec", "shard_sizes"), ".parallel.layout"),
    **dict.fromkeys(
        ("SPMesh", "build_mesh", "seed_everything", "single_process_mesh", "sp_generator"),
        ".parallel.mesh",
    ),
    **dict.fromkeys(("Plan", "Stage", "plan_stages"), ".parallel.plan"),
    **dict.fromkeys(("SeqParallel", "SeqTensor"), ".parallel.runtime"),
    **dict.fromkeys(
        ("ShardBlock", "shard_block", "sharded_dropout", "sharded_uniform"), ".parallel.sharded_rng"
    ),
    **dict.fromkeys(("SavedTensorMeter", "comm_region", "trace_comm"), ".parallel.trace"),
}

#: the parallel layer's old module paths (``dspzoo.core.runtime``, ``dspzoo.core.comm.exchange``,
#: …) name the moved modules of ``parallel/``
_PARALLEL = (
    "comm",
    "context",
    "layout",
    "mesh",
    "methods",
    "multiplan",
    "plan",
    "planner",
    "rng",
    "runtime",
    "sharded_rng",
    "strategies",
    "trace",
    "validate",
)


def __getattr__(name: str) -> _Any:
    """The public API and the old module paths, imported on first use."""
    if name in _API:
        value = getattr(_importlib.import_module(_API[name], __name__), name)
        globals()[name] = value
        return value
    if name in _PARALLEL or name in _MovedModules.MOVED:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API, *_PARALLEL})


class _MovedModules(_importlib.abc.MetaPathFinder, _importlib.abc.Loader):
    """Old paths of moved modules import the moved module itself, lazily: the training
    harness's (``dspzoo.core.loop``, …: importing :mod:`dspzoo.core` does not import the
    Trainer) and the parallel layer's, submodules included (``dspzoo.core.comm.exchange`` is
    ``dspzoo.core.parallel.comm.exchange``)."""

    MOVED = {
        "checkpoint": "train.checkpoint",
        "configflags": "train.flags",
        "ema": "train.ema",
        "loop": "train.loop",
        "resume": "train.resume",
        "runconfig": "train.config",
        "tensor_parallel_training": "train.tensor_parallel",
        **{name: f"parallel.{name}" for name in _PARALLEL},
    }

    def __init__(self) -> None:
        self._own_specs: dict[str, _importlib.machinery.ModuleSpec] = {}

    def _target(self, fullname: str) -> str | None:
        """The moved module that the old path ``fullname`` names, or ``None``."""
        prefix = f"{__name__}."
        if not fullname.startswith(prefix):
            return None
        first, dot, rest = fullname[len(prefix) :].partition(".")
        if first not in self.MOVED or (dot and first not in _PARALLEL):
            return None
        return f"{__name__}.{self.MOVED[first]}{dot}{rest}"

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> _importlib.machinery.ModuleSpec | None:
        if self._target(fullname) is None:
            return None
        return _importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: _importlib.machinery.ModuleSpec) -> _types.ModuleType:
        module = _importlib.import_module(self._target(spec.name))  # type: ignore[arg-type]
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: _types.ModuleType) -> None:
        """The moved module ran in :meth:`create_module`; give it back its own spec (the import
        system stamps the alias's spec on whatever :meth:`create_module` returned)."""
        module.__spec__ = self._own_specs[module.__name__]


if not any(isinstance(_f, _MovedModules) for _f in _sys.meta_path):
    # first: an old submodule path (dspzoo.core.comm.exchange) must not be found as a file of the
    # moved package's folder and run a second time under the old name
    _sys.meta_path.insert(0, _MovedModules())

__all__ = [
    "Plan",
    "SPMesh",
    "SavedTensorMeter",
    "SeqParallel",
    "SeqSpec",
    "SeqTensor",
    "ShardBlock",
    "Stage",
    "build_mesh",
    "comm_region",
    "gather",
    "gather_for_local_use",
    "plan_stages",
    "seed_everything",
    "set_debug",
    "shard_block",
    "shard_sizes",
    "sharded_dropout",
    "sharded_uniform",
    "single_process_mesh",
    "sp_dataloader",
    "sp_generator",
    "sp_mean",
    "sp_mse",
    "sp_report",
    "split",
    "switch",
    "switch_async",
    "trace_comm",
]
