"""STDiT and Latte under DSP against the single-process computation (forward and gradients)."""

from __future__ import annotations

import dataclasses
import itertools
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import dspzoo.domains.video  # noqa: F401  (registers the families)
from dspzoo.core import SeqParallel, build_mesh, sp_mse, trace_comm
from dspzoo.core.layers import attention as attention_module
from dspzoo.core.testing import run_distributed
from dspzoo.zoo import create_model

# (T, H, W) latents: divisible at SP 2 and 4, T = 5 frames, and a 6×6 latent (S = 9 tokens)
SHAPES = [(4, 8, 8), (5, 6, 6)]


def _model(family: str, cond: bool, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(
        f"{family}-tiny", cond_dim=8 if cond else 0, hidden=32, heads=4, num_classes=3
    ).to(dtype)
    with (
        torch.no_grad()
    ):  # adaLN-Zero starts at identity: randomise so every gradient is non-trivial
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _inputs(shape: tuple[int, int, int], cond: bool, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    t, h, w = shape
    inputs = {
        "x": torch.randn(2, 12, t, h, w, generator=g, dtype=dtype),
        # per-frame timesteps on the odd shape: conditioning sliced in lockstep with the tokens
        "timestep": torch.rand(2, *([t] if t % 2 else []), generator=g, dtype=dtype) * 1000,
        "y": torch.tensor([0, 2]),
    }
    if cond:
        inputs["cond"] = torch.randn(2, 3, 8, generator=g, dtype=dtype)
        inputs["cond_mask"] = torch.tensor([[True, True, False], [True, True, True]])
    return inputs


def _run(model: torch.nn.Module, inputs: dict, sp: SeqParallel, sharded_loss: bool) -> torch.Tensor:
    torch.manual_seed(5)  # label dropout draws from the global RNG, identical in the SP group
    model.train()
    weight = torch.randn(
        inputs["x"].shape, generator=torch.Generator().manual_seed(9), dtype=inputs["x"].dtype
    )
    if sharded_loss:
        out = model(**inputs, sp=sp, gather_output=False)
        target = sp.shard_like(model.patchify_target(weight), out)
        frames = inputs["x"].shape[2]
        frame_mask = (torch.arange(frames) != 1).to(target.dtype)[
            None, :, None, None
        ]  # [1, T', 1, 1]
        loss = sp_mse(out.tensor, target, sp.group, weight=sp.shard_like(frame_mask, out))
        loss.backward()
        return loss.detach()
    out = model(**inputs, sp=sp)
    ((out - weight) ** 2).mean().backward()
    return out.detach()


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp64: elementwise to 1e-5 relative; fp32: relative error of the whole tensor ≤ 1e-5
    (elementwise, fp32 sums taken in another order differ by more near zero)."""
    if ref.dtype == torch.float64:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8, msg=lambda m: f"{what}: {m}")
        return
    error = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    assert error <= 1e-5, f"{what}: relative error {error:.2e} in {ref.dtype}"


def _compare(sp: SeqParallel, world: int) -> int:
    """Every (dtype, family, conditioning, shape, loss placement) case against one process."""
    checks = 0
    for dtype, family, cond, shape, sharded_loss in itertools.product(
        (torch.float64, torch.float32), ("stdit", "latte"), (False, True), SHAPES, (False, True)
    ):
        case = f"{dtype} {family} cond={cond} {shape} sharded_loss={sharded_loss}"
        inputs = _inputs(shape, cond, dtype)
        ref_model, model = _model(family, cond, dtype), _model(family, cond, dtype)
        ref = _run(ref_model, inputs, SeqParallel(), sharded_loss)
        got = _run(model, inputs, sp, sharded_loss)
        if sharded_loss:  # per-rank loss share: its SP mean is the full loss
            got = got.clone()
            dist.all_reduce(got)
            got = got / world
        _assert_matches(got, ref, case)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert q.grad is not None and q.grad.abs().sum() > 0, name
            grad = p.grad.clone()
            dist.all_reduce(grad)
            _assert_matches(grad / world, q.grad, f"{case} grad {name}")
        checks += 1
    return checks


def _traced_bytes(sp: SeqParallel, world: int, depth: int = 3) -> dict:
    """All-to-all count and bytes per layer of an STDiT forward (T = 8, S = 16, hidden 64)."""
    torch.manual_seed(0)
    model = create_model("stdit-tiny", depth=depth).eval()
    x = torch.randn(1, 12, 8, 8, 8)
    with trace_comm() as tracer, torch.no_grad():
        model(x, torch.tensor([500.0]), sp=sp)
    m = 1 * 8 * 16 * model.config.hidden
    return {
        "switches": tracer.count("all_to_all", "forward"),
        "per_layer": [
            tracer.total_bytes("all_to_all", "forward", f"block{i}") for i in range(depth)
        ],
        "formula": 2 * (m / world) * (world - 1) / world * x.element_size(),
    }


def _worker(rank: int, world: int) -> dict:
    """One spawned group per world size runs every multi-rank check (start-up is the cost)."""
    sp = SeqParallel(build_mesh(world))
    return {"checks": _compare(sp, world), "trace": _traced_bytes(sp, world)}


@pytest.mark.parametrize("world", [2, 4])
def test_video_models_under_dsp(world: int) -> None:
    """Outputs and all gradients equal one process; STDiT does 2 switches per layer."""
    results = run_distributed(_worker, world, timeout=400)
    for r in results:
        assert r["checks"] == 32
        trace = r["trace"]
        assert trace["switches"] == 2 * 3 - 1  # the first layer's first switch is the entry split
        assert trace["per_layer"][1] == trace["per_layer"][2] == trace["formula"]
        assert trace["per_layer"][0] == trace["formula"] / 2


def test_big_configs_on_meta_device() -> None:
    from dspzoo.zoo import count_parameters

    n720 = count_parameters(create_model("stdit-720M", device="meta"))
    n3b = count_parameters(create_model("stdit-3B", device="meta"))
    assert 600e6 < n720 < 800e6, n720
    assert 2.5e9 < n3b < 3.5e9, n3b
    cfg = create_model("stdit-3B", device="meta").config
    assert (cfg.depth, cfg.hidden, cfg.heads, cfg.patch) == (36, 2048, 32, (1, 2, 2))


def test_bad_inputs_raise_clear_errors() -> None:
    model = create_model("stdit-tiny")
    t = torch.tensor([1.0])
    with pytest.raises(ValueError, match="latent channels"):
        model(torch.randn(1, 3, 4, 8, 8), t)
    with pytest.raises(ValueError, match="position-embedding range"):
        model(torch.randn(1, 12, model.config.max_frames + 1, 8, 8), t)
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\]"):
        model(torch.randn(1, 12, 8, 8), t)
    with pytest.raises(ValueError, match="not divisible by the patch"):
        model(torch.randn(1, 12, 4, 7, 8), t)
    x = torch.randn(1, 12, 4, 8, 8)
    no_cross = create_model("stdit-tiny", cond_dim=0)
    with pytest.raises(ValueError, match="without cross-attention"):
        no_cross(x, t, cond=torch.randn(1, 2, 32))
    with pytest.raises(ValueError, match="cond_dim=32"):
        model(x, t, cond=torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match="cond_mask"):
        model(x, t, cond=torch.randn(1, 2, 32), cond_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="timestep"):
        model(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"per frame \[B=1, T'=4\]"):
        model(x, torch.rand(1, 3))
    with pytest.raises(ValueError, match="depth must be even"):
        create_model("latte-tiny", depth=3)


@pytest.mark.parametrize("family", ["stdit", "latte"])
def test_equal_per_frame_timesteps_match_one_per_sample(family: str) -> None:
    model = _model(family, cond=False).eval()
    x = torch.randn(2, 12, 5, 6, 6, dtype=torch.float64)
    t = torch.tensor([10.0, 700.0], dtype=torch.float64)
    y = torch.tensor([0, 2])
    per_frame = model(x, t[:, None].expand(2, 5), y)
    torch.testing.assert_close(per_frame, model(x, t, y))
    t_frames = t[:, None].repeat(1, 5)
    t_frames[:, 0] = 0.0  # a clean first frame changes the prediction for the others too
    assert not torch.allclose(model(x, t_frames, y)[:, :, 1:], per_frame[:, :, 1:])


@pytest.mark.parametrize("family", ["stdit", "latte"])
def test_blocks_start_as_identity(family: str) -> None:
    """adaLN-Zero: at init every block (cross-attention included) returns its input."""
    model = create_model(f"{family}-tiny").eval()
    x = torch.randn(2, 12, 3, 4, 6)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(
            lambda m, args, out: seen.append(torch.equal(out.tensor, args[0].tensor))
        )
    out = model(x, torch.tensor([10.0, 900.0]), y=torch.tensor([1, 2]), cond=torch.randn(2, 5, 32))
    assert seen == [True] * model.config.depth
    assert torch.equal(out, torch.zeros_like(x))  # zero final layer


def test_learn_sigma_doubles_the_output() -> None:
    model = create_model("latte-tiny", learn_sigma=True)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x, t = torch.randn(1, 12, 2, 4, 4), torch.tensor([3.0])
    out = model(x, t)
    assert out.shape == (1, 24, 2, 4, 4)
    pred, var = model.split_sigma(model(x, t, gather_output=False).tensor)
    assert torch.equal(pred, model.patchify_target(out[:, :12]))
    assert torch.equal(var, model.patchify_target(out[:, 12:]))
    with pytest.raises(ValueError, match="learn_sigma=False"):
        create_model("latte-tiny").split_sigma(pred)


def test_flash_attention_dispatch() -> None:
    q = torch.randn(2, 5, 4, 8)
    assert not attention_module.can_use_flash(q, None)  # CPU: always SDPA
    calls = []

    def fake_flash(q, k, v, dropout_p=0.0, causal=False):
        calls.append(q.shape)
        return torch.zeros_like(q)

    with (
        mock.patch.object(attention_module, "can_use_flash", return_value=True),
        mock.patch.object(attention_module, "flash_attn_func", return_value=fake_flash),
    ):
        out = attention_module.attend(q, q, q)
    assert calls == [q.shape] and torch.equal(out, torch.zeros_like(q))
    ref = attention_module.attend(q, q, q)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2)
    )
    torch.testing.assert_close(ref, sdpa.transpose(1, 2))


def test_config_round_trip_through_zoo(tmp_path) -> None:
    from dspzoo.zoo import from_pretrained, save_pretrained

    model = create_model("latte-tiny")
    path = save_pretrained(model, tmp_path / "latte")
    loaded = from_pretrained(path, expected_family="latte")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(model.config)
    assert loaded.config.patch == (1, 2, 2)
