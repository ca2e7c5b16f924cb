"""``--fsdp``: sharded training gives the run of one process, and its checkpoints go anywhere.

One 4-process launch (gloo) of the axial3d example, a tiny model on an uneven shape (5 frames):

* 5 steps at dp 2 × sp 2 with ``--fsdp --activation-checkpointing`` — the losses equal one
  process's (rel 1e-5) and the final folder (a plain ``save_pretrained`` one) holds the
  weights one process ends with;
* a run stopped after step 3 at dp 2 × sp 2, resumed under ``--fsdp`` at dp 4 × sp 1 (another
  layout) — steps 4 and 5 as uninterrupted; its step-3 checkpoint also resumes on one process
  without ``--fsdp`` (full tensors), the same steps again;
* the video domain (STDiT, blocks written with ``stage()``, an EMA) stopped after step 2 at
  dp 2 × sp 2 with ``--activation-checkpointing`` and resumed at dp 4 × sp 1: one process's run;
* 2 steps with ``--mixed-precision bf16`` (FSDP's policy: bf16 compute, fp32 reduction and
  master weights) — close to fp32.

Run as a script under ``torch.distributed.run`` this file is the 4-process driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STEPS = 5


def _config(out: Path, **kw):
    from dspzoo.examples.axial3d_training import Axial3DTrainConfig

    base = dict(model="axial3d-tiny", sp=1, frames=5, size=12, steps=STEPS, global_batch=4,
                warmup=2, log_every=1, save_every=0, eval_clips=2, output_dir=str(out))  # fmt: skip
    return Axial3DTrainConfig(**{**base, **kw})


def _driver(out: str) -> None:
    import torch.distributed as dist

    from dspzoo.examples.axial3d_training import train

    root = Path(out)
    fsdp = dict(sp=2, fsdp=True)
    losses = {
        "fsdp": train(_config(root / "fsdp", **fsdp, activation_checkpointing=True)),
        "cut": train(_config(root / "cut", **fsdp, stop_after=3)),
        "resumed_dp4": train(_config(root / "cut", sp=1, fsdp=True, resume="latest")),
    }
    # video: an EMA (its averages checkpointed and restored), unevenly sharded tensors, and
    # blocks written with stage() (recomputed in the region they ran in) checkpointed
    video_train, video = _video(root)
    cut = video(root / "video", sp=2, fsdp=True, activation_checkpointing=True, stop_after=2)
    losses["video_cut"] = video_train(cut)
    losses["video_resumed"] = video_train(video(root / "video", sp=1, fsdp=True, resume="latest"))
    # Accelerate's state is per process: made anew for another precision
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    losses["bf16"] = train(_config(root / "bf16", **fsdp, steps=2, mixed_precision="bf16"))
    if dist.get_rank() == 0:
        record = {name: result["losses"] for name, result in losses.items()}
        (root / "losses.json").write_text(json.dumps(record))


def _video(root: Path):
    """The video domain's tiny run of tests/test_trainer_layouts.py (3 steps, EMA 0.999), with
    a global batch of 4 (dp 4 × sp 1 takes one sample per rank)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_trainer_layouts import domains

    (root / "data").mkdir(exist_ok=True)
    train, config = domains(root / "data")["video"]
    return train, (lambda out, **kw: config(output_dir=str(out), global_batch=4, **kw))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from dspzoo.examples.axial3d_training import train

    root = tmp_path_factory.mktemp("fsdp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           str(Path(__file__).resolve()), str(root)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((root / "losses.json").read_text())
    got["reference"] = train(_config(root / "one"))["losses"]
    step_3 = root / "cut" / "checkpoints" / "step_3"
    got["resumed_one"] = train(_config(root / "one-resumed", resume=str(step_3)))["losses"]
    video_train, video = _video(root)
    got["video_reference"] = video_train(video(root / "video-one", sp=1))["losses"]
    got["root"] = str(root)
    return got


def test_five_fsdp_steps_at_dp2_sp2_equal_one_process(launched) -> None:
    assert len(launched["reference"]) == STEPS
    assert launched["fsdp"] == pytest.approx(launched["reference"], rel=1e-5)
    assert launched["cut"] == pytest.approx(launched["reference"][:3], rel=1e-5)


def test_the_final_fsdp_model_is_a_plain_folder_with_one_process_weights(launched) -> None:
    from dspzoo.zoo import from_pretrained

    root = Path(launched["root"])
    sharded = from_pretrained(root / "fsdp" / "final")
    one = from_pretrained(root / "one" / "final")
    assert type(sharded) is type(one)
    # atol: the key part of a qkv bias has no gradient in exact arithmetic (softmax is shift
    # invariant), so Adam turns rounding noise into ~1e-5 steps there at any layout
    for (name, got), want in zip(sharded.state_dict().items(), one.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5, msg=name)


def test_fsdp_checkpoints_resume_at_another_layout_and_without_fsdp(launched) -> None:
    tail = launched["reference"][3:]
    assert launched["resumed_dp4"] == pytest.approx(tail, rel=1e-5)
    assert launched["resumed_one"] == pytest.approx(tail, rel=1e-5)


def test_video_ema_and_uneven_shards_checkpoint_and_resume_under_fsdp(launched) -> None:
    """Stopped after step 2 at dp 2 × sp 2 (with activation checkpointing of STDiT's blocks,
    which are written with ``stage()``: their recomputation reopens the region they ran in),
    resumed at dp 4 × sp 1: the EMA's averages and the optimizer's moments come back, the
    final model equals one process's."""
    from dspzoo.zoo import from_pretrained

    resumed = launched["video_cut"] + launched["video_resumed"]
    assert resumed == pytest.approx(launched["video_reference"], rel=1e-5)
    root = Path(launched["root"])
    sharded = from_pretrained(root / "video" / "final").state_dict()
    one = from_pretrained(root / "video-one" / "final").state_dict()
    for name, want in one.items():  # the EMA weights
        torch.testing.assert_close(sharded[name], want, rtol=1e-4, atol=5e-5, msg=name)


def test_bf16_policy_trains_close_to_fp32(launched) -> None:
    assert launched["bf16"] == pytest.approx(launched["reference"][:2], rel=2e-2)
    assert launched["bf16"] != pytest.approx(launched["reference"][:2], rel=1e-6)  # bf16 ran


def test_fsdp_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="--activation-checkpointing applies to --fsdp"):
        _config(Path("unused"), activation_checkpointing=True).validate()
    with pytest.raises(ValueError, match="--fsdp shards the weights over dp × sp"):
        _config(Path("unused"), fsdp=True, sp_strategy="megatron_sp").validate()


def test_shard_units_are_the_blocks() -> None:
    from dspzoo.core.train.fsdp import shard_units
    from dspzoo.zoo import create_model

    model = create_model("axial3d-tiny")
    units = shard_units(model)
    assert units and all(any(u is b for b in model.modules()) for u in units)
    assert len(units) == sum(len(m) for m in model.children() if isinstance(m, torch.nn.ModuleList))


if __name__ == "__main__":
    _driver(sys.argv[1])
