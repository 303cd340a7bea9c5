#!/usr/bin/env bash
# Create .venv (once) and install ft with its test dependencies into it.
# torch is installed first, pinned, so that pip does not pull a multi-GB build it does not need;
# on a GPU machine install the torch build for your CUDA first and this script keeps it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==${FT_TORCH_VERSION:-2.13.0}"
fi
DS_BUILD_OPS=${DS_BUILD_OPS:-0} python -m pip install --quiet -e ".[test]"  # DeepSpeed compiles the ops it uses on first use
python -c "import torch, transformers, peft; print(f'ft environment ready: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
