"""The method registry: one object per way of running a stage over the SP group.

A *method* is everything the library knows about one way to run a stage whose dims may be
sharded: which op kinds it can run over a sharded dim, what the planner pays for it (bytes
forward and backward, in switch units), the exact per-rank byte formula the tracer must see,
the extra activation memory it keeps, and its kernel entry. The planner, the cost model, the
``auto`` strategy, the benchmark and the dispatcher all read this registry; there is no
``if method == "…"`` anywhere else. Adding a method is one class and :func:`register_method`.

Op kinds (:func:`register_op_kind`) name what a stage computes: ``attention`` (every embedded
method runs it), ``generic`` (a convolution, pooling, an FFT mixer, a user's custom op: it needs
its dims whole, so only DSP's moves run it — a switch to a free dim, or ``gather`` when it mixes
every dim) and kinds that other domains register with their own methods (the Mamba scan).

Units. The planner's costs are in *switch units*: one unit is ``E·(N−1)/N`` elements sent per
rank (``E = M/N`` the local activation, ``M`` the global one), the volume of one DSP switch in
one direction. So a switch costs 2 (forward + backward), Ulysses 8 (four all-to-alls each
way), Ring ``6N`` (K and V of ``N−1`` blocks forward, again backward plus the fp32 dK/dV
accumulators), LSS ``4N`` (all-gather of ``[K|V]`` forward, reduce-scatter backward), a gather
for local use ``2N`` (all-gather forward, reduce-scatter backward of the activation).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..layout import shard_sizes
from .balanced import balanced_ring_attention, balanced_ring_bytes
from .lss import lss_attention
from .lss_offload import lss_offload_bytes
from .ring import ring_attention
from .scan import (
    ScanOp,
    ScanShape,
    halo_bytes,
    head_a2a_scan,
    state_passing_saved_elements,
    state_passing_scan,
)
from .ulysses import kv_heads_aligned, ulysses_attention
from .usp import usp_attention

if TYPE_CHECKING:
    from ..runtime import SeqParallel

PHASES = ("forward", "backward")


# -- op kinds -------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpKind:
    """What a stage computes. ``entry`` names the runtime call that runs it over a sharded dim
    (``sp.attention`` for attention); a generic op has none: it always gets its dims whole.
    ``ordered``: the op mixes its dims in their declared order (a scan over a raster), so a
    method can run it only with the first (outermost) of them sharded."""

    name: str
    entry: str | None
    doc: str = ""
    ordered: bool = False


OP_KINDS: dict[str, OpKind] = {}


def register_op_kind(kind: OpKind) -> OpKind:
    """Add an op kind (e.g. a domain's selective scan); its methods list it in ``ops``."""
    if kind.name in OP_KINDS and OP_KINDS[kind.name] != kind:
        raise ValueError(f"op kind {kind.name!r} is already registered differently")
    OP_KINDS[kind.name] = kind
    return kind


ATTENTION = register_op_kind(
    OpKind("attention", "sp.attention", "self-attention over the stage's dims")
)
GENERIC = register_op_kind(
    OpKind("generic", None, "any op that needs its dims whole (conv, pooling, FFT, custom)")
)
SCAN = register_op_kind(
    OpKind("scan", "sp.scan", "a selective scan (Mamba) along the stage's dims, in order", True)
)


def get_op_kind(name: str) -> OpKind:
    """The registered op kind ``name`` (a clear error listing the known ones)."""
    try:
        return OP_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown op kind {name!r}; registered: {sorted(OP_KINDS)}") from None


# -- byte accounting --------------------------------------------------------------------------
class CommCount(defaultdict):
    """``{(op, phase): [count, bytes]}`` with helpers; missing keys read as ``[0, 0]``."""

    def __init__(self) -> None:
        super().__init__(lambda: [0, 0])

    def add(self, op: str, phase: str, nbytes: int, count: int = 1) -> None:
        entry = self[(op, phase)]
        entry[0] += count
        entry[1] += int(nbytes)

    def bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            b
            for (o, p), (_, b) in self.items()
            if (op is None or o == op) and (phase is None or p == phase)
        )

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            c
            for (o, p), (c, _) in self.items()
            if (op is None or o == op) and (phase is None or p == phase)
        )

    def collectives(self, phase: str | None = None) -> dict[str, int]:
        """``{op: count}`` (for the latency term)."""
        out: dict[str, int] = defaultdict(int)
        for (o, p), (c, _) in self.items():
            if phase is None or p == phase:
                out[o] += c
        return dict(out)


