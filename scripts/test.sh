#!/usr/bin/env bash
# Set up .venv (see setup_env.sh), lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DSPZOO_VENV:-.venv}/bin/activate"
ruff check .
pytest -q "$@"
