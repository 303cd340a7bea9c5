#!/usr/bin/env bash
# The test command: set up .venv if needed, check formatting and lint (ruff), then run the tests.
#   bash scripts/test.sh            every test (what CI runs), then the vLLM tests in their own environment
#   bash scripts/test.sh --fast     the inner loop: leaves out the tests marked slow (training runs, process launches)
# Extra arguments go to pytest, e.g. bash scripts/test.sh --fast -k planner
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
. .venv/bin/activate
# where scripts/setup.sh compiled DeepSpeed's CPU op for this environment (the DeepSpeed tests' jobs load it from there)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch-extensions}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Python's bytecode cache: the many ft processes the tests start compile ft's modules once, not each time
unset PYTHONDONTWRITEBYTECODE
ruff format --check . || { echo "ruff: files above need formatting; run: ruff format <files>" >&2; exit 1; }
ruff check .
# Three workers on a 2-core machine, each taking whole test files (module fixtures train once): many tests wait on the
# processes they start (rendezvous, signals, timeouts), and a third worker fills those waits (cores busy ~96% of the
# run, ~86% with two). Files are sent longest first (the order tests/conftest.py gives them) so that no long file
# starts last. FT_TEST_WORKERS sets another count.
pytest=(python -m pytest -q -n "${FT_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder)
if [ "$fast" = 0 ]; then
  status=0
  # The tests marked vllm run in a second environment with vLLM's CPU build (scripts/setup-vllm.sh: vLLM pins an older
  # transformers). Only for the whole suite: arguments select tests of the main environment. They run beside the main
  # tests, not after them: they mostly wait (servers starting, requests in flight), about one core for ~3 minutes, and
  # the main tests fill the other (the whole suite then takes the cores' time, not the sum of the two tiers' times).
  vllm_pid=""
  if [ $# -eq 0 ] && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    bash scripts/setup-vllm.sh
    vllm_log=$(mktemp)
    # its own process group, stopped with the script (Ctrl-C): no vLLM server outlives an interrupted run
    trap 'kill -TERM -- "-$vllm_pid" 2>/dev/null || true; rm -f "$vllm_log"' EXIT
    OMP_NUM_THREADS=1 setsid -w .venv-vllm/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -m vllm \
      tests/test_vllm_generate.py tests/test_vllm_rollout.py tests/test_vllm_serve.py tests/test_vllm_merged.py \
      tests/test_vllm_ray.py >"$vllm_log" 2>&1 &
    vllm_pid=$!
  fi
  "${pytest[@]}" --durations=15 "$@" || status=$?
  if [ -n "$vllm_pid" ]; then
    vllm_status=0
    wait "$vllm_pid" || vllm_status=$?
    echo "---- the tests marked vllm (vLLM's CPU build, run beside the others) ----"
    cat "$vllm_log"
    [ "$vllm_status" = 0 ] || status=$vllm_status
  fi
  exit "$status"
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
"${pytest[@]}" -m "not slow" "$@" 2>&1 | tee "$log" || status=$?
deselected=$(grep -Eo '[0-9]+ tests deselected' "$log" | tail -1 | grep -Eo '^[0-9]+' || echo 0)  # tests/conftest.py
echo "--fast: $deselected tests marked slow were left out; bash scripts/test.sh (what CI runs) runs them too"
exit "$status"
