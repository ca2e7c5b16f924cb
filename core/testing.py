"""Test utilities: run a function on N gloo worker processes (inside pytest), never hanging.

Workers are spawned with ``torch.multiprocessing``, join a gloo group over a file store with a
short collective timeout, and send back either their return value or their traceback. The
parent waits with a deadline and kills every worker that is still alive.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue as queue_module
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .entry import release_communicators
from .parallel.mesh import SPMesh

COLLECTIVE_TIMEOUT_S = 60


def _worker(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", _to_bytes(result)))
        release_communicators()  # the groups' threads end before the interpreter does
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, "error", traceback.format_exc()))
        if dist.is_initialized():  # a collective may be in flight: no waiting on it
            dist.destroy_process_group()


def _to_bytes(value: Any) -> bytes:
    """``value`` serialised into plain bytes.

    Tensors put on a ``torch.multiprocessing`` queue travel as shared-memory handles that the
    receiver fetches from the sender *after* ``get``; a worker that has already exited by then
    takes its tensors with it (and the parent sees an error, or nothing). Bytes carry the data.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def run_distributed(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Raises ``AssertionError`` with the
    workers' tracebacks if any fails, and ``TimeoutError`` (after killing them) on a hang.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, init_file, fn, args, queue, env or {}), daemon=False
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) < world:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise TimeoutError(
                        f"distributed test timed out after {timeout}s; finished ranks: {sorted(results)}"
                    )
                try:
                    rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                except queue_module.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if not p.is_alive() and r not in results and p.exitcode not in (0, None)
                    ]
                    if dead:
                        raise AssertionError(
                            f"worker(s) {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
                    continue
                results[rank] = (status, payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    errors = [
        f"--- rank {r} ---\n{payload}"
        for r, (status, payload) in sorted(results.items())
        if status == "error"
    ]
    if errors:
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    return [_from_bytes(results[r][1]) for r in range(world)]


def sub_mesh(size: int) -> SPMesh | None:
    """An SP group over world ranks ``0 .. size - 1`` (DP 1): several SP sizes in one spawn.

    Collective: every rank of the world calls it, in the same order (``dist.new_group``);
    ranks outside the group get ``None``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= size <= world:
        raise ValueError(f"sub_mesh: SP size {size} must be between 1 and the world size {world}")
    group = dist.new_group(list(range(size)))
    if rank >= size:
        return None
    return SPMesh(world, rank, 1, size, 0, rank, sp_group=group)


@contextlib.contextmanager
def counting_calls(owner: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of ``owner.name`` inside the block (it still runs): yields a one-item
    list holding the count, e.g. ``with counting_calls(dist, "all_to_all_single") as n:``."""
    original, count = getattr(owner, name), [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield count
    finally:
        setattr(owner, name, original)
