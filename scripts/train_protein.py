r"""Train the Evoformer's distogram under sequence parallelism on real protein structures.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_protein.py --sp 2 \
        --model evoformer-small --crop-size 64 --steps 600

--data builtin (the default) trains on the real chains shipped in
domains/protein/data_files/pdb_chains (held-out entries chosen by a hash of their names);
--data /path/to/folder trains on any folder of .cif/.pdb files with optional
alignments/<entry>_<chain>/*.a3m|*.sto. Losses are distogram cross-entropies (nats).
Evaluation reports the held-out chains' top-L/5 long-range contact precision beside a
sequence-separation-only baseline and writes contact maps to <output-dir>/contact_maps/.
Checkpoints go to <output-dir>/checkpoints/step_N (atomic; --resume latest continues exactly,
at any layout), the final model to <output-dir>/final (save_pretrained, with the settings
scripts/predict_protein.py needs).
"""

from __future__ import annotations

from dspzoo.core.train.flags import TrainingCLI
from dspzoo.domains.protein.training import ProteinTask, ProteinTrainConfig, train

CLI = TrainingCLI(
    ProteinTrainConfig, train, __doc__, "dspzoo.protein.train", "distogram loss", task=ProteinTask
)
build_parser, parse_args, main = CLI.build_parser, CLI.parse_args, CLI.main

if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "train_protein.py"))
