"""The GPU-first hot path: a steady-state training step agrees once and reads no data back.

For ``stdit-mini``, ``evoformer-tiny`` and ``hybridlm-tiny`` at SP 2 and 3 under every strategy
each can run (uneven shapes), the second forward + backward of a training step makes at most
one control exchange in the forward (the runtime's entry agreement), none in the backward, and
no host read of a data-path tensor (:class:`dspzoo.core.host_reads.DataReads`: no ``.item()``,
``.tolist()``, ``nonzero`` … of anything computed from the parameters or inputs). Beside it,
:class:`DataReads` itself is checked to catch such reads, and a rank whose input differs at the
entry still raises on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import dspzoo.domains.mamba  # noqa: F401  (registers the families)
import dspzoo.domains.protein  # noqa: F401
import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SeqParallel, comm, trace_comm
from dspzoo.core.harness import not_runnable
from dspzoo.core.host_reads import DataReads
from dspzoo.core.parallel.methods.megatron import parallelize_megatron
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.core.testing import run_distributed, sub_mesh
from dspzoo.domains.protein import CONFIGS, Evoformer
from dspzoo.zoo import create_model

# every strategy but USP, which needs a 2-D mesh (Ulysses × ring) of its own
STRATEGY_NAMES = tuple(s for s in ("auto", *STRATEGIES) if s != "usp")


def _protein_batch(b: int = 1, s: int = 5, r: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    aatype = torch.randint(0, 21, (b, r), generator=g)
    target_feat = torch.zeros(b, r, 22).scatter_(2, (aatype + 1)[..., None], 1.0)
    seq_mask = torch.ones(b, r)
    seq_mask[:, -1] = 0.0
    return {
        "aatype": aatype,
        "target_feat": target_feat,
        "msa_feat": torch.randn(b, s, r, 49, generator=g),
        "residue_index": torch.arange(r).repeat(b, 1),
        "seq_mask": seq_mask,
        "msa_mask": torch.ones(b, s, r) * seq_mask[:, None],
    }


def _case(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Any]:
    """The model, its data inputs, and a step (forward + a loss) on them."""
    torch.manual_seed(0)
    if name == "stdit-mini":
        model = create_model("stdit-mini")
        x, t, y = torch.randn(1, 12, 5, 14, 10), torch.full((1,), 500.0), torch.tensor([1])
        return model, (x, t), lambda sp: model(x, t, y=y, sp=sp).square().mean()
    if name == "evoformer-tiny":
        model = Evoformer(replace(CONFIGS["tiny"], num_recycles=0)).train()
        batch = _protein_batch()

        def step(sp: SeqParallel) -> torch.Tensor:
            out = model(batch, sp=sp, rng_key=3)
            return sum(v.square().mean() for v in out.values())

        return model, tuple(batch.values()), step
    model = create_model("hybridlm-tiny")
    tokens = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(2))
    return model, (tokens,), lambda sp: model(tokens, sp=sp).square().mean()


MODELS = ("stdit-mini", "evoformer-tiny", "hybridlm-tiny")


def _steps(rank: int, world: int) -> dict[tuple[str, str, int], tuple[list[str], ...]]:
    meshes = {size: sub_mesh(size) for size in (2, 3)}
    out = {}
    for size, mesh in meshes.items():
        if mesh is None:
            continue
        for name in MODELS:
            for strategy in STRATEGY_NAMES if name != "evoformer-tiny" else ("dsp",):
                model, inputs, step = _case(name)
                if not_runnable(strategy, model, size) is not None:
                    continue
                sp = SeqParallel(mesh, strategy)
                if strategy == "megatron_sp":
                    parallelize_megatron(model, sp.group)
                step(sp).backward()  # the first step plans and builds
                with trace_comm() as tracer, DataReads(model.parameters(), *inputs) as reads:
                    step(sp).backward()
                out[(name, strategy, size)] = (
                    [f"{c.what} in '{c.region}'" for c in tracer.control if c.phase == "forward"],
                    [f"{c.what} in '{c.region}'" for c in tracer.control if c.phase == "backward"],
                    reads.where,
                )
    return out


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return run_distributed(_steps, 3, timeout=280)


@pytest.mark.timeout(300)
def test_a_training_step_agrees_once_and_reads_no_data_back(steps) -> None:
    cases = set().union(*(r.keys() for r in steps))
    assert {(m, "dsp", n) for m in MODELS for n in (2, 3)} <= cases
    for name in ("stdit-mini", "hybridlm-tiny"):  # every strategy the model can run
        assert sum(c[0] == name and c[2] == 2 for c in cases) == len(STRATEGY_NAMES), name
    bad = [
        (case, forward, backward, reads)
        for rank_out in steps
        for case, (forward, backward, reads) in rank_out.items()
        if len(forward) > 1 or backward or reads
    ]
    assert not bad, "\n".join(map(str, bad))


def test_data_reads_catch_what_would_stall_a_gpu() -> None:
    w = torch.randn(4)
    with DataReads(w) as reads:
        positions = torch.arange(4)
        positions.tolist()  # host bookkeeping: not a read of data
        torch.nonzero(positions)
        (w * 2).sum().item()
        bool(w[0] > 0)
        torch.nonzero(w > 0)
        (w + 1).tolist()
    assert reads.count == 4, reads.where
    assert "test_hot_path.py" in reads.where[0]


def _entry_mismatch(rank: int, world: int) -> list[str]:
    """One rank enters with another frame count: the entry agreement raises on every rank."""
    sp = SeqParallel(sub_mesh(world))
    model = create_model("stdit-tiny", num_classes=4)
    frames = 4 if rank == 1 else 3
    x = torch.randn(1, model.config.in_channels, frames, 6, 6)
    with trace_comm() as tracer, pytest.raises(comm.CollectiveInputError) as info:
        model(x, torch.full((1,), 10.0), y=torch.tensor([1]), sp=sp)
    assert tracer.control_count() == 1
    return [str(info.value)]


def test_an_entry_mismatch_raises_on_every_rank() -> None:
    texts = [t for r in run_distributed(_entry_mismatch, 2, timeout=90) for t in r]
    assert len(set(texts)) == 1, texts
    assert texts[0].startswith("entry (") and "rank 1 disagrees" in texts[0], texts[0]
    assert "x.shape differs" in texts[0], texts[0]
