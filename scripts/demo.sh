#!/usr/bin/env bash
# Set up .venv (see setup_env.sh) and run the main job on built-in data with 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DSPZOO_VENV:-.venv}/bin/activate"
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    scripts/dsp_demo.py "$@"
