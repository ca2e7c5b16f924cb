"""``latte1`` (diffusers' Latte architecture) under every strategy equals one process.

SP 2, 3 and 4 in one 4-process spawn, outputs and every parameter gradient, on a latent whose
token grid (F = 5 frames, S = 5·7 = 35 patches) no SP size divides: dsp, ulysses, ring, lss,
usp (2 × 2 at SP 4) and megatron_sp in fp64, dsp in fp32, a loss taken on sharded tokens,
image mode (one frame). Plus single-process checks: configs, input errors, position tables.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import dspzoo.domains.video  # noqa: F401  (registers latte1)
from dspzoo.core import SeqParallel, build_mesh, sp_mse, trace_comm
from dspzoo.core.parallel.methods.megatron import (
    gather_full,
    megatron_grad_sync,
    parallelize_megatron,
)
from dspzoo.core.testing import run_distributed, sub_mesh
from dspzoo.domains.video.dit import patchify
from dspzoo.domains.video.latte1 import Latte1, parameter_count_formula, spatial_table
from dspzoo.zoo import count_parameters, create_model, from_pretrained, save_pretrained

FRAMES, HEIGHT, WIDTH = 5, 10, 14  # T' = 5, S = 35
STRATEGIES = ("dsp", "ulysses", "ring", "lss", "usp")


def _model(dtype: torch.dtype = torch.float64) -> Latte1:
    torch.manual_seed(0)
    model = create_model("latte1-tiny").to(dtype)
    with torch.no_grad():  # zero-initialised layers re-randomised: every gradient non-trivial
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _inputs(dtype: torch.dtype, frames: int = FRAMES) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(2, 4, frames, HEIGHT, WIDTH, generator=g, dtype=dtype),
        "timestep": torch.tensor([17.0, 803.0], dtype=dtype),
        "cond": torch.randn(2, 3, 12, generator=g, dtype=dtype),
        "cond_mask": torch.tensor([[True, True, False], [True, True, True]]),
    }


def _loss_weight(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=dtype)


def _step(model: Latte1, sp: SeqParallel, case: str) -> torch.Tensor:
    """Forward + backward of one case; returns the output (or the per-rank loss share)."""
    dtype = next(model.parameters()).dtype
    inputs = _inputs(dtype, frames=1 if case == "image" else FRAMES)
    weight = _loss_weight(inputs["x"].shape[:1] + (8,) + inputs["x"].shape[2:], dtype)
    if case == "sharded_loss":
        out = model(**inputs, sp=sp, gather_output=False)
        patch = (1, model.config.patch, model.config.patch)
        target = sp.shard_like(patchify(weight, patch), out)  # [B, F_l, S_l, p·p·C_out]
        loss = sp_mse(out.tensor, target, sp.group)
        loss.backward()
        return loss.detach()
    out = model(**inputs, sp=sp)
    ((out - weight) ** 2).mean().backward()
    return out.detach()


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp64: elementwise 1e-7 relative; fp32: relative error of the whole tensor ≤ 1e-5."""
    if ref.dtype == torch.float64:
        torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-10, msg=lambda m: f"{what}: {m}")
        return
    error = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


def _reference(case: str, dtype: torch.dtype) -> dict:
    model = _model(dtype)
    out = _step(model, SeqParallel(), case)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, f"{case}: no gradient for {name}"
    return {"out": out, "grads": grads}


def _check(sp: SeqParallel, case: str, dtype: torch.dtype, ref: dict) -> int:
    """One case under ``sp`` against one process; returns the forward all-to-all count."""
    what = f"SP{sp.size} {sp.strategy.name} {case} {dtype}"
    model = _model(dtype)
    megatron = sp.strategy.name == "megatron_sp"
    if megatron:
        parallelize_megatron(model, sp.group)
    with trace_comm() as tracer:
        got = _step(model, sp, case)
    if case == "sharded_loss":  # per-rank shares: their SP mean is the loss
        dist.all_reduce(got, group=sp.group)
        got = got / sp.size
    _close(got, ref["out"], what)
    if megatron:
        # this SP group alone (the two SP-2 groups run different cases: no DP averaging)
        megatron_grad_sync(model, dataclasses.replace(sp.mesh, dp_size=1, dp_group=None))
        grads = gather_full(model, sp.group, grads=True)
    else:
        grads = {}
        for name, p in model.named_parameters():
            total = p.grad.clone()
            dist.all_reduce(total, group=sp.group)
            grads[name] = total / sp.size
    assert grads.keys() == ref["grads"].keys()
    for name, grad in grads.items():
        _close(grad, ref["grads"][name], f"{what} grad {name}")
    return tracer.count("all_to_all", "forward")


