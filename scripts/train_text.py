r"""Train a byte-level language model with sequence parallelism (the LSS enwik8 setting).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_text.py --sp 2 \
        --model bytelm-small --seq-len 512 --steps 1000

--data stdlib (the default) trains on the Python standard library's own sources, built into
one byte file and cached at first use; --data /path/to/enwik8 trains on any raw byte file.
Losses are in bits per byte. Checkpoints go to <output-dir>/checkpoints/step_N (written aside,
fsynced, swapped in; the newest --keep-checkpoints are kept), the final model to
<output-dir>/final, the loss histories to <output-dir>/losses.json. The run is the same at any
dp × sp layout with the same --global-batch, and --resume latest continues it exactly, at any
layout.
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.domains.text.training import TextTask, TextTrainConfig, train

CLI = TrainingCLI(TextTrainConfig, train, __doc__, "dspzoo.text.train", "bits/byte", task=TextTask)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_text.py"))
