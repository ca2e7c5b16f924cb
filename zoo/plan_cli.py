"""``dspzoo plan``: FLOPs, bytes, memory and predicted step time per strategy and SP size.

dspzoo plan stdit-720M --frames 128 --size 512 --batch 1 --sp 1,2,4,8 --cluster h100-nvlink-ib
dspzoo plan bytelm-lss-12l --seq-len 50000 --sp 8,16 --cluster v100-summit
dspzoo plan mamba2lm-130m --seq-len 65536 --sp 1,4,8
dspzoo plan hybridlm-130m --seq-len 65536 --sp 4,8
dspzoo plan weathertx-global-1.40625 --grid 128x256 --history 2 --sp 8
dspzoo plan evoformer-af2 --residues 384 --msa-depth 512 --sp 1,2,4,8
dspzoo plan axial3d-mini --dims t=64,h=128,w=128 --sp 4,8

Each kind of model takes its own sizes; a size left out is the config's own:

* video (stdit, latte, latte1, videomamba): ``--frames`` latent frames (default 1: an image),
  ``--size`` the pixel size H or HxW (divided by ``--vae-stride``, 8 by default) or ``--latent``
  the latent size (default: the config's ``input_size`` or ``sample_size``), ``--context``
  conditioning tokens;
* text (bytelm): ``--seq-len`` bytes per sequence (default: the config's ``max_len``);
* Mamba LMs (mambalm, mamba2lm, hybridlm): ``--seq-len`` tokens per sequence (default
  :data:`MAMBA_SEQ_LEN`, the Mamba papers' training context);
* weather (weathertx, weathermamba): ``--grid`` HxW grid points and ``--history`` input states
  (default: the config's ``grid`` and ``history``; ``--latent`` and ``--frames`` are accepted
  for them);
* protein (evoformer): ``--residues`` and ``--msa-depth`` (default 256 and 128, AlphaFold 2's
  training crop); the Evoformer runs under ``dsp`` only, so it prints its two-activation plan;
* any other family (yours): the sizes its workload builder reads (``--frames``, ``--size`` /
  ``--latent``, ``--seq-len``), as given: ``--size`` is not divided by ``--vae-stride`` (your
  builder turns pixels into tokens itself, so ``--size`` and ``--latent`` say the same);
* every model: ``--dims name=tokens,...`` sets token lengths (after patching) by the model's
  own dim names, e.g. ``--dims h=64,w=64``; with ``--dims`` alone, name every dim.

Strategies that run the same method on every stage with the same prediction share one row of
the table, named ``dsp,ulysses,...`` (a model of scans only runs state passing under every
strategy). Under the table, one line per SP size and list of methods says which method runs
each stage that mixes the sharded dim (the strategies that share it listed): a Mamba model's
scans run by ``state_passing`` or ``head_a2a`` under every strategy, its attention by the
strategy's method.
``--inference`` predicts a forward pass only (``--steps`` of them, e.g. sampling steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dspzoo.core.costmodel import (
    CLUSTERS,
    DEFAULT_STRATEGIES,
    TABLE_LEGEND,
    default_strategies,
    format_table,
    make_plan,
    merge_same_plans,
    predict_table,
    recommend,
    stage_methods,
)
from dspzoo.core.costmodel.predict import plan_unsupported
from dspzoo.core.parallel.strategies import STRATEGIES

from ..core.argparser import CommandParser, corrections, positive_int, positive_int_list
from ..core.entry import reader_gone
from ..core.errors import UsageError
from .registry import (
    _match,
    count_parameters,
    create_model,
    format_count,
    get_config,
    override_config,
    resolve_name,
)
from .workloads import workload_for

#: ``--seq-len`` of a Mamba LM when none is given: the Mamba papers' training context
MAMBA_SEQ_LEN = 2048

# argparse dests of the per-kind size flags (each None unless given)
SIZE_FLAGS = (
    *("frames", "size", "latent", "context"),  # video
    "seq_len",  # text
    *("grid", "history"),  # weather
    *("residues", "msa_depth"),  # protein
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``plan`` arguments (on ``parser``, e.g. a ``dspzoo`` subparser)."""
    p = parser or CommandParser(prog="dspzoo plan", description=__doc__.split("\n")[0])
    p.add_argument(
        "model",
        help="zoo model, e.g. stdit-720M, mamba2lm-130m, evoformer-af2, weathertx-small, or a "
        "shipped name (its config), e.g. stdit-mini-shapes",
    )
    p.epilog = (
        "Sizes per kind of model: video (stdit, latte, latte1, videomamba): --frames, "
        "--size/--latent, --context. Language models (bytelm; Mamba LMs mambalm, mamba2lm, "
        "hybridlm): --seq-len. Weather (weathertx, weathermamba): --grid, --history. Protein "
        "(evoformer): --residues, --msa-depth. Any model: --dims name=tokens,... . A family of "
        "yours gets --frames, --size/--latent, --seq-len and --context as they are given."
    )
    video = p.add_argument_group("video models: stdit, latte, latte1, videomamba")
    video.add_argument("--frames", type=positive_int, help="latent frames (default 1: an image)")
    video.add_argument(
        "--size",
        type=str,
        help="pixel size H or HxW (a video family divides it by --vae-stride; a family of yours "
        "gets it as given)",
    )
    video.add_argument("--latent", type=str, help="latent size H or HxW (instead of --size)")
    video.add_argument(
        "--vae-stride",
        type=positive_int,
        help="pixels per latent of the video families' --size (default 8; a shipped model's "
        "own codec factor)",
    )
    video.add_argument("--context", type=positive_int, help="conditioning tokens (default 0)")
    text = p.add_argument_group("language models: bytelm; Mamba LMs mambalm, mamba2lm, hybridlm")
    text.add_argument(
        "--seq-len",
        type=positive_int,
        help=f"tokens per sequence (default: bytelm's max_len; Mamba LMs {MAMBA_SEQ_LEN})",
    )
    weather = p.add_argument_group("weather models: weathertx, weathermamba")
    weather.add_argument("--grid", type=str, help="grid points HxW (default: the config's)")
    weather.add_argument(
        "--history", type=positive_int, help="input states (default: the config's)"
    )
    protein = p.add_argument_group("protein models: evoformer")
    protein.add_argument("--residues", type=positive_int, help="residues (default 256)")
    protein.add_argument("--msa-depth", type=positive_int, help="MSA rows (default 128)")
    p.add_argument(
        "--dims",
        type=str,
        help="token lengths by the model's dim names, e.g. t=16,h=64,w=64 (any model)",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="samples per SP group")
    p.add_argument(
        "--sp", type=positive_int_list, default=[1, 2, 4, 8], help="SP sizes, comma-separated"
    )
    p.add_argument(
        "--strategies",
        type=str,
        help=f"strategies to compare, comma-separated (default: {','.join(DEFAULT_STRATEGIES)}; "
        "for a causal attention model with one sequence dim also ring_zigzag, ring_balanced, "
        "lss_zigzag and lss_balanced, and for one with scans only the contiguous two of those "
        "(ring_balanced, lss_balanced); ulysses_flat only for a model with several "
        "sequence dims, where it differs from ulysses)",
    )
    p.add_argument(
        "--cluster",
        default="h100-nvlink-ib",
        choices=CLUSTERS,
        help="hardware to predict for: a preset of published rates (default h100-nvlink-ib), "
        "or this-cpu: rates measured on this machine (probed once, then cached in "
        "~/.cache/dspzoo/this-cpu.json)",
    )
    p.add_argument("--dtype-bytes", type=positive_int, default=2, help="activation bytes (bf16: 2)")
    p.add_argument(
        "--stream-bytes",
        type=positive_int,
        default=None,
        help="bytes of the residual stream where they differ: 4 for training under autocast "
        "with fp32 parameters (Accelerate's --mixed_precision bf16), whose stream stays fp32, "
        "so DSP's switches and Megatron-SP's all-gathers send 4 bytes per element (default: "
        "--dtype-bytes, a model held in bf16)",
    )
    p.add_argument(
        "--dp", type=positive_int, default=1, help="data-parallel groups (ZeRO sharding)"
    )
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--recompute", action="store_true", help="activation checkpointing")
    p.add_argument("--inference", action="store_true", help="forward only")
    p.add_argument("--steps", type=positive_int, default=1, help="forward passes per prediction")
    return p


