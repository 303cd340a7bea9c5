#!/usr/bin/env bash
# ft's GPU checks in one prepared run: the first hour on a GPU machine (issue 31), sized to fit in 10 minutes on one
# H200: every section has a timeout (its cap, CAP below), the default sections' caps sum to the budget (560 s).
#
#   bash scripts/gpu-check.sh                  the default sections, then a summary; exit 1 if any section failed:
#                                              first-contact vllm memory savers loss bf16pure pytest
#   bash scripts/gpu-check.sh pytest memory    only these (setup always runs): first-contact vllm memory savers loss
#                                              bf16pure pytest bench scaling rollout
#   bash scripts/gpu-check.sh --fetch-wheels   on a machine with PyPI: download into .whl/ the Python 3.12 wheels that a
#                                              GPU machine without network lacks; carry .whl/ along (installed from there)
# Every check prints one line, `check NAME: PASS|FAIL|SKIP <figure>` ($OUT/checks.txt; the summary repeats them).
# Sections:
#   setup   the Python to use: .venv if it has torch; else python3 if its torch sees CUDA (used as it is, plus the
#           wheels in .whl/ if any, installed into $WORK/site); else scripts/setup.sh into a .venv that sees python3's
#           packages (needs network). Prints torch, CUDA, the GPUs, bitsandbytes, deepspeed, flash-attn, ...
#   first-contact  what issue 31 found on first contact with GPUs, each check a GPU-marked test (or command) under its
#           own timeout (bench/gpu_first_contact.py check): host loading keeps torch.cuda.memory_allocated() ~0 while
#           loading (host-loading); DDP's buckets are the gradients (ddp-buckets); the final full model is written in
#           bf16 (save-dtype) (FSDP2's root unit, item 12, has no GPU test yet: its 2-rank test is in pytest -m slow);
#           the varlen kernel is taken under autocast with no host reads (varlen-autocast); offloaded activations pin
#           what the plan counts, torch.cuda.host_memory_stats() (pinned-host); the chunked loss under FSDP2 and ZeRO-3
#           with DeepSpeed's trace invalidations counted (chunked-loss); compile under FSDP2 LoRA with TORCH_LOGS=
#           recompiles, failing above a few "Recompiling function" lines (compile-fsdp2). The tests it ran are left
#           out of the pytest section.
#   vllm    vLLM alone on the GPU (in the Python that FT_GPU_CHECK_VLLM_PYTHON names, else .venv-vllm, else $PY; every
#           check SKIPs where none has vLLM): a colocated engine's sleep frees its memory and wakes with new weights
#           (tests/test_gpu_rollout.py -k sleeping_colocated), the trainer API versions
#           (tests/test_weight_transfer_versions.py), sleep levels' freed and host GiB (bench/vllm_sleep_bench.py
#           --size 1b); $OUT/vllm-sleep.jsonl
#   pytest  pytest -m gpu over every other test file with gpu marks (tests/test_gpu.py: one GPU; tests/test_gpu_multi.py:
#           two GPUs, skipped with one; not tests/test_gpu_rollout.py, the vllm section's), less the tests first-contact
#           ran, 4 workers, a timeout per test; $OUT/pytest-gpu.xml (junit) and .log
#   memory  a ~1B Llama built offline, LoRA under FSDP2 full_shard on the visible GPUs: memory per rank after loading
#           and after each step next to the plan's per-device estimate (bench/gpu_bench.py memory); summary line per
#           rank: max_memory_allocated vs the estimate and their ratio; $OUT/memory.json
#   bench   tokens/s, MFU and peak memory of the same model, LoRA and full fine-tuning, bf16, 20 steps
#           (bench/gpu_bench.py throughput); $OUT/bench.json
#   scaling the same model's full fine-tuning, bf16, 8 x 1024 packed tokens per GPU and step, on one GPU and then on all
#           the visible GPUs with the plan's backend: measured scaling efficiency (tokens/s on N / (N x tokens/s on
#           one)) next to the plan's predicted scaling.efficiency, compute and communication seconds per step
#           (bench/gpu_bench.py scaling); skipped (passes) with fewer than two GPUs; $OUT/scaling.json
#   savers  activation offload on vs off in ft's loop (full fine-tuning of a ~170M Llama, bf16, 4 x 2048 tokens):
#           max_memory_allocated and step time; fails unless offload lowers the peak and gives plain's losses and
#           gradient norms (bench/memory_savers_bench.py); summary line per saver: max_memory_allocated (and the
#           estimate with the ratio where savers.json has one); $OUT/savers.json
#   bf16pure full fine-tuning of the ~1B model, mixed bf16 then bf16-pure, 20 steps each: max_memory_allocated and
#           losses; fails unless bf16-pure saves >= 6 bytes per trained parameter and its loss is within 2%;
#           $OUT/bf16-pure.jsonl
#   loss    the loss implementations (finetune/methods/head.py) on a Llama with a 128k vocabulary (hidden 2048, 4 layers,
#           bf16, 2 x 4096 tokens): plain, chunked, and liger / cut_cross_entropy where installed; max_memory_allocated
#           over the loss and its backward, time, and the loss, gradients and log-probs against plain's; fails unless
#           they agree and every other implementation peaks below 0.6 x plain's; $OUT/loss.json
#   rollout GRPO's vLLM rollout engine on GPUs, all of tests/test_gpu_rollout.py (not in the default list: it needs
#           vLLM, in the Python that FT_GPU_CHECK_VLLM_PYTHON names, else $PY; two GPUs for its NCCL test): a colocated engine's sleep mode frees its memory
#           and wakes with new weights; full weights reach a rollout server over NCCL (two GPUs); placement: ray on a
#           one-node Ray cluster gives the rank and the server GPUs of their own (two GPUs, Ray installed); $OUT/rollout.log
# Environment: OUT (default gpu-check-out), FT_GPU_CHECK_WORK (default /tmp/ft-gpu-check: the model, runs; removed at
# the end unless FT_GPU_CHECK_KEEP=1), FT_GPU_CHECK_BUDGET (seconds for the
# sections, default 560),
# FT_GPU_CHECK_BENCH_ARGS (more options for the bench/gpu_bench.py commands: memory, bench, scaling),
# FT_GPU_CHECK_PYTHON (the Python to use),
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

