#!/usr/bin/env bash
# ft's GPU checks in one prepared run (about 4 minutes on one H200; every section has a timeout, 8 minutes at most).
#
#   bash scripts/gpu-check.sh                  every section, then a summary; exit 1 if any section failed
#   bash scripts/gpu-check.sh pytest memory    only these (setup always runs): setup pytest memory bench
#   bash scripts/gpu-check.sh --fetch-wheels   on a machine with PyPI: download into .whl/ the Python 3.12 wheels that a
#                                              GPU machine without network lacks; carry .whl/ along (installed from there)
# Sections:
#   setup   the Python to use: .venv if it has torch; else python3 if its torch sees CUDA (used as it is, plus the
#           wheels in .whl/ if any, installed into $WORK/site); else scripts/setup.sh into a .venv that sees python3's
#           packages (needs network). Prints torch, CUDA, the GPUs, bitsandbytes, deepspeed, flash-attn, ...
#   pytest  pytest -m gpu over every test file with gpu marks (tests/test_gpu.py: one GPU; tests/test_gpu_multi.py:
#           two GPUs, skipped with one), 4 workers, a timeout per test; $OUT/pytest-gpu.xml (junit) and .log
#   memory  a ~1B Llama built offline, LoRA under FSDP2 full_shard on the visible GPUs: memory per rank after loading
#           and after each step next to the plan's per-device estimate (bench/gpu_bench.py memory); $OUT/memory.json
#   bench   tokens/s, MFU and peak memory of the same model, LoRA and full fine-tuning, bf16, 20 steps
#           (bench/gpu_bench.py throughput); $OUT/bench.json
# Environment: OUT (default gpu-check-out), FT_GPU_CHECK_WORK (default /tmp/ft-gpu-check: the model, runs; removed at
# the end unless FT_GPU_CHECK_KEEP=1), FT_GPU_CHECK_BUDGET (seconds for the whole script, default 460),
# FT_GPU_CHECK_BENCH_ARGS (more options for both bench/gpu_bench.py commands), FT_GPU_CHECK_PYTHON (the Python to use),
# FT_WHEEL_DIR (default .whl).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$PWD
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# What ft needs beyond the packages of a typical CUDA PyTorch image (torch, transformers, peft, accelerate, safetensors,
# tokenizers, typer, rich, pyyaml, matplotlib, filelock, pyarrow, pandas, fsspec, huggingface-hub, pytest, xdist, timeout).
WHL=${FT_WHEEL_DIR:-.whl}
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess bitsandbytes hjson)

fetch_wheels() {
  local py=${PYTHON:-python3} specs=() p v
  [ -x .venv/bin/python ] && py=.venv/bin/python
  for p in "${WHEELS[@]}"; do  # the versions this checkout's tests ran with, where .venv has them
    v=$("$py" -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null) && specs+=("$p==$v") || specs+=("$p")
  done
  mkdir -p "$WHL"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${FT_WHEEL_PYTHON:-3.12}" --implementation cp \
    "${PLATFORMS[@]}" -d "$WHL" "${specs[@]}" || return 1
  v=$("$py" -c "import importlib.metadata as m; print(m.version('deepspeed'))" 2>/dev/null) || v=0.19.8
  # DeepSpeed is published as source only: built here into a pure-Python wheel (its ops compile on first use).
  DS_BUILD_OPS=0 "$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHL" "deepspeed==$v" || return 1
  du -sh "$WHL" && ls "$WHL"
  echo "Keep .whl out of git (echo /.whl/ >> .git/info/exclude) and carry it to the GPU machine with the checkout."
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  fetch_wheels
  exit
fi

SECTIONS=${*:-pytest memory bench}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${FT_GPU_CHECK_WORK:-/tmp/ft-gpu-check}
BUDGET=${FT_GPU_CHECK_BUDGET:-460}
mkdir -p "$WORK"
rm -f "$OUT"/gpu-check.log "$OUT"/pytest-gpu.log "$OUT"/pytest-gpu.xml "$OUT"/memory.json "$OUT"/bench.json "$OUT"/summary.txt
exec > >(tee "$OUT/gpu-check.log") 2>&1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # ft importable without an install
export OUT WORK REPO
NAMES=()
RESULTS=()
FAILED=0

now() { echo $((SECONDS)); }
record() {  # record NAME RESULT
  NAMES+=("$1")
  RESULTS+=("$2")
  case $2 in FAIL*) FAILED=1 ;; esac
}
# section NAME CAP RESERVE CMD...: run CMD under a timeout of CAP seconds, less if the budget (minus RESERVE seconds
# kept for the sections after it) is shorter. The timeout ends the command's whole process group (torchrun, ranks).
section() {
  local name=$1 cap=$2 reserve=$3 limit rc t0 result
  shift 3
  limit=$((BUDGET - $(now) - reserve))
  ((limit > cap)) && limit=$cap
  if ((limit < 30)); then
    record "$name" "FAIL (not run: no time left in the ${BUDGET} s budget)"
    return
  fi
  echo
  echo "=== $name (timeout ${limit} s, $(now) s into the check) ==="
  t0=$(now)
  timeout -k 5 "$limit" "$@"
  rc=$?
  case $rc in
    0) result=PASS ;;
    124 | 137) result="FAIL (timed out after ${limit} s)" ;;
    *) result="FAIL (exit $rc)" ;;
  esac
  record "$name" "$result  $(($(now) - t0)) s"
}

