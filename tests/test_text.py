"""ByteLM, byte-window data and text training: one process thoroughly, SP 2 and 3 against it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dspzoo.domains.text  # noqa: F401  (registers bytelm)
from dspzoo.core import SeqParallel, build_mesh
from dspzoo.core.loss import sp_report
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.methods.megatron import (
    gather_full,
    megatron_grad_sync,
    parallelize_megatron,
)
from dspzoo.core.parallel.plan import plan_stages
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.core.parallel.validate import InputValidationError
from dspzoo.core.testing import run_distributed
from dspzoo.core.train.config import NOT_WIRED
from dspzoo.core.train.tensor_parallel import clip_sharded_grad_norm_
from dspzoo.domains.text.data import ByteWindows, stdlib_corpus
from dspzoo.domains.text.model import apply_rotary, rotary_table
from dspzoo.domains.text.training import TextTrainConfig, train
from dspzoo.zoo import count_parameters, create_model, from_pretrained, load_extra

REPO = Path(__file__).resolve().parents[1]
STRATEGY = "dsp"  # SP 1 cases: every strategy is the same computation at one rank
# dsp: the hybrid plan (an embedded method on attn); ring_zigzag: positions out of order
SP_STRATEGIES = (
    "dsp",
    "lss",
    "lss_zigzag",
    "lss_balanced",
    "ring",
    "ring_zigzag",
    "ring_balanced",
    "ulysses",
)


def _model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("bytelm-tiny", **overrides)


def _tokens(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length + 1), generator=torch.Generator().manual_seed(seed))


def _sp() -> SeqParallel:
    return SeqParallel(strategy=STRATEGY)


# -- the model at SP 1 -------------------------------------------------------------------------


def test_configs_and_parameter_counts() -> None:
    counts = {
        name: count_parameters(create_model(f"bytelm-{name}", device="meta"))
        for name in ("tiny", "small", "lss-12l", "gpt2-small")
    }
    assert counts == {
        "tiny": 115_008,
        "small": 6_361_344,
        "lss-12l": 37_892_608,
        "gpt2-small": 85_150_464,
    }
    untied = create_model("bytelm-tiny", tie_embeddings=False, device="meta")
    assert count_parameters(untied) == counts["tiny"] + 256 * 64
    learned = create_model("bytelm-tiny", position="learned", device="meta")
    assert count_parameters(learned) == counts["tiny"] + 512 * 64


def test_dsp_plans_an_embedded_method_for_the_attention_stage() -> None:
    """A 1-D model has nothing to switch to: DSP's hybrid plan keeps ``l`` sharded and runs
    attention with an embedded method, Ulysses unless there are fewer heads than ranks, then the
    ring that balances the causal work (the stage declares ``causal=True``)."""
    model = create_model("bytelm-small", device="meta")  # 4 heads
    assert model.stages[0].causal
    for size, method in ((2, "ulysses"), (4, "ulysses"), (8, "ring_balanced")):
        plan = plan_stages(("l",), (4096,), model.stages, size)
        assert plan.switches_per_period == 0 and plan.entry == "l"
        assert [(step.sharded, step.method) for step in plan.steps] == [
            ("l", method),
            ("l", "local"),
        ]


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_causal_and_loss_is_cross_entropy(position: str) -> None:
    model, sp = _model(position=position), _sp()
    data = _tokens()
    tokens, targets = data[:, :-1], data[:, 1:]
    logits = model(tokens, sp)
    assert logits.shape == (2, 24, 256)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    after = model(changed, sp)
    torch.testing.assert_close(after[:, :10], logits[:, :10], rtol=0, atol=0)
    assert (after[:, 10:] - logits[:, 10:]).abs().amax(-1).min() > 0
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model.loss(tokens, targets, sp), expected)


def test_rotary_scores_depend_on_relative_position_only() -> None:
    q, k = (
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
        torch.randn(1, 1, 1, 16, dtype=torch.float64),
    )
    table = rotary_table(1000, 16).double()

    def score(i: int, j: int) -> float:
        return float((apply_rotary(q, table[i : i + 1]) * apply_rotary(k, table[j : j + 1])).sum())

    assert score(3, 7) == pytest.approx(score(503, 507), rel=1e-5)
    assert score(3, 7) != pytest.approx(score(3, 9), rel=1e-3)
    # a shard of a table is the table of that shard's global positions
    torch.testing.assert_close(rotary_table(5, 16, start=995), rotary_table(1000, 16)[995:])


def test_learned_positions_and_rotary_differ_and_limit() -> None:
    rope, learned = _model(), _model(position="learned")
    assert rope.pos is None and learned.pos.weight.shape == (512, 64)
    too_long = torch.zeros(1, 513, dtype=torch.long)
    with pytest.raises(ValueError, match="max_len=512"):
        learned(too_long)
    assert rope(too_long).shape == (1, 513, 256)  # rotary positions have no table to outgrow


def test_activation_checkpointing_gives_identical_gradients() -> None:
    data = _tokens()
    grads = []
    for ckpt in (False, True):
        model = _model(checkpoint=ckpt)
        loss = model.loss(data[:, :-1], data[:, 1:], _sp())
        loss.backward()
        grads.append(
            (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    assert grads[0][0] == grads[1][0]
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=0, atol=1e-7, msg=name)


def test_grouped_query_attention_equals_mha_with_shared_kv_heads() -> None:
    gqa = _model(kv_heads=2)
    assert count_parameters(gqa) < count_parameters(_model())
    mha = _model()
    state = dict(gqa.state_dict())
    for i, block in enumerate(gqa.blocks):  # repeat each K/V head for the 2 query heads it serves
        k, v = block.attn.kv.linear.weight.split([32, 32])
        rep = [t.unflatten(0, (2, 16)).repeat_interleave(2, 0).flatten(0, 1) for t in (k, v)]
        state[f"blocks.{i}.attn.kv.linear.weight"] = torch.cat(rep)
    mha.load_state_dict(state)
    data = _tokens()[:, :-1]
    torch.testing.assert_close(mha(data, _sp()), gqa(data, _sp()), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not divisible by kv_heads"):
        create_model("bytelm-tiny", kv_heads=3)


def test_inputs_are_validated() -> None:
    model = _model()
    with pytest.raises(TypeError, match="integer"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        model(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="batch, length"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="targets"):
        model.loss(torch.tensor([[1, 2]]), torch.tensor([[1]]))


def test_kv_cache_decoding_matches_the_full_forward() -> None:
    for kw in ({}, {"position": "learned"}, {"kv_heads": 1}):
        model = _model(**kw).eval()
        data = _tokens(batch=1, length=20)[:, :-1]
        cache = [{} for _ in model.blocks]
        steps = [model.decode(data[:, :12], cache, 0)]
        steps += [model.decode(data[:, i : i + 1], cache, i) for i in range(12, 20)]
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(steps, 1), model(data), rtol=1e-5, atol=1e-5)


def test_generation_is_deterministic_with_a_seeded_generator() -> None:
    model = _model()

    def sample(seed: int, **kw) -> bytes:
        return model.generate(b"def ", 30, generator=torch.Generator().manual_seed(seed), **kw)

    first = sample(0, top_k=20)
    assert len(first) == 30 and sample(0, top_k=20) == first and sample(1, top_k=20) != first
    greedy = model.generate("def ", 8, temperature=0)
    tokens = torch.tensor([list(b"def ")])
    for byte in greedy:  # greedy decoding with the cache = argmax of full recomputation
        with torch.no_grad():
            assert byte == int(model(tokens)[0, -1].argmax())
        tokens = torch.cat([tokens, torch.tensor([[byte]])], 1)
    with pytest.raises(ValueError, match="at least one byte"):
        model.generate(b"", 4)


# -- SP 2 and 3 against one process ------------------------------------------------------------


def _compare_with_one_process(rank: int, world: int) -> list[tuple[str, int, int]]:
    """Per strategy: loss, gathered logits and every gradient at SP 3 (all ranks) and SP 2
    (ranks 0, 1) equal one process, for lengths 12 (even at SP 2 and 3) and 11 (uneven), with
    grouped-query attention (4 query heads, 2 K/V heads)."""
    mesh3 = build_mesh(world)
    group2 = dist.new_group([0, 1])  # every rank takes part in creating it
    mesh2 = SPMesh(world, rank, dp_size=1, sp_size=2, dp_rank=0, sp_rank=rank, sp_group=group2)
    checked = []
    for length in (12, 11):
        data = _tokens(length=length)
        tokens, targets = data[:, :-1], data[:, 1:]
        model = _model(kv_heads=2)
        ref_loss = model.loss(tokens, targets, SeqParallel(strategy=STRATEGY))
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            ref_logits = model(tokens)
        for strategy in SP_STRATEGIES:
            for size, mesh in ((3, mesh3), (2, mesh2)):
                if rank >= size:
                    continue
                sp = SeqParallel(mesh, strategy=strategy)
                model.zero_grad()
                loss = model.loss(tokens, targets, sp)
                loss.backward()
                report = loss.detach().clone()
                dist.all_reduce(report, group=sp.group)
                what = f"{strategy} at SP {size}, L={length}"
                torch.testing.assert_close(
                    report / size, ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=what
                )
                for name, p in model.named_parameters():  # the SP-group mean is the reference
                    grad = p.grad.clone()
                    dist.all_reduce(grad, group=sp.group)
                    torch.testing.assert_close(
                        grad / size, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{what}: {name}"
                    )
                with torch.no_grad():
                    torch.testing.assert_close(
                        model(tokens, sp), ref_logits, rtol=1e-5, atol=1e-5, msg=what
                    )
                checked.append((strategy, size, length))
    return checked


def _megatron_case(mesh: SPMesh, length: int, **model_kw) -> None:
    """megatron_sp on ByteLM: the loss, the global gradient norm and every clipped gradient
    (shards gathered after ``megatron_grad_sync``) equal one process's."""
    data = _tokens(length=length)
    tokens, targets = data[:, :-1], data[:, 1:]
    reference = _model(**model_kw)
    reference.loss(tokens, targets, SeqParallel(strategy=STRATEGY)).backward()
    model = parallelize_megatron(_model(**model_kw), mesh.sp_group)
    sp = SeqParallel(mesh, strategy="megatron_sp")
    loss = model.loss(tokens, targets, sp)
    loss.backward()
    megatron_grad_sync(model, mesh)
    what = f"megatron_sp at SP {mesh.sp_size}, L={length}, {model_kw}"
    ref_loss = reference.loss(tokens, targets, SeqParallel(strategy=STRATEGY))
    assert sp_report(loss, sp.group) == pytest.approx(float(ref_loss), rel=1e-5), what
    # the global gradient norm (shards summed over the group once, replicated counted once),
    # clipped to half of it: the one-process clip_grad_norm_
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    norm = clip_sharded_grad_norm_(model, ref_norm / 2, sp.group)
    assert float(norm) == pytest.approx(ref_norm, rel=1e-5), what
    torch.nn.utils.clip_grad_norm_(reference.parameters(), ref_norm / 2)
    grads = gather_full(model, sp.group, grads=True)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