# -- sizes per kind of model ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """How ``dspzoo plan`` sizes one kind of model: the flags it reads and the
    :func:`~dspzoo.zoo.workloads.workload_for` keywords they give (with a note per size that
    came from a default, printed under the header)."""

    kind: str
    flags: tuple[str, ...]
    sizes: Callable[[Any, argparse.Namespace], tuple[dict[str, Any], list[str]]]


#: pixels per latent of the video families' autoencoder (SD's VAE), unless --vae-stride says
DEFAULT_VAE_STRIDE = 8


def _hw(text: str, scale: int = 1, flag: str = "--size") -> tuple[int, int]:
    """``"H"`` or ``"HxW"`` (positive integers) divided by ``scale``; a one-line error naming
    ``flag`` for anything else."""
    h, _, w = text.lower().partition("x")
    try:
        sides = int(h), int(w or h)
    except ValueError:
        sides = (0, 0)
    if min(sides) < 1:
        raise UsageError(
            f"{flag} takes H or HxW in positive integers (e.g. 256 or 128x256), got {text!r}"
        )
    return sides[0] // scale, sides[1] // scale


def _video_sizes(config: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    notes = []
    if args.latent is not None:
        spatial = _hw(args.latent, flag="--latent")
    elif args.size is not None:
        stride = args.vae_stride or DEFAULT_VAE_STRIDE
        if min(_hw(args.size)) < stride:
            raise UsageError(
                f"--size {args.size} is smaller than one latent pixel (--vae-stride {stride})"
            )
        spatial = _hw(args.size, stride)
    elif hasattr(config, "input_size"):  # stdit, latte
        spatial = tuple(config.input_size)
        notes.append(f"latent {spatial[0]}x{spatial[1]} (the config's input_size; --size/--latent)")
    else:  # latte1
        spatial = (config.sample_size, config.sample_size)
        notes.append(
            f"latent {spatial[0]}x{spatial[1]} (the config's sample_size; --size/--latent)"
        )
    frames = args.frames
    if frames is None:
        frames = config.patch[0] if isinstance(config.patch, tuple) else 1
        notes.append(f"{frames} latent frame(s): an image (--frames for a video)")
    context = args.context or 0
    return {"frames": frames, "spatial": spatial, "context": context}, notes


def _text_sizes(config: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.seq_len is not None:
        return {"seq_len": args.seq_len}, []
    return {"seq_len": config.max_len}, [f"{config.max_len} bytes (the config's max_len)"]


def _mamba_lm_sizes(config: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.seq_len is not None:
        return {"seq_len": args.seq_len}, []
    note = f"{MAMBA_SEQ_LEN} tokens (a Mamba LM has no maximum length; --seq-len)"
    return {"seq_len": MAMBA_SEQ_LEN}, [note]


def _weather_sizes(config: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.grid is not None and args.latent is not None:
        raise UsageError("give the weather grid once: --grid (or its alias --latent)")
    if args.history is not None and args.frames is not None:
        raise UsageError("give the weather history once: --history (or its alias --frames)")
    notes = []
    grid = args.grid if args.grid is not None else args.latent
    if grid is None:
        spatial = tuple(config.grid)
        notes.append(f"grid {spatial[0]}x{spatial[1]} (the config's; --grid)")
    else:
        spatial = _hw(grid, flag="--grid")
    history = args.history if args.history is not None else args.frames
    if history is None:
        history = config.history
        notes.append(f"history {history} (the config's; --history)")
    return {"frames": history, "spatial": spatial}, notes


def _builder_sizes(config: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Any other family: the sizes as given, for its workload builder to read (``--size`` and
    ``--latent`` alike: a family of yours has no VAE that ``--vae-stride`` would describe; its
    builder turns pixels into tokens itself)."""
    if args.size is not None and args.latent is not None:
        raise UsageError("give the size once: --size or --latent (the same for a family of yours)")
    kwargs: dict[str, Any] = {"frames": args.frames, "seq_len": args.seq_len}
    if args.latent is not None:
        kwargs["spatial"] = _hw(args.latent, flag="--latent")
    elif args.size is not None:
        kwargs["spatial"] = _hw(args.size)
    kwargs["context"] = args.context or 0
    return kwargs, []


