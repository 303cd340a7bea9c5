#!/usr/bin/env bash
# The vision-language quickstart: set up .venv if needed, then train ft's tiny vision-language model on the colour
# pictures the repo ships and report its held-out accuracy before and after.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ft plan examples/yaml/quickstart-vision.yaml
ft train examples/yaml/quickstart-vision.yaml --overwrite