# ------------------------------------------------------------------ setup
python_sees() {  # python_sees PYTHON CODE: true when the code runs without error
  "$1" -c "$2" >/dev/null 2>&1
}
venv_seeing() {  # venv_seeing PYTHON: create .venv whose packages include PYTHON's (a venv made from a venv sees only the base's)
  local py=$1 site
  if python_sees "$py" 'import sys; assert sys.prefix == sys.base_prefix'; then
    "$py" -m venv --system-site-packages .venv
  else
    "$py" -m venv .venv || return 1
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$py" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/ft-parent-site.pth"
  fi
}
setup() {
  local t0 sys_py need='import torch, transformers, peft, pydantic, datasets, finetune.config, finetune.data.preprocess'
  t0=$(now)
  echo "=== setup ==="
  sys_py=${FT_GPU_CHECK_PYTHON:-$(command -v python3 || true)}
  if [ -n "${FT_GPU_CHECK_PYTHON:-}" ]; then
    PY=$FT_GPU_CHECK_PYTHON
    echo "python: $PY (FT_GPU_CHECK_PYTHON)"
  elif [ -x .venv/bin/python ] && python_sees .venv/bin/python 'import torch'; then
    PY=$REPO/.venv/bin/python
    echo "python: $PY (the checkout's .venv)"
  elif [ -n "$sys_py" ] && python_sees "$sys_py" 'import torch; assert torch.cuda.is_available()'; then
    PY=$sys_py
    echo "python: $PY (its CUDA torch, used as it is)"
  else
    echo "python3 has no CUDA torch: scripts/setup.sh (installs torch ${FT_TORCH_VERSION:-2.13.0} unless one is there; needs PyPI)"
    timeout -k 5 "${FT_GPU_CHECK_SETUP_TIMEOUT:-150}" bash scripts/setup.sh
    PY=$REPO/.venv/bin/python
  fi
  if ! python_sees "$PY" "$need" && compgen -G "$WHL/*.whl" >/dev/null; then
    echo "installing the carried wheels ($WHL) into $WORK/site"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHL"/*.whl \
      && export PYTHONPATH="$WORK/site:$PYTHONPATH"
  fi
  if ! python_sees "$PY" "$need" && [ "$PY" = "$sys_py" ]; then  # ft's own setup, in a .venv that keeps python3's CUDA torch
    echo "python3 lacks some of ft's packages: scripts/setup.sh into a .venv that sees python3's packages (needs PyPI)"
    [ -x .venv/bin/python ] || venv_seeing "$PY"
    PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=1 timeout -k 5 "${FT_GPU_CHECK_SETUP_TIMEOUT:-150}" bash scripts/setup.sh \
      && PY=$REPO/.venv/bin/python
  fi
  export PY
  if "$PY" - <<'EOF'; then
import importlib, importlib.metadata as md, shutil, subprocess, sys
print(f"python {sys.version.split()[0]} at {sys.executable}")
cuda, CUDA_HOME = False, None
try:
    import torch
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {cuda}, GPUs: {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
    if cuda:
        print(f"  NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, bf16 supported: {torch.cuda.is_bf16_supported()}")
    from torch.utils.cpp_extension import CUDA_HOME
except Exception as e:
    print(f"torch: {type(e).__name__}: {e}")
try:
    print("driver", subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split()[0])
except Exception as e:
    print(f"nvidia-smi: {type(e).__name__}")
versions = []
for name in ("transformers", "peft", "accelerate", "datasets", "pydantic", "tokenizers", "safetensors", "bitsandbytes", "deepspeed", "flash-attn", "trl",
             "pytest", "pytest-xdist", "pytest-timeout"):
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} -")
print(", ".join(versions))
print(f"build tools (DeepSpeed's CPU Adam compiles on first use): CUDA_HOME {CUDA_HOME}, nvcc {shutil.which('nvcc')}, ninja {shutil.which('ninja')}, c++ {shutil.which('c++')}")
missing = []
for module in ("transformers", "peft", "pydantic", "datasets", "finetune.config", "finetune.data.preprocess"):
    try:
        importlib.import_module(module)
    except Exception as e:
        missing.append(f"{module} ({type(e).__name__}: {e})")
for m in missing:
    print(f"cannot import {m}")
if not cuda:
    print("torch sees no CUDA GPU")
sys.exit(0 if cuda and not missing else 1)
EOF
    record setup "PASS  $(($(now) - t0)) s"
  else
    echo "ft cannot run here: a CUDA torch and ft's packages are needed (no network: on a machine with PyPI run"
    echo "'bash scripts/gpu-check.sh --fetch-wheels' and carry .whl/ along)"
    record setup "FAIL  $(($(now) - t0)) s"
  fi
}