def _megatron_checks(rank: int, world: int) -> list[str]:
    """GQA (4 query, 2 K/V heads) at SP 2, uneven MHA heads (2, 1, 1) at SP 3; clear errors at
    SP 3 for 2 K/V heads (fewer than the ranks) and for 8 / 4 heads (groups split)."""
    mesh3 = build_mesh(world)
    group2 = dist.new_group([0, 1])
    mesh2 = SPMesh(world, rank, dp_size=1, sp_size=2, dp_rank=0, sp_rank=rank, sp_group=group2)
    errors = []
    for length in (12, 11):
        if rank < 2:
            _megatron_case(mesh2, length, kv_heads=2)
        _megatron_case(mesh3, length)
    try:
        parallelize_megatron(_model(kv_heads=2), mesh3.sp_group)
    except ValueError as exc:
        errors.append(str(exc))
    model = parallelize_megatron(_model(heads=8, kv_heads=4), mesh3.sp_group)
    try:
        model(_tokens()[:, :-1], SeqParallel(mesh3, strategy="megatron_sp"))
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _sp_worker(rank: int, world: int) -> dict:
    sp = SeqParallel(build_mesh(world), strategy=STRATEGY)
    tokens = _tokens()[:, :-1]
    if rank == 1:
        tokens[0, 0] = 300  # only rank 1 holds a bad byte: every rank must raise, none hang
    try:
        _model()(tokens, sp)
        validation = "accepted"
    except InputValidationError as exc:
        validation = str(exc)
    megatron = _megatron_checks(rank, world)
    try:
        checked = _compare_with_one_process(rank, world)
        return {"validation": validation, "checked": checked, "megatron": megatron}
    except AssertionError:
        raise  # a wrong answer is a failure, whatever the state of the core
    except Exception as exc:  # the core cannot run this layout yet
        return {"validation": validation, "unsupported": f"{type(exc).__name__}: {exc}"}


