"""The Python API for using a loaded model (``dspzoo.zoo.inference``) and the commands on it.

Each function gives what its command line prints or writes (the scripts call it), refuses a
model of another family by name, and — sampling and prediction — gives on an SP group of 2
what it gives on one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspzoo.core.testing import run_distributed
from dspzoo.zoo import create_model, inference, save_pretrained

REPO = Path(__file__).resolve().parents[1]
PROTEIN_DATA = REPO / "tests" / "data" / "protein"
QUERY = "MGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP"


def _script(name: str):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return __import__(name).main
    finally:
        sys.path.remove(str(REPO / "scripts"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny seeded models saved as training saves them (with their extras)."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    video = create_model("stdit-tiny")
    with torch.no_grad():  # adaLN-Zero starts as the identity: make the velocity non-trivial
        for p in video.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sampling = {"frames": 5, "size": 12, "codec": "pixel-unshuffle", "codec_factor": 2}
    text = create_model("bytelm-tiny")
    protein = create_model("evoformer-tiny")
    return {
        "video": save_pretrained(video, root / "video", "stdit-tiny", {"sampling": sampling}),
        "text": save_pretrained(text, root / "text", "bytelm-tiny", {"training": {"seq_len": 8}}),
        "protein": save_pretrained(
            protein, root / "protein", "evoformer-tiny", {"protein": {"num_recycles": 1}}
        ),
    }


def test_generate_text_is_what_the_command_prints(folders, capsys) -> None:
    result = inference.generate_text(folders["text"], "def ", max_new=12, seed=3)
    assert result.prompt == b"def " and len(result.new) == 12 and result.seconds > 0
    assert result.beyond_training  # 16 bytes, trained on 8-byte windows
    again = inference.generate_text(inference.load(folders["text"]), "def ", max_new=12, seed=3)
    assert again.new == result.new  # seeded: reproducible
    printed = _script("generate_text")(
        ["--model-dir", str(folders["text"]), "--prompt", "def ", "--max-new", "12", "--seed", "3"]
    )
    out, err = capsys.readouterr()
    assert printed == result.text and out == result.text + "\n"
    assert "beyond the 8-byte windows" in err
    greedy = inference.generate_text(folders["text"], "ab", max_new=4, temperature=0, seed=1)
    assert greedy.new == inference.generate_text(folders["text"], "ab", 4, 0, seed=2).new
    with pytest.raises(ValueError, match="non-empty prompt"):
        inference.generate_text(folders["text"], "", max_new=3)


def test_a_model_of_another_family_is_refused_by_name(folders) -> None:
    with pytest.raises(ValueError, match=r"holds a 'stdit' model; this takes \['bytelm'\]"):
        inference.generate_text(folders["video"], "def ")
    loaded = inference.load(folders["text"])
    with pytest.raises(ValueError, match=r"'bytelm' model; this takes \['stdit', 'latte'\]"):
        inference.sample_video(loaded)
    with pytest.raises(FileNotFoundError):
        inference.load("no-such-model")


def _sample(rank: int, world: int, folder: str) -> torch.Tensor:
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.parallel.runtime import SeqParallel

    sp = SeqParallel(build_mesh(world)) if world > 1 else None
    return inference.sample_video(folder, per_class=1, steps=3, seed=5, sp=sp).video


def test_sample_video_at_sp2_equals_one_process(folders) -> None:
    """5 latent frames and 6 × 6 latents over 2 ranks: uneven shards."""
    one = inference.sample_video(folders["video"], per_class=1, steps=3, seed=5)
    classes = inference.load(folders["video"]).model.config.num_classes
    assert one.video.shape == (classes, 3, 5, 12, 12) and one.latents.shape[-1] == 6
    assert one.labels.tolist() == list(range(classes))
    assert one.video.abs().max() <= 1 and one.video.std() > 0
    for got in run_distributed(_sample, 2, str(folders["video"])):
        torch.testing.assert_close(got, one.video, rtol=1e-4, atol=1e-5)
    other = inference.sample_video(folders["video"], per_class=1, steps=3, seed=6)
    assert not torch.allclose(other.video, one.video)  # the noise comes from the seed


def _predict(rank: int, world: int, folder: str, msa: str) -> np.ndarray:
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.parallel.runtime import SeqParallel

    sp = SeqParallel(build_mesh(world))
    return inference.predict_protein(folder, QUERY, [msa], sp=sp).contact_probs


def test_predict_protein_is_what_the_command_writes_and_sp2_agrees(folders, tmp_path) -> None:
    msa = str(PROTEIN_DATA / "alignments" / "2q2k_A" / "bfd_uniclust_hits.a3m")
    pred = inference.predict_protein(folders["protein"], QUERY, [msa])
    n = len(QUERY)
    assert pred.distogram.shape[:2] == (n, n) and pred.contact_probs.shape == (n, n)
    np.testing.assert_allclose(pred.distogram.sum(-1), 1.0, rtol=1e-5)
    fasta = tmp_path / "q.fasta"
    fasta.write_text(f">2q2k_A\n{QUERY}\n")
    argv = ["--model-dir", str(folders["protein"]), "--fasta", str(fasta), "--msa", msa]
    _script("predict_protein")([*argv, "--out", str(tmp_path / "q")])
    written = np.load(tmp_path / "q.npz")
    np.testing.assert_array_equal(written["contact_probs"], pred.contact_probs)
    np.testing.assert_array_equal(written["distogram"], pred.distogram.astype(np.float16))
    for got in run_distributed(_predict, 2, str(folders["protein"]), msa):
        np.testing.assert_allclose(got, pred.contact_probs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="first row"):  # an alignment of another query
        inference.predict_protein(folders["protein"], "ACDEFGHIK", [msa])


def test_forecast_weather_is_what_the_command_writes(tmp_path) -> None:
    """The shipped weather model, two steps from its default start (the last training year)."""
    fc = inference.forecast_weather("weathertx-small-a1b-e1", steps=2)
    assert fc.lead == 1 and fc.forecast.forecast.shape[0] == 2
    summary = fc.summary()
    assert summary["leads"] == [1, 2] and summary["init"].startswith("2059")
    forecast = _script("forecast_weather")
    written = forecast(["--model-dir", "weathertx-small-a1b-e1", "--steps", "2",
                        "--out", str(tmp_path)])  # fmt: skip
    assert written == summary == json.loads((tmp_path / "rmse.json").read_text())
    with pytest.raises(ValueError, match="initial year 1800 is not in the data"):
        inference.forecast_weather("weathertx-small-a1b-e1", steps=1, init_year=1800)
