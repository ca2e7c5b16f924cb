"""The tensor-parallel contract: what a module must declare to run under ``megatron_sp``.

``megatron_sp`` (:mod:`dspzoo.core.parallel.methods.megatron`) shards the linears a module names
in its class attribute ``TP_PLAN`` and nothing else; it can only cut them where the module's
own forward will still make sense. The contract, checked by :func:`check_tp_contract` before
the weights are sharded (by the harness, the benchmark and the training path):

1. ``TP_PLAN`` maps attribute names to ``"column"``, ``("column", k)`` (``k`` stacked groups,
   e.g. q, k, v: 3) or ``"row"``; each names an ``nn.Linear`` of the module.
2. A module whose linears carry **attention heads** has an integer attribute ``heads``: its
   head count, the shard unit. Rank ``r`` of ``N`` then gets ``shard_sizes(heads, N)[r]`` whole
   heads of every group (never part of a head), which needs ``heads`` to divide each column's
   per-group outputs and the row linear's inputs. A module without ``heads`` is sharded by
   single features (an MLP's hidden units). A module that names its head count otherwise
   (``num_heads``, ``n_heads``…) and not ``heads`` would be cut through its heads — the usual
   symptom is an ``EinopsError`` in its forward at some SP size, or silently wrong heads at
   another — so it is refused here, with the fix.
3. Every rank needs at least one unit: ``N ≤`` the smallest unit count (heads, or features).
   :func:`tp_units` gives that count; the method registry's ``unsupported`` turns it into the
   "not runnable" reason.
4. At run time the forward reads its *local* head count from the weight shapes (or reshapes
   with the head dim, ``rearrange(..., "... (n h d) -> n ... h d", n=3, d=head_dim)``), calls
   ``sp.tp_enter`` before the column linears and ``sp.tp_exit(row_linear, y, spec)`` for the
   row one. The harness checks this part: outputs and gradients under ``megatron_sp`` equal one
   process's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

HEAD_COUNT_NAMES = ("num_heads", "n_heads", "nheads", "n_head", "num_attention_heads")
"""Attribute names that hold a head count under another name than ``heads``."""

CONTRACT_DOC = "docs/new_architecture.md, 'Tensor parallelism: the TP_PLAN contract'"


class TPContractError(ValueError):
    """A module's ``TP_PLAN`` breaks the tensor-parallel contract (one line: what and the fix)."""


@dataclass(frozen=True)
class TPLinear:
    """One linear a ``TP_PLAN`` declares.

    Attributes:
        where: ``module_path.linear`` (the model's class name for the root module).
        style: ``"column"`` or ``"row"``.
        groups: stacked groups of a column linear (q, k, v: 3).
        units: shard units per group (heads, or single features).
        unit: ``"heads"`` or ``"features"``.
    """

    where: str
    style: str
    groups: int
    units: int
    unit: str


def _style(entry: object, where: str) -> tuple[str, int]:
    if isinstance(entry, str):
        style, groups = entry, 1
    elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], int):
        style, groups = entry
    else:
        style, groups = "", 0
    if style not in ("column", "row") or groups < 1 or (style == "row" and groups != 1):
        raise TPContractError(
            f"{where}: bad TP_PLAN entry {entry!r}; use 'column', ('column', k) or 'row' "
            f"({CONTRACT_DOC})"
        )
    return style, groups


def _heads_of(module: nn.Module, owner: str) -> int | None:
    """The module's ``heads`` (checked), or ``None`` for a feature-sharded module."""
    heads = getattr(module, "heads", None)
    if heads is None:
        other = [n for n in HEAD_COUNT_NAMES if isinstance(getattr(module, n, None), int)]
        if other:
            raise TPContractError(
                f"megatron_sp: {owner} ({type(module).__name__}) declares TP_PLAN and a head "
                f"count {other[0]}={getattr(module, other[0])} but no attribute 'heads', so its "
                f"linears would be cut by single features, through its heads; set "
                f"self.heads = {other[0]} (the shard unit) and read the local head count from "
                f"the weight shape in forward ({CONTRACT_DOC})"
            )
        return None
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise TPContractError(
            f"megatron_sp: {owner} ({type(module).__name__}).heads is {heads!r}; TP_PLAN shards "
            f"by whole heads, so 'heads' must be the module's head count, an int >= 1 "
            f"({CONTRACT_DOC})"
        )
    return heads


def tp_linears(model: nn.Module) -> list[TPLinear]:
    """Every linear the model's ``TP_PLAN`` s declare, checked against the contract (module
    docstring, points 1–2); raises :class:`TPContractError` naming the module and the fix."""
    found = []
    for path, module in model.named_modules():
        plan = getattr(type(module), "TP_PLAN", None)
        if not plan:
            continue
        owner = path or type(model).__name__
        heads = _heads_of(module, owner)
        for name, entry in plan.items():
            where = f"{owner}.{name}"
            style, groups = _style(entry, where)
            linear = getattr(module, name, None)
            if not isinstance(linear, nn.Linear):
                raise TPContractError(
                    f"megatron_sp: {where} is declared in TP_PLAN but is "
                    f"{type(linear).__name__ if linear is not None else 'missing'}, not an "
                    f"nn.Linear attribute of {type(module).__name__} ({CONTRACT_DOC})"
                )
            features = linear.out_features if style == "column" else linear.in_features
            per_group, rest = divmod(features, groups)
            if rest or (heads is not None and per_group % heads):
                what = f"{heads} heads" if heads is not None else f"{groups} equal groups"
                side = "outputs" if style == "column" else "inputs"
                raise TPContractError(
                    f"megatron_sp: {where} has {features} {side}, which do not split into "
                    f"{groups} group(s) of {what}; a {style} linear's {side} must be "
                    f"groups x heads x head_dim ({CONTRACT_DOC})"
                )
            units = heads if heads is not None else per_group
            unit = "heads" if heads is not None else "features"
            found.append(TPLinear(where, style, groups, units, unit))
    return found


def declares_tensor_parallelism(model: nn.Module) -> bool:
    """True when some module of ``model`` declares ``TP_PLAN`` (``megatron_sp`` applies)."""
    return any(getattr(type(m), "TP_PLAN", None) for m in model.modules())


def check_tp_contract(model: nn.Module) -> None:
    """Raise :class:`TPContractError` (a ``ValueError``: one line at an entry point) if the
    model cannot be sharded by ``megatron_sp``: no ``TP_PLAN`` at all, or one that breaks the
    contract of the module docstring."""
    if not declares_tensor_parallelism(model):
        raise TPContractError(
            f"megatron_sp: {type(model).__name__} declares no TP_PLAN, so tensor parallelism has "
            f"no linears to shard; declare TP_PLAN on its attention/MLP modules and call "
            f"sp.tp_enter / sp.tp_exit around them ({CONTRACT_DOC}), or use a sequence-parallel "
            f"strategy (dsp, ulysses, ring, ...)"
        )
    tp_linears(model)


def tp_units(model: nn.Module) -> TPLinear | None:
    """The declared linear with the fewest shard units (what bounds the SP size under
    ``megatron_sp``), ``None`` without ``TP_PLAN``. Checks the contract on the way."""
    linears = tp_linears(model)
    return min(linears, key=lambda t: t.units) if linears else None
