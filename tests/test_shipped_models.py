"""The shipped video and text models load by name and reproduce their cards' figures.

(The protein and weather models are checked the same way in their domains' tests.)
"""

from __future__ import annotations

import pytest
import torch

from dspzoo.zoo import from_pretrained, load_extra, model_card, shipped_names
from dspzoo.zoo.cli import load_domains


def _shipped(family: str) -> list[str]:
    return [n for n in shipped_names() if n.startswith(f"{family}-")] or [f"{family}-(none)"]


@pytest.mark.parametrize("name", _shipped("bytelm"))
def test_shipped_byte_lm_reproduces_its_bits_per_byte(name: str) -> None:
    if name.endswith("(none)"):
        pytest.skip("no byte LM shipped")
    from dspzoo.domains.text.data import resolve_data
    from dspzoo.domains.text.evaluation import corpus_digest, heldout_bits_per_byte

    load_domains()
    card = model_card(name)
    model = from_pretrained(name)
    seq_len = load_extra(name)["training"]["seq_len"]
    digest = corpus_digest(resolve_data("stdlib"))
    if digest != card.extra["corpus_digest"]:
        pytest.skip(
            f"this Python's standard library differs from the one {name} was measured on "
            f"({digest} vs {card.extra['corpus_digest']}); the figure is not comparable"
        )
    bpb = heldout_bits_per_byte(model, seq_len)
    assert bpb == pytest.approx(card.metrics["val_bpb"], abs=1e-4)
    assert bpb < 3.0  # far below the 8 bits of a uniform guess: it learnt the data


@pytest.mark.parametrize("name", _shipped("stdit"))
def test_shipped_video_model_reproduces_its_figures(name: str) -> None:
    if name.endswith("(none)"):
        pytest.skip("no video model shipped")
    from dspzoo.domains.video.evaluation import evaluate

    load_domains()
    torch.manual_seed(0)
    card = model_card(name)
    figures = evaluate(from_pretrained(name), load_extra(name)["sampling"])
    for key, want in card.metrics.items():
        assert figures[key] == pytest.approx(want, abs=2e-3), key
    assert figures["palette_fidelity"] > 0.9 and figures["colour_stability"] > 0.8
