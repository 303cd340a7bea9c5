#!/usr/bin/env bash
# Entrypoint of the CUDA images (docker/README.md, "What the entrypoint does"). Before it hands over to ft:
# 1. It points TORCH_EXTENSIONS_DIR, where DeepSpeed keeps the CPU kernels it compiles on first use (CPU Adam), at a
#    folder of the cache named after this image's Python/torch/DeepSpeed and this machine's CPU. DeepSpeed compiles
#    them for the CPU it runs on, so nodes of different CPUs that share /cache never load each other's build (a kernel
#    built for AVX-512 dies of an illegal instruction on an AVX2 node). A TORCH_EXTENSIONS_DIR you set is kept.
# 2. It stops, with the reason and the fix, when nvidia-smi lists GPUs that torch cannot use (a driver too old for
#    the image's CUDA), rather than let ft plan for the CPU. FT_ALLOW_CPU_WITH_GPUS=1 goes on regardless.
# 3. It execs ft with the container's arguments, so that ft receives docker stop's SIGTERM itself.
set -euo pipefail

# The CPU that a native build targets, hashed: vendor, family, model and feature flags of the first CPU
# (on Arm: implementer, architecture, variant, part and features). Without /proc/cpuinfo: this host alone.
cpu_key() {
  local fields
  fields="$(awk '/^$/ { exit }
    /^(vendor_id|cpu family|model|flags|CPU implementer|CPU architecture|CPU variant|CPU part|Features)[[:space:]]*:/' \
    /proc/cpuinfo 2>/dev/null || true)"
  printf '%s-%s' "$(uname -m)" "$(printf '%s' "${fields:-host ${HOSTNAME:-unknown}}" | sha256sum | cut -c1-16)"
}

if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
  # The builder stage writes this image's Python, torch and DeepSpeed versions there (docker/Dockerfile).
  build="$(cat /opt/venv/ft-build-key 2>/dev/null || echo unknown-build)"
  TORCH_EXTENSIONS_DIR="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/torch_extensions/${build}/$(cpu_key)"
  export TORCH_EXTENSIONS_DIR
fi

python -m finetune.gpucheck
exec ft "$@"
