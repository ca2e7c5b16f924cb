"""The diffusers → ``latte1`` converter: folders, errors, and equivalence with diffusers.

Without diffusers: zoo weights written in diffusers' layout (single file, sharded, an fp16
variant) convert back exactly, and every bad folder raises a clear error. With diffusers
(skipped when absent): tiny ``LatteTransformer3DModel`` s with random weights, saved with
``save_pretrained`` and converted, give diffusers' outputs at SP 1, 2 and 3 (dsp, ulysses,
ring; frames and tokens divisible by neither 2 nor 3), in fp64 and fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import dspzoo.domains.video  # noqa: F401  (registers latte1)
from dspzoo.core import SeqParallel, build_mesh
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.testing import run_distributed
from dspzoo.zoo import create_model, from_pretrained, load_extra
from dspzoo.zoo.convert import (
    ConversionError,
    convert_diffusers_latte,
    convert_folder,
    diffusers_config,
    to_diffusers_state_dict,
)

STEM = "diffusion_pytorch_model"


def _random_tiny(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("latte1-tiny", **overrides)
    with torch.no_grad():  # zero-initialised layers re-randomised: every weight matters
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _write_folder(folder: Path, model, shards: int = 1, variant: str = "") -> Path:
    """A diffusers-layout folder of a zoo model (config.json + safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(diffusers_config(model.config)))
    state = to_diffusers_state_dict(model)
    dot = f".{variant}" if variant else ""
    if shards == 1:
        save_file(state, str(folder / f"{STEM}{dot}.safetensors"))
        return folder
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"{STEM}{dot}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index = f"{STEM}.safetensors.index{dot}.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k].to(sa[k].dtype), sa[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": False, "norm_elementwise_affine": True, "cross_attention": False}],
)
def test_roundtrip_single_sharded_and_variant(tmp_path: Path, overrides: dict) -> None:
    model = _random_tiny(**overrides)
    single = convert_diffusers_latte(_write_folder(tmp_path / "single", model))
    _same_parameters(model, single)
    assert single.config == model.config and not single.training
    _same_parameters(model, convert_diffusers_latte(_write_folder(tmp_path / "sh", model, 3)))
    half = _write_folder(tmp_path / "fp16", model.half(), variant="fp16")
    assert convert_diffusers_latte(half).x_embed.weight.dtype == torch.float16
    assert convert_diffusers_latte(half, dtype=torch.float32).t_mod.weight.dtype == torch.float32
    # a pipeline folder (model_index.json + transformer/) converts through its transformer/
    pipe = tmp_path / "pipe"
    _write_folder(pipe / "transformer", model.float())
    (pipe / "model_index.json").write_text("{}")
    out = convert_folder(pipe, tmp_path / "zoo")
    _same_parameters(model, from_pretrained(out, expected_family="latte1"))
    extra = load_extra(out)
    assert extra["converted_from"] == "diffusers"
    assert extra["diffusers_config"]["_class_name"] == "LatteTransformer3DModel"


def _expect(error: type, match: str, folder: Path) -> None:
    with pytest.raises(error, match=match):
        convert_folder(folder, folder.parent / "out")


