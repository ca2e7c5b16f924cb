"""Protein training and prediction: two steps at SP 2 equal SP 1 (gloo, scripts launched with
torch.distributed.run), resume, prediction at SP 2 equals SP 1, flags, and the shipped
``evoformer-small-pdb`` reproducing its recorded held-out contact precision."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspzoo.domains.protein.dataset import BUILTIN_DATA
from dspzoo.domains.protein.training import ProteinTrainConfig, train

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "protein"
SHIPPED = "evoformer-small-pdb"

COMMON = dict(
    model="evoformer-tiny",
    crop_size=24,
    max_msa_rows=5,
    global_batch=2,
    steps=2,
    warmup=1,
    log_every=1,
    save_every=0,
    eval_every=0,
    eval_max_length=40,
    held_out_entries="4zey",
    num_recycles=1,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Four real entries (one with MSAs), 4zey held out."""
    root = tmp_path_factory.mktemp("chains")
    for name in ("2cviA.pdb.gz", "2xcjA.pdb.gz", "2q2k.cif.gz", "4zey.cif.gz"):
        shutil.copy(BUILTIN_DATA / name, root / name)
    shutil.copytree(BUILTIN_DATA / "alignments" / "2q2k_A", root / "alignments" / "2q2k_A")
    return root


def _config(out: Path, data: Path, **kw) -> ProteinTrainConfig:
    return ProteinTrainConfig(
        **{**COMMON, "sp": 1, "data": str(data), "output_dir": str(out), **kw}
    )


def _launch(script: str, *flags: str, cwd: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += [str(REPO / "scripts" / script), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_two_steps_at_sp2_equal_sp1_resume_and_predict(folder: Path, tmp_path: Path) -> None:
    one = train(_config(tmp_path / "sp1", folder))
    assert len(one["losses"]) == 2 and all(np.isfinite(one["losses"]))
    ((step, figures),) = one["evals"]
    assert step == 2 and figures["chains"] == 1 and 0.0 <= figures["precision"] <= 1.0
    assert (tmp_path / "sp1" / "contact_maps" / "step_2" / "4zey_A.png").is_file()

    # the same run on two processes, SP 2 under DSP, with a checkpoint after step 1
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items() if k != "save_every"]
    sp2 = tmp_path / "sp2"
    _launch("train_protein.py", "--sp=2", f"--data={folder}", f"--output-dir={sp2}",
            "--save-every=1", *flags, cwd=tmp_path)  # fmt: skip
    logged = json.loads((sp2 / "losses.json").read_text())
    assert logged["train_loss"] == pytest.approx(one["losses"], rel=1e-5)
    got = logged["evals"][0][1]
    assert got["distogram_loss"] == pytest.approx(figures["distogram_loss"], rel=1e-5)
    assert got["precision"] == pytest.approx(figures["precision"], abs=1e-6)

    # the SP 2 checkpoint of step 1 resumed on one process: the uninterrupted run's step 2
    ckpt = sp2 / "checkpoints" / "step_1"
    rest = train(_config(tmp_path / "resumed", folder, resume=str(ckpt)))
    assert len(rest["losses"]) == 1
    assert rest["loss_history"] == pytest.approx(one["losses"], rel=1e-5)
    assert rest["evals"][-1][1]["distogram_loss"] == pytest.approx(
        figures["distogram_loss"], rel=1e-5
    )

    # prediction from the final model: one process, then two (DSP), identical
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from predict_protein import main as predict_main
    finally:
        sys.path.remove(str(REPO / "scripts"))
    fasta = tmp_path / "2q2k.fasta"
    fasta.write_text(
        ">2q2k_A\nMGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP\n"
    )
    args = ["--model-dir", str(tmp_path / "sp1" / "final"), "--fasta", str(fasta),
            "--msa", str(DATA / "alignments" / "2q2k_A" / "bfd_uniclust_hits.a3m"),
            "--msa", str(DATA / "alignments" / "2q2k_A" / "uniref90_hits.sto")]  # fmt: skip
    single = predict_main([*args, "--out", str(tmp_path / "p1" / "q")])
    assert single["distogram"].shape == (70, 70, 16) and single["contact_probs"].shape == (70, 70)
    np.testing.assert_allclose(single["distogram"].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(single["contact_probs"], single["contact_probs"].T, atol=1e-6)
    _launch("predict_protein.py", *args, "--out", str(tmp_path / "p2" / "q"), cwd=tmp_path)
    two = np.load(tmp_path / "p2" / "q.npz")
    np.testing.assert_allclose(two["contact_probs"], single["contact_probs"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two["distogram"], single["distogram"].astype(np.float16), atol=1e-3)
    assert str(two["sequence"]).startswith("MGSSHHHHHH") and (tmp_path / "p2" / "q.png").is_file()


def test_flags_describe_themselves_and_reject_bad_values(capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from train_protein import build_parser, parse_args
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = build_parser().format_help()
    assert "--crop-size" in text and "--num-recycles" in text and "--held-out-entries" in text
    cfg = parse_args([])
    assert cfg.model == "evoformer-small" and cfg.sp_strategy == "dsp" and cfg.data == "builtin"
    bad_values = (
        ["--crop-size", "0"],
        ["--held-out-fraction", "1.5"],
        ["--sp-strategy", "ulysses"],
        ["--num-recycles", "-1"],
    )
    for bad in bad_values:
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2
    assert "--num-recycles must be >= 0" in capsys.readouterr().err
    # checkpointing (of every block's layers) is taken at any SP size
    for sp in ("1", "2"):
        cfg = parse_args(["--sp", sp, "--fsdp", "--activation-checkpointing"])
        assert cfg.fsdp and cfg.activation_checkpointing


def test_predict_rejects_a_query_that_is_not_the_msa_first_row(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from predict_protein import main as predict_main
    finally:
        sys.path.remove(str(REPO / "scripts"))
    msa = str(DATA / "alignments" / "2q2k_A" / "bfd_uniclust_hits.a3m")
    with pytest.raises(SystemExit):
        predict_main(["--model-dir", SHIPPED, "--fasta", str(DATA / "short.fasta"), "--msa", msa])
    assert "bfd_uniclust_hits.a3m: the MSA's first row has 70 columns" in capsys.readouterr().err


def test_shipped_model_reproduces_its_held_out_precision() -> None:
    from dspzoo.domains.protein.training import evaluate_pretrained
    from dspzoo.zoo.shipped import model_card

    card = model_card(SHIPPED)
    summary, records = evaluate_pretrained(SHIPPED)
    metrics = card.metrics
    assert summary["chains"] == len(card.extra["held_out_chains"]) >= 5
    assert summary["precision"] == pytest.approx(
        metrics["held_out_top_l5_long_range_precision"], abs=0.02
    )
    assert summary["distogram_loss"] == pytest.approx(metrics["held_out_distogram_loss"], rel=1e-3)
    assert summary["baseline_separation"] == pytest.approx(metrics["separation_baseline_precision"])
    assert [r["name"] for r in records] == [r["name"] for r in card.extra["held_out_chains"]]
    assert torch.tensor([r["precision"] for r in records]).isfinite().all()
