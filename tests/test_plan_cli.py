"""``dspzoo plan`` for every kind of model, in-process: video (an image by default), text,
weather (grid and history), protein (residues and MSA depth), any family by ``--dims``, counts
formatted like ``dspzoo list``, and a clear error for a size the model does not take."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dspzoo.core.costmodel import TABLE_LEGEND, StageSpec, Workload
from dspzoo.core.costmodel.workload import register_workload
from dspzoo.core.parallel.plan import Stage
from dspzoo.core.parallel.trace import format_bytes
from dspzoo.zoo import (
    count_parameters,
    create_model,
    format_count,
    get_config,
    list_models,
    register_config,
    register_family,
    unregister_family,
)
from dspzoo.zoo.plan_cli import main
from dspzoo.zoo.workloads import workload_for


def _plan(capsys, *argv: str) -> list[str]:
    assert main([*argv, "--sp", "1,2,4"]) == 0
    return capsys.readouterr().out.splitlines()


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--sp", "2"])
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """``(sp, strategy) -> cells`` of the prediction table."""
    return {
        (cells[0], cells[1]): cells
        for cells in (line.split() for line in lines)
        if len(cells) > 2 and cells[0].isdigit()
    }


@pytest.mark.parametrize("name", ["weathertx-tiny", "stdit-720M", "latte-3B", "bytelm-tiny"])
def test_the_header_counts_parameters_as_dspzoo_list_does(capsys, name: str) -> None:
    header = _plan(capsys, name)[0]
    count = format_count(count_parameters(create_model(name, device="meta")))
    assert header.startswith(f"{name}: {count} parameters, batch 1, tokens (")
    assert count[-1] in "KMB" and "0M parameters" not in header


def test_a_video_model_without_frames_is_an_image(capsys) -> None:
    image = _plan(capsys, "stdit-tiny", "--size", "256")
    assert "tokens (t=1, s=256)" in image[0]
    assert "  default size: 1 latent frame(s): an image (--frames for a video)" in image
    video = _plan(capsys, "stdit-tiny", "--size", "256", "--frames", "8")
    assert "tokens (t=8, s=256)" in video[0] and not any("default" in x for x in video)
    bare = _plan(capsys, "latte-tiny")  # the config's latent input_size
    h, w = get_config("latte-tiny").input_size
    assert f"tokens (t=1, s={(h // 2) * (w // 2)})" in bare[0]
    latte1 = _plan(capsys, "latte1-tiny")  # the config's sample_size (8: 4 × 4 patches of 2)
    assert "tokens (t=1, s=16)" in latte1[0]
    assert "  default size: latent 8x8 (the config's sample_size; --size/--latent)" in latte1
    assert (
        "tokens (t=5, s=35)"
        in _plan(capsys, "latte1-tiny", "--frames", "5", "--latent", "10x14")[0]
    )


def test_a_text_model_takes_its_sequence_length(capsys) -> None:
    lines = _plan(capsys, "bytelm-tiny", "--seq-len", "300")
    assert "tokens (l=300)" in lines[0]
    default = _plan(capsys, "bytelm-tiny")
    max_len = get_config("bytelm-tiny").max_len
    assert f"tokens (l={max_len})" in default[0]
    assert f"  default size: {max_len} bytes (the config's max_len)" in default


def test_the_table_is_followed_by_its_legend(capsys) -> None:
    """Under the recommendation, the legend names every column of the table's header."""
    lines = _plan(capsys, "bytelm-tiny", "--seq-len", "300")
    rec = next(i for i, x in enumerate(lines) if x.startswith("recommendation:"))
    legend = " ".join(lines[rec + 1 : rec + 1 + len(TABLE_LEGEND)])
    assert lines[rec + 1 : rec + 1 + len(TABLE_LEGEND)] == list(TABLE_LEGEND)
    header = next(x for x in lines if x.lstrip().startswith("SP strategy"))
    columns = header.split()[2:]  # after "SP strategy"
    named = legend.replace(",", " ").replace(";", " ").replace("=", " ").split()
    assert all(c in named for c in columns), [c for c in columns if c not in named]