DEFAULT_SECTIONS="first-contact vllm memory savers loss bf16pure pytest"
# Each section's cap (its timeout, seconds): the default sections' caps sum to at most the default budget.
declare -A CAP=([first-contact]=170 [vllm]=100 [memory]=50 [savers]=40 [loss]=40 [bf16pure]=70 [pytest]=90
                [bench]=120 [scaling]=120 [rollout]=180)
SECTIONS=${*:-$DEFAULT_SECTIONS}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${FT_GPU_CHECK_WORK:-/tmp/ft-gpu-check}
BUDGET=${FT_GPU_CHECK_BUDGET:-560}
mkdir -p "$WORK"
rm -f "$OUT"/gpu-check.log "$OUT"/pytest-gpu.log "$OUT"/pytest-gpu.xml "$OUT"/memory.json "$OUT"/bench.json "$OUT"/summary.txt
rm -f "$OUT"/savers.json "$OUT"/bf16-pure.jsonl "$OUT"/loss.json "$OUT"/rollout.log "$OUT"/scaling.json "$OUT"/checks.txt
rm -f "$OUT"/vllm-sleep.jsonl "$WORK"/first-contact.ids
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
  mapfile -t files < <(grep -l -E 'mark\.gpu' tests/test_*.py | grep -v test_gpu_rollout.py)
  [ -s "$WORK/first-contact.ids" ] && while read -r id; do args+=(--deselect "$id"); done <"$WORK/first-contact.ids"
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
# bf16pure: full fine-tuning of the ~1B model in one process (ft's own setup and train_step), mixed bf16 (fp32 master
# weights) and then bf16-pure (stochastic rounding), each in a fresh process: torch.cuda.max_memory_allocated over the
# steps and the losses. Fails unless bf16-pure saves at least 6 bytes per trained parameter (expected ~10: fp32
# weights, gradients and moments and autocast's bf16 weight copies, against bf16 weights, gradients and moments), both
# losses fall, and the last losses agree to 2%. FT_BF16_PURE_SIZE=small FT_BF16_PURE_STEPS=3: a CPU dry run.
BF16_PURE_PY=$(cat <<'EOF'
import json, os, sys
from pathlib import Path

work, out = Path(os.environ["WORK"]) / "bf16-pure", Path(os.environ["OUT"]) / "bf16-pure.jsonl"
steps = int(os.environ.get("FT_BF16_PURE_STEPS", "20"))
if sys.argv[1] == "run":
    import torch

    sys.path.insert(0, os.path.join(os.environ["REPO"], "bench"))
    from gpu_bench import build, job_yaml, write_data
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import probe
    from finetune.plan import plan
    from finetune.train import setup, train_step
    from finetune.workflow import model_facts

    precision, size = sys.argv[2], os.environ.get("FT_BF16_PURE_SIZE", "1b")
    model = Path(os.environ["WORK"]) / f"llama-{size}"
    build(model, size)
    data = write_data(work / "data.jsonl", records=400)
    text = job_yaml(model, data, work / precision, work / "cache", adapter="full", precision=precision, seq_len=512,
                    micro=4, batch=4, steps=steps, distributed="{backend: single}")
    (work / f"{precision}.yaml").write_text(text.replace("lr: 1.0e-5", "lr: 1.0e-4"))
    config = load(work / f"{precision}.yaml")
    p = plan(config, probe(), model_facts(config.model))
    assert p.adapter == "full" and p.pure_bf16 == (precision == "bf16-pure"), (p.adapter, p.pure_bf16)
    job = setup(config, p, prepare(config))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = [train_step(job)["loss"] for _ in range(steps)]
    row = {"precision": precision, "trained_params": p.estimate.trainable_params,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "plan_allocated_gib": p.estimate.allocated_bytes / 2**30, "first_loss": losses[0], "last_loss": losses[-1],
           "weights": sorted({str(q.dtype) for q in job.model.parameters()})}
    print(json.dumps(row))
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
else:
    rows = {r["precision"]: r for r in map(json.loads, out.read_text().splitlines())}
    mixed, pure = rows["bf16"], rows["bf16-pure"]
    ok = pure["weights"] == ["torch.bfloat16"] and mixed["weights"] == ["torch.float32"]
    ok &= all(r["last_loss"] < r["first_loss"] for r in (mixed, pure))
    ok &= abs(pure["last_loss"] - mixed["last_loss"]) <= 0.02 * mixed["last_loss"]
    for r in (mixed, pure):
        print(f"{r['precision']:>9}: peak allocated {r['peak_allocated_gib']} GiB (plan {r['plan_allocated_gib']:.2f}), "
              f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} after {steps} steps")
    if mixed["peak_allocated_gib"] is not None:
        saved = (mixed["peak_allocated_gib"] - pure["peak_allocated_gib"]) * 2**30 / pure["trained_params"]
        print(f"bf16-pure saves {saved:.1f} bytes per trained parameter (expected ~10, at least 6)")
        ok &= saved >= 6
    print("ok" if ok else "not ok")
    sys.exit(0 if ok else 1)
EOF
)
# first-contact: check NAME TIMEOUT FIGURE CMD...: one line `check NAME: PASS|FAIL|SKIP <figure>`
check() {
  local name=$1 t=$2 fig=$3
  shift 3
  "$PY" bench/gpu_first_contact.py check "$name" "$t" --figure "$fig" --ids "$WORK/first-contact.ids" -- "$@"
}
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_first_contact() {
  local fc=tests/test_gpu_first_contact.py g=(-m pytest -m gpu -v -s -ra -p no:cacheprovider) rc=0
  check host-loading 20 "host loading" "$PY" "${g[@]}" $fc -k host_loading_leaves_the_gpu_empty || rc=1
  check ddp-buckets 25 "DDP on a GPU" "$PY" "${g[@]}" $fc -k ddp_on_a_gpu || rc=1
  check save-dtype 25 "" "$PY" "${g[@]}" $fc -k gpu_full_fine_tune_in_mixed_bf16 || rc=1
  check varlen-autocast 15 "varlen kernel calls" "$PY" "${g[@]}" tests/test_attention.py -k autocast || rc=1
  check pinned-host 15 "" "$PY" "${g[@]}" tests/test_activation_savers.py -k offloaded_activations_pin || rc=1
  check chunked-loss 40 "" "$PY" "${g[@]}" tests/test_gpu.py -k chunked_loss || rc=1
  check compile-fsdp2 40 "recompiles" "$PY" bench/gpu_first_contact.py compile --timeout 38 || rc=1
  return $rc
}
# vllm: alone on the GPU; every check SKIPs where no Python has vLLM
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_vllm() {
  local py=${FT_GPU_CHECK_VLLM_PYTHON:-} c rc=0
  for c in "$REPO/.venv-vllm/bin/python" "$PY"; do
    [ -z "$py" ] && python_sees "$c" 'import vllm' && py=$c
  done
  if [ -z "$py" ] || ! python_sees "$py" 'import vllm'; then
    for c in vllm-sleep vllm-versions vllm-sleep-bench; do
      echo "check $c: SKIP no vLLM (set FT_GPU_CHECK_VLLM_PYTHON)" | tee -a "$OUT/checks.txt"
    done
    return 0
  fi
  check vllm-sleep 45 "" "$py" -m pytest -m gpu -v -s -ra -p no:cacheprovider tests/test_gpu_rollout.py -k sleeping_colocated || rc=1
  check vllm-versions 10 "" "$py" -m pytest -v -ra -p no:cacheprovider tests/test_weight_transfer_versions.py || rc=1
  check vllm-sleep-bench 40 "freed_gib" "$py" bench/vllm_sleep_bench.py --size 1b --out "$OUT/vllm-sleep.jsonl" || rc=1
  return $rc
}
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_rollout() {
  local py=${FT_GPU_CHECK_VLLM_PYTHON:-$PY}
  if ! python_sees "$py" 'import vllm'; then
    echo "no vLLM in $py: install it (pip install vllm) or set FT_GPU_CHECK_VLLM_PYTHON to a Python that has it"
    return 1
  fi
  "$py" -m pytest -m gpu -v -ra -p no:cacheprovider tests/test_gpu_rollout.py 2>&1 | tee "$OUT/rollout.log"
  local rc=${PIPESTATUS[0]}
  ((rc == 0)) && grep -q ' passed' "$OUT/rollout.log"
}
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_bf16_pure() {
  rm -f "$OUT/bf16-pure.jsonl"
  "$PY" -c "$BF16_PURE_PY" run bf16 && "$PY" -c "$BF16_PURE_PY" run bf16-pure && "$PY" -c "$BF16_PURE_PY" compare
}
# loss: plain against chunked and the fused kernels installed, on one GPU (FT_LOSS_CHECK_SIZE=small: a CPU dry run).
LOSS_PY=$(cat <<'EOF'
import importlib.util, json, os, time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.methods.head import PACKAGES, LossHead

cuda = torch.cuda.is_available()
small = os.environ.get("FT_LOSS_CHECK_SIZE") == "small"
V, H, I, L, B, T, CHUNK = (8000, 64, 128, 1, 2, 256, 64) if small else (128256, 2048, 5632, 4, 2, 4096, 1024)
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=16,
                     num_key_value_heads=8, max_position_embeddings=T, tie_word_embeddings=False)
