"""The benchmark's case: one model with its weights, one global batch, the strategies to run.

A :class:`Case` is what every strategy of one run shares: the model (seeded, perturbed off its
identity start), the inputs, the step (forward + the sharded loss, as training runs it) and the
cost model's :class:`~dspzoo.core.costmodel.Workload` of the same shapes. Which strategies a
run compares comes from one list, :data:`dspzoo.core.parallel.strategies.STRATEGIES`; which of them the
model cannot run, and why, from the method registry (:meth:`Method.unsupported`) and the model
(Megatron-SP needs ``TP_PLAN`` linears).
"""

from __future__ import annotations

import argparse
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..argparser import corrections, suggestion
from .precision import Precision

PEER = "deepspeed_ulysses"
# Mamba models: the families whose sequence mixers are selective scans, and the three ways a
# scan stage runs under SP that a Mamba case compares (``all`` means these for such a model)
MAMBA_LM_FAMILIES = ("mambalm", "mamba2lm")
MAMBA_VIDEO_FAMILIES = ("videomamba",)
SCAN_STRATEGIES = ("dsp", "state_passing", "head_a2a")
# the families the benchmark builds a case of (:func:`build_case`): video DiTs (inputs
# ``x, t, y``, patches ``t × s``), byte-level LMs, and the Mamba models above
VIDEO_FAMILIES = ("stdit", "latte")
TEXT_FAMILIES = ("bytelm",)
BENCH_FAMILIES = VIDEO_FAMILIES + MAMBA_VIDEO_FAMILIES + TEXT_FAMILIES + MAMBA_LM_FAMILIES
BENCH_MODELS = (
    "video DiTs (stdit-*, latte-*), byte LMs (bytelm-*) and Mamba models (mambalm-*, "
    "mamba2lm-*, videomamba-*)"
)


def model_family(name: str) -> str:
    """The zoo family of model ``name`` (``"mamba2lm-tiny"`` → ``"mamba2lm"``)."""
    return name.lower().split("-")[0]


def is_mamba(name: str) -> bool:
    return model_family(name) in MAMBA_LM_FAMILIES + MAMBA_VIDEO_FAMILIES


def scan_heads(config: Any) -> int:
    """What a head all-to-all shards in a Mamba model: Mamba-2 heads, Mamba-1 channels."""
    inner = config.expand * getattr(config, "hidden_size", getattr(config, "hidden", 0))
    if getattr(config, "version", None) == 2:
        return config.num_heads
    if getattr(config, "mixer", None) == "mamba2":
        return inner // config.head_dim
    return inner


def unsupported_model(name: str) -> str | None:
    """Why the benchmark cannot build a case of model ``name`` (``None``: it can): a family
    outside :data:`BENCH_FAMILIES`, or a name the zoo does not know (with its hint)."""
    from dspzoo.zoo.registry import resolve_name

    from ..entry import error_message

    family = model_family(name)
    if family not in BENCH_FAMILIES:
        hint = suggestion(difflib.get_close_matches(family, BENCH_FAMILIES, n=1, cutoff=0.6))
        return (
            f"{name!r} is not a model the benchmark runs (family {family!r}); it takes "
            f"{BENCH_MODELS}{hint} (`dspzoo plan` predicts the other families)"
        )
    try:
        resolve_name(name)
    except (KeyError, ValueError) as exc:
        return error_message(exc)
    return None


