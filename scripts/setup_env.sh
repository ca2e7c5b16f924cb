#!/usr/bin/env bash
# Create (or reuse) a virtual environment in .venv and install dspzoo into it.
#
# torch: an importable torch in the venv is kept as is (CPU or CUDA build). Otherwise
# TORCH_SPEC is installed first (default torch==2.13.0, whose CPU wheel is what a CPU-only
# machine should get; GPU users set e.g. TORCH_SPEC="torch==2.13.0 --index-url ..." or
# pre-install torch), so the `torch>=2.4,<2.15` requirement is already satisfied when pip
# resolves dspzoo and never pulls a different build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DSPZOO_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
fi
pip install --quiet -e ".[dev]"
python -c "import dspzoo, torch; print(f'dspzoo {dspzoo.__version__} with torch {torch.__version__} in $VENV')"
