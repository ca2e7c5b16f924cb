r"""Train the worked example of docs/new_architecture.md: Axial3D, next-frame prediction.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_axial3d.py --sp 2 \
        --model axial3d-mini --steps 300

Trains on the built-in moving-shapes clips (--frames frames of --size × --size pixels); the loss
is the mean squared error of the predicted next frames. Checkpoints go to
<output-dir>/checkpoints/step_N (--resume latest continues), the final model to
<output-dir>/final with its held-out MSE next to the copy-the-last-frame baseline's, the loss
history to <output-dir>/losses.json.
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.examples.axial3d_training import Axial3DTask, Axial3DTrainConfig, train

CLI = TrainingCLI(
    Axial3DTrainConfig, train, __doc__, "dspzoo.axial3d.train", "mse", task=Axial3DTask
)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_axial3d.py"))
