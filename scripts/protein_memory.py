"""Long proteins: the largest residue count one AF2-width Evoformer block runs forward at.

For each SP size, a doubling then bisection search over the residue count ``R``; every trial
spawns ``N`` gloo processes that build one ``evoformer-af2`` block (c_m 256, c_z 128, 8 MSA and
4 pair heads, triangle-multiplication width 128), create *their own shards* of the MSA
``[1, S, R, 256]`` and pair ``[1, R, R, 128]`` activations (the full pair is never
materialised), and run the block forward under ``torch.no_grad()`` with chunking (updates added
in place, gathered operands travelling a few channels at a time, switches chunked over
channels). Each rank's address space is capped (``RLIMIT_DATA``) at ``--max-mem-gb / N`` so that
a trial that would not fit fails with an allocation error instead of pressing the machine; a
trial slower than ``--trial-timeout`` counts as failed too (and is reported as time-limited).

Prints a table (largest R reached, what stopped the search, peak RSS per rank and in total,
forward time) with the per-rank plan bytes of one block, then the command that reproduces it::

    python scripts/protein_memory.py --sp-sizes 1,2,4 --max-mem-gb 16

``--one-block R`` instead runs that block forward once at ``R`` residues in this process (SP 1,
no spawn, no cap) on ``--device`` (``cuda`` or ``cpu``, activations created there) and prints its
measured peak (``torch.cuda.max_memory_allocated`` on a GPU, ``ru_maxrss`` on CPU) beside
:func:`predicted_peak`::

    python scripts/protein_memory.py --one-block 4096 --device cuda --chunk-size 8 --channel-chunk 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from dspzoo.core.argparser import CommandParser
from dspzoo.core.device_memory import CudaPeak
from dspzoo.core.entry import UsageError
from dspzoo.core.testing import run_distributed

if TYPE_CHECKING:
    from dspzoo.core.parallel.multiplan import MultiParallel
    from dspzoo.core.parallel.runtime import SeqParallel
    from dspzoo.domains.protein.model import EvoformerBlock


class Af2Block(NamedTuple):
    """One af2-width block, its :class:`MultiParallel`, this rank's shards and all-ones masks."""

    block: EvoformerBlock
    mp: MultiParallel
    local: dict[str, torch.Tensor]
    msa_mask: torch.Tensor
    pair_mask: torch.Tensor


def af2_block(
    sp: SeqParallel,
    residues: int,
    depth: int,
    chunk: int | None = None,
    channel_chunk: int | None = None,
    requires_grad: bool = False,
    device: torch.device | str = "cpu",
) -> Af2Block:
    """Build one ``evoformer-af2`` block (seed 0) and this rank's random shards of ``m``
    ``[1, S, R, 256]`` and ``z`` ``[1, R, R, 128]`` (seeded by the rank), directly on
    ``device``. ``chunk`` / ``channel_chunk``: the config's row chunk and triangle channel
    chunk, and the switch pieces (``None``: the af2 config's own, switches whole)."""
    from dspzoo.core.parallel.multiplan import MultiParallel
    from dspzoo.domains.protein import CONFIGS
    from dspzoo.domains.protein.model import EvoformerBlock, evoformer_plan

    given = {"chunk_size": chunk, "mul_channel_chunk": channel_chunk}
    cfg = replace(CONFIGS["af2"], num_blocks=1, **{k: v for k, v in given.items() if v is not None})
    torch.manual_seed(0)
    block = EvoformerBlock(cfg).eval().to(device)  # eval: no dropout
    plan = evoformer_plan(cfg, residues, depth, sp.size)
    mp = MultiParallel(sp, plan, switch_chunk=channel_chunk)
    generator = torch.Generator(device).manual_seed(sp.rank)
    local = {}
    for name, channels in (("m", cfg.c_m), ("z", cfg.c_z)):
        spec = mp.spec(name, plan.entry(name))
        shape = (1, *spec.local_shape(sp.rank, sp.size), channels)
        local[name] = torch.randn(
            shape, generator=generator, device=device, requires_grad=requires_grad
        )
    # all-ones masks as broadcast views: the whole masks cost no memory
    one = torch.ones(1, 1, 1, device=device)
    return Af2Block(
        block, mp, local, one.expand(1, depth, residues), one.expand(1, residues, residues)
    )


