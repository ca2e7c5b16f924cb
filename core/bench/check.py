"""The benchmark's agreement check: every strategy against one process on the same samples.

Each rank runs the step once alone (``SeqParallel()``, no group) on its DP group's samples:
the reference output ``[B, …]`` and every parameter gradient. A strategy's gathered output and
its full gradients (the SP-group mean, the gradient contract; Megatron's reassembled tensors)
are compared with them by relative error (``max|got − want| / max|want|``, the public
harness's :func:`~dspzoo.core.harness.relative_error`), flagged above the run's tolerance:
``1e-4`` in fp32, a multiple of the dtype's epsilon under autocast
(:func:`~dspzoo.core.bench.precision.tolerance`, where the value is argued). The reference runs
the case's step, so under ``--mixed-precision`` it is one process under the same autocast.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..harness import relative_error
from .precision import FP32_RTOL

# relative error above which a strategy is flagged as disagreeing with one process (fp32);
# under autocast the tolerance follows the dtype (precision.tolerance)
RTOL = FP32_RTOL
ATOL = 1e-12


@dataclass
class Reference:
    """One process's output (gathered, ``[B, …]``) and parameter gradients, by name."""

    output: torch.Tensor
    grads: dict[str, torch.Tensor]


def one_process_reference(case: Any, inputs: dict[str, torch.Tensor]) -> Reference:
    """Run ``case``'s step on ``inputs`` in this process alone (a copy of the weights)."""
    from ..parallel.runtime import SeqParallel

    model = copy.deepcopy(case.model)
    sp = SeqParallel()
    model.zero_grad(set_to_none=True)
    loss, out = case.step(model, sp, inputs)
    loss.backward()
    with torch.no_grad():
        output = sp.exit(out.with_tensor(out.tensor.detach()))
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    return Reference(output, grads)


@dataclass
class Agreement:
    """Relative errors of one strategy on one rank against :class:`Reference`."""

    output_error: float
    grad_error: float
    worst_param: str
    missing: list[str]
    rtol: float = RTOL

    @property
    def ok(self) -> bool:
        return self.output_error <= self.rtol and self.grad_error <= self.rtol and not self.missing


def compare(
    reference: Reference,
    output: torch.Tensor,
    grads: dict[str, torch.Tensor],
    rtol: float = RTOL,
) -> Agreement:
    """Output and every reference parameter's gradient against one process, flagged above
    ``rtol`` (the run's: :attr:`~dspzoo.core.bench.precision.Precision.rtol`)."""
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
