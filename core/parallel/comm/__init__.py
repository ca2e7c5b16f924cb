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
the received buffer is the result, or needs one more copy when leading axes are not trivial;
between the processes of one host on gloo the blocks go through shared memory instead, copied
straight from the input into a slot and from the slot into the result (:mod:`.shm`, the
default there); elsewhere on gloo, when each block is a few long contiguous runs, the runs
travel as point-to-point messages from the input into the result, with no layout copy at all
(:mod:`.direct`).
Outputs are never views of their inputs, so in-place ops on them are fine.

Failures reach every rank: each forward primitive first agrees on its arguments across the
group (:mod:`.agreement`, one tiny all-gather), so a bad shard, a length, dtype or shape
mismatch on any rank raises the same :class:`CollectiveInputError` on every rank, naming the
rank, the primitive and the comm region (a ``switch`` the group has made before folds that
agreement into its all-to-all instead: :mod:`.rehearsal`, :mod:`.folded`); a backend failure (timeout, lost peer) is re-raised as
:class:`CollectiveTimeoutError` naming the primitive, the region and the group's timeout.

Modules: :mod:`.settings` (the settings object: debug mode, per-group send workspaces),
:mod:`.agreement` (the cross-rank agreement and the errors), :mod:`.blocks` (block layout:
the one pack/unpack), :mod:`.rehearsal` (each group's agreed calls, predicting the next),
:mod:`.folded` (the switch exchange with status words in its chunks), :mod:`.shm` (the switch
through shared memory between the processes of one host), :mod:`.direct` (the switch
sent as point-to-point messages straight from the input into the result, gloo, long blocks),
:mod:`.checks` (``check_consistent`` for user code), :mod:`.group`
(group queries, tracing, small reductions), :mod:`.replicate` (split, gather,
gather_for_local_use), :mod:`.exchange` (switch, switch_async), :mod:`.p2p` (ring exchange).
"""

from __future__ import annotations

from .agreement import CollectiveInputError, CollectiveTimeoutError
from .checks import check_consistent
from .exchange import SwitchHandle, switch, switch_async
from .group import group_rank, group_size
from .p2p import ring_exchange
from .reductions import all_reduce_sum
from .replicate import gather, gather_for_local_use, split
from .settings import SETTINGS, release_workspace, set_debug, set_workspace_limit

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
    "release_workspace",
    "ring_exchange",
    "set_debug",
    "set_workspace_limit",
    "split",
    "switch",
    "switch_async",
]