def chunked_forward(parts: Af2Block, chunk: int) -> torch.Tensor:
    """The block's forward without autograd, updates added in place ``chunk`` rows at a time;
    returns ``z`` (this rank's shard, on its entry dim)."""
    from dspzoo.domains.protein.model import Residual

    with torch.no_grad(), parts.mp.region(**parts.local) as region:
        m, z = parts.block(
            parts.local["m"], parts.local["z"], parts.msa_mask, parts.pair_mask, Residual(chunk)
        )
        return region.seq("z", z).tensor


def _trial(
    rank: int, world: int, residues: int, depth: int, chunk: int, channel_chunk: int, cap: int
) -> dict[str, float]:
    """One rank of one trial: build the block and the local shards, run forward, measure."""
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.parallel.runtime import SeqParallel

    sp = SeqParallel(build_mesh(sp_size=world) if world > 1 else None)
    parts = af2_block(sp, residues, depth, chunk, channel_chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    z = chunked_forward(parts, chunk)
    seconds = time.perf_counter() - start
    finite = bool(torch.isfinite(z).all())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": float(peak), "before": float(before), "seconds": seconds, "finite": finite}


def _activations(rank: int, world: int, residues: int, depth: int) -> float:
    """Bytes autograd saves on this rank for one af2-width block forward (training)."""
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.parallel.runtime import SeqParallel
    from dspzoo.core.parallel.trace import SavedTensorMeter
    from dspzoo.domains.protein.model import Residual

    sp = SeqParallel(build_mesh(sp_size=world) if world > 1 else None)
    # eval: no dropout masks, the layers' own saved tensors
    parts = af2_block(sp, residues, depth, requires_grad=True)
    with SavedTensorMeter(parts.block.parameters()) as meter, parts.mp.region(**parts.local):
        parts.block(parts.local["m"], parts.local["z"], parts.msa_mask, parts.pair_mask, Residual())
    return float(meter.bytes)


def activation_table(residues: int, depth: int, sizes: list[int]) -> None:
    """Saved-for-backward bytes per rank of one af2-width block at each SP size."""
    print(f"\nactivation memory of one af2-width block (training, fp32, R={residues}, S={depth}):")
    print("| SP | saved for backward per rank (MiB) | ratio to SP 1 |\n|---|---|---|")
    first = None
    for world in sizes:
        per_rank = run_distributed(_activations, world, residues, depth, timeout=1200)
        worst = max(per_rank) / 2**20
        first = first or worst
        print(f"| {world} | {worst:.1f} | {worst / first:.2f} |", flush=True)


def run_trial(args: argparse.Namespace, world: int, residues: int) -> tuple[str, list[dict]]:
    """``("ok" | "memory" | "time" | "error: …", per-rank results)``."""
    cap = int(args.max_mem_gb * 2**30 / world)
    try:
        res = run_distributed(
            _trial,
            world,
            residues,
            args.msa_depth,
            args.chunk_size,
            args.channel_chunk,
            cap,
            timeout=args.trial_timeout,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
    except TimeoutError:
        return "time", []
    except AssertionError as exc:
        text = str(exc)
        if "can't allocate memory" in text or "MemoryError" in text or "died without" in text:
            return "memory", []
        return f"error: {text.splitlines()[-1][:200]}", []
    if not all(r["finite"] for r in res):
        return "error: non-finite output", res
    return "ok", res


def search(args: argparse.Namespace, world: int, log) -> dict:
    """Doubling from ``--start`` then bisection to ``--resolution`` residues."""
    good: tuple[int, list[dict]] | None = None
    bad: tuple[int, str] | None = None
    r = args.start
    while bad is None and r <= args.max_residues:
        status, res = run_trial(args, world, r)
        log(world, r, status, res)
        if status == "ok":
            good, r = (r, res), r * 2
        else:
            bad = (r, status)
    while good is not None and bad is not None and bad[0] - good[0] > args.resolution:
        mid = (good[0] + bad[0]) // 2
        status, res = run_trial(args, world, mid)
        log(world, mid, status, res)
        if status == "ok":
            good = (mid, res)
        else:
            bad = (mid, status)
    return {"world": world, "good": good, "bad": bad}


def predicted_peak(
    residues: int, world: int, depth: int, chunk: int, channel_chunk: int, base: float = 0.31
) -> float:
    """Model of one rank's peak memory (GiB) from the block's largest live tensors (fp32).

    ``P = R·⌈R/N⌉`` local pair positions, ``cc`` the channel chunk, ``h`` the rows of one chunk.
    Triangle multiplication: pair ``P·c_z`` + product ``P·c_mul`` + the gathered operand piece
    and its contiguous copy for the product ``2·R²·cc`` + local pieces ``4·P·cc``. Triangle
    attention: pair + whole bias ``R²·H`` + local bias ``P·H`` + one chunk's logits (the
    weights reuse their buffer without autograd) ``h·H·R²``. MSA row attention: pair + whole
    bias ``R²·8`` + ``h·8·R²`` logits (``h ≤ S/N`` rows). A switch: pair in + pair out + pieces
    ``3·P·cc``. Plus ``base`` GiB for the process (torch, the block's weights) and the MSA
    (``S·R·c_m``, twice). Allocator slack is not modelled.
    """
    from dspzoo.domains.protein import CONFIGS

    c = CONFIGS["af2"]
    r, n = residues, world
    local = r * -(-r // n)
    msa = depth * r * c.c_m * 2
    rows = min(chunk, -(-r // n))
    msa_rows = min(chunk, -(-depth // n))
    mul = local * (c.c_z + c.c_hidden_mul + 4 * channel_chunk) + 2 * r * r * channel_chunk
    att = local * (c.c_z + c.pair_heads) + r * r * c.pair_heads * (1 + rows)
    row = local * c.c_z + r * r * c.msa_heads * (1 + msa_rows)
    switch = local * (2 * c.c_z + 3 * channel_chunk)
    return base + 4 * (max(mul, att, row, switch) + msa) / 2**30


def one_block(
    residues: int, depth: int, chunk: int, channel_chunk: int, device: str, threads: int = 1
) -> dict[str, object]:
    """One af2-width block forward at ``residues`` in this process (SP 1, chunked, no grad),
    activations created on ``device``; its measured memory beside :func:`predicted_peak`.

    On CUDA ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` (tensors only, reset before
    the forward) and ``before_bytes`` the bytes allocated before it (weights, ``m``, ``z``);
    on CPU both are ``ru_maxrss`` (the whole process, torch included). ``predicted_gib`` is
    the model with its ``base`` (0.31 GiB: a CPU process with torch and the weights),
    ``predicted_device_gib`` the model without it plus the block's weights — the number that
    ``max_memory_allocated`` measures (the model counts ``m`` and ``z`` itself).
    """
    from dspzoo.core.parallel.runtime import SeqParallel

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        why = "torch built without CUDA" if torch.version.cuda is None else "no GPU visible"
        raise UsageError(f"--device {device}: CUDA is not available ({why}); use --device cpu")
    previous_threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(threads)
    try:
        parts = af2_block(SeqParallel(None), residues, depth, chunk, channel_chunk, device=dev)
        weights = sum(t.numel() * t.element_size() for t in parts.block.parameters())
        inputs = sum(t.numel() * t.element_size() for t in parts.local.values())
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with CudaPeak(dev) as device_peak:
            start = time.perf_counter()
            z = chunked_forward(parts, chunk)
            if cuda:
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - start
        if cuda:
            before, peak = device_peak.before_bytes, device_peak.peak_bytes
            reserved = device_peak.reserved_bytes
        else:
            before, reserved = rss_before, None
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        finite = bool(torch.isfinite(z).all())  # after the peak: its mask is not the block's
    finally:
        torch.set_num_threads(previous_threads)
    name = (
        torch.cuda.get_device_name(dev)
        if cuda
        else f"CPU {platform.machine()}, {threads} thread(s)"
    )
    predicted = predicted_peak(residues, 1, depth, chunk, channel_chunk)
    bare = predicted_peak(residues, 1, depth, chunk, channel_chunk, base=0.0)
    on_device = bare + weights / 2**30
    return {
        "residues": residues,
        "msa_depth": depth,
        "chunk_size": chunk,
        "channel_chunk": channel_chunk,
        "sp": 1,
        "device": str(dev),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": seconds,
        "finite": finite,
        "peak_bytes": int(peak),
        "before_bytes": int(before),
        "reserved_peak_bytes": reserved,
        "weight_bytes": int(weights),
        "input_bytes": int(inputs),
        "predicted_gib": predicted,
        "predicted_base0_gib": bare,
        "predicted_device_gib": on_device,
        "ratio_device": peak / 2**30 / on_device,
        "ratio_with_base": peak / 2**30 / predicted,
    }


def one_block_table(res: dict) -> None:
    """Print :func:`one_block`'s result as a small markdown table."""
    gib, mib = 2**30, 2**20
    cuda = res["device"].startswith("cuda")
    what = "max_memory_allocated" if cuda else "ru_maxrss"
    print(
        f"One af2-width Evoformer block forward, R={res['residues']}, S={res['msa_depth']}, "
        f"SP 1, chunk {res['chunk_size']}, channel chunk {res['channel_chunk']}, fp32, no grad; "
        f"{res['device_name']} ({res['device']}), torch {res['torch']}: "
        f"{res['seconds']:.2f} s, finite {res['finite']}"
    )
    rows = [
        (f"measured peak ({what})", res["peak_bytes"] / gib),
        (
            f"before the forward ({'allocated: weights + m + z' if cuda else what})",
            res["before_bytes"] / gib,
        ),
        ("weights", res["weight_bytes"] / gib),
        ("inputs m + z", res["input_bytes"] / gib),
    ]
    if res["reserved_peak_bytes"] is not None:
        rows.append(("peak reserved by the allocator", res["reserved_peak_bytes"] / gib))
    rows += [
        ("predicted_peak (base 0.31 GiB: CPU process)", res["predicted_gib"]),
        ("predicted_peak (base 0)", res["predicted_base0_gib"]),
        ("predicted_peak (base 0) + weights", res["predicted_device_gib"]),
    ]
    print("| quantity | GiB | MiB |\n|---|---|---|")
    for label, value in rows:
        print(f"| {label} | {value:.3f} | {value * gib / mib:.1f} |")
    print(
        f"| measured / predicted (base 0 + weights) | {res['ratio_device']:.3f} | |\n"
        f"| measured / predicted (base 0.31 GiB) | {res['ratio_with_base']:.3f} | |"
    )


def plan_bytes(residues: int, depth: int, world: int) -> tuple[int, int]:
    """Forward and backward bytes per block on rank 0 (fp32, batch 1)."""
    from dspzoo.domains.protein import CONFIGS
    from dspzoo.domains.protein.model import evoformer_plan

    plan = evoformer_plan(CONFIGS["af2"], residues, depth, world)
    return plan.bytes_per_period(0, 1, 4, "forward"), plan.bytes_per_period(0, 1, 4, "backward")


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp-sizes", default="1,2,4", help="comma-separated SP sizes")
    p.add_argument("--msa-depth", type=int, default=8, help="MSA rows S")
    p.add_argument("--start", type=int, default=256, help="first residue count of the doubling")
    p.add_argument("--max-residues", type=int, default=8192, help="stop doubling here")
    p.add_argument("--resolution", type=int, default=128, help="bisection stops at this gap")
    p.add_argument("--chunk-size", type=int, default=4, help="rows per chunk in every layer")
    p.add_argument(
        "--channel-chunk", type=int, default=8, help="channels per gathered operand / switch piece"
    )
    p.add_argument(
        "--max-mem-gb", type=float, default=16.0, help="memory cap of all ranks together (GiB)"
    )
    p.add_argument("--trial-timeout", type=float, default=1200.0, help="seconds per trial")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--activations",
        type=int,
        default=0,
        metavar="R",
        help="instead: saved-for-backward bytes per rank of one block at R residues",
    )
    p.add_argument(
        "--one-block",
        type=int,
        default=0,
        metavar="R",
        help="instead: one block forward at R residues in this process (SP 1, --device), "
        "its measured peak beside predicted_peak",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where --one-block runs (default cpu; the search and --activations run on CPU)",
    )
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sp_sizes.split(",") if x]
    cmd = " ".join(
        ["python", "scripts/protein_memory.py", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.device is not None and not args.one_block:
        raise UsageError("--device applies to --one-block only")
    if args.one_block and args.activations:
        raise UsageError("choose one of --one-block and --activations")
    if args.one_block:
        device = args.device or "cpu"
        res = one_block(
            args.one_block,
            args.msa_depth,
            args.chunk_size,
            args.channel_chunk,
            device,
            args.threads,
        )
        one_block_table(res)
        prefix = "" if device == "cuda" else f"OMP_NUM_THREADS={args.threads} "
        print(f"\nreproduce: {prefix}{cmd}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "one_block": res}, fh, indent=1)
        return 0
    if args.activations:
        activation_table(args.activations, args.msa_depth, sizes)
        print(f"\nreproduce: OMP_NUM_THREADS={args.threads} {cmd}")
        return 0

    def log(world: int, r: int, status: str, res: list[dict]) -> None:
        peak = max((x["peak"] for x in res), default=0.0) / 2**30
        secs = max((x["seconds"] for x in res), default=0.0)
        print(
            f"  SP {world}  R={r:>5}  {status:<8} peak/rank {peak:6.2f} GiB  {secs:8.1f} s",
            flush=True,
        )

    results = []
    for world in sizes:
        print(
            f"SP {world}: searching (cap {args.max_mem_gb:g} GiB over {world} rank(s))", flush=True
        )
        results.append(search(args, world, log))

    print()
    print(
        f"Largest R for one af2-width Evoformer block forward (S={args.msa_depth}, chunk "
        f"{args.chunk_size}, channel chunk {args.channel_chunk}, fp32, no grad), cap "
        f"{args.max_mem_gb:g} GiB in total:"
    )
    print(
        "| SP | largest R | next tried | stopped by | peak RSS/rank (GiB) | total (GiB) | "
        "forward (s) | plan fwd bytes/block/rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for out in results:
        world, good, bad = out["world"], out["good"], out["bad"]
        if good is None:
            print(
                f"| {world} | none | {bad[0] if bad else '-'} | {bad[1] if bad else '-'} | | | | |"
            )
            continue
        r, res = good
        peak = max(x["peak"] for x in res) / 2**30
        total = sum(x["peak"] for x in res) / 2**30
        secs = max(x["seconds"] for x in res)
        fwd, _ = plan_bytes(r, args.msa_depth, world)
        stop = f"{bad[1]}" if bad else f"--max-residues {args.max_residues}"
        nxt = bad[0] if bad else "-"
        print(
            f"| {world} | {r} | {nxt} | {stop} | {peak:.2f} | {total:.2f} | {secs:.1f} | "
            f"{fwd / 2**20:.1f} MiB |"
        )
        rows.append({"sp": world, "residues": r, "peak_gib": peak, "total_gib": total,
                     "seconds": secs, "next": nxt, "stopped_by": stop})  # fmt: skip
    print(
        "\npredicted peak per rank (scripts/protein_memory.py:predicted_peak) and the largest R "
        f"it lets fit in {args.max_mem_gb:g} GiB in total:"
    )
    for world in sizes:
        r = args.resolution
        while predicted_peak(r + args.resolution, world, args.msa_depth, args.chunk_size,
                             args.channel_chunk) * world <= args.max_mem_gb:  # fmt: skip
            r += args.resolution
        measured = next((row for row in rows if row["sp"] == world), None)
        check = ""
        if measured:
            pred = predicted_peak(measured["residues"], world, args.msa_depth, args.chunk_size,
                                  args.channel_chunk)  # fmt: skip
            check = f"; at R={measured['residues']}: predicted {pred:.2f}, measured {measured['peak_gib']:.2f} GiB/rank"
        print(f"  SP {world}: R <= {r}{check}")
    print(f"\nreproduce: OMP_NUM_THREADS={args.threads} {cmd}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "protein_memory.py"))