VIDEO = Sizing("video", ("frames", "size", "latent", "context"), _video_sizes)
TEXT = Sizing("text", ("seq_len",), _text_sizes)
MAMBA_LM = Sizing("Mamba language", ("seq_len",), _mamba_lm_sizes)
WEATHER = Sizing("weather", ("grid", "history", "latent", "frames"), _weather_sizes)
PROTEIN = Sizing("protein", ("residues", "msa_depth"), lambda config, args: ({}, []))
BUILDER = Sizing("zoo", ("frames", "size", "latent", "context", "seq_len"), _builder_sizes)
SIZINGS = {
    "stdit": VIDEO,
    "latte": VIDEO,
    "latte1": VIDEO,
    "bytelm": TEXT,
    "weathertx": WEATHER,
    "videomamba": VIDEO,
    "mambalm": MAMBA_LM,
    "mamba2lm": MAMBA_LM,
    "hybridlm": MAMBA_LM,
    "weathermamba": WEATHER,
    "evoformer": PROTEIN,
}


def sizing_of(family: str) -> Sizing:
    """The :class:`Sizing` of ``family`` (a family of no known kind: :data:`BUILDER`)."""
    return SIZINGS.get(family, BUILDER)


def _check_flags(name: str, sizing: Sizing, args: argparse.Namespace) -> None:
    wrong = [f for f in SIZE_FLAGS if getattr(args, f) is not None and f not in sizing.flags]
    if wrong:
        own = ", ".join(f"--{f.replace('_', '-')}" for f in sizing.flags)
        given = ", ".join(f"--{f.replace('_', '-')}" for f in wrong)
        raise UsageError(
            f"{name} is a {sizing.kind} model: its sizes are {own} (or --dims name=tokens,...); "
            f"{given} is not one of them"
        )


