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
import pkgutil as _pkgutil
import sys as _sys
import types as _types

from .data import sp_dataloader
from .loss import sp_mean, sp_mse, sp_report
from .parallel.comm import gather, gather_for_local_use, set_debug, split, switch, switch_async
from .parallel.layout import SeqSpec, shard_sizes
from .parallel.mesh import SPMesh, build_mesh, seed_everything, single_process_mesh, sp_generator
from .parallel.plan import Plan, Stage, plan_stages
from .parallel.runtime import SeqParallel, SeqTensor
from .parallel.sharded_rng import ShardBlock, shard_block, sharded_dropout, sharded_uniform
from .parallel.trace import SavedTensorMeter, comm_region, trace_comm

# the parallel layer's old module paths (dspzoo.core.runtime, …) name the moved modules
for _name in (
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
):
    _module = _importlib.import_module(f".parallel.{_name}", __name__)
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)
    globals().setdefault(_name, _module)
    for _sub in _pkgutil.iter_modules(getattr(_module, "__path__", [])):
        _full = _importlib.import_module(f".parallel.{_name}.{_sub.name}", __name__)
        _sys.modules.setdefault(f"{__name__}.{_name}.{_sub.name}", _full)


class _MovedModules(_importlib.abc.MetaPathFinder, _importlib.abc.Loader):
    """Old paths of the training harness's modules (``dspzoo.core.loop``, …) import the moved
    module itself, lazily (importing :mod:`dspzoo.core` does not import the Trainer)."""

    MOVED = {
        "checkpoint": "train.checkpoint",
        "configflags": "train.flags",
        "ema": "train.ema",
        "loop": "train.loop",
        "resume": "train.resume",
        "runconfig": "train.config",
        "tensor_parallel_training": "train.tensor_parallel",
    }

    def __init__(self) -> None:
        self._own_specs: dict[str, _importlib.machinery.ModuleSpec] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> _importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in self.MOVED:
            return None
        return _importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: _importlib.machinery.ModuleSpec) -> _types.ModuleType:
        module = _importlib.import_module(f"{__name__}.{self.MOVED[spec.name.rpartition('.')[2]]}")
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: _types.ModuleType) -> None:
        """The moved module ran in :meth:`create_module`; give it back its own spec (the import
        system stamps the alias's spec on whatever :meth:`create_module` returned)."""
        module.__spec__ = self._own_specs[module.__name__]


if not any(isinstance(_f, _MovedModules) for _f in _sys.meta_path):
    _sys.meta_path.append(_MovedModules())

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