def test_balanced_layouts_are_compared_by_default_for_causal_attention_models(capsys) -> None:
    """A causal attention LM's plan shows ring_zigzag and lss_zigzag (the text trainer's
    default) beside ring and LSS; a video model's and a Mamba hybrid's (whose scans a zigzag
    layout would gather) do not."""

    def strategies(*args: str) -> list[str]:
        rows = [line.split()[1] for line in _plan(capsys, *args, "--sp", "4") if line[:3] == "  4"]
        return [name for row in rows for name in row.split(",")]

    text = strategies("bytelm-tiny", "--seq-len", "256")
    assert text.index("ring") + 1 == text.index("ring_zigzag")
    assert text.index("lss") + 1 == text.index("lss_zigzag")
    for other in (("stdit-tiny",), ("hybridlm-130m", "--seq-len", "4096")):
        assert not {"ring_zigzag", "lss_zigzag"} & set(strategies(*other)), other


def test_an_unknown_strategy_names_every_one_plan_takes(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["bytelm-tiny", "--sp", "2", "--strategies", "ring,ringz"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--strategies: unknown 'ringz'; choose from auto, dsp" in err
    assert "ring_zigzag" in err and "ulysses_flat" in err
    with pytest.raises(SystemExit):
        main(["bytelm-tiny", "--sp", "2", "--strategies", "ring_balance"])
    assert "did you mean 'ring_balance' → 'ring_balanced'?" in capsys.readouterr().err


def test_a_weather_model_takes_grid_and_history(capsys) -> None:
    lines = _plan(capsys, "weathertx-tiny", "--grid", "64x128", "--history", "2")
    assert "tokens (t=2, y=16, x=32)" in lines[0]  # patch 4
    alias = _plan(capsys, "weathertx-tiny", "--latent", "64x128", "--frames", "2")
    assert alias == lines
    default = _plan(capsys, "weathertx-tiny")
    config = get_config("weathertx-tiny")
    wl = workload_for("weathertx-tiny", frames=config.history, spatial=config.grid, itemsize=2)
    assert "tokens (" + ", ".join(f"{d}={n}" for d, n in zip(wl.dims, wl.lengths)) in default[0]
    assert "  default size: grid 37x49 (the config's; --grid)" in default
    assert "  default size: history 3 (the config's; --history)" in default


def test_a_protein_model_takes_residues_and_msa_depth(capsys) -> None:
    from dspzoo.domains.protein import evoformer_plan

    lines = _plan(capsys, "evoformer-tiny", "--residues", "64", "--msa-depth", "16")
    assert lines[0].startswith("evoformer-tiny: 11.8K parameters, batch 1, MSA (s=16, r=64)")
    assert "pair (i=64, j=64)" in lines[0] and "dsp only" in lines[0]
    config = get_config("evoformer-tiny")
    table = {c[0]: c for c in (x.split() for x in lines[3:6])}
    assert table["1"][1:] == ["0", "0", "B", "0", "B", "0", "B"]
    for sp in (2, 4):
        plan = evoformer_plan(config, 64, 16, sp)
        fwd = plan.bytes_per_period(0, 1, 2, "forward")
        bwd = plan.bytes_per_period(0, 1, 2, "backward")
        row = " ".join(table[str(sp)])
        expected = f"{format_bytes(fwd)} {format_bytes(bwd)} {format_bytes(2 * (fwd + bwd))}"
        assert row == f"{sp} {plan.switches_per_period} {expected}"
    assert any(x.startswith("DSP multi-activation plan over m[s=16, r=64]") for x in lines)
    by_dims = _plan(capsys, "evoformer-tiny", "--dims", "s=16,r=64")
    assert by_dims == lines
    assert "(s=128, r=256)" in _plan(capsys, "evoformer-tiny")[0]  # AF2's training crop


def test_dims_size_any_family_by_name(capsys) -> None:
    by_dims = _plan(capsys, "axial3d-tiny", "--dims", "t=8,h=16,w=16")
    by_flags = _plan(capsys, "axial3d-tiny", "--frames", "8", "--latent", "32")  # patch 2
    assert by_dims == by_flags and "tokens (t=8, h=16, w=16)" in by_dims[0]
    partial = _plan(capsys, "axial3d-tiny", "--frames", "8", "--latent", "32", "--dims", "h=5")
    assert "tokens (t=8, h=5, w=16)" in partial[0]
    toy = _plan(capsys, "toy2d-tiny", "--dims", "t=8,s=32")
    assert "tokens (t=8, s=32)" in toy[0]
    assert _rows(toy)[("4", "dsp")] != _rows(_plan(capsys, "toy2d-tiny"))[("4", "dsp")]


@dataclass(frozen=True)
class ImageConfig:
    hidden: int = 32
    heads: int = 4
    depth: int = 2
    patch: int = 4


class ImageModel(nn.Module):
    def __init__(self, config: ImageConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden, config.hidden)


STAGES = (Stage("rows", ("w",)), Stage("cols", ("h",)), Stage("mlp"))


def _image_workload(name, config, *, spatial=None, batch=1, itemsize=4, params=0, **_):
    if spatial is None:
        raise ValueError(f"{name} needs --latent (the image size in pixels)")
    h, w = (spatial, spatial) if isinstance(spatial, int) else spatial
    layer = (
        StageSpec(STAGES[0], attention=("w",), adaln=False),
        StageSpec(STAGES[1], attention=("h",), adaln=False),
        StageSpec(STAGES[2], mlp=True, adaln=False),
    )
    lengths = (h // config.patch, w // config.patch)
    return Workload(name, "planimage", batch, ("h", "w"), lengths, config.hidden, config.heads,
                    config.heads, 4 * config.hidden, (layer,) * config.depth, STAGES, 3, 3,
                    params=params, itemsize=itemsize)  # fmt: skip


def test_a_users_image_model_is_planned_by_its_own_dim_names(capsys) -> None:
    register_family("planimage", ImageModel, ImageConfig)
    register_config("planimage", "tiny", ImageConfig())
    register_workload("planimage", _image_workload)
    try:
        by_dims = _plan(capsys, "planimage-tiny", "--dims", "h=64,w=64")
        assert by_dims[0].startswith(
            "planimage-tiny: 1.1K parameters, batch 1, tokens (h=64, w=64)"
        )
        assert by_dims == _plan(capsys, "planimage-tiny", "--latent", "256")
        assert "missing ['w']" in _error(capsys, "planimage-tiny", "--dims", "h=64")
    finally:
        unregister_family("planimage")


def test_a_users_family_gets_its_size_as_given_and_a_clear_error_below_one_token(capsys) -> None:
    """``--size`` of a family of yours is not divided by ``--vae-stride`` (the help: "as they
    are given"): it says what ``--latent`` says; a size below one token (the builder's patch)
    or not a positive integer is one line naming the flag, not a ``ZeroDivisionError``."""
    register_family("planimage", ImageModel, ImageConfig)
    register_config("planimage", "tiny", ImageConfig())  # patch 4
    register_workload("planimage", _image_workload)
    try:
        by_size = _plan(capsys, "planimage-tiny", "--size", "256")
        assert "tokens (h=64, w=64)" in by_size[0]
        assert by_size == _plan(capsys, "planimage-tiny", "--latent", "256")
        strided = _plan(capsys, "planimage-tiny", "--size", "32x16", "--vae-stride", "4")
        assert "tokens (h=8, w=4)" in strided[0]  # no VAE of its own: the stride is not applied
        assert _error(capsys, "planimage-tiny", "--size", "2") == (
            "dspzoo plan: error: planimage-tiny gets no token along h, w from --size 2: one token "
            "covers more than that; give a larger size (see dspzoo plan --help)"
        )
        assert "along w from --latent 8x3:" in _error(capsys, "planimage-tiny", "--latent", "8x3")
        for flag, text in (("--size", "0"), ("--latent", "x"), ("--size", "-4")):
            assert f"{flag} takes H or HxW in positive integers" in _error(
                capsys, "planimage-tiny", flag, text
            )
        both = _error(capsys, "planimage-tiny", "--size", "32", "--latent", "32")
        assert "give the size once: --size or --latent" in both
    finally:
        unregister_family("planimage")
    assert "no token along s from --latent 1:" in _error(capsys, "stdit-tiny", "--latent", "1")


def test_the_methods_per_stage_leave_out_what_is_not_runnable(capsys) -> None:
    """A strategy whose row is "not runnable" runs no stage: the "methods per stage" lines name
    it on a ``not runnable`` line of its own, never with the methods it would have run."""
    register_family("planimage", ImageModel, ImageConfig)  # no TP_PLAN: megatron_sp cannot run
    register_config("planimage", "tiny", ImageConfig())
    register_workload("planimage", _image_workload)
    try:
        image = _plan(capsys, "planimage-tiny", "--latent", "64")
    finally:
        unregister_family("planimage")
    assert main(["axial3d-mini", "--frames", "8", "--latent", "32", "--sp", "4,8"]) == 0
    axial = capsys.readouterr().out.splitlines()  # 4 heads: ulysses and megatron_sp stop at 4
    for lines in (image, axial):
        unrunnable = {key for key, cells in _rows(lines).items() if "runnable:" in cells}
        methods = lines[lines.index("methods per stage (those not listed run locally):") + 1 :]
        for line in methods:
            sp, text, names = re.fullmatch(r"  SP (\d+): (.*)  \((.*)\)", line).groups()
            marked = text == "not runnable (the table's row says why)"
            assert all(((sp, s) in unrunnable) == marked for s in names.split(", ")), line
        assert unrunnable, lines
    assert "  SP 4: not runnable (the table's row says why)  (megatron_sp)" in image
    assert "  SP 8: not runnable (the table's row says why)  (ulysses, megatron_sp)" in axial


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["weathertx-tiny", "--seq-len", "64"],
            "weathertx-tiny is a weather model: its sizes are --grid, --history, --latent, "
            "--frames (or --dims name=tokens,...); --seq-len is not one of them",
        ),
        (["bytelm-tiny", "--frames", "4"], "bytelm-tiny is a text model: its sizes are --seq-len"),
        (["evoformer-tiny", "--grid", "8x8"], "evoformer-tiny is a protein model"),
        (["stdit-tiny", "--dims", "q=3"], "stdit-tiny has token dims ['t', 's']; --dims names"),
        (["stdit-tiny", "--dims", "t=0"], "--dims takes name=tokens pairs like h=64,w=64"),
        (["stdit-tiny", "--dims", "t=2,t=3"], "--dims names 't' twice"),
        (["weathertx-tiny", "--grid", "big"], "--grid takes H or HxW"),
        (["evoformer-tiny", "--strategies", "ring"], "runs under the dsp strategy only"),
        (["evoformer-tiny", "--dims", "i=8"], "the pair's i and j follow it); --dims names ['i']"),
        (["axial3d-tiny", "--dims", "t=8"], "name all of them (missing ['h', 'w'])"),
        (["latte1-tiny", "--frames", "3"], "takes video_length=5 latent frames or 1 (an image)"),
        (["mambalm-tiny", "--seq-len", "0"], "--seq-len: expected a positive integer, got 0"),
        (["bytelm-tiny", "--seq-len", "-5"], "--seq-len: expected a positive integer, got -5"),
        (["evoformer-tiny", "--residues", "x"], "--residues: expected a positive integer, got 'x'"),
        (["stdit-tiny", "--sp", "1,0"], "--sp: expected a positive integer, got 0 (in '1,0')"),
        (["stdit-tiny", "--sp", "two"], "--sp: expected a positive integer, got 'two'"),
    ],
)
def test_sizes_a_model_does_not_take_are_refused_by_name(capsys, argv, message) -> None:
    assert message in _error(capsys, *argv)