def parse_dims(text: str | None) -> dict[str, int]:
    """``"h=64,w=64"`` → ``{"h": 64, "w": 64}`` (a clear error for anything else)."""
    dims: dict[str, int] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        dim, sep, value = item.partition("=")
        dim = dim.strip()
        try:
            length = int(value)
        except ValueError:
            length = 0
        if not sep or not dim or length < 1:
            raise UsageError(f"--dims takes name=tokens pairs like h=64,w=64, got {item!r}")
        if dim in dims:
            raise UsageError(f"--dims names {dim!r} twice")
        dims[dim] = length
    return dims


def workload_from_args(
    name: str,
    config: Any,
    sizing: Sizing,
    args: argparse.Namespace,
    overrides: dict[str, Any] | None = None,
):
    """The :class:`Workload` the flags describe (of ``name``'s config with ``overrides``, as
    ``config`` is), and the notes on sizes that were defaults."""
    dims = parse_dims(args.dims)
    kwargs, notes = sizing.sizes(config, args)
    given = any(getattr(args, f) is not None for f in sizing.flags)
    if dims and sizing is BUILDER and not given:  # sized by dim names alone
        kwargs = {}
    try:
        wl = workload_for(
            name,
            **kwargs,
            batch=args.batch,
            itemsize=args.dtype_bytes,
            dims=dims or None,
            overrides=overrides,
        ).with_(stream_itemsize=getattr(args, "stream_bytes", None))
    except ValueError as exc:
        raise UsageError(
            str(exc).replace("dims names", "--dims names").replace("with dims", "with --dims")
        ) from None
    empty = [d for d, n in zip(wl.dims, wl.lengths) if n < 1]
    if empty:  # a size below one patch (or one latent pixel): say so, not a ZeroDivisionError
        given = " ".join(
            f"--{f.replace('_', '-')} {getattr(args, f)}"
            for f in sizing.flags
            if getattr(args, f) is not None
        )
        raise UsageError(
            f"{name} gets no token along {', '.join(empty)} from {given or 'its default sizes'}: "
            "one token covers more than that; give a larger size"
        )
    return wl, [] if dims else notes