def stats_itemsize(itemsize: int) -> int:
    """Bytes of Ring's softmax statistics / dK-dV accumulators: fp64 stays, else fp32."""
    return 8 if itemsize == 8 else 4


@dataclass(frozen=True)
class AttentionShape:
    """One attention over a sharded dim, folded: ``seq[r]`` tokens of the attended sequence
    on rank ``r``, ``bf`` folded batch lines, ``heads``/``kv_heads`` of ``head_dim``, items of
    ``itemsize`` bytes, USP's Ulysses degree ``ulysses``."""

    seq: tuple[int, ...]
    bf: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    ulysses: int = 1
    causal: bool = False


def switch_bytes(out: CommCount, src: list[int], dst: list[int], rank: int, other: int) -> None:
    """A DSP switch from a dim split ``src`` to one split ``dst``; ``other`` bytes per
    (src row, dst row) pair: the blocks addressed to other ranks, forward and reversed."""
    out.add("all_to_all", "forward", src[rank] * (sum(dst) - dst[rank]) * other)
    out.add("all_to_all", "backward", dst[rank] * (sum(src) - src[rank]) * other)


def gather_bytes(out: CommCount, sizes: list[int], row_bytes: int) -> None:
    """An all-gather for local use forward (padded to the longest shard), reduce-scatter back."""
    chunk = (len(sizes) - 1) * max(sizes) * row_bytes
    out.add("all_gather", "forward", chunk)
    out.add("reduce_scatter", "backward", chunk)


def blockwise_causal_factor(blocks: int, layout: str) -> float:
    """Causal work of the busiest of ``blocks`` query blocks attending to the key blocks up to
    their own, over the average: ``(2B − 1)/B`` on a contiguous layout (the last block sees
    every block), 1 on the zigzag layout (each rank's two chunks pair the short and the long)."""
    if layout != "contiguous" or blocks < 2:
        return 1.0
    return (2 * blocks - 1) / blocks


# -- methods ----------------------------------------------------------------------------------
class Method:
    """One way to run a stage over the SP group (see the module docstring).

    Class attributes:
        name: the registry key (what plans and ``SeqSpec.method`` hold).
        ops: op kinds it runs over a *sharded* dim (``local`` runs anything on free dims).
        hybrid: DSP may pick it per stage for a stage that mixes every dim.
        tensor_parallel: it runs on every stage (Megatron-SP) and syncs gradients itself.
        scans_whole_lines: a scan method that scans whole sequences for a share of the heads
            (what it saves is the mixer's ``HeadScanSaved``, not one process's on its tokens).
        layout: how it cuts the sharded dim (``"contiguous"`` or ``"zigzag"``).
        blockwise_causal: each rank's query block attends the key blocks up to its own, so
            causal work is unbalanced on a contiguous layout (:meth:`causal_work_factor`).
        entry: the runtime call a stage must make while the method is in force.
    """

    name: ClassVar[str] = ""
    ops: ClassVar[frozenset[str]] = frozenset()
    hybrid: ClassVar[bool] = False
    tensor_parallel: ClassVar[bool] = False
    scans_whole_lines: ClassVar[bool] = False
    layout: ClassVar[str] = "contiguous"
    blockwise_causal: ClassVar[bool] = False
    entry: ClassVar[str | None] = None
    formula: ClassVar[str] = ""

    def runs(self, op: str) -> bool:
        """Whether this method can run op kind ``op`` over a sharded dim."""
        return op in self.ops

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        """Forward + backward bytes per rank of one stage, in switch units (module doc);
        ``causal``: under a causal mask (only a method whose schedule follows the mask sends
        differently)."""
        return 0.0

    def unsupported(self, sp_size: int, heads: int | None = None) -> str | None:
        """Why this method cannot run a stage with ``heads`` at ``sp_size`` (``None``: it can)."""
        return None

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        """Add the bytes rank ``rank`` sends for one attention of ``shape`` (tracer conventions)."""
        raise ValueError(f"method {self.name!r} has no attention byte formula")

    def saved_elements_per_token(
        self, kv_width: int, sp_size: int, q_width: int = 0, heads: int = 0, causal: bool = False
    ) -> float:
        """Elements per local token it saves for backward beyond one process's (LSS: K, V), on
        the busiest rank; ``q_width``/``heads``/``causal``: the stage's query width, head count
        and mask (what ``lss_balanced``'s lent rows depend on)."""
        return 0

    def ring_size(self, sp_size: int, ulysses: int = 1) -> int:
        """How many sequence blocks its ring passes around (USP: the ``N/U`` slots)."""
        return sp_size

    def causal_work_factor(self, sp_size: int, layout: str, ulysses: int = 1) -> float:
        """The busiest rank's causal attention work over the average, on the plan's
        ``layout``: :func:`blockwise_causal_factor` of its ring for a method whose query blocks
        attend the key blocks up to their own (:attr:`blockwise_causal`), else 1 (balanced, as
        when every rank attends over whole sequences)."""
        if not self.blockwise_causal:
            return 1.0
        return blockwise_causal_factor(self.ring_size(sp_size, ulysses), layout)

    def attention(
        self,
        sp: SeqParallel,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_lengths: list[int],
        causal: bool,
        scale: float | None,
        layout: str = "contiguous",
    ) -> torch.Tensor:
        """Run attention on folded ``[Bf, L_local, H, D]`` tensors over ``sp``'s group."""
        raise RuntimeError(f"method {self.name!r} does not run attention over a sharded dim")

    def scan_bytes(self, out: CommCount, shape: ScanShape, rank: int) -> None:
        """Add the bytes rank ``rank`` sends for one scan mixer of ``shape`` (tracer conventions)."""
        raise ValueError(f"method {self.name!r} has no scan byte formula")

    def scan_saved_elements(self, shape: ScanShape, rank: int) -> float:
        """Elements it saves for backward for one scan mixer of ``shape`` on rank ``rank``
        beyond one process's on the same local tokens (the scan analogue of
        :meth:`saved_elements_per_token`)."""
        return 0.0

    def scan(
        self, sp: SeqParallel, op: ScanOp, x: torch.Tensor, seq_lengths: list[int]
    ) -> torch.Tensor:
        """Run scan module ``op`` on this rank's segment ``[B', L_r, C]`` of the sequence."""
        raise RuntimeError(f"method {self.name!r} does not run a scan over a sharded dim")

    def __repr__(self) -> str:
        return f"<method {self.name}>"