def make_latte1() -> nn.Module:
    """Latte1-tiny with every weight random (the zero-initialised ones too)."""
    model = create_model("latte1-tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def latte1_inputs() -> dict[str, torch.Tensor]:
    """5 latent frames (the tiny config's video_length) of 10 × 14: tokens (t=5, s=35)."""
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(2, 4, 5, 10, 14, generator=g),
        "timestep": torch.tensor([17.0, 803.0]),
        "cond": torch.randn(2, 3, 12, generator=g),
        "cond_mask": torch.tensor([[True, True, False], [True, True, True]]),
    }


@pytest.mark.timeout(240)
def test_the_latte1_workload_predicts_the_traced_bytes_of_every_strategy() -> None:
    """The workload behind `dspzoo plan latte1-...`: on every rank, under every strategy at SP 2
    and 3 (uneven: t=5, s=35), the traced bytes equal the plan's and the model equals one
    process (outputs and all gradients)."""
    from dspzoo.core.harness import check_model

    wl = workload_for("latte1-tiny", batch=2, frames=5, spatial=(10, 14), context=3)
    assert wl.lengths == (5, 35) and wl.context == 3
    report = check_model(make_latte1, latte1_inputs, workload=wl, sp_sizes=(2, 3), timeout=200)
    strategies = {c.strategy for c in report.checks}
    assert {"dsp", "ulysses", "ring", "lss", "usp", "megatron_sp"} <= strategies
    assert all(c.traced_bytes == c.plan_bytes > 0 for c in report.checks)