# -- what the table does not show: the model's scans and the method of every stage ---------------


def describe_scans(wl: Any) -> list[str]:
    """A line on a Mamba model's scan layers (Mamba-2: heads; Mamba-1: channels, which is what
    its head all-to-all shards) and one on a hybrid's attention layers; none for other models."""
    scan = wl.extra.get("scan")
    if not scan or "mixer" not in wl.extra:
        return []
    count = sum(1 for layer in wl.layers for spec in layer if spec.scan is not None)
    inner, state, conv = scan["inner"], scan["state"], scan["conv"]
    if wl.extra["mixer"] == "mamba2":
        shape = f"d_inner {inner} = {scan['heads']} heads x {inner // scan['heads']}"
        version = "Mamba-2"
    else:
        shape = f"d_inner {inner} channels (no heads: head_a2a shards the channels)"
        version = "Mamba-1"
    lines = [f"  scans: {count} {version} scan stages, {shape}, state {state}, conv {conv}"]
    attention = wl.extra.get("attention_layers")
    if attention:
        where = ", ".join(str(i) for i in attention)
        heads = f"{wl.heads} heads x {wl.head_dim}"
        if wl.kv_heads != wl.heads:
            heads += f" ({wl.kv_heads} K/V heads)"
        lines.append(f"  attention: layers {where} of {wl.depth}, {heads}, MLP {wl.mlp_hidden}")
    return lines


def describe_methods(wl: Any, strategies: list[str], sizes: list[int]) -> list[str]:
    """Per SP size, the method of every stage that mixes the sharded dim, one line per distinct
    list of methods (:func:`stage_methods`; the strategies that make it listed together, as
    the table's merged rows list them). A strategy the table marks not runnable at that size
    (:func:`~dspzoo.core.costmodel.predict.plan_unsupported`) runs no stage: it is left out of
    those lines and named on one line of its own, ``SP n: not runnable (...)``."""
    lines = []
    for n in sizes:
        if n < 2:
            continue
        seen: dict[str, list[str]] = {}
        unrunnable: list[str] = []
        for strategy in strategies:
            if strategy == "ulysses_flat":
                continue
            plan = make_plan(wl, strategy, n)
            if plan_unsupported(plan, wl, strategy):
                unrunnable.append(strategy)
                continue
            used = stage_methods(plan)
            methods = {m for _, m in used}
            if not used:
                text = "every stage local (each mixes a dim that is whole)"
            elif len(methods) == 1 and len(used) == len(plan.steps):
                text = f"every stage {used[0][1]}"
            else:
                text = ", ".join(f"{stage} {method}" for stage, method in used)
            seen.setdefault(text, []).append(strategy)
        for text, names in seen.items():
            lines.append(f"  SP {n}: {text}  ({', '.join(names)})")
        if unrunnable:
            text = "not runnable (the table's row says why)"
            lines.append(f"  SP {n}: {text}  ({', '.join(unrunnable)})")
    if not lines:
        return []
    return ["methods per stage (those not listed run locally):", *lines]


