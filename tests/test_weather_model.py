"""WeatherTransformer: exact under every SP layout and strategy, periodic in longitude, checked
inputs, and the cost model's bytes equal to the tracer's.

One spawn of 4 gloo workers runs SP 4, SP 3 (ranks 0-2) and SP 2 (two groups) on a 37 × 49
grid at patch 4 (10 × 13 patches) with T = 5 states, so no dim divides by 3 or 4.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

import dspzoo.domains.weather  # noqa: F401  (registers the family)
from dspzoo.core import SeqParallel, build_mesh, trace_comm
from dspzoo.core.costmodel import comm_bytes
from dspzoo.core.parallel.plan import plan_stages
from dspzoo.core.parallel.validate import InputValidationError
from dspzoo.core.testing import run_distributed, sub_mesh
from dspzoo.domains.weather import WeatherTransformer, layer_stages
from dspzoo.domains.weather.workload import weather_workload
from dspzoo.zoo import create_model, from_pretrained, save_pretrained

GRID = (37, 49)
WORLD = 4
OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p")
# (spatial, strategy, history, dropout): axial and full under DSP and two embedded methods;
# full at T = 2 is a hybrid plan at SP 3 and 4 (t = 2 cannot feed every rank); keyed dropout
CASES = [
    (spatial, strategy, 5, 0.0)
    for spatial in ("axial", "full")
    for strategy in ("dsp", "ulysses", "ring")
] + [("full", "dsp", 2, 0.0), ("axial", "dsp", 5, 0.1)]


def _model(
    spatial: str = "axial",
    history: int = 5,
    dropout: float = 0.0,
    depth: int = 2,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> WeatherTransformer:
    torch.manual_seed(0)
    overrides = {"grid": GRID, "patch": 4, "num_static": 3, **overrides}
    model = create_model(
        "weathertx-tiny",
        spatial=spatial,
        history=history,
        dropout=dropout,
        depth=depth,
        **overrides,
    ).to(dtype)
    with torch.no_grad():  # adaLN-Zero and the zero head start at persistence: randomise
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def _inputs(model: WeatherTransformer, seed: int = 1) -> dict:
    c = model.config
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, c.history, len(c.variables), *c.grid, generator=g, dtype=dtype),
        "lead_time": torch.tensor([1.0, 3.0], dtype=dtype),
        "static": torch.randn(2, c.num_static, *c.grid, generator=g, dtype=dtype)
        if c.num_static
        else None,
    }


def _step(model: WeatherTransformer, inputs: dict, sp: SeqParallel) -> torch.Tensor:
    model.train()
    out = model(**inputs, sp=sp, dropout_key=1234)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    ((out - weight) ** 2).mean().backward()
    return out.detach()


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _reference(case: tuple) -> dict:
    spatial, _, history, dropout = case
    model = _model(spatial, history, dropout)
    out = _step(model, _inputs(model), SeqParallel())
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{case}: no gradient for {name}"
        grads[name] = p.grad
    return {"out": out, "grads": grads}


def _traced(tracer) -> dict:
    return {
        (op, phase): tracer.total_bytes(op, phase)
        for op in OPS
        for phase in ("forward", "backward")
    }


def _check(case: tuple, ref: dict, sp: SeqParallel) -> dict:
    """One case under ``sp``: output, every gradient, and traced bytes vs the cost model."""
    spatial, strategy, history, dropout = case
    model = _model(spatial, history, dropout)
    with trace_comm() as tracer:
        out = _step(model, _inputs(model), sp)
    what = f"SP{sp.size} {case}"
    worst = _relative_error(out, ref["out"])
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=sp.group)
        worst = max(worst, _relative_error(grad / sp.size, ref["grads"][name]))
    assert worst <= 1e-5, f"{what}: relative error {worst:.2e}"
    r = sp.rank
    wl = {
        d: weather_workload("w", _model(spatial, history, dropout, depth=d).config, batch=2)
        for d in (1, 2)
    }
    want = comm_bytes(wl[2], strategy, sp.size, r)
    formula = {key: want.bytes(*key) for key in _traced(tracer)}
    layer = (
        comm_bytes(wl[2], strategy, sp.size, r).bytes()
        - comm_bytes(wl[1], strategy, sp.size, r).bytes()
    )
    plan = sp.plan(("t", "y", "x"), wl[2].lengths, model.STAGES)
    # the exit gathers the last state's outputs alone: what it sends, and what it no longer does
    no_exit = comm_bytes(wl[2], strategy, sp.size, r, exit_gather=False).bytes()
    all_steps = comm_bytes(wl[2].with_(exit_last=()), strategy, sp.size, r).bytes()
    return {
        "error": worst,
        "traced": _traced(tracer),
        "formula": formula,
        "exit_traced": tracer.total_bytes("all_gather", "forward", region_prefix="exit"),
        "exit_formula": want.bytes() - no_exit,
        "exit_all_steps": all_steps - no_exit,
        "layer_traced": tracer.total_bytes(region_prefix="block1"),
        "layer_formula": layer,
        "methods": plan.methods,
        "switches": plan.switches_per_period,
    }


def _bad_inputs(sp: SeqParallel) -> dict:
    """NaN on SP rank 0 only, and a wrong grid everywhere: every rank raises, naming it."""
    model = _model()
    caught = {}
    inputs = _inputs(model)
    if sp.rank == 0:
        inputs["x"][0, 0, 0, 3, 4] = float("nan")
    for what, kwargs in (
        ("nan", inputs),
        ("grid", {**_inputs(model), "x": torch.randn(2, 5, 2, 36, 49)}),
    ):
        try:
            model(**kwargs, sp=sp)
            caught[what] = None
        except InputValidationError as exc:
            caught[what] = str(exc)
    return caught


def _worker(rank: int, world: int) -> dict:
    meshes = {4: build_mesh(world), 2: build_mesh(2), 3: sub_mesh(3)}
    parts: list = [None] * world
    dist.all_gather_object(
        parts, {i: _reference(c) for i, c in enumerate(CASES) if i % world == rank}
    )
    refs = {i: ref for part in parts for i, ref in part.items()}
    results: dict = {}
    for i, case in enumerate(CASES):
        for size, mesh in meshes.items():
            if mesh is None or (size == 2 and i % 2 != mesh.dp_rank):
                continue  # SP 3: ranks 0-2; SP 2: the two groups share the cases
            results[(i, size)] = _check(case, refs[i], SeqParallel(mesh, case[1]))
    return {"checks": results, "bad": _bad_inputs(SeqParallel(meshes[4]))}


def test_weather_model_under_sp() -> None:
    """SP 2, 3, 4 × {axial, full} × {dsp, ulysses, ring} (+ a hybrid plan, + keyed dropout):
    output and every gradient equal one process (fp32, relative ≤ 1e-5); the bytes each rank
    sends, per op and phase and per layer, equal the cost model's; the exit gathers the last
    state alone (fewer bytes than all T states); bad input fails on every rank."""
    results = run_distributed(_worker, WORLD, timeout=240)
    for rank, res in enumerate(results):
        checks = res["checks"]
        sizes = {size for _, size in checks}
        assert sizes == ({2, 3, 4} if rank < 3 else {2, 4}), (rank, sizes)
        for (i, size), got in checks.items():
            case = CASES[i]
            assert got["error"] <= 1e-5
            assert got["traced"] == got["formula"], (rank, size, case)
            assert got["exit_traced"] == got["exit_formula"] > 0, (rank, size, case)
            # all T states were gathered before, padded to the longest shard: now one state
            # (the same bytes only when t is sharded with at most one state per rank)
            assert got["exit_traced"] <= got["exit_all_steps"], (rank, size, case)
            if case[2] > size:
                assert got["exit_traced"] < got["exit_all_steps"], (rank, size, case)
            assert got["layer_traced"] == got["layer_formula"] > 0, (rank, size, case)
            spatial, strategy, history, _ = case
            if strategy == "dsp" and history == 5:  # pure DSP: 2 switches per layer
                assert got["switches"] == 2 and set(got["methods"].values()) == {"local"}
            if (spatial, strategy, history) == ("full", "dsp", 2):
                hybrid = got["methods"]["spatial"] != "local"
                assert hybrid == (size > 2), (size, got["methods"])
        assert "NaN" in res["bad"]["nan"] and "rank(s) [0]" in res["bad"]["nan"], res["bad"]
        assert "grid" in res["bad"]["grid"], res["bad"]
    assert sum(len(r["checks"]) for r in results) == len(CASES) * (4 + 3 + 2)


def _harness_model() -> WeatherTransformer:
    return _model("full", history=2)


def _harness_inputs() -> dict:
    return _inputs(_harness_model())


@pytest.mark.slow
def test_every_strategy_through_the_harness() -> None:
    """The full-spatial variant with T = 2 under the strategies the spawn above leaves out
    (megatron_sp, lss, usp, ring_zigzag) at SP 2, 3, 4: output, gradients (full tensors under
    megatron_sp) and bytes per (op, phase), as :func:`dspzoo.core.harness.check_model` checks."""
    from dspzoo.core.harness import check_model

    others = ("megatron_sp", "lss", "usp", "ring_zigzag")
    workload = weather_workload("w", _harness_model().config, batch=2)
    report = check_model(_harness_model, _harness_inputs, strategies=others, workload=workload)
    assert {(c.sp, c.strategy) for c in report.checks} == {
        (n, s) for n in (2, 3, 4) for s in others
    }


# -- single process ---------------------------------------------------------------------------
def test_starts_as_persistence_on_a_padded_grid() -> None:
    model = create_model("weathertx-tiny", grid=GRID, patch=4)
    assert model.config.patch_grid == (10, 13)
    x = torch.randn(2, model.config.history, 2, *GRID)
    out = model(x, torch.tensor([1.0, 2.0]))
    assert out.shape == (2, 2, *GRID)
    torch.testing.assert_close(out, x[:, -1], rtol=0, atol=0)


@pytest.mark.parametrize("spatial", ["axial", "full"])
def test_lead_time_conditioning_changes_the_forecast(spatial: str) -> None:
    model = _model(spatial).eval()
    inputs = _inputs(model)
    with torch.no_grad():
        a = model(**inputs)
        b = model(**{**inputs, "lead_time": inputs["lead_time"] + 2})
        again = model(**inputs)
    assert _relative_error(b, a) > 1e-3
    torch.testing.assert_close(again, a, rtol=0, atol=0)


@pytest.mark.parametrize("spatial", ["axial", "full"])
def test_rolling_by_a_lon_patch_rolls_the_forecast(spatial: str) -> None:
    """Circular rotary positions along longitude: the model is equivariant to rolling the
    input (and the static fields) by whole lon patches, wrapping the last patch next to the
    first; an absolute lon table (periodic_lon=False) is not."""
    grid = (37, 48)  # 12 lon patches of 4: a roll by 4 columns is a roll by one patch
    for periodic in (True, False):
        model = _model(spatial, grid=grid, periodic_lon=periodic, dtype=torch.float64).eval()
        inputs = _inputs(model)
        rolled = {
            "x": inputs["x"].roll(4, dims=-1),
            "static": inputs["static"].roll(4, dims=-1),
            "lead_time": inputs["lead_time"],
        }
        with torch.no_grad():
            out, out_rolled = model(**inputs), model(**rolled)
        error = _relative_error(out_rolled, out.roll(4, dims=-1))
        if periodic:
            assert error < 1e-12, error
            assert _relative_error(out_rolled, out) > 1e-2  # the forecast does vary in lon
        else:
            assert error > 1e-3, error


def test_dropout_is_keyed() -> None:
    """Training-mode dropout draws from ``dropout_key`` only: same key, same forecast; another
    key, another; no key (or eval mode), no dropout."""
    model = _model(dropout=0.2)
    inputs = _inputs(model)
    with torch.no_grad():
        clean = model.eval()(**inputs, dropout_key=7)
        model.train()
        a, b = model(**inputs, dropout_key=7), model(**inputs, dropout_key=7)
        other, none = model(**inputs, dropout_key=8), model(**inputs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(none, clean, rtol=0, atol=0)
    assert _relative_error(a, clean) > 1e-3 and _relative_error(other, a) > 1e-3


def test_bad_inputs_raise_clear_errors() -> None:
    model = _model()
    good = _inputs(model)
    lead = good["lead_time"]
    cases = [
        ({"x": torch.randn(2, 5, 2, 36, 49)}, "36 x 49 .*built for 37 x 49 .*'grid'"),
        ({"x": torch.randn(2, 5, 3, *GRID)}, "3 variables .*'z@500', 't@850'"),
        ({"x": torch.randn(2, 4, 2, *GRID)}, "4 input states .*history=5"),
        ({"x": torch.randn(5, 2, *GRID)}, r"\[B, T, V, lat, lon\]"),
        ({"x": good["x"].clone().index_fill_(0, torch.tensor([1]), float("nan"))}, "NaN"),
        ({"lead_time": lead[:1]}, r"lead_time must be \[B=2\]"),
        ({"lead_time": -lead}, ">= 0"),
        ({"lead_time": lead * 1e4}, "max_lead"),
        ({"static": None}, "num_static=3"),
        ({"static": good["static"][:, :2]}, "static must be"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            model(**{**good, **change})
    plain = create_model("weathertx-tiny", grid=GRID)
    x = torch.randn(1, 3, 2, *GRID)
    with pytest.raises(ValueError, match="num_static=0"):
        plain(x, torch.tensor([1.0]), static=torch.zeros(1, 1, *GRID))
    with pytest.raises(ValueError, match="spatial must be"):
        create_model("weathertx-tiny", spatial="diagonal")


def test_plans_axial_dsp_and_hybrid_full() -> None:
    axial = layer_stages(create_model("weathertx-tiny", device="meta").config)
    plan = plan_stages(("t", "y", "x"), (5, 10, 13), axial, 4)
    assert plan.switches_per_period == 2 and set(plan.methods.values()) == {"local"}
    full = layer_stages(create_model("weathertx-global-1.40625", device="meta").config)
    plan8 = plan_stages(("t", "y", "x"), (2, 64, 128), full, 8)  # t = 2 < 8
    assert plan8.methods["spatial"] == "ulysses" and plan8.switches_per_period == 0
    plan2 = plan_stages(("t", "y", "x"), (2, 64, 128), full, 2)  # t feeds 2 ranks: pure DSP
    assert plan2.methods["spatial"] == "local" and plan2.switches_per_period == 2


def test_configs_and_cli() -> None:
    from dspzoo.zoo import count_parameters
    from dspzoo.zoo.cli import main

    counts = {
        name: count_parameters(create_model(f"weathertx-{name}", device="meta"))
        for name in ("tiny", "small", "global-1.40625")
    }
    assert counts["tiny"] < 1e5 < counts["small"] < 1e7 < 5e8 < counts["global-1.40625"] < 1e9
    big = create_model("weathertx-global-1.40625", device="meta").config
    assert (big.grid, big.patch, len(big.variables), big.spatial) == ((128, 256), 2, 69, "full")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "weathertx-global-1.40625"]) == 0
        assert (
            main(
                [
                    "plan",
                    "weathertx-global-1.40625",
                    "--sp",
                    "8",
                    "--frames",
                    "2",
                    "--latent",
                    "128x256",
                ]
            )
            == 0
        )
    text = out.getvalue()
    assert "636.9M parameters" in text and "tokens (t=2, y=64, x=128)" in text
    # at SP 8 DSP runs the spatial stage with Ulysses, as Ulysses does: one row for both
    assert any(line.split()[:2] == ["8", "dsp,ulysses"] for line in text.splitlines()), text


def test_save_and_load_round_trip(tmp_path) -> None:
    model = _model(spatial="full")
    save_pretrained(model, tmp_path / "w")
    loaded = from_pretrained(tmp_path / "w", expected_family="weathertx")
    assert loaded.config == model.config and isinstance(loaded.config.variables, tuple)
    inputs = _inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**inputs), model.eval()(**inputs))