def make_toy() -> nn.Module:
    return create_model("toy2d-tiny")


def toy_inputs() -> dict[str, torch.Tensor]:
    """``[B=2, T=7, S=10, C=4]``: neither length divisible by 3."""
    return {"x": torch.randn(2, 7, 10, 4, generator=torch.Generator().manual_seed(1))}


@pytest.mark.timeout(240)
def test_the_toy2d_workload_predicts_the_traced_bytes_of_every_strategy() -> None:
    from dspzoo.core.harness import check_model

    wl = workload_for("toy2d-tiny", batch=2, frames=7, spatial=10)
    assert wl.lengths == (7, 10)
    report = check_model(make_toy, toy_inputs, workload=wl, sp_sizes=(3,), timeout=200)
    assert {c.strategy for c in report.checks} >= {"dsp", "ulysses", "ring", "megatron_sp"}
    assert all(c.traced_bytes == c.plan_bytes > 0 for c in report.checks)


def test_a_mamba_model_plan_says_which_method_runs_each_stage(capsys) -> None:
    """The hybrid's plan: its layers described, the scans by state passing beside the attention
    by each strategy's method (DSP's own choice Ulysses), and rows a strategy cannot run marked
    as such instead of 'fits yes'."""
    lines = _plan(capsys, "hybridlm-tiny", "--seq-len", "4096")
    assert "tokens (l=4096)" in lines[0] and not any("default size" in x for x in lines)
    assert "  scans: 2 Mamba-2 scan stages, d_inner 64 = 4 heads x 16, state 8, conv 4" in lines
    assert "  attention: layers 1, 3 of 4, 4 heads x 8 (2 K/V heads), MLP 64" in lines
    assert "  SP 2: scan state_passing, attn ulysses  (dsp, ulysses)" in lines
    assert "  SP 4: scan state_passing, attn ring  (ring)" in lines
    assert "  SP 4: scan state_passing, attn lss  (lss)" in lines
    rows = _rows(lines)
    assert ("4", "ulysses_flat") not in rows  # a prediction-only variant for 2-D attention
    megatron = " ".join(rows[("4", "megatron_sp")])
    assert megatron.endswith(
        "- (not runnable: stage 'scan' has no tensor-parallel linears (no TP_PLAN))"
    )
    for cells in rows.values():
        assert not ("yes" in cells and "runnable:" in " ".join(cells)), cells


