"""The benchmark's agreement check: every strategy against one process on the same samples.

Each rank runs the step once alone (``SeqParallel()``, no group) on its DP group's samples:
the reference output ``[B, …]`` and every parameter gradient. A strategy's gathered output and
its full gradients (the SP-group mean, the gradient contract; Megatron's reassembled tensors)
are compared with them by relative error (``max|got − want| / max|want|``, the public
harness's :func:`~dspzoo.core.harness.relative_error`), flagged above the run's tolerance:
``1e-4`` in fp32. Under ``--mixed-precision`` the reference is one process under the same
autocast, and the tolerance follows the rounding of that very computation: the reference is run
once more in fp32, and the tolerance is the larger of a multiple of the dtype's epsilon and a
multiple of how far the autocast reference lies from the fp32 one
(:func:`~dspzoo.core.bench.precision.tolerance_for`, where the values are argued), so a deeper
model, whose rounding grows with its depth, is not flagged for rounding alone; it is capped
(:data:`~dspzoo.core.bench.precision.MAX_RTOL`) so that an O(1) error is always flagged. Under
fp16 the checked steps scale the loss (:func:`~dspzoo.core.bench.precision.scaled_backward`),
as fp16 training does, so that small gradients do not underflow.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..harness import relative_error
from .precision import FP32_RTOL, Precision, loss_scales, scaled_backward, tolerance_for

ATOL = 1e-12


@dataclass
class Reference:
    """One process's output (gathered, ``[B, …]``) and parameter gradients, by name, and the
    relative error above which a strategy disagrees with them (``rtol``)."""

    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    rtol: float = FP32_RTOL
    rounding: float = 0.0  # under autocast: its relative error against the step in fp32
    loss_scale: float = 1.0  # under fp16: the loss scale its gradients came from
    finite: bool = True  # its loss and gradients are finite (False: no loss scale helped)


def one_process_reference(case: Any, inputs: dict[str, torch.Tensor]) -> Reference:
    """Run ``case``'s step on ``inputs`` in this process alone (a copy of the weights), with
    the tolerance of the check: under autocast measured against the same step in fp32; under
    fp16 with the largest loss scale that keeps its gradients finite
    (:data:`~dspzoo.core.bench.precision.FP16_LOSS_SCALES`), which the strategies' checked
    step then uses too (:func:`~dspzoo.core.bench.precision.sharded_loss_scale`). A loss
    that overflows in the forward ends the search: no scale helps it."""
    for scale in loss_scales(case.precision):
        reference, loss_finite = _one_process(case, inputs, scale)
        if reference.finite or not loss_finite:
            break
    if case.precision.dtype is None:
        return reference
    exact, _ = _one_process(replace(case, precision=Precision()), inputs, 1.0)
    rounding = max(
        relative_error(reference.output.float(), exact.output, ATOL),
        *(relative_error(g, exact.grads[n], ATOL) for n, g in reference.grads.items()),
    )
    reference.rounding = rounding
    reference.rtol = tolerance_for(case.precision.dtype, rounding)
    return reference


def _one_process(
    case: Any, inputs: dict[str, torch.Tensor], loss_scale: float
) -> tuple[Reference, bool]:
    """``case``'s step on ``inputs`` in this process alone, on a copy of the weights, its
    backward with ``loss_scale`` (:attr:`Reference.finite`: loss and gradients finite); and
    whether its loss is finite."""
    from ..parallel.runtime import SeqParallel

    model = copy.deepcopy(case.model)
    sp = SeqParallel()
    model.zero_grad(set_to_none=True)
    loss, out = case.step(model, sp, inputs)
    loss_finite = bool(torch.isfinite(loss.detach()))
    finite = scaled_backward(loss, model.parameters(), loss_scale) and loss_finite
    with torch.no_grad():
        output = sp.exit(out.with_tensor(out.tensor.detach()))
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    return Reference(output, grads, loss_scale=loss_scale, finite=finite), loss_finite


@dataclass
class Agreement:
    """Relative errors of one strategy on one rank against :class:`Reference`."""

    output_error: float
    grad_error: float
    worst_param: str
    missing: list[str]
    rtol: float = FP32_RTOL

    @property
    def ok(self) -> bool:
        return self.output_error <= self.rtol and self.grad_error <= self.rtol and not self.missing


def compare(
    reference: Reference,
    output: torch.Tensor,
    grads: dict[str, torch.Tensor],
    rtol: float | None = None,
) -> Agreement:
    """Output and every reference parameter's gradient against one process, flagged above
    ``rtol`` (default: the reference's, :attr:`Reference.rtol`)."""
    rtol = reference.rtol if rtol is None else rtol
    out_err = relative_error(output, reference.output, ATOL)
    grad_err, worst, missing = 0.0, "", []
    for name, want in reference.grads.items():
        got = grads.get(name)
        if got is None:
            missing.append(name)
            continue
        err = relative_error(got, want, ATOL)
        if not err <= grad_err:
            grad_err, worst = err, name
    return Agreement(out_err, grad_err, worst, missing, rtol)