with torch.device(device):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.randint(0, V, (B, T), device=device)
labels = ids.clone()
labels[:, : T // 4] = -100  # prompts: untrained
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
trained = int((labels[:, 1:] != -100).sum())
names = ["plain", "chunked"] + [n for n, (module, _) in PACKAGES.items() if cuda and importlib.util.find_spec(module)]
print(f"Llama vocab {V}, hidden {H}, {L} layers, bf16, {B} x {T} tokens ({trained} trained), {device}; "
      f"chunked: {CHUNK} tokens a chunk; fused kernels installed: {names[2:] or 'none'}")
rows, ref = {}, None
for name in names:
    head = LossHead(name, CHUNK if name == "chunked" else 0)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    loss = head.summed_nll(model, batch) / trained
    loss.backward()
    value = loss.item()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    checked = (model.lm_head.weight, model.model.layers[-1].mlp.down_proj.weight, model.model.embed_tokens.weight)
    grads = torch.cat([p.grad.float().flatten() for p in checked])
    logps = None
    if name != "liger":  # liger serves the summed loss (sft) only
        with torch.no_grad():
            logps = head.token_logps(model, batch)[0]
    if ref is None:
        ref = (value, grads, logps)
    row = {"loss": value, "peak_gib": peak, "seconds": round(seconds, 3), "loss_rel_diff": abs(value - ref[0]) / abs(ref[0]),
           "grad_rel_diff": float((grads - ref[1]).norm() / ref[1].norm()),
           "logp_max_abs_diff": float((logps - ref[2]).abs().max()) if logps is not None else None}
    rows[name] = row
    print(f"{name:>17}: loss {row['loss']:.5f} (rel diff {row['loss_rel_diff']:.1e}), gradient rel diff "
          f"{row['grad_rel_diff']:.1e}, log-prob max diff {row['logp_max_abs_diff']}, peak above the model "
          f"{'-' if peak is None else f'{peak:.2f} GiB'}, {seconds:.2f} s")
    del loss, grads, logps
predicted = B * (T - 1) * V * (2 + 8) / 2**30
print(f"the plain logits' t·V·(a+8): {predicted:.2f} GiB")
ok = all(r["loss_rel_diff"] < 2e-3 and r["grad_rel_diff"] < 3e-2 for r in rows.values())
ok &= all(r["logp_max_abs_diff"] is None or r["logp_max_abs_diff"] < 5e-2 for r in rows.values())
if cuda:
    ok &= all(r["peak_gib"] < 0.6 * rows["plain"]["peak_gib"] for n, r in rows.items() if n != "plain")
    ok &= rows["plain"]["peak_gib"] > 0.7 * predicted
Path(os.environ.get("OUT", "."), "loss.json").write_text(json.dumps({"predicted_plain_logits_gib": predicted, **rows}, indent=1))
print("ok" if ok else "not ok")
raise SystemExit(0 if ok else 1)
EOF
)
# shellcheck disable=SC2329  # run through bash -c, under the section's timeout
run_loss() {
  "$PY" -c "$LOSS_PY"
}
export BF16_PURE_PY LOSS_PY
export -f junit run_pytest python_sees run_bf16_pure run_loss check run_first_contact run_vllm

