"""The Python API for using a loaded model (``dspzoo.zoo.inference``) and the commands on it.

Each function gives what its command line prints or writes (the scripts call it), refuses a
model of another family by name, and — sampling and prediction — gives on an SP group of 2
what it gives on one process.
"""

from __future__ import annotations

import json
import re
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
    families = r"\['bytelm', 'mambalm', 'mamba2lm', 'hybridlm'\]"
    with pytest.raises(ValueError, match=rf"holds a 'stdit' model; this takes {families}"):
        inference.generate_text(folders["video"], "def ")
    loaded = inference.load(folders["text"])
    with pytest.raises(
        ValueError, match=r"'bytelm' model; this takes \['stdit', 'latte', 'videomamba'\]"
    ):
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


def test_a_sample_size_the_patches_do_not_divide_is_named(folders) -> None:
    """``--size 30`` with a 2× codec and 2×2 patches: the message names the size and a fix
    (it named only the latent's shape and the patch)."""
    with pytest.raises(ValueError, match=r"size 30 px does not fit .* multiple of 4 .* e\.g\. 28"):
        inference.sample_video(folders["video"], per_class=1, steps=1, size=30)


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


def test_forecast_without_out_writes_under_outputs(tmp_path, monkeypatch) -> None:
    """No ``--out``: a shipped name's forecast goes to ``outputs/<name>/forecast`` (it went to
    ``./forecast``, into whatever folder the command ran in)."""
    monkeypatch.chdir(tmp_path)
    _script("forecast_weather")(["--model-dir", "weathertx-small-a1b-e1", "--steps", "1"])
    assert (tmp_path / "outputs" / "weathertx-small-a1b-e1" / "forecast" / "rmse.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


# -- Mamba models: recurrent decoding, the video Mamba sampler, the weather Mamba forecast -------
def _mixers():
    from dspzoo.core.layers.mamba import Mamba1Config, Mamba1Mixer, Mamba2Config, Mamba2Mixer

    torch.manual_seed(0)
    yield Mamba1Mixer(Mamba1Config(hidden_size=16, state_size=4, conv_kernel=3))
    yield Mamba2Mixer(
        Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=2,
                     chunk_size=4, time_step_limit=(0.0, 0.05))
    )  # fmt: skip


@pytest.mark.parametrize("mixer", list(_mixers()), ids=["mamba1", "mamba2"])
def test_mixer_step_is_the_full_forward_token_by_token(mixer) -> None:
    """11 tokens one step at a time (from zero state, and from a 5-token prefill) give the
    whole-sequence forward's outputs and final state."""
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    mixer = mixer.double()
    with torch.no_grad():
        full, final = mixer(x, return_state=True)
        state, outs = None, []
        for t in range(11):
            y, state = mixer.step(x[:, t], state)
            outs.append(y)
        torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state.ssm, final.ssm, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(state.conv, final.conv, rtol=1e-10, atol=1e-12)
        _, prefix = mixer(x[:, :5], return_state=True)
        y, _ = mixer.step(x[:, 5], prefix)
        torch.testing.assert_close(y, full[:, 5], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"one token per line, \[B, C=16\]"):
        mixer.step(x[:, :2])
    conv_shape, _ = mixer.state_shapes(2)
    bad = type(final)(conv=final.conv[:1], ssm=final.ssm)
    with pytest.raises(ValueError, match=re.escape(f"state must be conv {tuple(conv_shape)}")):
        mixer.step(x[:, 0], bad)


def test_a_bidirectional_mixer_has_no_step() -> None:
    from dspzoo.core.layers.mamba import Mamba1Config, Mamba1Mixer

    mixer = Mamba1Mixer(Mamba1Config(hidden_size=8, state_size=2, bidirectional=True))
    with pytest.raises(ValueError, match="bidirectional mixer reads the future"):
        mixer.step(torch.randn(1, 8))