@pytest.mark.parametrize(
    "argv",
    [
        ("mambalm-tiny", "--seq-len", "4096"),
        ("hybridlm-tiny", "--seq-len", "4096"),
        ("videomamba-tiny", "--frames", "8"),
        ("stdit-tiny", "--frames", "8", "--latent", "16"),
        # dsp and ulysses differ only in the dim the temporal stage keeps sharded (y vs x)
        ("weathertx-global-1.40625", "--history", "2", "--grid", "128x256"),
    ],
)
def test_each_distinct_plan_is_one_row(capsys, argv) -> None:
    """Strategies that run the same method on every stage with the same figures share one row
    named ``a,b,...`` (each row inside one group of the "methods per stage" lines, which
    splits only where the figures differ); every strategy is in exactly one row per SP size,
    and no two rows of one SP size show the same figures."""
    lines = _plan(capsys, *argv)
    rows = _rows(lines)
    methods = lines.index("methods per stage (those not listed run locally):")
    groups = [  # (sp, strategies) of each "methods per stage" line
        (sp, set(names.split(", ")))
        for sp, names in (
            re.fullmatch(r"  SP (\d+): .*  \((.*)\)", x).groups() for x in lines[methods + 1 :]
        )
    ]
    for sp, name in rows:  # a row never joins what the methods lines keep apart
        if sp != "1" and name != "ulysses_flat":
            assert any(sp == g and set(name.split(",")) <= names for g, names in groups), lines
    for sp in ("2", "4"):
        mine = {name: cells[2:] for (size, name), cells in rows.items() if size == sp}
        named = [s for name in mine for s in name.split(",")]
        expected = {"dsp", "ulysses", "ring", "lss", "usp", "megatron_sp"}
        if argv[0] == "hybridlm-tiny":  # causal attention beside scans: the contiguous balance
            expected |= {"ring_balanced", "lss_balanced"}
        assert sorted(named) == sorted(expected | ({"ulysses_flat"} & set(named))), mine
        figures = [tuple(cells) for cells in mine.values()]
        assert len(set(figures)) == len(figures), mine


