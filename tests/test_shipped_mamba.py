"""The shipped Mamba models load by name, reproduce their cards' figures and run their commands.

``mambalm-mini-stdlib`` (held-out bits/byte, generation), ``videomamba-tiny-shapes`` (held-out
flow loss, sampling) and ``weathermamba-tiny-a1b-e1`` (held-out RMSE/ACC against persistence).
The figures are recomputed on the shipped (fp16-stored) weights with the functions the cards
name, exactly as ``tests/test_shipped_models.py`` and ``tests/test_weather_training.py`` do for
the other families.
"""

from __future__ import annotations

import pytest
import torch

from dspzoo.zoo import from_pretrained, inference, load_extra, model_card
from dspzoo.zoo.cli import load_domains

LM, VIDEO, WEATHER = "mambalm-mini-stdlib", "videomamba-tiny-shapes", "weathermamba-tiny-a1b-e1"


@pytest.fixture(scope="module", autouse=True)
def _domains() -> None:
    load_domains()


def test_shipped_mamba_lm_reproduces_its_bits_per_byte_and_generates() -> None:
    from dspzoo.domains.text.data import resolve_data
    from dspzoo.domains.text.evaluation import corpus_digest, heldout_bits_per_byte

    card = model_card(LM)
    assert card.model == "mambalm-mini" and card.parameters == 114560
    model = from_pretrained(LM)
    assert type(model).__name__ == "MambaLM"
    digest = corpus_digest(resolve_data("stdlib"))
    if digest != card.extra["corpus_digest"]:
        pytest.skip(
            f"this Python's standard library differs from the one {LM} was measured on "
            f"({digest} vs {card.extra['corpus_digest']}); the figure is not comparable"
        )
    bpb = heldout_bits_per_byte(model, load_extra(LM)["training"]["seq_len"])
    assert bpb == pytest.approx(card.metrics["val_bpb"], abs=1e-4)
    # the same evaluation as the byte LM of its size class, which it beats
    assert bpb < model_card("bytelm-tiny-stdlib").metrics["val_bpb"]
    out = inference.generate_text(LM, "def ", max_new=24, temperature=0)
    assert len(out.new) == 24
    assert out.new == inference.generate_text(LM, "def ", max_new=24, temperature=0).new


def test_shipped_video_mamba_reproduces_its_held_out_loss_and_samples() -> None:
    from dspzoo.domains.video.evaluation import heldout_flow_loss

    card = model_card(VIDEO)
    assert card.eval.startswith("dspzoo.domains.mamba.sampling.evaluate")
    model = from_pretrained(VIDEO)
    settings = load_extra(VIDEO)["sampling"]
    loss = heldout_flow_loss(model, settings)
    assert loss == pytest.approx(card.metrics["heldout_flow_loss"], abs=2e-3)
    torch.manual_seed(0)
    untrained = type(model)(model.config).eval()
    assert loss < 0.5 * heldout_flow_loss(untrained, settings)  # it learnt the data
    # and beat what any width-32 model (the first shipping's) could reach: its final layer
    # spans 32 of a patch's 48 values, leaving 16/48 of the unit-variance noise out of reach
    assert model.config.hidden >= model.out_patch_dim == 48 and loss < 16 / 48
    clips = inference.sample_video(VIDEO, per_class=1, steps=2, seed=0)
    assert clips.video.shape == (4, 3, settings["frames"], settings["size"], settings["size"])
    assert torch.isfinite(clips.video).all() and clips.video.abs().max() <= 1


def test_shipped_weather_mamba_reproduces_its_metrics_and_beats_persistence() -> None:
    from dspzoo.domains.weather.training import evaluate_saved

    card = model_card(WEATHER)
    rows, model, data = evaluate_saved(WEATHER)
    assert type(model).__name__ == "WeatherMamba"
    assert data.fields.names == ("A1B_north_america.nc", "E1_north_america.nc")
    got = {f"{r['forecast']}/{r['variable']}/lead{r['lead']}/{k}": r[k] for r in rows for k in r}
    for key, value in card.metrics.items():
        assert got[key] == pytest.approx(value, rel=2e-3), key
    for lead in (1, 2):
        model_rmse = got[f"model/air_temperature/lead{lead}/rmse"]
        assert model_rmse < got[f"persistence/air_temperature/lead{lead}/rmse"]
        assert model_rmse < got[f"climatology/air_temperature/lead{lead}/rmse"]
        acc = got[f"model/air_temperature/lead{lead}/acc"]
        assert acc > got[f"persistence/air_temperature/lead{lead}/acc"]
    fc = inference.forecast_weather(WEATHER, steps=2)
    assert fc.forecast.forecast.shape == (2, 1, 37, 49)