# -- the command --------------------------------------------------------------------------------


def resolve_model(text: str) -> tuple[str, str, str | None]:
    """The zoo config name of ``text`` (a config name, or a shipped name: its card's config),
    the label the header prints (``"stdit-mini-shapes (shipped; config stdit-mini)"``) and the
    shipped name (``None`` for a config name). An unknown name raises the registry's
    ``KeyError`` with its did-you-mean hints."""
    from .shipped import model_card, shipped_names

    if _match(text, shipped_names()) is not None:
        card = model_card(text)
        name = resolve_name(card.model)
        return name, f"{card.name} (shipped; config {name})", card.name
    name = resolve_name(text)
    return name, name, None


def shipped_overrides(name: str, shipped: str) -> dict[str, Any]:
    """The fields in which shipped model ``shipped``'s saved config differs from zoo config
    ``name``'s (what ``create_model(name, **overrides)`` needs to build that model)."""
    from .pretrained import load_config
    from .shipped import pretrained_path

    # the shipped folder itself, never a same-named folder in the working directory
    base, saved = get_config(name), load_config(pretrained_path(shipped))[1]
    return {
        f.name: getattr(saved, f.name)
        for f in dataclasses.fields(saved)
        if getattr(saved, f.name) != getattr(base, f.name)
    }


def shipped_sizes(shipped: str, args: argparse.Namespace) -> list[str]:
    """Fill the size flags ``args`` leaves unset from the settings the shipped model was trained
    or samples with (its folder's ``extra``); returns the notes the header prints."""
    from .pretrained import load_extra
    from .shipped import pretrained_path

    if getattr(args, "dims", None):  # token lengths given by dim name: those decide
        return []
    extra, notes = load_extra(pretrained_path(shipped)), []
    sampling, training = extra.get("sampling") or {}, extra.get("training") or {}
    protein = extra.get("protein") or {}
    if sampling:  # a video model: its clips' frames and its codec's pixels per latent
        if getattr(args, "frames", None) is None and sampling.get("frames"):
            args.frames = int(sampling["frames"])
            notes.append(f"{args.frames} frames (the shipped model's sampling settings)")
        if getattr(args, "vae_stride", None) is None and sampling.get("codec_factor"):
            args.vae_stride = int(sampling["codec_factor"])
            if getattr(args, "size", None) is not None:  # the stride divides --size only
                notes.append(f"--vae-stride {args.vae_stride} (its {sampling.get('codec')} codec)")
    if training.get("seq_len") and getattr(args, "seq_len", None) is None:
        args.seq_len = int(training["seq_len"])
        notes.append(f"{args.seq_len} tokens (the length it was trained at)")
    if protein:
        if getattr(args, "residues", None) is None and protein.get("crop_size"):
            args.residues = int(protein["crop_size"])
            notes.append(f"{args.residues} residues (its training crop)")
        if getattr(args, "msa_depth", None) is None and protein.get("max_msa_rows"):
            args.msa_depth = int(protein["max_msa_rows"])
            notes.append(f"{args.msa_depth} MSA rows (its training depth)")
    return notes


