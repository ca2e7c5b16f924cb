"""Autograd-aware collectives on the sequence-parallel group, exact for uneven lengths.

The four primitives of DSP (plus the one a protein trunk needs) act on a tensor axis ``dim``:

=========================  ===========================  ====================================
primitive                  layout change                backward
=========================  ===========================  ====================================
``split``                  replicated → sharded         keep own slice in place (no comm)
``gather``                 sharded → replicated         own slice of the gradient × N
``gather_for_local_use``   sharded → full, per-rank use reduce-scatter (sum)
``switch``                 sharded on src → on dst      reverse switch (one all-to-all)
=========================  ===========================  ====================================

Gradient contract (see ``docs/gradient_contract.md``): every backward above is the exact
adjoint of its forward over the SP group, and each SP rank's loss is normalised so that the
*mean* of the losses over the SP group equals the full-sample loss (a loss on replicated data
is just computed on every rank; a loss on sharded tokens uses :func:`dspzoo.core.loss.sp_mean`).
Averaging parameter gradients over the whole dp × sp world, which DDP and FSDP do by default,
then gives exactly the gradient of the single-process computation. ``gather``'s "× N" is the
adjoint under its precondition that what follows it is computed identically on every rank; a
tensor consumed *differently* per rank (the other operand of a triangle multiplication, K/V for
local queries) must use ``gather_for_local_use``, whose backward reduce-scatters.

The backwards of ``gather``, ``gather_for_local_use`` and ``switch`` are once-differentiable:
differentiating them again (``create_graph=True`` then a second backward) raises
"trying to differentiate twice" on every rank, before any collective. ``split``'s backward is
local and may be differentiated again.

Shards are balanced and unpadded (:func:`dspzoo.core.parallel.layout.shard_sizes`). A switch moves
exactly the blocks other ranks need, laid out by one copy so that a single
``all_to_all_single`` (with per-rank split sizes when lengths are uneven) does the exchange and
the received buffer is the result, or needs one more copy when leading axes are not trivial.
Every collective is the backend's own operation (``all_to_all_single``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``batch_isend_irecv``) on the group's
communicator, the same code on NCCL and gloo. Outputs are never views of their inputs, so
in-place ops on them are fine.

Failures reach every rank: the ranks agree on the arguments before a collective
(:mod:`.agreement`, one tiny all-gather of a few words on the host, over the group's gloo side
group), so a bad shard, a length, dtype or shape mismatch on any rank raises the same
:class:`CollectiveInputError` on every rank, naming the rank, the primitive and the comm region.
The runtime agrees once per forward, at the sharded region's entry, and its collectives after
that exchange nothing more (:func:`~.agreement.trusted_calls`); direct calls of these
primitives agree each time. A backend failure (timeout, lost peer) is re-raised as
:class:`CollectiveTimeoutError` naming the primitive, the region and the group's timeout.

Modules: :mod:`.settings` (the settings object: debug mode), :mod:`.agreement` (the cross-rank
agreement and the errors), :mod:`.blocks` (block layout: the one pack/unpack), :mod:`.checks`
(``check_consistent`` for user code), :mod:`.group` (group queries, the control side group,
tracing), :mod:`.reductions` (small all-reduces), :mod:`.replicate` (split, gather,
gather_for_local_use), :mod:`.exchange` (switch, switch_async), :mod:`.p2p` (ring exchange).
"""

from __future__ import annotations

from .agreement import CollectiveInputError, CollectiveTimeoutError, trusted_calls
from .checks import check_consistent
from .exchange import SwitchHandle, switch, switch_async
from .group import group_rank, group_size, register_control_group
from .p2p import ring_exchange
from .reductions import all_reduce_sum
from .replicate import gather, gather_for_local_use, split
from .settings import SETTINGS, set_debug

__all__ = [
    "SETTINGS",
    "CollectiveInputError",
    "CollectiveTimeoutError",
    "SwitchHandle",
    "all_reduce_sum",
    "check_consistent",
    "gather",
    "gather_for_local_use",
    "group_rank",
    "group_size",
    "register_control_group",
    "ring_exchange",
    "set_debug",
    "split",
    "switch",
    "switch_async",
    "trusted_calls",
]