START=$(now)
setup
export PY
read -ra EXTRA <<<"${FT_GPU_CHECK_BENCH_ARGS:-}"  # e.g. "--size small --hardware cpu --seq-len 128 --micro 2 --steps 3": a CPU dry run
read -ra LIST <<<"$SECTIONS"
for i in "${!LIST[@]}"; do
  s=${LIST[$i]}
  reserve=0  # kept for the sections after this one: their caps
  for later in "${LIST[@]:i+1}"; do reserve=$((reserve + ${CAP[$later]:-0})); done
  cap=${CAP[$s]:-0}
  case $s in
    setup) ;;
    first-contact) section first-contact "$cap" "$reserve" bash -c run_first_contact ;;
    vllm) section vllm "$cap" "$reserve" bash -c run_vllm ;;
    pytest) section pytest "$cap" "$reserve" bash -c run_pytest ;;
    memory) section memory "$cap" "$reserve" "$PY" bench/gpu_bench.py memory --model "$WORK/llama-1b" --work "$WORK/memory" --json "$OUT/memory.json" "${EXTRA[@]}" ;;
    bench) section bench "$cap" "$reserve" "$PY" bench/gpu_bench.py throughput --model "$WORK/llama-1b" --work "$WORK/bench" --json "$OUT/bench.json" "${EXTRA[@]}" ;;
    scaling) section scaling "$cap" "$reserve" "$PY" bench/gpu_bench.py scaling --model "$WORK/llama-1b" --work "$WORK/scaling" --json "$OUT/scaling.json" "${EXTRA[@]}" ;;
    savers) section savers "$cap" "$reserve" "$PY" bench/memory_savers_bench.py --device cuda --columns "plain,activation offload" \
      --expect-lower "activation offload" --loss-tolerance 2e-3 --hidden 1024 --layers 8 --seq-len 2048 --micro 4 \
      --steps 3 --json "$OUT/savers.json" ;;
    bf16pure) section bf16pure "$cap" "$reserve" env FT_BF16_PURE_STEPS="${FT_BF16_PURE_STEPS:-10}" bash -c run_bf16_pure ;;
    loss) section loss "$cap" "$reserve" bash -c run_loss ;;
    rollout) section rollout "$cap" "$reserve" bash -c run_rollout ;;
    *) record "$s" "FAIL (no such section: setup, first-contact, vllm, pytest, memory, bench, scaling, savers, bf16pure, loss, rollout)" ;;
  esac
