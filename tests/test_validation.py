"""A bad input on one rank raises the same clear error on every rank (never a hang)."""

from __future__ import annotations

import os
import re

import pytest
import torch

import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SeqParallel, build_mesh
from dspzoo.core.parallel.validate import InputValidationError, validate_collectively
from dspzoo.core.testing import run_distributed
from dspzoo.zoo import create_model

BAD_RANK = 1


def _bad_input_on_one_rank(rank: int, world: int) -> list[str]:
    from dspzoo.core import comm

    comm.set_debug(os.environ.get("TEST_COMM_DEBUG") == "1")
    torch.manual_seed(0)
    model = create_model("stdit-tiny", num_classes=4)
    sp = SeqParallel(build_mesh(world))
    x = torch.randn(1, 12, 3, 6, 6)
    t = torch.full((1,), 500.0)
    cases = {
        "channels": (torch.randn(1, 5, 3, 6, 6), t, "expected 12 latent channels, got 5"),
        "timestep": (x, torch.full((2,), 500.0), "timestep must be [B=1]"),
        "label_drop": (x, t, "label_drop must be a [B=1] boolean mask"),
    }
    messages = []
    for name, (bad_x, bad_t, expected) in cases.items():
        mine_x, mine_t = (bad_x, bad_t) if rank == BAD_RANK else (x, t)
        drop = (
            torch.zeros(3, dtype=torch.bool) if name == "label_drop" and rank == BAD_RANK else None
        )
        with pytest.raises(InputValidationError) as info:
            model(mine_x, mine_t, y=torch.tensor([1]), sp=sp, label_drop=drop)
        text = str(info.value)
        assert f"SP rank(s) [{BAD_RANK}] of {world}" in text and expected in text, text
        messages.append(text)
    # the group is still usable afterwards: a good forward matches one process
    out = model(x, t, y=torch.tensor([1]), sp=sp)
    torch.testing.assert_close(out, model(x, t, y=torch.tensor([1])), rtol=1e-5, atol=1e-6)
    return messages


@pytest.mark.parametrize("debug", ["0", "1"])
def test_one_bad_rank_fails_every_rank_with_the_same_message(debug: str) -> None:
    messages = run_distributed(
        _bad_input_on_one_rank, 3, timeout=90, env={"TEST_COMM_DEBUG": debug}
    )

    def without_rank(texts: list[str]) -> list[str]:
        return [re.sub(r"\(this is rank \d\)", "", t) for t in texts]

    assert all(without_rank(m) == without_rank(messages[0]) for m in messages)


def test_single_process_raises_the_local_error() -> None:
    def check() -> None:
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        validate_collectively(check, None)