def _protein(
    name: str,
    config: Any,
    args: argparse.Namespace,
    sizes: list[int],
    label: str,
    overrides: dict[str, Any],
) -> int:
    from dspzoo.domains.protein.workload import DEFAULT_MSA_DEPTH, DEFAULT_RESIDUES, plan_table

    if args.strategies and {s.strip() for s in args.strategies.split(",") if s.strip()} != {"dsp"}:
        raise UsageError(f"{name} runs under the dsp strategy only; drop --strategies")
    dims = parse_dims(args.dims)
    unknown = sorted(set(dims) - {"s", "r"})
    if unknown:
        raise UsageError(
            f"{name} has token dims s (MSA rows) and r (residues; the pair's i and j follow it); "
            f"--dims names {unknown}"
        )
    residues = dims.get("r", args.residues or DEFAULT_RESIDUES)
    msa_depth = dims.get("s", args.msa_depth or DEFAULT_MSA_DEPTH)
    params = count_parameters(create_model(name, device="meta", **overrides))
    what = "forward pass" if args.inference else "training step"
    print(
        f"{label}: {format_count(params)} parameters, batch {args.batch}, MSA (s={msa_depth}, "
        f"r={residues}) x{config.c_m}, pair (i={residues}, j={residues}) x{config.c_z}, {what}; "
        f"the Evoformer runs under dsp only: bytes rank 0 sends ({args.dtype_bytes}-byte items)"
    )
    print(
        plan_table(
            name,
            config,
            residues=residues,
            msa_depth=msa_depth,
            sp_sizes=sizes,
            batch=args.batch,
            itemsize=args.dtype_bytes,
            training=not args.inference,
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Print the prediction table; bad input raises ``ValueError``/``KeyError`` with the reason.

    A reader that closes the pipe early (``dspzoo plan ... | head``) ends it quietly."""
    try:
        status = _run(args)
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        return reader_gone()


def _run(args: argparse.Namespace) -> int:
    name, label, shipped = resolve_model(args.model)  # clear error for unknown names
    sizing = sizing_of(name.split("-", 1)[0])
    _check_flags(name, sizing, args)
    # a shipped name plans the shipped model: its saved config, its training/sampling sizes
    overrides = shipped_overrides(name, shipped) if shipped else {}
    config = override_config(get_config(name), **overrides)
    shipped_notes = shipped_sizes(shipped, args) if shipped else []
    sizes = list(args.sp)
    if sizing is PROTEIN:
        return _protein(name, config, args, sizes, label, overrides)
    wl, notes = workload_from_args(name, config, sizing, args, overrides)
    notes = shipped_notes + notes
    strategies = [s.strip() for s in (args.strategies or "").split(",") if s.strip()]
    known = ("auto", *STRATEGIES, "ulysses_flat")
    unknown = [s for s in strategies if s not in known]
    if unknown:
        raise UsageError(
            f"--strategies: unknown {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(known)} (ulysses_flat: the reference code's Ulysses, predicted only)"
            + corrections(unknown, known)
        )
    rows = predict_table(
        wl,
        strategies or list(default_strategies(wl)),
        sizes,
        args.cluster,
        dp=args.dp,
        zero=args.zero,
        recompute=args.recompute,
        training=not args.inference,
    )
    rows = merge_same_plans(rows, wl)  # one row per distinct plan and prediction
    if args.steps != 1:
        rows = [
            p.__class__(
                **{
                    **p.__dict__,
                    "flops": p.flops * args.steps,
                    "bytes": p.bytes * args.steps,
                    "compute_s": p.compute_s * args.steps,
                    "comm_s": p.comm_s * args.steps,
                    "step_s": p.step_s * args.steps,
                    "memory_s": p.memory_s * args.steps,
                    "copy_s": p.copy_s * args.steps,
                    "latency_s": p.latency_s * args.steps,
                }
            )
            for p in rows
        ]
    dims = ", ".join(f"{d}={n}" for d, n in zip(wl.dims, wl.lengths))
    what = "inference" if args.inference else "training step"
    print(
        f"{label}: {format_count(wl.params)} parameters, batch {wl.batch}, tokens ({dims}), "
        f"{what} x{args.steps} on {args.cluster}"
    )
    if args.cluster == "this-cpu":
        from dspzoo.core.costmodel.cluster import this_cpu_note

        print(f"  {this_cpu_note()}")
    for note in notes:
        print(f"  default size: {note}")
    for line in describe_scans(wl):
        print(line)
    print(format_table(rows, recommend(rows)))
    print("\n".join(TABLE_LEGEND))
    for line in describe_methods(wl, strategies or list(default_strategies(wl)), sizes):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))


if __name__ == "__main__":
    sys.exit(main())
