"""STDiT and Latte under DSP (SP 2, 3, 4) against the single-process computation (forward and
gradients)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

import dspzoo.domains.video  # noqa: F401  (registers the families)
from dspzoo.core import SeqParallel, build_mesh, shard_sizes, sp_mse, trace_comm
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.testing import run_distributed
from dspzoo.zoo import create_model

# (T, H, W) latents → (T', S) tokens with patch (1, 2, 2): (4, 16) divides by 2 and 4 but
# neither dim by 3; (5, 9) has T' = 5 frames, divisible by none, and S = 9 tokens (6×6 latent)
SHAPES = [(4, 8, 8), (5, 6, 6)]
SP_SIZES = (2, 3, 4)
WORLD = 4  # one spawn: SP 4 = the world, SP 2 = two groups, SP 3 = ranks 0-2


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


CASES = list(
    itertools.product(
        (torch.float64, torch.float32), ("stdit", "latte"), (False, True), SHAPES, (False, True)
    )
)  # (dtype, family, conditioning, shape, loss on sharded tokens)


def _reference(case: tuple) -> dict:
    """Single-process output (or loss) and every parameter gradient of one case."""
    dtype, family, cond, shape, sharded_loss = case
    model = _model(family, cond, dtype)
    out = _run(model, _inputs(shape, cond, dtype), SeqParallel(), sharded_loss)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{case} {name}"
        grads[name] = p.grad
    return {"out": out, "grads": grads}


def _references(rank: int, world: int) -> dict[int, dict]:
    """Every case's reference, each computed once on one rank and shared with all."""
    mine = {i: _reference(case) for i, case in enumerate(CASES) if i % world == rank}
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    return {i: ref for part in parts for i, ref in part.items()}


def _check(case: tuple, ref: dict, sp: SeqParallel) -> None:
    """One case under ``sp`` against its single-process reference (forward and gradients)."""
    dtype, family, cond, shape, sharded_loss = case
    what = f"SP{sp.size} {dtype} {family} cond={cond} {shape} sharded_loss={sharded_loss}"
    model = _model(family, cond, dtype)
    got = _run(model, _inputs(shape, cond, dtype), sp, sharded_loss)
    if sharded_loss:  # per-rank loss share: its SP mean is the full loss
        got = got.clone()
        dist.all_reduce(got, group=sp.group)
        got = got / sp.size
    _assert_matches(got, ref["out"], what)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=sp.group)
        _assert_matches(grad / sp.size, ref["grads"][name], f"{what} grad {name}")


def _traced_bytes(sp: SeqParallel, depth: int = 3) -> dict:
    """All-to-all count and bytes per layer of an STDiT forward (T = 8, S = 16, hidden 64)."""
    torch.manual_seed(0)
    model = create_model("stdit-tiny", depth=depth).eval()
    x = torch.randn(1, 12, 8, 8, 8)
    with trace_comm() as tracer, torch.no_grad():
        model(x, torch.tensor([500.0]), sp=sp)
    return {
        "sp_rank": sp.rank,
        "hidden": model.config.hidden,
        "switches": tracer.count("all_to_all", "forward"),
        "per_layer": [
            tracer.total_bytes("all_to_all", "forward", f"block{i}") for i in range(depth)
        ],
    }


def _worker(rank: int, world: int) -> dict:
    """SP 2, 3 and 4 in one spawned world of 4 (process start-up is the main cost)."""
    sp4 = SeqParallel(build_mesh(world))
    mesh2 = build_mesh(2)  # SP groups [0, 1] and [2, 3]
    sp2 = SeqParallel(mesh2)
    group3 = dist.new_group([0, 1, 2])  # every rank takes part in creating it
    sp3 = None
    if rank < 3:
        mesh3 = SPMesh(world, rank, dp_size=1, sp_size=3, dp_rank=0, sp_rank=rank, sp_group=group3)
        sp3 = SeqParallel(mesh3)
    refs = _references(rank, world)
    checked: dict[int, list[int]] = {size: [] for size in SP_SIZES}
    for i, case in enumerate(CASES):
        _check(case, refs[i], sp4)
        checked[4].append(i)
        if sp3 is not None:
            _check(case, refs[i], sp3)
            checked[3].append(i)
        if i % 2 == mesh2.dp_rank:  # the two SP-2 groups share the cases
            _check(case, refs[i], sp2)
            checked[2].append(i)
    traces = {size: _traced_bytes(sp) for size, sp in ((2, sp2), (3, sp3), (4, sp4)) if sp}
    return {"checked": checked, "trace": traces}


def _switch_bytes(n: int, sp_rank: int, hidden: int, t: int = 8, s: int = 16) -> tuple[int, int]:
    """Bytes rank ``sp_rank`` sends in the t→s and the s→t switch of a [1, t, s, hidden] fp32
    activation: its own block stays, uneven shards included."""
    t_own, s_own = shard_sizes(t, n)[sp_rank], shard_sizes(s, n)[sp_rank]
    return t_own * (s - s_own) * hidden * 4, (t - t_own) * s_own * hidden * 4


def test_video_models_under_dsp() -> None:
    """At SP 2, 3 and 4, outputs and all gradients equal one process; STDiT does 2 switches
    per layer, each moving exactly the off-rank part of its shard (uneven at SP 3)."""
    results = run_distributed(_worker, WORLD, timeout=500)
    everything = list(range(len(CASES)))
    assert all(r["checked"][4] == everything for r in results)
    assert all(r["checked"][3] == everything for r in results[:3])
    assert sorted(results[0]["checked"][2] + results[2]["checked"][2]) == everything
    for rank, r in enumerate(results):
        assert set(r["trace"]) == ({2, 3, 4} if rank < 3 else {2, 4})
        for n, trace in r["trace"].items():
            assert trace["sp_rank"] == (rank % 2 if n == 2 else rank)
            to_s, to_t = _switch_bytes(n, trace["sp_rank"], trace["hidden"])
            assert (
                trace["switches"] == 2 * 3 - 1
            )  # the first layer's first switch is the entry split
            assert trace["per_layer"] == [to_s, to_s + to_t, to_s + to_t], (n, rank)
            if n in (2, 4):  # even shards: the README's 2·(M/N)·(N−1)/N elements per layer
                m = 8 * 16 * trace["hidden"]
                assert to_s + to_t == 2 * (m / n) * (n - 1) / n * 4


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
            lambda m, args, out: seen.append(torch.equal(out, args[0]))  # plain tensors
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


def test_config_round_trip_through_zoo(tmp_path) -> None:
    from dspzoo.zoo import from_pretrained, save_pretrained

    model = create_model("latte-tiny")
    path = save_pretrained(model, tmp_path / "latte")
    loaded = from_pretrained(path, expected_family="latte")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(model.config)
    assert loaded.config.patch == (1, 2, 2)
