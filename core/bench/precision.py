"""The benchmark's precision (``--mixed-precision no|bf16|fp16``): what the timed steps run in,
how close to one process they must come, and how their bytes are counted.

Mixed precision as training uses it: the parameters stay fp32 and every strategy's forward and
loss (and those of the one-process reference of the check) run under
``torch.autocast(device_type, dtype)``; the backward runs outside autocast, in the dtypes
autocast chose for each forward op (PyTorch's recommended use). fp16 autocast needs a GPU: on a
CPU it is refused (:func:`refuse_unsupported`) before any process group exists.

**Tolerance of the check.** fp32 steps agree with one process up to ``1e-4`` (the summation
order of the sharded reductions). Under autocast the parallel and the one-process step round
different intermediate tensors to the low-precision dtype (a Megatron partial sum, a ring's
blockwise softmax kept in fp32 where one process rounds the attention output, a switch of a
bf16 tensor against none), so they differ by the dtype's rounding, amplified through the
layers and the backward — more in a deeper model. The tolerance (:func:`tolerance_for`) is the
larger of :data:`ROUNDINGS` times the dtype's machine epsilon (:func:`tolerance`: bf16, 8
significant bits, ε = 2⁻⁷, 6.25e-2; fp16, 11 bits, ε = 2⁻¹⁰, 7.8e-3) and
:data:`ROUNDING_MARGIN` times the step's own rounding, measured in the run: the one-process
reference under autocast against the same step in fp32 (``check.one_process_reference``), and
at most :data:`MAX_RTOL`. A wrong result the check exists to catch (a missing SP-group mean
halves a gradient, a wrong shard swaps tokens) is off by O(1) and still fails
(``tests/test_benchmark_precision.py``).

**Loss scaling under fp16.** The checked steps scale the loss, as fp16 training does
(:data:`FP16_LOSS_SCALES`, :func:`scaled_backward`), so that small gradients do not underflow;
the timed steps do not (a scale changes none of their kernels).

**Bytes.** Under autocast some collectives carry 16-bit tensors (what a linear produced: the
Q/K/V and outputs of Ulysses' all-to-alls) and others fp32 ones (the residual stream, which
adds fp32 to the low-precision branch and stays fp32: DSP's switches; ring's fp32 dK/dV
accumulators). The tracer records each collective's dtype; :func:`fp32_equivalent` scales a
16-bit payload to fp32 bytes, so "traced = formula" compares the *elements* sent with the cost
model's formula at 4 bytes per element, exactly, on every rank and (op, phase), whatever dtype
each op sent. The report shows the bytes actually sent, by dtype, and the formula at the run's
element sizes (:attr:`Precision.itemsize` for what the linears and attention produce,
:attr:`Precision.stream_itemsize` for the residual stream: the cost model's
``Workload.itemsize`` and ``Workload.stream_itemsize``), which is then the bytes sent, exactly,
for the video and text models' strategies (``tests/test_benchmark_precision.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..entry import UsageError

#: the values of ``--mixed-precision``
PRECISIONS = ("no", "bf16", "fp16")
#: fp32 steps against one process: the summation order of sharded reductions
FP32_RTOL = 1e-4
#: the floor of the check's tolerance under autocast, in units of the dtype's machine epsilon
#: ε. One rounding is at most ε/2 of the value; a weight gradient is rounded once per rank
#: before the SP-group sum (once in one process), and the activation gradients reaching it
#: carry the roundings the two steps placed differently in every layer above, so the error
#: grows with depth (hence ROUNDING_MARGIN beside it). Measured under bf16 on the CPU (28 Nov
#: 2026, SP 2, every strategy): stdit-mini (depth 4) 1.1e-2 = 1.4 ε, bytelm-small (depth 8,
#: L 256) 2.2e-2 = 2.8 ε. A wrong result the check exists for (a gradient missing the
#: SP-group mean is off by 0.5 of its size, a misplaced shard by ~1) stays well above 8 ε.
ROUNDINGS = 8
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: the tracer's dtype names (``str(dtype)`` without ``torch.``), short, as the report prints them
DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
_LOW_PRECISION = tuple(str(dtype).removeprefix("torch.") for dtype in _DTYPES.values())


@dataclass(frozen=True)
class Precision:
    """One value of ``--mixed-precision``: ``"no"`` (fp32 steps) or an autocast dtype.

    Attributes:
        name: ``"no"``, ``"bf16"`` or ``"fp16"``.
    """

    name: str = "no"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise UsageError(
                f"--mixed-precision {self.name}: choose one of {', '.join(PRECISIONS)}"
            )

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (``None``: no autocast, fp32)."""
        return _DTYPES.get(self.name)

    @property
    def itemsize(self) -> int:
        """Bytes per activation element the cost model prices the run at."""
        return 4 if self.dtype is None else self.dtype.itemsize

    @property
    def stream_itemsize(self) -> int | None:
        """Bytes per element of the residual stream where they differ from :attr:`itemsize`:
        4 under autocast (``x + block(x)`` adds the 16-bit branch to fp32 ``x``), else
        ``None`` (the cost model's ``Workload.stream_itemsize``)."""
        return None if self.dtype is None else 4

    @property
    def label(self) -> str:
        """In words, for the report: ``fp32`` or ``bf16 autocast (fp32 parameters)``."""
        return "fp32" if self.dtype is None else f"{self.name} autocast (fp32 parameters)"

    @property
    def rtol(self) -> float:
        """The check's tolerance (see :func:`tolerance`)."""
        return tolerance(self.dtype)

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        """``torch.autocast(device_type, dtype)`` for a low precision, else nothing."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=device_type, dtype=self.dtype):
            yield


#: the check's tolerance under autocast is at least this many times the rounding of the step
#: itself: how far the one-process reference under autocast lies from the same step in fp32.
#: A sharded step rounds as many tensors as one process, in other places, so its distance to
#: the autocast reference is of the same size. Measured on the CPU under bf16 at SP 2, every
#: strategy (28 Nov 2026; ``scripts/benchmark.py --mixed-precision bf16 --peer off`` under
#: ``accelerate launch --num_processes 2``): stdit-tiny (``--frames 4 --latent 8``, depth 2)
#: rounds 8.6e-3 and its worst strategy lies 0.79× that from the reference; bytelm-small
#: (``--seq-len 256 --reps 0``, depth 8) rounds 1.9e-2 and its worst lies 1.17× that (ring and
#: LSS on the zigzag layout). 4× leaves room; the floor of ROUNDINGS ε keeps shallow models,
#: whose rounding is small, at the dtype's tolerance (bytelm-small's is 7.5e-2 by its rounding).
ROUNDING_MARGIN = 4


#: the check's tolerance never exceeds this: a wrong result it exists to catch (a gradient
#: missing the SP-group mean is off by 0.5) stays flagged however large the step's rounding.
#: The report prints the reference's rounding beside the tolerance, so a step rounded close to
#: it (above ``MAX_RTOL / ROUNDING_MARGIN``) shows why its strategies may be flagged.
MAX_RTOL = 0.25

#: fp16's loss scales, largest first: the check's steps under fp16 multiply the loss by the
#: first under which the one-process reference's gradients are all finite, and divide the
#: gradients by it (GradScaler's start, 2¹⁶, halved on overflow). Without it small gradients
#: underflow fp16 (smallest normal 6.1e-5): on an H200 (28 Nov 2026, stdit-mini, SP 1) the
#: unscaled fp16 reference lay 0.97 (relative) from the fp32 step, which made the tolerance
#: 3.9: no check at all.
FP16_LOSS_SCALES = tuple(2.0**e for e in range(16, -1, -1))


def tolerance_for(dtype: torch.dtype | None, rounding: float) -> float:
    """The check's tolerance for a step under autocast in ``dtype`` whose one-process result
    lies ``rounding`` (relative error) from the same step in fp32: the larger of
    :func:`tolerance` and :data:`ROUNDING_MARGIN` × ``rounding``, which grows with the depth
    of the model as its rounding does, and at most :data:`MAX_RTOL`. fp32 (``None``):
    :data:`FP32_RTOL`."""
    if dtype is None or dtype == torch.float32:
        return FP32_RTOL
    return min(max(tolerance(dtype), ROUNDING_MARGIN * rounding), MAX_RTOL)


def loss_scales(precision: Precision) -> tuple[float, ...]:
    """The loss scales the check's one-process reference tries, in order: fp16's
    (:data:`FP16_LOSS_SCALES`), else none (1)."""
    return FP16_LOSS_SCALES if precision.name == "fp16" else (1.0,)


def scaled_backward(loss: torch.Tensor, params: Iterable[torch.nn.Parameter], scale: float) -> bool:
    """``loss.backward()`` with the loss multiplied by ``scale`` and the gradients of
    ``params`` divided by it after (loss scaling, so that small fp16 gradients do not
    underflow); ``scale`` 1: a plain backward. Returns whether every gradient is finite (one
    device sync; a DTensor gradient's local shard is read). A step of an SP group takes
    :func:`sharded_loss_scale` of the one-process reference's scale."""
    (loss * scale if scale != 1.0 else loss).backward()
    grads = [p.grad for p in params if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    with torch.no_grad():
        if scale != 1.0:
            torch._foreach_div_(grads, scale)
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def sharded_loss_scale(scale: float, sp_size: int) -> float:
    """The loss scale a step of an SP group of ``sp_size`` uses for the one-process
    reference's ``scale``: ``scale / 2^ceil(log2 sp_size)``, at least 1. Under the gradient
    contract a rank's loss is ``N`` times its share, so the sharded region's activation
    gradients are up to ``N`` times the one-process step's; this keeps a scale the reference
    found finite finite there too."""
    if scale == 1.0 or sp_size <= 1:
        return scale
    return max(1.0, scale / 2 ** math.ceil(math.log2(sp_size)))


def tolerance(dtype: torch.dtype | None) -> float:
    """The check's relative tolerance: :data:`FP32_RTOL` for fp32 (``None``), else
    :data:`ROUNDINGS` × the dtype's machine epsilon (bf16: 6.25e-2; fp16: 7.8e-3)."""
    if dtype is None or dtype == torch.float32:
        return FP32_RTOL
    return ROUNDINGS * torch.finfo(dtype).eps


def refuse_unsupported(precision: Precision, cuda: bool) -> None:
    """Raise :class:`~dspzoo.core.entry.UsageError` for fp16 without CUDA (CPU autocast runs
    bf16 only). Every rank calls it before any process group work, so all of them exit with
    the same one line."""
    if precision.name == "fp16" and not cuda:
        raise UsageError(
            "--mixed-precision fp16 needs a CUDA GPU: CPU autocast runs bf16 only "
            "(use --mixed-precision bf16 on a CPU)"
        )


def fp32_equivalent(bytes_sent: int, dtype: str) -> int:
    """A collective's payload in fp32 bytes: a 16-bit float payload (``bfloat16``,
    ``float16``, the tracer's dtype names) counts twice, anything else as sent."""
    return 2 * bytes_sent if dtype in _LOW_PRECISION else bytes_sent