METHODS: dict[str, Method] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: instantiate ``cls`` and add it to :data:`METHODS` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    for op in cls.ops:
        get_op_kind(op)
    METHODS[cls.name] = cls()
    return cls


def get_method(name: str) -> Method:
    """The registered method ``name`` (a clear error listing the known ones)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered: {sorted(METHODS)}") from None


def methods_for(op: str, *, hybrid: bool | None = None) -> list[Method]:
    """Methods that run op kind ``op`` over a sharded dim (optionally only the hybrid ones)."""
    return [m for m in METHODS.values() if m.runs(op) and (hybrid is None or m.hybrid == hybrid)]


@register_method
class Local(Method):
    """The stage does not mix the sharded dim: no communication inside it."""

    name = "local"
    formula = "0"


@register_method
class Switch(Method):
    """DSP's move: re-shard on a dim the stage does not mix (one all-to-all each way).

    Planned *between* stages (the step's ``switch_from``); it runs every op kind, generic ones
    included, because afterwards the stage's dims are whole on every rank.
    """

    name = "switch"
    formula = "(M/N)·(N−1)/N per switch, each way"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 2.0


@register_method
class Gather(Method):
    """A stage that mixes *every* dim and has no method of its own (a generic op): the
    activation is all-gathered for local use (backward: reduce-scatter), the op runs on the
    whole tensor on every rank, and each rank keeps its own rows afterwards."""

    name = "gather"
    ops = frozenset({"generic"})
    formula = "all-gather (N−1)·M/N forward, reduce-scatter backward"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 2.0 * sp_size


class HeadSharded(Method):
    """A method that all-to-alls the sequence to heads: runnable with at least as many heads as
    ranks, priced as two switches each way."""

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return float("inf") if self.unsupported(sp_size, heads) else 8.0

    def unsupported(self, sp_size: int, heads: int | None = None) -> str | None:
        if heads is not None and heads < sp_size:
            return f"{self.name} needs at least as many heads as ranks ({heads} < {sp_size})"
        return None


@register_method
class Ulysses(HeadSharded):
    """DeepSpeed-Ulysses: all-to-all the sequence to heads for q, k, v and back for the output."""

    name = "ulysses"
    ops = frozenset({"attention"})
    hybrid = True
    entry = "sp.attention"
    formula = "4·(M/N)(N−1)/N per attention stage over the sharded dim (GQA: 2+2·Hkv/H)"

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        seq, r = list(shape.seq), rank
        n, length = len(seq), sum(seq)
        h, hkv, d, bf, isz = shape.heads, shape.kv_heads, shape.head_dim, shape.bf, shape.itemsize
        if hkv != h and kv_heads_aligned(h, hkv, n):
            exchanges = [(h, d), (hkv, 2 * d)]
        else:
            exchanges = [(h, 3 * d)]
        for heads, width in exchanges:
            hs = shard_sizes(heads, n)
            out.add("all_to_all", "forward", seq[r] * (heads - hs[r]) * bf * width * isz)
            out.add("all_to_all", "backward", hs[r] * (length - seq[r]) * bf * width * isz)
        hq = shard_sizes(h, n)
        out.add("all_to_all", "forward", hq[r] * (length - seq[r]) * bf * d * isz)
        out.add("all_to_all", "backward", seq[r] * (h - hq[r]) * bf * d * isz)

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        return ulysses_attention(
            q, k, v, group=sp.group, seq_lengths=seq_lengths, causal=causal, scale=scale
        )


def ring_bytes(out: CommCount, seq: list[int], r: int, bf: int, kv_heads: int, d: int, isz: int):
    """Ring attention over ``seq`` (tokens per rank) on rank ``r``: K and V blocks of steps
    ``0…N−2`` forward; backward the same plus the dK/dV accumulators of steps ``0…N−1``."""
    n = len(seq)
    if n == 1:
        block = seq[0] * bf * kv_heads * d
        out.add("p2p", "backward", 2 * block * stats_itemsize(isz), count=2)
        return
    for s in range(n):
        block = seq[(r - s) % n] * bf * kv_heads * d
        if s < n - 1:
            out.add("p2p", "forward", 2 * block * isz, count=2)
            out.add("p2p", "backward", 2 * block * isz, count=2)
        out.add("p2p", "backward", 2 * block * stats_itemsize(isz), count=2)


@register_method
class Ring(Method):
    """Ring attention: K/V blocks passed around the ring with an online-softmax merge."""

    name = "ring"
    blockwise_causal = True
    ops = frozenset({"attention"})
    hybrid = True
    entry = "sp.attention"
    formula = "fwd 2·(N−1)·M_kv/N (K,V passed N−1 times); bwd same + 2·M_kv·stats dK/dV"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 6.0 * sp_size

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        ring_bytes(
            out, list(shape.seq), rank, shape.bf, shape.kv_heads, shape.head_dim, shape.itemsize
        )

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        return ring_attention(
            q,
            k,
            v,
            group=sp.group,
            seq_lengths=seq_lengths,
            causal=causal,
            scale=scale,
            layout=layout,
        )


@register_method
class RingZigzag(Ring):
    """Ring attention on the zigzag layout (rank ``r`` holds chunks ``r`` and ``2N−1−r`` of
    ``2N``): the same bytes as Ring, balanced causal work."""

    name = "ring_zigzag"
    hybrid = False
    layout = "zigzag"


@register_method
class RingBalanced(Ring):
    """Ring attention on the contiguous layout with balanced causal work: each (query block,
    earlier key block) pair is computed where the queries live or where the keys live, so every
    rank computes the same share, in ``⌊N/2⌋`` steps (:mod:`.balanced`). Non-causal attention
    runs the plain ring (balanced already). The contiguous layout keeps DSP's switches and
    scans possible, which a zigzag layout rules out."""

    name = "ring_balanced"
    blockwise_causal = False
    formula = (
        "causal: per step d ≤ N/2 K,V (2·M_kv/N) or query rows, partial out/lse back; bwd "
        "K,V or q,dO,out,lse, dK/dV or dQ back; non-causal: ring"
    )

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        # causal: ⌊N/2⌋ steps of about 2 blocks forward and 4 backward per rank, ≈ 3(N + 1)
        # units (the exact bytes: attention_bytes); else Ring's
        if causal and sp_size > 1:
            return 3.0 * (sp_size + 1)
        return super().plan_cost(sp_size, heads, ulysses)

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        if not shape.causal:
            super().attention_bytes(out, shape, rank)
            return
        balanced_ring_bytes(
            out,
            list(shape.seq),
            rank,
            shape.bf,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.itemsize,
            stats_itemsize(shape.itemsize),
        )

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        if layout != "contiguous":
            raise ValueError(f"ring_balanced runs on the contiguous layout, not {layout!r}")
        return balanced_ring_attention(
            q, k, v, group=sp.group, seq_lengths=seq_lengths, causal=causal, scale=scale
        )


@register_method
class LSS(Method):
    """The Long-Short-Sequence transformer's distributed attention: one fused all-gather of
    ``[K|V]`` forward, a reduce-scatter backward; every rank keeps its queries."""

    name = "lss"
    blockwise_causal = True
    lends_rows: ClassVar[bool] = False  # lss_attention(balanced=...): see LSSBalanced
    ops = frozenset({"attention"})
    entry = "sp.attention"
    formula = "fwd all-gather (N−1)·M_kv·2/N of [K|V]; bwd reduce-scatter, same"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 4.0 * sp_size

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        n = len(shape.seq)
        chunk = max(shape.seq) * shape.bf * shape.kv_heads * 2 * shape.head_dim * shape.itemsize
        out.add("all_gather", "forward", (n - 1) * chunk)
        out.add("reduce_scatter", "backward", (n - 1) * chunk)

    def saved_elements_per_token(
        self, kv_width: int, sp_size: int, q_width: int = 0, heads: int = 0, causal: bool = False
    ) -> float:
        return 2 * kv_width * (sp_size - 1)  # the gathered K and V of the other ranks

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        return lss_attention(
            q,
            k,
            v,
            group=sp.group,
            seq_lengths=seq_lengths,
            causal=causal,
            scale=scale,
            layout=layout,
            balanced=self.lends_rows,
        )


@register_method
class StatePassing(Method):
    """A scan over the sharded dim, each rank on its segment: the conv halo by p2p, segment
    summaries ``(decay, contribution)`` in one all-gather, an exclusive scan over the ranks for
    each incoming state, a correction of the outputs (:mod:`.scan`). Its bytes do not grow
    with the sequence: the planner prices it at a nominal quarter of a switch (the exact bytes,
    ``scan_bytes``, need the mixer's shape: ``2·(N−1)·B·(decay + state)`` per direction)."""

    name = "state_passing"
    ops = frozenset({"scan"})
    hybrid = True
    entry = "sp.scan"
    formula = "all-gather (N−1)·B·(decay+state) fwd, reduce-scatter bwd; conv halo B·C·(K−1) p2p"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 0.25

    def scan_bytes(self, out: CommCount, shape: ScanShape, rank: int) -> None:
        n = len(shape.seq)
        halo_bytes(out, shape)
        chunk = (n - 1) * shape.batch * shape.summary * shape.summary_itemsize
        for _ in range(shape.directions):
            out.add("all_gather", "forward", chunk)
            out.add("reduce_scatter", "backward", chunk)

    def scan_saved_elements(self, shape: ScanShape, rank: int) -> float:
        return state_passing_saved_elements(shape, rank)

    def scan(self, sp, op, x, seq_lengths):
        return state_passing_scan(sp, op, x, seq_lengths)


@register_method
class HeadAllToAll(HeadSharded):
    """A scan over the sharded dim with whole sequences per head (Megatron-Core's Mamba
    context parallelism): after the conv (its halo by p2p) one all-to-all from sequence to head
    (channel) shards, ``B``/``C`` gathered for local use, one all-to-all back (:mod:`.scan`)."""

    name = "head_a2a"
    ops = frozenset({"scan"})
    hybrid = True
    scans_whole_lines = True
    entry = "sp.scan"
    formula = "all-to-all of the scan inputs to heads and of the output back, B/C all-gather"

    def scan_bytes(self, out: CommCount, shape: ScanShape, rank: int) -> None:
        seq, n = list(shape.seq), len(shape.seq)
        heads = shard_sizes(shape.heads, n)
        halo_bytes(out, shape)
        line = shape.batch * shape.itemsize
        for _ in range(shape.directions):
            switch_bytes(out, seq, heads, rank, line * shape.head_in)
            gather_bytes(out, seq, line * shape.gathered)
        switch_bytes(out, heads, seq, rank, line * shape.head_out)

    def scan(self, sp, op, x, seq_lengths):
        return head_a2a_scan(sp, op, x, seq_lengths)


@register_method
class LSSZigzag(LSS):
    """LSS on the zigzag layout (rank ``r`` holds chunks ``r`` and ``2N−1−r`` of ``2N``, as
    ring_zigzag): every rank attends about the same number of causal (query, key) pairs. The
    same bytes as LSS: the formula's ``max(seq)`` is the longest zigzag shard."""

    name = "lss_zigzag"
    layout = "zigzag"


@register_method
class LSSBalanced(LSS):
    """LSS on the contiguous layout with balanced causal work: the later rank of each pair
    ``(x, N−1−x)`` lends the tail of its query rows to the earlier one, which computes them on
    the gathered K/V and sends them back finished (:mod:`.lss_offload`). LSS's bytes plus those
    rows point to point (q and out forward, dO and dQ backward); non-causal it is LSS. The
    contiguous layout keeps DSP's switches and scans possible, which a zigzag layout rules
    out. The byte formula is the kernel path's (the fallback without the shared kernel,
    :func:`~.lss.lss_attention`, lends nothing; the kernel module always ships)."""

    name = "lss_balanced"
    blockwise_causal = False
    lends_rows = True
    formula = "LSS's all-gather / reduce-scatter + causal: lent query rows q, out fwd; dO, dQ bwd"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        # causal: under half a shard of rows each way per direction (the pair (0, N−1) lends
        # N − √(N² − N + 1) of its block with equal blocks), ≈ one more unit; the exact
        # bytes: attention_bytes
        return super().plan_cost(sp_size, heads, ulysses) + (1.0 if causal and sp_size > 1 else 0)

    def saved_elements_per_token(
        self, kv_width: int, sp_size: int, q_width: int = 0, heads: int = 0, causal: bool = False
    ) -> float:
        lss = super().saved_elements_per_token(kv_width, sp_size)
        if not causal or sp_size < 2:
            return lss
        # the helper of the pair (0, N−1) keeps the lent rows' q, out and log-sum-exp: with
        # equal blocks it computes N − √(N² − N + 1) of a block (0.27 at N = 2, 0.39 at 4, < ½)
        lent = sp_size - math.sqrt(sp_size * sp_size - sp_size + 1)
        return lss + lent * (2 * q_width + heads)

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        super().attention_bytes(out, shape, rank)
        if shape.causal:
            lss_offload_bytes(
                out, list(shape.seq), rank, shape.bf, shape.heads, shape.head_dim, shape.itemsize
            )

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        if layout != "contiguous":
            raise ValueError(f"lss_balanced runs on the contiguous layout, not {layout!r}")
        return super().attention(sp, q, k, v, seq_lengths, causal, scale, layout)


def usp_split(seq_lengths: list[int], ulysses: int, sp_rank: int) -> tuple[list[int], list[int]]:
    """USP's view of an SP split: per-ring-slot segments, and this slot's per-Ulysses split."""
    segments = [sum(seq_lengths[j : j + ulysses]) for j in range(0, len(seq_lengths), ulysses)]
    slot = sp_rank // ulysses
    return segments, seq_lengths[slot * ulysses : (slot + 1) * ulysses]


@register_method
class USP(Method):
    """Unified SP: Ulysses inside groups of ``U`` ranks, Ring across the ``R = N/U`` slots."""

    name = "usp"
    blockwise_causal = True
    ops = frozenset({"attention"})
    entry = "sp.attention"
    formula = "Ulysses 4·(M/N)(U−1)/U in groups of U + ring over N/U slots"

    def ring_size(self, sp_size: int, ulysses: int = 1) -> int:
        # after the Ulysses switch each of the R = N/U slots holds a contiguous segment
        return sp_size // max(ulysses, 1)

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        ring = self.ring_size(sp_size, ulysses)
        return (8.0 if ulysses > 1 else 0.0) + (6.0 * ring if ring > 1 else 0.0)

    def attention_bytes(self, out: CommCount, shape: AttentionShape, rank: int) -> None:
        seq, u = list(shape.seq), shape.ulysses
        h, hkv, d, bf, isz = shape.heads, shape.kv_heads, shape.head_dim, shape.bf, shape.itemsize
        segments, split = usp_split(seq, u, rank)
        slot, ur = divmod(rank, u)
        seg = segments[slot]
        kv_eff = hkv
        if u > 1:
            if h % u or hkv % u:
                kv_eff = h
            for heads in (h, kv_eff, kv_eff):
                hs = shard_sizes(heads, u)
                out.add("all_to_all", "forward", split[ur] * (heads - hs[ur]) * bf * d * isz)
                out.add("all_to_all", "backward", hs[ur] * (seg - split[ur]) * bf * d * isz)
            hq = shard_sizes(h, u)
            out.add("all_to_all", "forward", hq[ur] * (seg - split[ur]) * bf * d * isz)
            out.add("all_to_all", "backward", split[ur] * (h - hq[ur]) * bf * d * isz)
        kv_local = shard_sizes(kv_eff, u)[ur]
        if len(segments) > 1:  # a one-slot ring (R = 1) is plain Ulysses
            ring_bytes(out, segments, slot, bf, kv_local, d, isz)

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        mesh = sp.mesh
        ulysses = 1 if mesh is None else mesh.ulysses_size
        segments, split = usp_split(seq_lengths, ulysses, sp.rank)
        if causal and split != shard_sizes(sum(split), ulysses):
            raise ValueError(f"usp: causal attention needs a balanced split, got {split}")
        return usp_attention(
            q,
            k,
            v,
            ulysses_group=None if mesh is None else mesh.ulysses_group,
            ring_group=sp.group if ulysses == 1 else mesh.ring_group,
            seq_lengths=segments,
            causal=causal,
            scale=scale,
            ulysses_lengths=split,
        )


@register_method
class MegatronSP(Method):
    """Megatron-LM tensor parallelism with sequence parallelism over the SP group: every stage
    all-gathers the sequence before its column-parallel linears (``sp.tp_enter``) and
    reduce-scatters after the row-parallel ones (``sp.tp_exit``)."""

    name = "megatron_sp"
    ops = frozenset({"attention"})
    tensor_parallel = True
    entry = "sp.tp_enter"
    formula = "2·(N−1)·M/N per linear pair each way (all-gather + reduce-scatter)"

    def plan_cost(
        self, sp_size: int, heads: int | None = None, ulysses: int = 1, causal: bool = False
    ) -> float:
        return 4.0 * sp_size  # per linear pair: all-gather + reduce-scatter, both directions

    def unsupported(self, sp_size: int, heads: int | None = None) -> str | None:
        if heads is not None and heads < sp_size:
            return f"megatron_sp shards heads: {heads} heads < {sp_size} ranks"
        return None

    def attention(self, sp, q, k, v, seq_lengths, causal, scale, layout="contiguous"):
        raise RuntimeError(
            "megatron_sp: this attention mixes the sharded dim, but the model did not gather "
            "the sequence first; tensor-parallel models declare TP_PLAN on their projection "
            "modules and call sp.tp_enter / sp.tp_exit around them (see core/layers/attention.py)"
        )


def megatron_pair_bytes(
    out: CommCount, sizes: list[int], rest_elems: int, isz: int, stream_isz: int | None = None
) -> None:
    """One Megatron linear pair: all-gather + reduce-scatter forward, their adjoints backward.

    The all-gather takes the stream (a norm's output, ``stream_isz`` bytes: fp32 under autocast)
    and its adjoint reduce-scatters that tensor's gradient; the forward reduce-scatter sums the
    row linear's partial outputs (``isz``) and its adjoint all-gathers their gradient."""
    n = len(sizes)
    chunk = (n - 1) * max(sizes) * rest_elems
    stream = chunk * (isz if stream_isz is None else stream_isz)
    out.add("all_gather", "forward", stream)
    out.add("all_gather", "backward", chunk * isz)
    out.add("reduce_scatter", "forward", chunk * isz)
    out.add("reduce_scatter", "backward", stream)


def describe_methods() -> str:
    """A table of the registered methods: name, op kinds, plan cost at N=4, byte formula."""
    rows = [
        f"  {m.name:<12} {','.join(sorted(m.ops)) or '-':<18} "
        f"{m.plan_cost(4, 8, 2):>6.1f}  {m.formula}"
        for m in METHODS.values()
    ]
    return "\n".join([f"  {'method':<12} {'op kinds':<18} {'N=4':>6}  bytes", *rows])


def strategy_methods(names: Any = None) -> list[str]:
    """Names of the registered methods (for help texts)."""
    return list(METHODS) if names is None else [n for n in names if n in METHODS]
