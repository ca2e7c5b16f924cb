r"""Train a video DiT with sequence parallelism (rectified flow on latents).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_video.py --sp 2 \
        --model stdit-tiny --steps 300

Checkpoints go to <output-dir>/checkpoints/step_N (written aside, fsynced, swapped in; the
newest --keep-checkpoints are kept), the final model to <output-dir>/final (EMA weights, with
the settings sample_video.py needs), the loss history to <output-dir>/losses.json and .png.
The run is the same at any dp × sp layout with the same --global-batch, and --resume latest
continues it exactly, at any layout.
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.domains.video.training import VideoTask, VideoTrainConfig, train

CLI = TrainingCLI(VideoTrainConfig, train, __doc__, "dspzoo.video.train", "losses", task=VideoTask)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_video.py"))