# ------------------------------------------------------------------ the sections
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_pytest() {
  local files args=(-m gpu -v -ra -p no:cacheprovider --durations=0 --durations-min=2 --junitxml="$OUT/pytest-gpu.xml")
  mapfile -t files < <(grep -l -E 'mark\.gpu' tests/test_*.py)
  python_sees "$PY" 'import xdist' && args+=(-n "${FT_GPU_CHECK_WORKERS:-4}")
  python_sees "$PY" 'import pytest_timeout' && args+=(--timeout "${FT_GPU_CHECK_TEST_TIMEOUT:-200}")
  echo "$PY -m pytest ${args[*]} ${files[*]}"
  # a run where every test was skipped (no GPU seen) or none passed is a failure here
  "$PY" -m pytest "${args[@]}" "${files[@]}" 2>&1 | tee "$OUT/pytest-gpu.log"
  local rc=${PIPESTATUS[0]}
  junit | tail -1
  ((rc == 0)) && junit | grep -q '^ok'
}
junit() {  # the junit file's counts, then "ok" when nothing failed and something passed
  "$PY" - "$OUT/pytest-gpu.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print("no junit file (pytest did not finish)"); sys.exit()
bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = [c for c in cases if c.find("skipped") is not None]
passed = len(cases) - len(bad) - len(skipped)
for c in bad:
    print(f"  failed: {c.get('classname')}::{c.get('name')}")
print(f"{passed} passed, {len(bad)} failed or errors, {len(skipped)} skipped")
print("ok" if passed and not bad else "not ok")
EOF
}
export -f junit run_pytest python_sees

START=$(now)
setup
export PY
read -ra EXTRA <<<"${FT_GPU_CHECK_BENCH_ARGS:-}"  # e.g. "--size small --hardware cpu --seq-len 128 --micro 2 --steps 3": a CPU dry run
for s in $SECTIONS; do
  case $s in
    setup) ;;
    pytest) section pytest 220 130 bash -c run_pytest ;;
    memory) section memory 100 110 "$PY" bench/gpu_bench.py memory --model "$WORK/llama-1b" --work "$WORK/memory" --json "$OUT/memory.json" "${EXTRA[@]}" ;;
    bench) section bench 120 5 "$PY" bench/gpu_bench.py throughput --model "$WORK/llama-1b" --work "$WORK/bench" --json "$OUT/bench.json" "${EXTRA[@]}" ;;
    *) record "$s" "FAIL (no such section: setup, pytest, memory, bench)" ;;
  esac
done

# ------------------------------------------------------------------ summary
{
  echo
  echo "================ ft GPU check: summary ($(($(now) - START)) s) ================"
  "$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))' 2>/dev/null
  for i in "${!NAMES[@]}"; do
    printf '%-8s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
    [ "${NAMES[$i]}" = pytest ] && junit | grep -v '^ok$\|^not ok$' | sed 's/^/         /'
  done
  echo
  figures=()
  [[ " $SECTIONS " == *" memory "* ]] && figures+=(--memory "$OUT/memory.json")
  [[ " $SECTIONS " == *" bench "* ]] && figures+=(--throughput "$OUT/bench.json")
  ((${#figures[@]})) && "$PY" bench/gpu_bench.py summary "${figures[@]}" 2>/dev/null
  echo
  echo "logs and figures: $OUT (gpu-check.log, pytest-gpu.log/.xml, memory.json, bench.json)"
  [ "$FAILED" = 0 ] && echo "ALL PASSED" || echo "SOME SECTIONS FAILED"
} | tee "$OUT/summary.txt"
[ "${FT_GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK"
exit "$FAILED"
