"""Mamba LMs (domains/mamba/lm.py, convert.py): transformers' checkpoints load and give their
logits (optional: needs transformers; tiny random models built locally, nothing downloaded),
the converter's folder round trip and its errors, bad inputs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dspzoo.domains.mamba import Mamba2LM, MambaLM, MambaLMConfig
from dspzoo.domains.mamba.convert import (
    ConversionError,
    config_from_transformers,
    convert_folder,
    load_transformers_state_dict,
    prepare_state_dict,
    transformers_config,
)
from dspzoo.zoo import create_model, from_pretrained

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its init, so each one matters in the comparison."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _hf_model(version: int, tie: bool):
    import transformers

    torch.manual_seed(0)
    if version == 1:
        cfg = transformers.MambaConfig(
            vocab_size=61, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2,
            conv_kernel=4, time_step_rank=3, use_bias=True, tie_word_embeddings=tie,
            use_mambapy=False,
        )  # fmt: skip
        model = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(
            vocab_size=61, hidden_size=16, num_hidden_layers=2, state_size=5, expand=2,
            num_heads=4, head_dim=8, n_groups=2, chunk_size=8, use_bias=True,
            tie_word_embeddings=tie,
        )  # fmt: skip
        model = transformers.Mamba2ForCausalLM(cfg)
    return _perturbed(model.eval(), 1)


@needs_transformers
@pytest.mark.parametrize("version, tie", [(1, True), (1, False), (2, False), (2, True)])
def test_transformers_weights_give_transformers_logits(version, tie):
    theirs = _hf_model(version, tie)
    config = config_from_transformers(theirs.config.to_dict())
    assert config.version == version and config.tie_word_embeddings == tie
    ours = load_transformers_state_dict(theirs.state_dict(), config).eval()
    assert type(ours) is (MambaLM if version == 1 else Mamba2LM)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    tokens = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@needs_transformers
@pytest.mark.parametrize("version", [1, 2])
def test_convert_saved_transformers_folder(tmp_path, version):
    theirs = _hf_model(version, tie=version == 1)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded safetensors
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = convert_folder(tmp_path / "hf", tmp_path / "zoo")
    ours = from_pretrained(out).eval()
    tokens = torch.randint(0, 61, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=1e-4)


@needs_transformers
def test_zoo_config_builds_the_same_transformers_model():
    """transformers_config → MambaConfig → a model whose state dict our model loads back."""
    import transformers

    for name, cls in (("mambalm-tiny", transformers.MambaConfig),
                      ("mamba2lm-tiny", transformers.Mamba2Config)):  # fmt: skip
        ours = create_model(name)
        hf_cfg = cls(
            **{k: v for k, v in transformers_config(ours.config).items() if k != "model_type"}
        )
        head = (
            transformers.MambaForCausalLM
            if cls is transformers.MambaConfig
            else transformers.Mamba2ForCausalLM
        )
        theirs = head(hf_cfg)
        theirs.load_state_dict(ours.state_dict())  # strict: same names and shapes


def test_checkpoint_of_the_other_version_is_refused():
    mamba2_state = create_model("mamba2lm-tiny").state_dict()
    with pytest.raises(ConversionError, match="not a MambaForCausalLM of this config: missing"):
        prepare_state_dict(mamba2_state, create_model("mambalm-tiny").config)


def test_wrong_shapes_and_untied_head_are_refused():
    model = create_model("mambalm-tiny")
    state = dict(model.state_dict())
    state["backbone.norm_f.weight"] = torch.ones(7)
    with pytest.raises(ConversionError, match=r"backbone.norm_f.weight \(7,\) \(want \(32,\)\)"):
        prepare_state_dict(state, model.config)
    state = dict(model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        prepare_state_dict(state, model.config)


def test_tied_head_may_be_absent_and_legacy_name_is_read():
    model = create_model("mambalm-tiny")
    state = {k.replace("embeddings", "embedding"): v for k, v in model.state_dict().items()}
    del state["lm_head.weight"]
    loaded = load_transformers_state_dict(state, model.config)
    tokens = torch.randint(0, 256, (1, 5))
    torch.testing.assert_close(loaded(tokens), model(tokens))


def test_bad_configs_and_folders(tmp_path):
    with pytest.raises(ConversionError, match="model_type 'llama' is not a transformers Mamba"):
        config_from_transformers({"model_type": "llama"})
    with pytest.raises(ValueError, match="num_heads × head_dim"):
        MambaLMConfig(version=2, hidden_size=32, num_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="is a Mamba-1 LM but the config has version=2"):
        MambaLM(MambaLMConfig(version=2, hidden_size=32, num_heads=4, head_dim=16))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        convert_folder(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        convert_folder(tmp_path, tmp_path / "out")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ConversionError, match="corrupt or truncated"):
        convert_folder(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(
    "tokens, error, message",
    [
        (torch.zeros(2, 4), TypeError, "integer tensor"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"\[batch, length >= 1\]"),
        (torch.full((1, 3), 256), ValueError, r"must lie in \[0, 256\)"),
    ],
)
def test_bad_tokens(tokens, error, message):
    with pytest.raises(error, match=message):
        create_model("mambalm-tiny")(tokens)


def test_activation_checkpointing_gives_the_same_gradients():
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = create_model("mamba2lm-tiny", checkpoint=checkpointed)
        model(tokens).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def _hand_count(config: MambaLMConfig) -> int:
    """Parameters of a Mamba LM counted from its shapes (tied head: the embedding once)."""
    d, n, k = config.hidden_size, config.state_size, config.conv_kernel
    layers, inner = config.num_hidden_layers, config.expand * config.hidden_size
    if config.version == 1:
        rank = -(-d // 16) if config.time_step_rank == "auto" else config.time_step_rank
        mixer = (d * 2 * inner + inner * k + inner + inner * (rank + 2 * n) + rank * inner + inner
                 + inner * n + inner + inner * d)  # fmt: skip
    else:
        heads, conv = config.num_heads, inner + 2 * config.n_groups * n
        mixer = d * (2 * inner + 2 * config.n_groups * n + heads) + conv * k + conv + 3 * heads
        mixer += inner + inner * d  # gated RMSNorm, out_proj
    head = 0 if config.tie_word_embeddings else config.vocab_size * d
    return config.vocab_size * d + layers * (mixer + d) + d + head


@pytest.mark.parametrize("name, version", [("mambalm-130m", 1), ("mamba2lm-130m", 2)])
def test_published_scale_configs_on_the_meta_device(name, version):
    """mamba-130m / mamba2-130m shapes: built on the meta device (no memory), the parameter
    count equals the count from the published shapes (~129M, the "130m" class) and, where
    transformers is installed, its model of the published config on the meta device."""
    model = create_model(name, device="meta")
    assert model.lm_head.weight.is_meta and model.config.version == version
    count = sum(p.numel() for p in model.parameters())
    assert count == _hand_count(model.config)
    assert 1.25e8 < count < 1.35e8, count
    assert model.lm_head.weight is model.backbone.embeddings.weight  # tied, as published
    if importlib.util.find_spec("transformers") is None:
        return
    import transformers

    published = {  # the checkpoints' config.json shapes
        1: (transformers.MambaConfig, transformers.MambaForCausalLM,
            dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16,
                 expand=2, conv_kernel=4, time_step_rank=48, use_bias=False, use_conv_bias=True)),
        2: (transformers.Mamba2Config, transformers.Mamba2ForCausalLM,
            dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, state_size=128,
                 expand=2, num_heads=24, head_dim=64, n_groups=1, conv_kernel=4,
                 use_bias=False, use_conv_bias=True)),
    }  # fmt: skip
    config_cls, model_cls, shapes = published[version]
    with torch.device("meta"):
        theirs = model_cls(config_cls(**shapes, tie_word_embeddings=True))
    assert count == sum(p.numel() for p in theirs.parameters())
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