def model_argument(text: str) -> str:
    """``--model``'s argparse ``type``: a model the benchmark runs (:func:`unsupported_model`),
    else a usage error, the same on every rank before anything is built."""
    why = unsupported_model(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def known_strategies() -> tuple[str, ...]:
    """What ``--strategies`` may name: every registered strategy, the scan methods of a Mamba
    case (:data:`SCAN_STRATEGIES`) and the DeepSpeed peer (its row is ``--peer``'s)."""
    from ..parallel.strategies import STRATEGIES

    scans = tuple(s for s in SCAN_STRATEGIES if s not in STRATEGIES)
    return (*STRATEGIES, *scans, PEER)


def strategies_argument(text: str) -> str:
    """``--strategies``' argparse ``type``: ``all`` or comma-separated names of
    :func:`known_strategies`; an unknown name is a usage error naming it, the choices and the
    closest (a registered strategy a model cannot run is reported by :func:`select_strategies`
    instead)."""
    if text.strip() == "all":
        return "all"
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = known_strategies()
    unknown = [s for s in names if s not in known]
    if not names or unknown:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else f"no name in {text!r}"
        raise argparse.ArgumentTypeError(
            f"{what}; choose from all (the default) or a comma-separated list of "
            f"{', '.join(known)} (state_passing, head_a2a: Mamba models' scan methods; "
            f"{PEER}: the peer row, see --peer)" + corrections(unknown, known)
        )
    return ",".join(names)


@dataclass
class Case:
    """One model with its weights and one global batch of inputs, the same on every rank.

    Attributes:
        name: the zoo model name.
        text: a 1-D byte LM (``tokens [B, L+1]``) rather than a video DiT
            (``x, target [B, C, F, H, W]``, ``t [B]``, ``y [B]``).
        model: the reference weights (each strategy runs on its own copy).
        lengths: token lengths of the sequence dims, e.g. ``{"t": 8, "s": 64}``.
        batch: samples of the global batch.
        inputs: the global batch (sliced per DP group by :meth:`shard_batch`).
        overrides: config fields replaced at creation (also given to the cost model).
        precision: what :meth:`step` runs in (``--mixed-precision``): fp32, or its forward
            and loss under autocast with fp32 parameters.
    """

    name: str
    text: bool
    model: torch.nn.Module
    lengths: dict[str, int]
    batch: int
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    frames: int = 0
    latent: int = 0
    precision: Precision = field(default_factory=Precision)

    @property
    def tokens(self) -> int:
        """Tokens of the global batch (one step)."""
        return self.batch * math.prod(self.lengths.values())

    @property
    def mamba(self) -> bool:
        """A Mamba model: its stages are scans, compared under :data:`SCAN_STRATEGIES`."""
        return is_mamba(self.name)

    @property
    def heads(self) -> int:
        """Attention heads, or for a Mamba model what a head all-to-all shards."""
        cfg = self.model.config
        return scan_heads(cfg) if self.mamba else cfg.heads

    @property
    def depth(self) -> int:
        cfg = self.model.config
        return cfg.num_hidden_layers if hasattr(cfg, "num_hidden_layers") else cfg.depth

    def strategy(self, name: str) -> Any:
        """What ``SeqParallel`` runs for strategy ``name``: the name, or for a scan method
        (``state_passing``, ``head_a2a``: not whole-model strategies) the embedded strategy
        that shards the longest sequence dim and runs every scan over it with that method."""
        from ..parallel.strategies import STRATEGIES, Embedded

        return name if name in STRATEGIES else Embedded(name)

    def describe(self) -> str:
        dims = " × ".join(f"{d}={n}" for d, n in self.lengths.items())
        cfg = self.model.config
        if self.mamba:
            hidden = getattr(cfg, "hidden_size", getattr(cfg, "hidden", 0))
            kind = f"Mamba-{cfg.version}" if hasattr(cfg, "version") else cfg.mixer
            extra = ", checkpoint" if getattr(cfg, "checkpoint", False) else ""
            return (
                f"{self.name} ({kind}, hidden {hidden}, state {cfg.state_size}, "
                f"{self.heads} scan heads/channels, depth {self.depth}{extra}): "
                f"global batch {self.batch}, {dims} = {self.tokens} tokens per step"
            )
        extra = "".join(
            f", {k} {getattr(cfg, k)}"
            for k in ("full_attention_every", "num_kv_heads", "checkpoint")
            if getattr(cfg, k, None) and not (k == "num_kv_heads" and cfg.num_kv_heads == cfg.heads)
        )
        return (
            f"{self.name} (hidden {cfg.hidden}, heads {cfg.heads}, depth {cfg.depth}{extra}): "
            f"global batch {self.batch}, {dims} = {self.tokens} tokens per step"
        )

    def workload(self, batch: int, itemsize: int | None = None) -> Any:
        """The cost model's description of ``batch`` samples of this case, its activations
        at ``itemsize`` bytes per element throughout (default: the run's element sizes,
        :attr:`Precision.itemsize` and, for the residual stream, :attr:`Precision.stream_itemsize`)."""
        from dspzoo.zoo.workloads import workload_for

        if itemsize is None:
            wl = self.workload(batch, self.precision.itemsize)
            return wl.with_(stream_itemsize=self.precision.stream_itemsize)
        sizes = {"seq_len": self.lengths["l"]} if self.text else {
            "frames": self.frames, "spatial": self.latent
        }  # fmt: skip
        return workload_for(
            self.name, batch=batch, itemsize=itemsize, overrides=self.overrides, **sizes
        )

    def to(self, device: torch.device | str) -> Case:
        """This case with its model and inputs on ``device`` (the accelerator's: a CUDA device
        when the run has one), in place."""
        self.model.to(device)
        self.inputs = {k: v.to(device) for k, v in self.inputs.items()}
        return self

    def shard_batch(self, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """The samples of data-parallel group ``dp_rank``."""
        per = self.batch // dp_size
        return {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in self.inputs.items()}

    def step(
        self, model: torch.nn.Module, sp: Any, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Any]:
        """This rank's loss and its output shard (a ``SeqTensor``; no output gather); the
        forward and the loss under the case's autocast (:attr:`precision`), on the device of
        ``inputs``. The caller's ``backward`` runs outside it, as PyTorch recommends."""
        device_type = next(iter(inputs.values())).device.type
        with self.precision.autocast(device_type):
            return self._forward_and_loss(model, sp, inputs)

    def _forward_and_loss(
        self, model: torch.nn.Module, sp: Any, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Any]:
        from ..loss import sp_mse

        if self.text:
            from dspzoo.domains.text.model import lm_loss

            tokens = inputs["tokens"]
            out = model(tokens[:, :-1], sp, gather_output=False)
            return lm_loss(out, tokens[:, 1:], sp), out
        out = model(inputs["x"], inputs["t"], inputs["y"], sp=sp, gather_output=False)
        raw = getattr(model, "module", model)  # under DDP in end-to-end mode
        target = sp.shard_like(raw.patchify_target(inputs["target"]), out)
        return sp_mse(out.tensor, target, sp.group), out


def build_case(args: argparse.Namespace, batch: int) -> Case:
    """The model (seeded, perturbed off its identity start) and ``batch`` samples of inputs.

    Reads ``--model``, ``--seq-len`` / ``--frames`` / ``--latent``, ``--kv-heads``,
    ``--checkpoint``, ``--full-attention-every``, ``--perturb``, ``--seed`` and
    ``--mixed-precision`` from ``args``.
    """
    from dspzoo.zoo import create_model

    from ..entry import UsageError

    why = unsupported_model(args.model)
    if why is not None:  # the parser's --model refuses it first (model_argument)
        raise UsageError(f"--model: {why}")
    family = model_family(args.model)
    mamba_lm = family in MAMBA_LM_FAMILIES
    text = family == "bytelm" or mamba_lm
    if is_mamba(args.model):
        import dspzoo.domains.mamba  # noqa: F401
    if text:
        import dspzoo.domains.text  # noqa: F401
    else:
        import dspzoo.domains.video  # noqa: F401
    overrides: dict[str, Any]
    if mamba_lm:  # no position table: any length
        overrides = {"checkpoint": True} if getattr(args, "checkpoint", False) else {}
    elif text:
        overrides = {"max_len": max(args.seq_len, 512)}
        if getattr(args, "kv_heads", 0):
            overrides["kv_heads"] = args.kv_heads
        if getattr(args, "checkpoint", False):
            overrides["checkpoint"] = True
    elif family in MAMBA_VIDEO_FAMILIES:
        overrides = {"max_frames": max(args.frames, 16)}
    else:
        overrides = {"cond_dim": 0, "max_frames": max(args.frames, 16)}
        if getattr(args, "full_attention_every", 0):
            overrides["full_attention_every"] = args.full_attention_every
    torch.manual_seed(args.seed)
    model = create_model(args.model, **overrides)
    g = torch.Generator().manual_seed(args.seed + 1)
    perturb = getattr(args, "perturb", 0.02)
    with torch.no_grad():  # adaLN-Zero starts as the identity: perturb for non-trivial outputs
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * perturb)
    cfg = model.config
    precision = Precision(getattr(args, "mixed_precision", "no"))
    if text:
        tokens = torch.randint(0, 256, (batch, args.seq_len + 1), generator=g)
        return Case(args.model, True, model.train(), {"l": args.seq_len}, batch,
                    {"tokens": tokens}, overrides, precision=precision)  # fmt: skip
    pt, ph, pw = cfg.patch
    lengths = {"t": args.frames // pt, "s": (args.latent // ph) * (args.latent // pw)}
    if family in MAMBA_VIDEO_FAMILIES:  # a grid model: t, h, w
        lengths = {"t": args.frames // pt, "h": args.latent // ph, "w": args.latent // pw}
    shape = (batch, cfg.in_channels, args.frames, args.latent, args.latent)
    inputs = {
        "x": torch.randn(shape, generator=g),
        "target": torch.randn(shape, generator=g),
        "t": torch.rand(batch, generator=g) * 1000,
        "y": torch.randint(0, max(cfg.num_classes, 1), (batch,), generator=g),
    }
    return Case(args.model, False, model.eval(), lengths, batch, inputs, overrides,
                args.frames, args.latent, precision)  # fmt: skip


def not_runnable(name: str, case: Case, sp: int) -> str | None:
    """Why ``case`` cannot run strategy ``name`` at SP ``sp`` (``None``: it can).

    The reasons come from the method registry (a method's :meth:`unsupported`, e.g. Ulysses
    with fewer heads than ranks) and, for tensor-parallel methods, from the model: it must
    declare ``TP_PLAN`` linears.
    """
    from ..harness import declares_tensor_parallelism
    from ..parallel.methods.registry import METHODS
    from ..parallel.strategies import STRATEGIES

    if case.mamba and name not in SCAN_STRATEGIES:
        return f"a Mamba model's stages are scans: compare {', '.join(SCAN_STRATEGIES)}"
    if not case.mamba and name in SCAN_STRATEGIES and name not in STRATEGIES:
        return f"a scan method (of Mamba models): {case.name} has no scans"
    if not case.mamba and name not in STRATEGIES:
        return f"not a registered strategy (registered: {', '.join(STRATEGIES)})"
    method = METHODS.get(name)
    if method is None:  # a policy over methods (dsp): it plans around what cannot run
        return None
    if method.tensor_parallel and not declares_tensor_parallelism(case.model):
        return (
            f"{type(case.model).__name__} declares no TP_PLAN linears (its blocks do not call "
            f"sp.tp_enter/sp.tp_exit)"
        )
    return method.unsupported(sp, case.heads)


def select_strategies(requested: str, case: Case, sp: int) -> tuple[list[str], dict[str, str]]:
    """Strategies to run (``dsp`` first: the reference) and the others with the reason.

    ``requested``: ``"all"`` (every name of :data:`~dspzoo.core.parallel.strategies.STRATEGIES`;
    for a Mamba model :data:`SCAN_STRATEGIES`) or a comma-separated list. A strategy the model
    cannot run is reported as ``"not runnable: <reason>"``, never run into a failure.
    """
    from ..parallel.strategies import STRATEGIES

    if sp == 1:
        return ["dsp"], {"*": "SP 1: pure data parallelism, every strategy is the same"}
    every = SCAN_STRATEGIES if case.mamba else tuple(STRATEGIES)
    names = (
        list(every)
        if requested == "all"
        else [s.strip() for s in requested.split(",") if s.strip()]
    )
    run, skipped = [], {}
    for name in names:
        if name == PEER:
            continue
        why = not_runnable(name, case, sp)
        if why is None:
            run.append(name)
        else:
            skipped[name] = f"not runnable: {why}"
    if "dsp" not in run:
        run.insert(0, "dsp")
    run.sort(key=lambda s: s != "dsp")
    return run, skipped