def test_sp2_and_sp3_equal_one_process() -> None:
    """Under dsp, lss, ring (contiguous and zigzag) and ulysses, and megatron_sp (tensor
    parallel, GQA). Also: a bad byte on one rank raises the same validation error on every rank."""
    results = run_distributed(_sp_worker, 3, timeout=200)
    for rank, r in enumerate(results):
        assert "ByteLM inputs rejected on SP rank(s) [1] of 3" in r["validation"], r
        assert f"this is rank {rank}" in r["validation"] and "[0, 256)" in r["validation"]
    if any("unsupported" in r for r in results):
        pytest.xfail(
            "the core cannot yet run a stage that mixes the only sequence dim at SP > 1 "
            f"(hybrid plans with ulysses / ring / lss attention): {results[0].get('unsupported')}"
        )
    for r in results:
        fewer, split = r["megatron"]
        assert "attn.kv.linear has 2 heads, fewer than the 3 ranks" in fewer, fewer
        assert "3 must divide kv_heads=4" in split, split
    everything = [(s, n, length) for length in (12, 11) for s in SP_STRATEGIES for n in (3, 2)]
    assert results[0]["checked"] == results[1]["checked"] == everything
    assert results[2]["checked"] == [case for case in everything if case[1] == 3]


# -- data -----------------------------------------------------------------------------------------


