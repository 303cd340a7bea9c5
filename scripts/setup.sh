#!/usr/bin/env bash
# Create .venv (once) and install ft with its test dependencies into it.
# torch is installed first, pinned, so that pip does not pull a multi-GB build it does not need;
# on a GPU machine install the torch build for your CUDA first and this script keeps it.
# Nothing is installed again while pyproject.toml and this script are unchanged since the last successful install
# (their hash is kept in .venv/.ft-installed); FT_REINSTALL=1 installs anyway.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.ft-installed
# Compiled torch extensions (DeepSpeed's CPU op) live in this environment: torch's default folder (~/.cache) is shared
# by every environment and checkout on the machine, and one built against another environment's paths is rebuilt
EXTENSIONS=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch-extensions}
digest() { if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi; }
wanted=$(cat pyproject.toml scripts/setup.sh | digest | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] && [ "${FT_REINSTALL:-0}" != 1 ]; then
  echo "ft environment up to date (.venv; pyproject.toml unchanged since the last install; FT_REINSTALL=1 reinstalls)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
rm -f "$STAMP"
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==${FT_TORCH_VERSION:-2.13.0}"
fi
# llama-cpp-python (ft export --gguf, in [test]) is a source package: pip builds llama.cpp with cmake once, on every core,
# and caches the wheel (later installs take seconds; pip reuses a cached wheel whatever CMAKE_ARGS say: `pip cache remove
# llama_cpp_python` before building with other flags). ~6.5 CPU-minutes without the multimodal library, which ft never
# loads (LLAVA_BUILD=OFF). The CPU code is built for AVX2/FMA/F16C, not -march=native: on CPUs with AMX, a native build
# repacks quantized matrices for llama.cpp's AMX kernels, which crashed on small q8_0 models here (docs/export.md).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}
if [ "$(uname -m)" = x86_64 ]; then
  export CMAKE_ARGS=${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON}
else
  export CMAKE_ARGS=${CMAKE_ARGS:--DLLAVA_BUILD=OFF}
fi
DS_BUILD_OPS=${DS_BUILD_OPS:-0} python -m pip install --quiet -e ".[test]"  # DeepSpeed compiles the ops it uses on first use
# Without a GPU, DeepSpeed's CPU accelerator compiles its shared-memory collective op when a job first starts its
# backend (~35 CPU-s, cached in $EXTENSIONS; scripts/test.sh points TORCH_EXTENSIONS_DIR there): compiled once here
# rather than inside whichever DeepSpeed job or test comes first. A failure here only leaves it to that first job.
TORCH_EXTENSIONS_DIR=$EXTENSIONS DS_ACCELERATOR=cpu python - <<'PY' ||
import importlib.util, torch
if importlib.util.find_spec("deepspeed") and not torch.cuda.is_available():
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)
PY
  echo "note: DeepSpeed's CPU op was not compiled now; the first DeepSpeed job compiles it"
python -c "import finetune, torch, transformers, peft; print(f'ft environment ready: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
echo "$wanted" > "$STAMP"