done

# ------------------------------------------------------------------ summary
{
  echo
  echo "================ ft GPU check: summary ($(($(now) - START)) s) ================"
  "$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))' 2>/dev/null
  for i in "${!NAMES[@]}"; do
    printf '%-13s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
    [ "${NAMES[$i]}" = pytest ] && junit | grep -v '^ok$\|^not ok$' | sed 's/^/         /'
  done
  echo
  figures=()
  [[ " $SECTIONS " == *" memory "* ]] && figures+=(--memory "$OUT/memory.json")
  [[ " $SECTIONS " == *" bench "* ]] && figures+=(--throughput "$OUT/bench.json")
  [[ " $SECTIONS " == *" scaling "* ]] && figures+=(--scaling "$OUT/scaling.json")
  ((${#figures[@]})) && "$PY" bench/gpu_bench.py summary "${figures[@]}" 2>/dev/null
  "$PY" bench/gpu_first_contact.py figures --memory "$OUT/memory.json" --savers "$OUT/savers.json" >/dev/null 2>&1
  echo "one line per check:"
  [ -s "$OUT/checks.txt" ] && cat "$OUT/checks.txt"
  echo
  echo "logs and figures: $OUT (gpu-check.log, pytest-gpu.log/.xml, memory.json, bench.json, scaling.json)"
  [ "$FAILED" = 0 ] && echo "ALL PASSED" || echo "SOME SECTIONS FAILED"
} | tee "$OUT/summary.txt"
[ "${FT_GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK"
exit "$FAILED"