def test_a_scan_only_model_prints_its_one_plan_once(capsys) -> None:
    """Every stage of a pure-scan LM runs state passing under every attention strategy: one
    row per SP size (Megatron-SP apart: its sharded weights, and it cannot run the scans)."""
    rows = _rows(_plan(capsys, "mambalm-tiny", "--seq-len", "4096"))
    assert set(rows) == {
        ("1", "none"),
        *((sp, name) for sp in ("2", "4") for name in ("dsp,ulysses,ring,lss,usp", "megatron_sp")),
    }
    assert rows[("2", "dsp,ulysses,ring,lss,usp")][-2:] == ["1.00x", "yes"]
    hybrid = _rows(_plan(capsys, "hybridlm-tiny", "--seq-len", "4096"))
    assert {name for sp, name in hybrid if sp == "4"} == {
        "dsp,ulysses", "ring", "ring_balanced", "lss", "lss_balanced", "usp", "megatron_sp"
    }  # fmt: skip
    lines = _plan(capsys, "mambalm-130m", "--seq-len", "65536")
    assert any(
        x.startswith("recommendation: SP 4 with dsp (the same plan: ulysses, ring, lss, usp)")
        for x in lines
    ), lines[-4:]


def test_a_mamba1_plan_speaks_of_channels_and_its_default_length(capsys) -> None:
    lines = _plan(capsys, "mambalm-tiny")
    assert "tokens (l=2048)" in lines[0]
    assert "  default size: 2048 tokens (a Mamba LM has no maximum length; --seq-len)" in lines
    scans = next(x for x in lines if x.startswith("  scans:"))
    assert "Mamba-1" in scans and "d_inner 64 channels" in scans and "heads x" not in scans
    assert not any("not runnable: ulysses" in x for x in lines)  # no attention stage to shard
    assert "  SP 4: every stage state_passing  (dsp, ulysses, ring, lss, usp)" in lines
    assert "  SP 4: not runnable (the table's row says why)  (megatron_sp)" in lines  # no TP_PLAN
    video = _plan(capsys, "videomamba-tiny", "--frames", "8")
    assert "tokens (t=8, h=8, w=8)" in video[0]
    assert (
        "  SP 4: every stage local (each mixes a dim that is whole)  (dsp, ulysses, ring, lss, usp)"
        in video
    )
    assert "tokens (t=2, y=8, x=16)" in _plan(capsys, "weathermamba-tiny")[0]
    assert "weathermamba-tiny is a weather model" in _error(
        capsys, "weathermamba-tiny", "--seq-len", "9"
    )
    assert "mambalm-tiny is a Mamba language model: its sizes are --seq-len" in _error(
        capsys, "mambalm-tiny", "--frames", "4"
    )


def _mamba_scan_stages(config) -> int:
    """Scan stages of a Mamba model from its config: every scan order, generic ones included."""
    if hasattr(config, "orders"):  # video: one per order per layer
        return config.depth * len(config.orders)
    if hasattr(config, "periodic_lon"):  # weather: time, latitude, longitude per layer
        return config.depth * 3
    attention = getattr(config, "attention_layers", ())  # the hybrid's attention layers
    return config.num_hidden_layers - len(attention)


MAMBA_FAMILIES = ("mambalm", "mamba2lm", "hybridlm", "videomamba", "weathermamba")