@pytest.mark.parametrize("name", ["mambalm-tiny", "mamba2lm-tiny"])
def test_mamba_lm_decoding_gives_the_forward_logits(name) -> None:
    """Prefill 7 tokens, then 6 recurrent steps: the logits ``MambaLM.forward`` gives at all 13
    positions (float64)."""
    from dspzoo.domains.mamba.generate import decode_step, teacher_forced_logits

    torch.manual_seed(1)
    model = create_model(name).double().eval()
    tokens = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        want = model(tokens)
    got, states = teacher_forced_logits(model, tokens, 7)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match=r"prompt_len must be in \[1, 13\], got 0"):
        teacher_forced_logits(model, tokens, 0)
    with pytest.raises(ValueError, match="1 layer states for a model of 2 layers"):
        decode_step(model, tokens[:, 0], states[:1])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        decode_step(model, torch.tensor([256, 0]), states)


@pytest.fixture(scope="module")
def mamba_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untrained tiny Mamba models saved as training saves them (with their extras)."""
    root = tmp_path_factory.mktemp("mamba_models")
    torch.manual_seed(0)
    video = create_model("videomamba-tiny", num_classes=3, max_frames=5, input_size=(6, 6))
    with torch.no_grad():  # adaLN-Zero starts as the identity: make the velocity non-trivial
        for p in video.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sampling = {"frames": 5, "size": 12, "codec": "pixel-unshuffle", "codec_factor": 2}
    weather_extra = inference.load("weathertx-small-a1b-e1").extra
    weather = create_model(
        "weathermamba-tiny", grid=(37, 49), variables=("air_temperature",), history=4,
        periodic_lon=False, patch=4, num_static=4,  # the built-in data's 4 static fields
    )  # fmt: skip
    return {
        "mambalm": save_pretrained(
            create_model("mambalm-tiny"), root / "lm", "mambalm-tiny", {"training": {"seq_len": 8}}
        ),
        "mamba2lm": save_pretrained(create_model("mamba2lm-tiny"), root / "lm2", "mamba2lm-tiny"),
        "hybridlm": save_pretrained(
            create_model("hybridlm-tiny", rope=True), root / "hybrid", "hybridlm-tiny"
        ),
        "video": save_pretrained(video, root / "video", "videomamba-tiny", {"sampling": sampling}),
        "weather": save_pretrained(weather, root / "weather", "weathermamba-tiny", weather_extra),
    }


@pytest.mark.parametrize("family", ["mambalm", "mamba2lm", "hybridlm"])
def test_generate_text_with_a_mamba_lm(mamba_folders, family, capsys) -> None:
    """The Python API, the script and ``dspzoo generate`` give the same seeded text; greedy
    decoding (recurrent states, and the hybrid's KV caches) = the argmax of full forwards."""
    from dspzoo.zoo.cli import main as cli_main

    folder = mamba_folders[family]
    result = inference.generate_text(folder, "def ", max_new=12, seed=3)
    assert result.prompt == b"def " and len(result.new) == 12
    again = inference.generate_text(inference.load(folder), "def ", max_new=12, seed=3)
    assert again.new == result.new  # seeded: reproducible
    flags = ["--prompt", "def ", "--max-new", "12", "--seed", "3"]
    printed = _script("generate_text")(["--model-dir", str(folder), *flags])
    assert printed == result.text and capsys.readouterr().out == result.text + "\n"
    assert cli_main(["generate", str(folder), *flags]) == 0
    assert capsys.readouterr().out == result.text + "\n"
    # greedy decoding with the recurrent state = the argmax of a full forward over the text
    model = inference.load(folder).model
    greedy = inference.generate_text(folder, "ab", max_new=5, temperature=0).new
    text = list(b"ab")
    with torch.no_grad():
        for _ in range(5):
            text.append(int(model(torch.tensor([text]))[0, -1].argmax()))
    assert greedy == bytes(text[2:])


def test_mamba_lm_of_too_small_a_vocabulary_cannot_generate_bytes(tmp_path) -> None:
    from dspzoo.domains.mamba.generate import generate_bytes

    model = create_model("mambalm-tiny", vocab_size=50)
    with pytest.raises(ValueError, match="needs vocab_size >= 256; this model has 50"):
        generate_bytes(model, "a", 2)


def test_mamba_inference_refuses_models_of_other_families(mamba_folders, folders) -> None:
    with pytest.raises(ValueError, match=r"holds a 'videomamba' model; this takes \['bytelm'"):
        inference.generate_text(mamba_folders["video"], "def ")
    with pytest.raises(ValueError, match=r"holds a 'mambalm' model; this takes \['stdit'"):
        inference.sample_video(mamba_folders["mambalm"])
    with pytest.raises(ValueError, match=r"holds a 'videomamba' model; this takes \['weathertx'"):
        inference.forecast_weather(mamba_folders["video"])
    with pytest.raises(SystemExit):  # the script: one parser error naming both families
        _script("generate_text")(["--model-dir", str(folders["protein"]), "--prompt", "a"])


def test_sample_video_mamba_at_sp2_equals_one_process(mamba_folders) -> None:
    """5 latent frames of 6 × 6 over 2 ranks (uneven shards), classifier-free guidance."""
    folder = mamba_folders["video"]
    one = inference.sample_video(folder, per_class=1, steps=3, seed=5)
    assert one.video.shape == (3, 3, 5, 12, 12) and one.labels.tolist() == [0, 1, 2]
    assert one.video.abs().max() <= 1 and one.video.std() > 0
    for got in run_distributed(_sample, 2, str(folder)):
        torch.testing.assert_close(got, one.video, rtol=1e-4, atol=1e-5)
    other = inference.sample_video(folder, per_class=1, steps=3, seed=6)
    assert not torch.allclose(other.video, one.video)  # the noise comes from the seed
    # the Euler loop by hand: noise from the seed, guidance 2 (the default), 3 steps
    from dspzoo.domains.video.codec import PixelUnshuffleCodec
    from dspzoo.domains.video.diffusion import TIMESTEP_SCALE

    model = inference.load(folder).model
    x = torch.randn((3, 12, 5, 6, 6), generator=torch.Generator().manual_seed(5))
    labels, null = torch.arange(3), torch.full((3,), 3)
    with torch.no_grad():
        for t, t_next in [(1.0, 2 / 3), (2 / 3, 1 / 3), (1 / 3, 0.0)]:
            tvec = torch.full((3,), t * TIMESTEP_SCALE)
            v_c, v_u = model(x, tvec, labels), model(x, tvec, null)
            x = x + (t_next - t) * (v_u + 2.0 * (v_c - v_u))
    torch.testing.assert_close(one.latents, x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(one.video, PixelUnshuffleCodec(2).decode(x).clamp(-1, 1))


def test_forecast_with_a_weather_mamba_is_what_the_command_writes(mamba_folders, tmp_path) -> None:
    folder = mamba_folders["weather"]
    fc = inference.forecast_weather(folder, steps=2)
    assert fc.lead == 1 and fc.forecast.forecast.shape == (2, 1, 37, 49)
    summary = fc.summary()
    assert summary["leads"] == [1, 2] and summary["init"].startswith("2059")
    assert all(np.isfinite(summary["rmse"]["model"]).ravel())
    written = _script("forecast_weather")(
        ["--model-dir", str(folder), "--steps", "2", "--out", str(tmp_path)]
    )
    assert written == summary == json.loads((tmp_path / "rmse.json").read_text())


@pytest.mark.parametrize(
    "call, families",
    [
        ("sample_video", inference.VIDEO_FAMILIES),
        ("generate_text", inference.TEXT_FAMILIES),
        ("forecast_weather", inference.WEATHER_FAMILIES),
    ],
)
def test_the_docs_table_names_the_families_each_call_takes(call: str, families: tuple) -> None:
    """docs/inference.md's function table lists exactly the families the call accepts."""
    rows = (REPO / "docs" / "inference.md").read_text().splitlines()
    (row,) = [r for r in rows if r.startswith(f"| `{call}(")]
    documented = set(re.findall(r"`([a-z0-9]+)`", row.split("|")[2]))
    assert documented == set(families)
