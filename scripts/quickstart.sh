#!/usr/bin/env bash
# The quickstart: set up .venv if needed, then check and plan the offline tiny-model job.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ft validate examples/yaml/quickstart.yaml
ft plan examples/yaml/quickstart.yaml