@pytest.mark.parametrize("name", [m for m in list_models() if m.split("-", 1)[0] in MAMBA_FAMILIES])
def test_every_mamba_model_is_described(capsys, name: str) -> None:
    """Every Mamba zoo config (tiny to 130m, every scan order) gets a plan, its scan line
    counting every scan stage (cross, zigzag and the circular longitude scan too), and the
    method of every stage at every SP size."""
    video = ["--frames", "8"] if name.startswith("videomamba") else []
    lines = _plan(capsys, name, *video)
    config = create_model(name, device="meta").config
    scans = next(x for x in lines if x.startswith("  scans:"))
    assert scans.startswith(f"  scans: {_mamba_scan_stages(config)} Mamba-"), scans
    assert "methods per stage (those not listed run locally):" in lines
    assert any(x.startswith("  SP 2: ") for x in lines) and any(
        x.startswith("  SP 4: ") for x in lines
    )


def test_plan_help_names_the_mamba_families() -> None:
    from dspzoo.zoo.plan_cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "language models: bytelm; Mamba LMs mambalm, mamba2lm, hybridlm:" in text
    assert "video models: stdit, latte, latte1, videomamba:" in text
    assert "weather models: weathertx, weathermamba:" in text
    assert "Language models (bytelm; Mamba LMs mambalm, mamba2lm, hybridlm): --seq-len." in text


@pytest.mark.parametrize(
    ("shipped", "config", "tokens"),
    [
        ("stdit-mini-shapes", "stdit-mini", "tokens (t=8, s=64)"),  # 8 clips of 32 px, ×2 codec
        ("bytelm-tiny-stdlib", "bytelm-tiny", "tokens (l=256)"),  # its training length
        ("weathertx-small-a1b-e1", "weathertx-small", "tokens (t=4, y=10, x=13)"),  # history 4
        ("evoformer-small-pdb", "evoformer-small", "MSA (s=16, r=64)"),  # its training crop
    ],
)
def test_a_shipped_name_is_planned_as_the_shipped_model(
    capsys, shipped: str, config: str, tokens: str
) -> None:
    """The shipped model's saved config (not its zoo config's: other channels, classes,
    history) and the sizes it was trained or samples at, unless flags say otherwise."""
    from dspzoo.zoo import from_pretrained

    header = _plan(capsys, shipped.upper(), "--sp", "1,2")[0]
    count = format_count(count_parameters(from_pretrained(shipped)))
    assert header.startswith(f"{shipped} (shipped; config {config}): {count} parameters, batch 1")
    assert tokens in header, header
    if config == "stdit-mini":
        assert count != format_count(count_parameters(create_model(config, device="meta")))
        given = _plan(capsys, shipped, "--frames", "2", "--size", "64", "--sp", "2")[0]
        assert "tokens (t=2, s=256)" in given, given  # 64 px / its codec's 2 = 32: 16 × 16


def test_a_closed_pipe_ends_the_plan_quietly() -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "dspzoo.zoo.cli", "plan", "stdit-mini", "--sp", "1,2,4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the plan prints (`dspzoo plan ... | head`)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_plan_help_says_what_a_cluster_is() -> None:
    from dspzoo.zoo.plan_cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "a preset of published rates (default h100-nvlink-ib)" in text
    assert "this-cpu: rates measured on this machine" in text and "cached" in text


def test_stream_bytes_price_the_switches_of_an_autocast_run(capsys) -> None:
    """``--stream-bytes 4`` (autocast, fp32 parameters): DSP's switches carry the fp32 stream,
    twice the bf16 bytes; Ulysses' all-to-alls carry what the linears produced, unchanged."""
    argv = ("stdit-mini", "--frames", "16", "--size", "64", "--sp", "2", "--strategies",
            "dsp,ulysses")  # fmt: skip
    bf16 = _rows(_plan(capsys, *argv))
    autocast = _rows(_plan(capsys, *argv, "--stream-bytes", "4"))
    dsp, uly = ("2", "dsp"), ("2", "ulysses")
    assert bf16[dsp][4:6] == ["224.00", "KiB"] and autocast[dsp][4:6] == ["448.00", "KiB"]
    assert bf16[uly][4:6] == autocast[uly][4:6] == ["512.00", "KiB"]
