r"""Train a byte-level Mamba LM (Mamba-1 or Mamba-2) with sequence parallelism.

    dspzoo train mamba --model mambalm-tiny --seq-len 64 --steps 20
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_mamba.py --sp 2 \
        --model mamba2lm-small --seq-len 256 --steps 1000

The data, losses (bits per byte), evaluation, checkpoints and --resume are the text domain's
(scripts/train_text.py); the model is a zoo Mamba LM (`dspzoo list`: mambalm-…, mamba2lm-…).
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.domains.mamba.training import MambaTask, MambaTrainConfig, train

CLI = TrainingCLI(
    MambaTrainConfig, train, __doc__, "dspzoo.mamba.train", "bits/byte", task=MambaTask
)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_mamba.py"))