def _worker(rank: int, world: int) -> dict:
    meshes = {2: build_mesh(2), 3: sub_mesh(3), 4: build_mesh(4)}
    usp4 = build_mesh(4, ulysses_size=2)
    refs = {
        (case, dtype): _reference(case, dtype)
        for case, dtype in (
            ("video", torch.float64),
            ("video", torch.float32),
            ("sharded_loss", torch.float64),
            ("image", torch.float64),
        )
    }
    checked: list[str] = []
    switches: dict[int, int] = {}
    runs = [(s, "video", torch.float64) for s in (*STRATEGIES, "megatron_sp")]
    runs += [("dsp", "video", torch.float32), ("dsp", "sharded_loss", torch.float64)]
    runs += [("dsp", "image", torch.float64)]
    for size, mesh in meshes.items():
        if mesh is None:
            continue
        for i, (strategy, case, dtype) in enumerate(runs):
            if size == 2 and i % 2 != mesh.dp_rank:  # the two SP-2 groups share the runs
                continue
            use = usp4 if strategy == "usp" and size == 4 else mesh
            count = _check(SeqParallel(use, strategy), case, dtype, refs[case, dtype])
            if i == 0:
                switches[size] = count
            checked.append(f"{size}/{strategy}/{case}/{dtype}")
    return {"checked": checked, "switches": switches}


@pytest.mark.timeout(300)
def test_latte1_every_strategy_matches_one_process() -> None:
    """At SP 2, 3, 4: outputs and all gradients equal one process under every strategy; DSP
    switches twice per spatial/temporal pair (the entry split is not an all-to-all)."""
    results = run_distributed(_worker, 4, timeout=280)
    runs = len(STRATEGIES) + 1 + 3

    def done(size: int) -> set[str]:
        return {c.split("/", 1)[1] for r in results for c in r["checked"] if c[0] == str(size)}

    assert len(done(4)) == runs and done(3) == done(4) and done(2) == done(4)
    assert not any(c.startswith("3/") for c in results[3]["checked"])  # not in the SP-3 group
    depth = create_model("latte1-tiny", device="meta").config.depth
    for r in results:
        assert all(count == 2 * depth - 1 for count in r["switches"].values()), r["switches"]


# -- single process -----------------------------------------------------------------------------
def test_configs_and_parameter_counts() -> None:
    big = create_model("latte1-latte-1", device="meta")
    c = big.config
    assert (c.hidden, c.depth, c.heads, c.head_dim, c.patch) == (1152, 28, 16, 72, 2)
    assert (c.in_channels, c.channels_out, c.caption_channels, c.video_length) == (4, 8, 4096, 16)
    assert count_parameters(big) == parameter_count_formula(c) == 1_057_246_880
    for overrides in ({}, {"attention_bias": False, "norm_elementwise_affine": True}):
        tiny = create_model("latte1-tiny", cross_attention=False, **overrides)
        assert count_parameters(tiny) == parameter_count_formula(tiny.config)
    # the temporal table is recomputed, never stored (diffusers: a non-persistent buffer)
    assert set(big.state_dict()) == {name for name, _ in big.named_parameters()}
    assert not list(big.buffers())


def test_spatial_table_positions() -> None:
    """Columns in the first half of the channels, rows in the second; positions scaled to the
    base grid and divided by the interpolation scale."""
    grid_h, grid_w, dim, base, interp = 3, 5, 8, 4, 2
    table = spatial_table(grid_h, grid_w, dim, base, interp)
    assert table.shape == (grid_h * grid_w, dim) and table.dtype == torch.float32
    for i in range(grid_h):
        for j in range(grid_w):
            col, row = j * base / grid_w / interp, i * base / grid_h / interp
            for k, pos in ((0, col), (dim // 2, row)):
                # channel k: sin(pos · ω₀) with ω₀ = 1; channel k + dim/4: cos(pos · ω₀)
                assert math.isclose(table[i * grid_w + j, k], math.sin(pos), abs_tol=1e-6)
                assert math.isclose(
                    table[i * grid_w + j, k + dim // 4], math.cos(pos), abs_tol=1e-6
                )


def test_clear_input_errors() -> None:
    model = _model(torch.float32)
    good = _inputs(torch.float32)
    bad = {
        "3 latent frames": {"x": torch.randn(2, 4, 3, HEIGHT, WIDTH)},
        "expects latents": {"x": torch.randn(2, 3, FRAMES, HEIGHT, WIDTH)},
        "divisible by the patch size": {"x": torch.randn(2, 4, FRAMES, 9, WIDTH)},
        r"timestep must be \[B=2\]": {"timestep": torch.tensor([1.0])},
        "caption_channels=12": {"cond": torch.randn(2, 3, 7)},
        "cond_mask must be": {"cond_mask": torch.ones(2, 4, dtype=torch.bool)},
        "are required": {"cond": None, "cond_mask": None},
    }
    for match, change in bad.items():
        with pytest.raises(ValueError, match=match):
            model(**{**good, **change})
    # without temporal attention any number of frames runs (no temporal table)
    out = model(**{**good, "x": torch.randn(2, 4, 3, HEIGHT, WIDTH)}, temporal=False)
    assert out.shape == (2, 8, 3, HEIGHT, WIDTH)
    with pytest.raises(ValueError, match="activation 'relu'"):
        create_model("latte1-tiny", activation="relu")


def test_save_and_load_roundtrip(tmp_path) -> None:
    model = _model(torch.float32).eval()
    inputs = _inputs(torch.float32)
    save_pretrained(model, tmp_path / "m")
    loaded = from_pretrained(tmp_path / "m", expected_family="latte1").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs), model(**inputs), rtol=0, atol=0)