def test_clear_errors(tmp_path: Path) -> None:
    model = _random_tiny()
    _expect(FileNotFoundError, "does not exist", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    _expect(FileNotFoundError, "has no config.json", tmp_path / "empty")

    def folder(name: str, edit_config=None, edit_state=None) -> Path:
        path = _write_folder(tmp_path / name, model)
        config = json.loads((path / "config.json").read_text())
        if edit_config:
            edit_config(config)
            (path / "config.json").write_text(json.dumps(config))
        if edit_state:
            state = to_diffusers_state_dict(model)
            edit_state(state)
            save_file(state, str(path / f"{STEM}.safetensors"))
        return path

    _expect(
        ConversionError,
        "is a PixArtTransformer2DModel",
        folder("pixart", lambda c: c.update(_class_name="PixArtTransformer2DModel")),
    )
    _expect(ConversionError, "no _class_name", folder("anon", lambda c: c.pop("_class_name")))
    _expect(
        ConversionError,
        "norm_type='layer_norm' is not supported",
        folder("norm", lambda c: c.update(norm_type="layer_norm")),
    )
    _expect(
        ConversionError,
        "activation_fn='geglu'",
        folder("act", lambda c: c.update(activation_fn="geglu")),
    )
    _expect(
        ConversionError,
        r"fields \['frobnicate'\]",
        folder("field", lambda c: c.update(frobnicate=1)),
    )
    _expect(
        ConversionError,
        "caption_channels is required",
        folder("cap", lambda c: c.pop("caption_channels")),
    )
    _expect(
        ConversionError,
        "cross_attention_dim=8 must equal",
        folder("xdim", lambda c: c.update(cross_attention_dim=8)),
    )
    _expect(
        ConversionError,
        r"unknown keys: \['extra.weight'\]",
        folder("unknown", edit_state=lambda s: s.update({"extra.weight": torch.zeros(1)})),
    )
    _expect(
        ConversionError,
        r"missing keys: \['transformer_blocks.1.attn2.to_k.bias'\]",
        folder("missing", edit_state=lambda s: s.pop("transformer_blocks.1.attn2.to_k.bias")),
    )
    _expect(
        ConversionError,
        "missing keys",
        folder(  # 3 layers declared, 2 stored
            "layers", lambda c: c.update(num_layers=3)
        ),
    )
    _expect(
        ConversionError,
        "shapes do not match",
        folder(  # hidden 4·8 = 32 declared, 16 stored
            "heads", lambda c: c.update(attention_head_dim=8, cross_attention_dim=32)
        ),
    )
    # the non-persistent position tables are tolerated if a checkpoint carries them
    tables = folder("tables", edit_state=lambda s: s.update({"temp_pos_embed": torch.zeros(5)}))
    _same_parameters(model, convert_diffusers_latte(tables))
    weights = tmp_path / "single" / f"{STEM}.safetensors"
    _write_folder(tmp_path / "single", model)
    weights.rename(weights.with_suffix(".bin"))
    _expect(ConversionError, "pickled weights", tmp_path / "single")
    weights.with_suffix(".bin").unlink()
    _expect(FileNotFoundError, f"no {STEM}.safetensors", tmp_path / "single")
    sharded = _write_folder(tmp_path / "sharded", model, shards=2)
    next(sharded.glob(f"{STEM}-00002-*")).unlink()
    _expect(FileNotFoundError, "lists shards missing", sharded)
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "config.json").write_text(json.dumps(diffusers_config(model.config)))
    (tmp_path / "trunc" / f"{STEM}.safetensors").write_bytes(b"\x08\x00\x00")
    _expect(ConversionError, "corrupt or truncated", tmp_path / "trunc")


# -- equivalence with diffusers ----------------------------------------------------------------
DIFFUSERS_CONFIGS = {
    # Latte-1's flags at a tiny size
    "latte-1-like": dict(
        attention_bias=True,
        norm_elementwise_affine=False,
        activation_fn="gelu-approximate",
        sample_size=8,
        cross=True,
    ),
    # the other branches: affine norms, no q/k/v bias, exact GELU, interpolation scale 2
    # (sample_size 128), no cross-attention
    "variant": dict(
        attention_bias=False,
        norm_elementwise_affine=True,
        activation_fn="gelu",
        sample_size=128,
        cross=False,
    ),
}
FRAMES, HEIGHT, WIDTH = 5, 10, 14  # T' = 5, S = 5·7 = 35: divisible by neither 2 nor 3


def _diffusers_model(options: dict):
    from diffusers import LatteTransformer3DModel

    options = dict(options)
    cross = options.pop("cross")
    torch.manual_seed(0)
    model = LatteTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=4,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=16 if cross else None,
        patch_size=2,
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_eps=1e-6,
        caption_channels=12,
        video_length=FRAMES,
        **options,
    )
    with torch.no_grad():  # nothing stays at an init value (zeros, ones) that hides a mix-up
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _cases() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    video = {
        "x": torch.randn(2, 4, FRAMES, HEIGHT, WIDTH, generator=g),
        "timestep": torch.tensor([17.0, 803.0]),
        "cond": torch.randn(2, 6, 12, generator=g),
    }
    # one frame (image mode, no temporal table) with a caption mask: the only case in which
    # diffusers' own forward accepts a mask
    image = {
        "x": torch.randn(2, 4, 1, HEIGHT, WIDTH, generator=g),
        "timestep": torch.tensor([999.0, 0.0]),
        "cond": torch.randn(2, 6, 12, generator=g),
        "cond_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1]], dtype=torch.bool),
    }
    return [video, image]


