#!/usr/bin/env bash
# The CPU image's install steps (docker/Dockerfile.cpu, builder stage) in a fresh virtualenv, without Docker:
# torch first, then docker/requirements.txt under docker/constraints.txt, then a wheel of this repository
# without dependencies; then `pip check`, `ft --version` and `ft validate` on an example.
# torch comes from the default index (the Dockerfile takes it from PyTorch's CPU wheel index); set
# FT_TORCH_INDEX_URL to use that one. PYTHON picks the interpreter (default python3).
# Usage: bash docker/check-cpu-install.sh [--keep]   (--keep leaves the virtualenv and prints its path)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
keep=0
[ "${1:-}" = "--keep" ] && keep=1

torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu | head -n 1)
work=$(mktemp -d "${TMPDIR:-/tmp}/ft-cpu-install.XXXXXX")
cleanup() { if [ "$keep" = 1 ]; then echo "kept: $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
start=$SECONDS
step() { printf '[%4ds] %s\n' "$((SECONDS - start))" "$*"; }

step "fresh virtualenv ($("$PY" --version 2>&1)), torch==$torch_version"
"$PY" -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
echo "torch==$torch_version" > "$work/torch.txt"
index=()
[ -n "${FT_TORCH_INDEX_URL:-}" ] && index=(--index-url "$FT_TORCH_INDEX_URL")
pip install --quiet -c docker/constraints.txt pip
pip install --quiet --no-deps "${index[@]}" -c "$work/torch.txt" torch

step "docker/requirements.txt with docker/constraints.txt"
pip install --quiet -r docker/requirements.txt -c docker/constraints.txt -c "$work/torch.txt"

step "ft from a wheel of this repository"
pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$work/wheels" .
pip install --quiet --no-deps "$work"/wheels/finetune-*.whl
pip check

step "pins: every installed distribution is the version constraints.txt names"
python - docker/constraints.txt "$torch_version" <<'EOF'
import sys
from importlib.metadata import distributions
from packaging.utils import canonicalize_name
from packaging.version import Version

pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        pins[canonicalize_name(name)] = version
pins["torch"] = sys.argv[2]
bad = []
for d in distributions():
    name = canonicalize_name(d.metadata["Name"])
    if name == "finetune":
        continue
    if name not in pins:
        bad.append(f"{name} {d.version} is not pinned")
    elif Version(d.version).public != Version(pins[name]).public:
        bad.append(f"{name} {d.version} != {pins[name]}")
if bad:
    sys.exit("\n".join(bad))
print(f"{sum(1 for _ in distributions())} distributions, all as pinned")
EOF

step "ft --version; ft validate"
cd "$work"
ft --version
cp -r "$OLDPWD/examples" "$work/examples"
ft validate examples/yaml/quickstart.yaml
ft plan examples/yaml/quickstart.yaml --hardware cpu > /dev/null
python -c "import torch, transformers, peft, datasets, accelerate, bitsandbytes, matplotlib, tensorboard, wandb, mlflow; print('imports ok: torch', torch.__version__, 'transformers', transformers.__version__)"
step "done"
