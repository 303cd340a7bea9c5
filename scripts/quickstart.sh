#!/usr/bin/env bash
# The quickstart: set up .venv if needed, then train the offline tiny model and report what it learned.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ft plan examples/yaml/quickstart.yaml
ft train examples/yaml/quickstart.yaml --overwrite
