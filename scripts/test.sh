#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the whole suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -q "$@"
