#!/usr/bin/env bash
# Set up .venv (see setup_env.sh), then, with DSP on 2 processes:
#   1. sample clips from the shipped, trained stdit-mini-shapes at once (outputs/demo/shipped.gif),
#   2. fine-tune it for a few hundred steps on the built-in moving-shapes data
#      (DSPZOO_STEPS, default 200; extra flags go to train_video.py),
#   3. sample from the fine-tuned model (outputs/demo/finetuned/samples.gif).
# Training from scratch instead: scripts/train_video.py without --init-from (docs/video.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DSPZOO_VENV:-.venv}/bin/activate"
OUT="${DSPZOO_OUT:-outputs/demo}"
LAUNCH=(accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no)
"${LAUNCH[@]}" scripts/sample_video.py --model-dir stdit-mini-shapes --out "$OUT/shipped.gif" --guidance 3
# a re-run starts a new fine-tune: the previous one is kept as finetuned.previous (the trainer
# refuses to start fresh beside an earlier run's checkpoints); pass --resume latest to continue it
if [[ " $* " != *" --resume "* && -d "$OUT/finetuned" ]]; then
    rm -rf "$OUT/finetuned.previous"
    mv "$OUT/finetuned" "$OUT/finetuned.previous"
    echo "previous fine-tune moved to $OUT/finetuned.previous"
fi
"${LAUNCH[@]}" scripts/train_video.py --sp 2 --init-from stdit-mini-shapes --steps "${DSPZOO_STEPS:-200}" \
    --lr 1e-4 --warmup 20 --log-every 50 --save-every 0 --output-dir "$OUT/finetuned" "$@"
"${LAUNCH[@]}" scripts/sample_video.py --model-dir "$OUT/finetuned/final" --out "$OUT/finetuned/samples.gif" --guidance 3
echo "samples: $OUT/shipped.gif (shipped model), $OUT/finetuned/samples.gif (after the fine-tune)"
