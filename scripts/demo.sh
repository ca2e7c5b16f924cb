#!/usr/bin/env bash
# Set up .venv (see setup_env.sh), train a small STDiT with DSP on 2 processes on the built-in
# moving-shapes data, then sample a GIF with DSP. Extra flags go to train_video.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DSPZOO_VENV:-.venv}/bin/activate"
OUT="${DSPZOO_OUT:-outputs/stdit-mini}"
LAUNCH=(accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no)
"${LAUNCH[@]}" scripts/train_video.py --sp 2 --model stdit-mini --steps "${DSPZOO_STEPS:-4000}" --lr 1e-3 --warmup 50 \
    --log-every 200 --save-every 1000 --output-dir "$OUT" "$@"
"${LAUNCH[@]}" scripts/sample_video.py --model-dir "$OUT/final" --out "$OUT/samples.gif" --guidance 3
