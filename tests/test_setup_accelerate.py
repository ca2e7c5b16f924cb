"""setup_accelerate's process-wide side effects are visible and optional; seeding is honest."""

from __future__ import annotations

import logging
import os
import random
from unittest import mock

import pytest
import torch

from dspzoo.core import accelerate as accel_module
from dspzoo.core import perf
from dspzoo.core.errors import UsageError
from dspzoo.core.parallel.mesh import seed_everything, single_process_mesh
from dspzoo.core.parallel.runtime import SeqParallel


def test_seed_everything_leaves_pythonhashseed_alone(monkeypatch) -> None:
    """PYTHONHASHSEED only acts at interpreter start-up; setting it later is a no-op that
    child processes would then inherit, so seed_everything must not touch it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    value = seed_everything(single_process_mesh(), 3)
    assert "PYTHONHASHSEED" not in os.environ
    a = (random.random(), torch.rand(1).item())
    assert seed_everything(single_process_mesh(), 3) == value
    assert (random.random(), torch.rand(1).item()) == a
    assert "PYTHONHASHSEED" in (seed_everything.__doc__ or "")


def _setup(caplog, env: str | None, **kwargs):
    """setup_accelerate on CPU with a stub Accelerator and a recording keep_freed_memory."""
    calls: list[int] = []
    environ = {k: v for k, v in os.environ.items() if k != "DSPZOO_KEEP_FREED_MEMORY"}
    if env is not None:
        environ["DSPZOO_KEEP_FREED_MEMORY"] = env
    with (
        mock.patch.dict(os.environ, environ, clear=True),
        mock.patch.object(accel_module, "Accelerator") as accelerator_cls,
        mock.patch.object(perf, "keep_freed_memory", side_effect=lambda: calls.append(1) or True),
        caplog.at_level(logging.INFO, logger=accel_module.__name__),
    ):
        accelerator, mesh, sp = accel_module.setup_accelerate(1, cpu=True, **kwargs)
    assert accelerator is accelerator_cls.return_value and mesh.sp_size == 1
    assert isinstance(sp, SeqParallel)
    return len(calls), caplog.text


def test_keep_freed_memory_is_off_by_default_and_silent(caplog) -> None:
    """No process-wide side effect unless asked for, and no line about it."""
    called, log = _setup(caplog, None)
    assert called == 0 and "malloc" not in log


@pytest.mark.parametrize(
    ("env", "kwargs"),
    [("0", {}), ("false", {}), ("off", {}), ("", {}), ("1", {"keep_freed_memory": False})],
)
def test_keep_freed_memory_stays_off(caplog, env, kwargs) -> None:
    called, log = _setup(caplog, env, **kwargs)
    assert called == 0 and "malloc" not in log


@pytest.mark.parametrize("env", ["1", "yes", "true", "on"])
def test_keep_freed_memory_env_enables_and_is_logged(caplog, env) -> None:
    called, log = _setup(caplog, env)
    assert called == 1
    assert "M_MMAP_THRESHOLD" in log and "process-wide" in log
    assert f"DSPZOO_KEEP_FREED_MEMORY={env}" in log  # says what asked for it


def test_keep_freed_memory_argument_enables(caplog) -> None:
    called, log = _setup(caplog, "0", keep_freed_memory=True)  # the argument wins
    assert called == 1 and "setup_accelerate(keep_freed_memory=True)" in log


def test_keep_freed_memory_bad_env_value_is_an_error(caplog) -> None:
    with pytest.raises(UsageError, match="DSPZOO_KEEP_FREED_MEMORY"):
        _setup(caplog, "maybe")


def test_allocator_refusal_is_logged(caplog) -> None:
    with (
        mock.patch.object(accel_module, "Accelerator"),
        mock.patch.object(perf, "keep_freed_memory", return_value=False),
        caplog.at_level(logging.INFO, logger=accel_module.__name__),
    ):
        accel_module.setup_accelerate(1, cpu=True, keep_freed_memory=True)
    assert "left glibc malloc settings unchanged (allocator is not glibc" in caplog.text


def test_not_on_cuda(caplog) -> None:
    """GPU runs leave the host allocator alone (and say nothing about it)."""
    calls: list[int] = []
    with (
        mock.patch.object(accel_module, "Accelerator"),
        mock.patch.object(perf, "keep_freed_memory", side_effect=lambda: calls.append(1) or True),
    ):
        accel_module.setup_accelerate(1, cpu=False)
    assert calls == []


def test_setup_accelerate_documents_the_switches() -> None:
    doc = accel_module.setup_accelerate.__doc__ or ""
    assert "keep_freed_memory" in doc and "DSPZOO_KEEP_FREED_MEMORY" in doc


def test_fp16_on_a_cpu_is_refused_not_run_in_fp32() -> None:
    """Accelerate would accept fp16 on a CPU and run every step in fp32, saying nothing."""
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU.*use bf16"):
        accel_module.setup_accelerate(1, mixed_precision="fp16", cpu=True)