def _diffusers_output(model, case: dict, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return model.to(dtype)(
            case["x"].to(dtype),
            timestep=case["timestep"],
            encoder_hidden_states=case["cond"].to(dtype),
            encoder_attention_mask=case.get("cond_mask"),
        ).sample


def _sp_worker(rank: int, world: int, folders: dict, cases: list, refs: dict) -> dict:
    """Converted models under SP 1 (each rank), SP 2 (ranks 0-1) and SP 3: max |diff| each."""
    group2 = dist.new_group([0, 1])
    meshes = {1: None, 3: build_mesh(world)}
    if rank < 2:
        meshes[2] = SPMesh(
            world, rank, dp_size=1, sp_size=2, dp_rank=0, sp_rank=rank, sp_group=group2
        )
    found: dict = {}
    for name, folder in folders.items():
        for dtype in (torch.float64, torch.float32):
            model = from_pretrained(folder, expected_family="latte1").to(dtype)
            for size, mesh in meshes.items():
                for strategy in ("dsp", "ulysses", "ring") if size > 1 else ("dsp",):
                    sp = SeqParallel(mesh, strategy)
                    for i, case in enumerate(cases):
                        cond = case["cond"].to(dtype)
                        with torch.no_grad():
                            out = model(
                                case["x"].to(dtype),
                                case["timestep"],
                                cond,
                                case.get("cond_mask"),
                                sp=sp,
                            )
                        ref = refs[name, str(dtype), i]
                        found[name, str(dtype), size, strategy, i] = (
                            float((out - ref).abs().max()),
                            float((out - ref).abs().max() / ref.abs().max()),
                        )
    return found


@pytest.mark.timeout(240)
def test_matches_diffusers_at_sp_1_2_3(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    cases = _cases()
    folders, refs = {}, {}
    for name, options in DIFFUSERS_CONFIGS.items():
        model = _diffusers_model(options)
        model.save_pretrained(tmp_path / name)
        folders[name] = str(convert_folder(tmp_path / name, tmp_path / f"{name}-zoo"))
        for dtype in (torch.float64, torch.float32):
            for i, case in enumerate(cases):
                refs[name, str(dtype), i] = _diffusers_output(model, case, dtype)
        # the converted weights load back into diffusers exactly (the inverse mapping)
        back = _diffusers_model(options)
        back.load_state_dict(to_diffusers_state_dict(from_pretrained(folders[name])))
        for key, value in model.float().state_dict().items():
            torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)
    results = run_distributed(_sp_worker, 3, folders, cases, refs, timeout=220)
    merged = {k: v for r in results for k, v in r.items()}
    assert {k[2] for k in merged} == {1, 2, 3}
    print("\nlatte1 vs diffusers LatteTransformer3DModel: max |diff| (relative to max |ref|)")
    for key in sorted(merged, key=lambda k: (k[1], k[2], k[0], k[3], k[4])):
        name, dtype, size, strategy, i = key
        abs_diff, rel_diff = merged[key]
        print(
            f"  {dtype:14s} SP{size} {strategy:8s} {name:13s} "
            f"{'video' if i == 0 else 'image+mask'}: {abs_diff:.2e} ({rel_diff:.2e})"
        )
        limit = 1e-12 if dtype == "torch.float64" else 2e-6
        assert rel_diff <= limit, (key, abs_diff, rel_diff)


@pytest.mark.slow
def test_matches_diffusers_at_latte_1_widths(tmp_path: Path) -> None:
    """Latte-1's published config (hidden 1152 = 16 heads × 72, caption 4096, sample_size 64,
    16 frames) with 2 of its 28 layer pairs: the converted model gives diffusers' output."""
    pytest.importorskip("diffusers")
    from diffusers import LatteTransformer3DModel

    config = diffusers_config(create_model("latte1-latte-1", device="meta").config)
    config.pop("_class_name")
    torch.manual_seed(0)
    reference = LatteTransformer3DModel(**{**config, "num_layers": 2}).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.02)
    reference.save_pretrained(tmp_path / "wide")
    model = convert_diffusers_latte(tmp_path / "wide")
    g = torch.Generator().manual_seed(1)
    x, cond = torch.randn(1, 4, 16, 8, 8, generator=g), torch.randn(1, 20, 4096, generator=g)
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        want = reference(x, timestep=timestep, encoder_hidden_states=cond).sample
        got = model(x, timestep, cond)
    error = float((got - want).abs().max() / want.abs().max())
    print(
        f"\nLatte-1 widths, 2 layer pairs, fp32: max |diff| {float((got - want).abs().max()):.2e}"
        f" ({error:.2e} of max |ref|)"
    )
    assert error <= 2e-6
