"""Count the reads of data-path tensors back to the host during a step (a test and audit tool).

On a CUDA device every read of a tensor's values by the host — ``.item()``, ``bool(t)``,
``.tolist()``, ``.numpy()``, ``.cpu()``, and the ops whose output shape depends on the data
(``nonzero``, ``masked_select``, ``unique``, …) — waits for the GPU to finish everything queued
before it. The library's hot path must make none. On a CPU machine nothing distinguishes the
device from the host, so :class:`DataReads` tells them apart by *taint*: the tensors given to it
(the model's parameters and inputs) are data, and so is every tensor an op computes from data;
tensors the host builds from nothing (``arange`` positions, an agreement's words, an index
order) are host bookkeeping. A read of a data tensor is what would stall a GPU, on any device.

::

    with DataReads(model.parameters(), x) as reads:
        loss = model(x, sp=sp).sum()
        loss.backward()
    assert reads.count == 0, reads.where

Inside the block :func:`values_readable` answers as on a GPU, so input checks that read values
only where that costs nothing (CPU tensors) are skipped as they would be on a device.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

#: ops whose result the host must wait for: a scalar read or a data-dependent output shape
SYNCING_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.equal.default,
    aten.bincount.default,
    aten.histc.default,
}

#: ops that take a tensor only for its dtype and device: their output holds no data of it
FACTORY_LIKE = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
                "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                "randn_like", "randint_like"}  # fmt: skip

#: methods that copy a tensor's values to Python or to the host without dispatching an op
HOST_METHODS = ("tolist", "numpy", "cpu", "__array__")


_DEVICE_LIKE = [0]  # > 0 inside a DataReads block: host-only checks behave as on a GPU


def values_readable(t: torch.Tensor) -> bool:
    """Whether a model may read ``t``'s values for an input check without stalling a device:
    ``t`` lives on the CPU (and no :class:`DataReads` block simulates a device).

    On a GPU a value check (token ids in range, a mask's content) makes the host wait for
    every kernel queued before it; models skip such checks there (out-of-range ids then fail
    in the embedding's own device-side check) and run them on CPU tensors.
    """
    return t.device.type == "cpu" and _DEVICE_LIKE[0] == 0


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
        return None
    return storage if storage.data_ptr() else None  # empty storages share address 0


class DataReads(TorchDispatchMode):
    """Count host reads of data-path tensors inside the block (see the module docstring).

    ``count`` is the number of reads; ``where`` one line per read (the op, and the innermost
    frame outside torch that made it).
    """

    def __init__(self, *data: torch.Tensor | Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.tainted: set[int] = set()
        for item in data:
            for t in [item] if isinstance(item, torch.Tensor) else item:
                self._taint(t)
        self.where: list[str] = []
        self._patched: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return len(self.where)

    def _taint(self, t: torch.Tensor) -> None:
        storage = _storage(t)
        if storage is None or storage.data_ptr() in self.tainted:
            return
        key = storage.data_ptr()
        self.tainted.add(key)
        weakref.finalize(storage, self.tainted.discard, key)  # an address freed is no data

    def is_data(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        return storage is not None and storage.data_ptr() in self.tainted

    def _read(self, what: str) -> None:
        frame = next(
            (
                f"{f.filename}:{f.lineno} {f.name}"
                for f in reversed(traceback.extract_stack()[:-2])
                if "/torch/" not in f.filename and "host_reads" not in f.filename
            ),
            "?",
        )
        self.where.append(f"{what} at {frame}")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        data_in = any(self.is_data(t) for t in inputs) and (
            func._opname.rstrip("_") not in FACTORY_LIKE
        )
        bool_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
        bool_index = bool_index and any(
            t is not None and t.dtype in (torch.bool, torch.uint8)
            for t in tree_leaves(args[1:2])
            if isinstance(t, torch.Tensor)
        )
        if data_in and (func in SYNCING_OPS or bool_index):
            self._read(str(func))
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d":  # collectives write into their tensor arguments
            outputs += inputs
        for i, arg in enumerate(func._schema.arguments):  # in-place and out= arguments
            written = arg.alias_info is not None and arg.alias_info.is_write
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if written:
                outputs += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if data_in:
            for t in outputs:
                self._taint(t)
        return out

    def __enter__(self) -> DataReads:
        _DEVICE_LIKE[0] += 1
        for name in HOST_METHODS:
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def reading(
                t: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any
            ) -> Any:
                if self.is_data(t):
                    self._read(f"Tensor.{_name}")
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, reading)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _DEVICE_LIKE[0] -= 1
            for name, original in self._patched.items():
                setattr(torch.Tensor, name, original)
            self._patched.clear()