def test_byte_windows_split_by_position(tmp_path: Path) -> None:
    raw = bytes(range(256)) * 4  # 1024 bytes: the last 51 are held out
    path = tmp_path / "data.bin"
    path.write_bytes(raw)
    train_set, val_set = ByteWindows(path, 16), ByteWindows(path, 16, "val")
    assert (train_set.start, train_set.stop, val_set.start, val_set.stop) == (0, 973, 973, 1024)
    assert len(train_set) == (973 - 1) // 16 and len(val_set) == (51 - 1) // 16
    item = train_set[3]
    assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (16,)
    assert bytes(item["tokens"].tolist()) == raw[48:64]
    assert bytes(item["targets"].tolist()) == raw[49:65]
    last = train_set.window(len(train_set) - 1)
    assert len(last) == 17 and (len(train_set) - 1) * 16 + 17 <= 973  # never crosses into val
    assert bytes(val_set[0]["tokens"].tolist()) == raw[973:989]
    assert torch.equal(train_set[5]["tokens"], ByteWindows(path, 16)[5]["tokens"])
    with pytest.raises(IndexError):
        train_set.window(len(train_set))


def test_byte_windows_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ByteWindows(tmp_path / "missing.bin", 16)
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"val split \(5 bytes\) is shorter than one window"):
        ByteWindows(short, 16, "val")
    with pytest.raises(ValueError, match="shorter than one window of seq_len"):
        ByteWindows(short, 200)
    with pytest.raises(ValueError, match="split must be one of"):
        ByteWindows(short, 4, "test")


def test_stdlib_corpus_is_built_once_atomically(tmp_path: Path) -> None:
    path = stdlib_corpus(cap_bytes=200_000, folder=tmp_path)
    manifest = json.loads(path.with_suffix(".json").read_text())
    data = path.read_bytes()
    assert len(data) == manifest["bytes"] <= 200_000 and manifest["files"][0] == "__future__.py"
    assert data.startswith(b"# ==> __future__.py <==\n")
    assert data.count(b"\n# ==> ") + 1 == len(manifest["files"])
    assert manifest["files"] == sorted(manifest["files"]) and "PSF" in manifest["licence"]
    assert not any(f.startswith(("test/", "site-packages/")) for f in manifest["files"])
    assert not list(tmp_path.glob(".*tmp"))
    stamp = path.stat().st_mtime_ns
    assert stdlib_corpus(cap_bytes=200_000, folder=tmp_path) == path
    assert path.stat().st_mtime_ns == stamp  # cached, not rebuilt


# -- training -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.bin"
    path.write_bytes(stdlib_corpus(cap_bytes=100_000, folder=path.parent).read_bytes())
    return path


def _config(out: Path, data: Path, **kw) -> TextTrainConfig:
    base = dict(
        model="bytelm-tiny",
        sp=1,
        sp_strategy=STRATEGY,
        seq_len=32,
        steps=5,
        global_batch=2,
        warmup=2,
        eval_every=5,
        eval_windows=4,
        log_every=1,
        save_every=0,
        data=str(data),
        output_dir=str(out),
    )
    return TextTrainConfig(**{**base, **kw})


