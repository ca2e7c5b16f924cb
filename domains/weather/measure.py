r"""Measure one WeatherTransformer step: the plan, traced bytes per layer, activation memory.

    python -m dspzoo.domains.weather.measure --model weathertx-small             # SP 1
    torchrun --nproc_per_node 2 -m dspzoo.domains.weather.measure --model weathertx-small

All launched processes form one SP group (gloo on CPU). One training step (forward and
backward of a fixed random weighting of the forecast, batch ``--batch``) runs on random inputs
under :func:`~dspzoo.core.trace_comm` and :class:`~dspzoo.core.SavedTensorMeter`; rank 0
prints the plan, then per rank: bytes sent in layer ``block1`` (a steady-state layer; forward,
backward) and in the whole step, each beside the cost model's figure for the same plan
(:func:`~dspzoo.core.costmodel.comm_bytes`), and the activation memory saved for backward
(exact) beside the cost model's :func:`~dspzoo.core.costmodel.activation_bytes` (which leaves
out the variable tokenisation). ``--forward-only`` skips the backward (memory only), e.g. for
a big config on a CPU. ``--overrides field=value,...`` changes config fields (``grid=32x64``,
``depth=1``, ``spatial=full``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from dspzoo.core import SavedTensorMeter, SeqParallel, build_mesh, trace_comm
from dspzoo.core.costmodel import activation_bytes, comm_bytes
from dspzoo.zoo import count_parameters, create_model, format_count

from ...core.errors import UsageError
from .model import SEQ_DIMS, WeatherTransformer
from .workload import weather_workload

MiB = 2**20


def parse_overrides(text: str) -> dict[str, Any]:
    """``"grid=32x64,depth=1,variables=u+v"`` → config overrides (``AxB``, ``a+b``: tuples)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--overrides: expected field=value, got {item!r}")
        if key == "variables":
            out[key] = tuple(value.split("+"))
        elif "x" in value and all(v.isdigit() for v in value.split("x")):
            out[key] = tuple(int(v) for v in value.split("x"))
        elif value.lstrip("-").isdigit():
            out[key] = int(value)
        elif value in ("True", "False"):
            out[key] = value == "True"
        else:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def measure(
    model: WeatherTransformer, sp: SeqParallel, batch: int, strategy: str, backward: bool
) -> dict[str, Any]:
    """This rank's figures for one step of ``model`` under ``sp``."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c.history, len(c.variables), *c.grid, generator=g)
    static = torch.randn(batch, c.num_static, *c.grid, generator=g) if c.num_static else None
    lead = torch.ones(batch)
    weight = torch.randn(batch, len(c.variables), *c.grid, generator=g)
    with trace_comm() as tracer:
        with SavedTensorMeter(model.parameters()) as meter:
            out = model(x, lead, static, sp=sp)
        if backward:
            (out * weight).mean().backward()
    wl = weather_workload(strategy, c, batch=batch)
    r, n = sp.rank, sp.size
    phases = ("forward", "backward") if backward else ("forward",)
    layer_traced = layer_formula = None
    if c.depth >= 2:  # block1: a steady-state layer (block0 starts on the entry dim)
        one, two = (weather_workload(strategy, replace(c, depth=d), batch=batch) for d in (1, 2))
        layer_traced = {p: tracer.total_bytes(phase=p, region_prefix="block1") for p in phases}
        layer_formula = {
            p: comm_bytes(two, strategy, n, r).bytes(phase=p)
            - comm_bytes(one, strategy, n, r).bytes(phase=p)
            for p in phases
        }
    phase = None if backward else "forward"
    return {
        "rank": r,
        "layer_traced": layer_traced,
        "layer_formula": layer_formula,
        "total_traced": tracer.total_bytes(phase=phase),
        "total_formula": comm_bytes(wl, strategy, n, r).bytes(phase=phase) if c.depth else None,
        "memory": meter.bytes,
        "memory_formula": activation_bytes(wl, strategy, n, r) if c.depth else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="weathertx-small")
    parser.add_argument("--overrides", default="", help="config fields, e.g. grid=32x64,depth=1")
    parser.add_argument("--strategy", default="dsp")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--forward-only", action="store_true", help="memory only, no backward")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    sp = SeqParallel(build_mesh(world) if world > 1 else None, args.strategy)
    torch.manual_seed(0)
    model = create_model(args.model, **parse_overrides(args.overrides))
    with torch.no_grad():  # a trained-like model: every branch active
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    mine = measure(model, sp, args.batch, args.strategy, not args.forward_only)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if sp.rank == 0:
        c = model.config
        lengths = (c.history, *c.patch_grid)
        print(
            f"{args.model} {args.overrides or ''}: {format_count(count_parameters(model))} "
            f"parameters, batch {args.batch}, grid {c.grid} at patch {c.patch} -> tokens "
            f"(t={lengths[0]}, y={lengths[1]}, x={lengths[2]}), hidden {c.hidden}, depth {c.depth}"
        )
        if world > 1:
            print(sp.plan(SEQ_DIMS, lengths, model.STAGES))
        print(
            f"  {'rank':>4} {'layer fwd':>11} {'(model)':>11} {'layer bwd':>11} {'(model)':>11} "
            f"{'step total':>11} {'(model)':>11} {'act MiB':>9} {'(model)':>9}"
        )

        def cell(d: dict | None, key: str, width: int = 11) -> str:
            value = None if d is None else d.get(key)
            return f"{'-' if value is None else value:>{width}}"

        for e in everyone:
            lt, lf = e["layer_traced"], e["layer_formula"]
            model_mib = e["memory_formula"]
            model_mib = "-" if model_mib is None else f"{model_mib / MiB:.2f}"
            print(
                f"  {e['rank']:>4} {cell(lt, 'forward')} {cell(lf, 'forward')} "
                f"{cell(lt, 'backward')} {cell(lf, 'backward')} {e['total_traced']:>11} "
                f"{cell(e, 'total_formula')} {e['memory'] / MiB:>9.2f} {model_mib:>9}"
            )
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