def test_training_saves_resumes_and_generates(tmp_path: Path, byte_file: Path, capsys) -> None:
    full = train(_config(tmp_path / "full", byte_file))
    assert len(full["losses"]) == 5 and all(math.isfinite(x) for x in full["losses"])
    assert 7.0 < full["losses"][0] < 8.5  # near-uniform over 256 bytes at the start: ~8 bits
    assert [step for step, _ in full["evals"]] == [5] and full["tokens_per_s"] > 0
    assert full["activation_bytes"] > 0
    out = tmp_path / "cut"
    first = train(_config(out, byte_file, stop_after=3))
    assert not (out / "final").exists()
    resumed = train(_config(out, byte_file, resume="latest"))
    assert first["losses"] + resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    assert resumed["loss_history"] == pytest.approx(full["losses"], rel=1e-6)
    assert resumed["evals"][0][1] == pytest.approx(full["evals"][0][1], rel=1e-6)
    logged = json.loads((out / "losses.json").read_text())
    assert logged["train_bpb"] == resumed["loss_history"]
    extra = load_extra(out / "final")["training"]
    assert extra["seq_len"] == 32 and extra["steps"] == 5
    model = from_pretrained(out / "final", expected_family="bytelm")
    reference = from_pretrained(tmp_path / "full" / "final")
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from generate_text import main as generate_main
    finally:
        sys.path.remove(str(REPO / "scripts"))
    argv = ["--model-dir", str(out / "final"), "--prompt", "def ", "--max-new", "40"]
    text = generate_main(argv)
    assert text.startswith("def ") and generate_main(argv) == text
    captured = capsys.readouterr()
    assert text in captured.out and "beyond the 32-byte windows" in captured.err


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path, byte_file: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_config(tmp_path, byte_file, resume="latest"))


def test_command_line_flags_describe_themselves_and_reject_bad_values(capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from train_text import build_parser, parse_args
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = build_parser().format_help()
    assert "{no,fp16,bf16}" in text and "--sp-strategy" in text and "--eval-every" in text
    assert "bits per byte" in text and "``" not in text and ":func:" not in text
    cfg = parse_args(["--model", "bytelm-tiny", "--activation-checkpointing", "yes"])
    assert cfg.output_dir == "outputs/bytelm-tiny" and cfg.activation_checkpointing is True
    assert cfg.sp_strategy == "lss_zigzag" and cfg.data == "stdlib"
    assert "{" + ",".join(STRATEGIES) + "}" in text  # the registry's names are the choices
    assert parse_args(["--activation-checkpointing", "false"]).activation_checkpointing is False
    for bad in (
        ["--mixed-precision", "fp8"],
        ["--seq-len", "0"],
        ["--val-fraction", "1.5"],
        ["--activation-checkpointing", "maybe"],
        ["--sp-strategy", "megatron"],
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2
    assert "--val-fraction must be in [0, 1)" in capsys.readouterr().err
    assert parse_args(["--sp-strategy", "megatron_sp"]).sp_strategy == "megatron_sp"
    # no validation at all: every byte trains; a split with no evaluation would be read for
    # nothing, and an evaluation with no split cannot run
    assert parse_args(["--val-fraction", "0", "--eval-every", "0"]).val_fraction == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--val-fraction", "0"])
    assert "--val-fraction 0 holds no bytes out to evaluate on" in capsys.readouterr().err


def test_a_file_too_small_for_a_val_split_trains_without_evaluation(tmp_path: Path) -> None:
    """A 70-byte file at --seq-len 64: its 5 % validation split is shorter than one window,
    which only matters when something evaluates on it."""
    from dspzoo.domains.text.training import TextTrainConfig, train

    data = tmp_path / "tiny.txt"
    data.write_bytes(bytes(range(65, 65 + 70)))
    run = dict(model="bytelm-tiny", data=str(data), seq_len=64, steps=1, global_batch=1, sp=1)
    out = train(TextTrainConfig(**run, eval_every=0, output_dir=str(tmp_path / "a")))
    assert len(out["losses"]) == 1 and out["evals"] == []
    with pytest.raises(ValueError, match="its val split .* is shorter than one window"):
        train(TextTrainConfig(**run, eval_every=1, output_dir=str(tmp_path / "b")))


def test_five_training_steps_at_sp2_repeat_sp1_under_every_strategy(
    tmp_path: Path, byte_file: Path
) -> None:
    """One 2-process launch trains 5 steps under each strategy; every loss sequence equals the
    one-process run's."""
    import os
    import subprocess

    reference = train(_config(tmp_path / "sp1", byte_file, eval_every=0))["losses"]
    strategies = [s for s in STRATEGIES if s not in NOT_WIRED]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "text_strategies_driver.py"),
        str(byte_file),
        str(tmp_path),
        *strategies,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert sorted(losses) == sorted(strategies)
    for strategy, got in losses.items():
        assert got == pytest.approx(reference, rel=1e-5), (strategy, reference, got)
