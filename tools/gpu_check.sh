#!/usr/bin/env bash
# The GPU check of issue 9, in one call of under ten minutes on a machine with
# a CUDA GPU, nvcc, g++ and Python + torch + pybind11 but no Bazel:
#   1. builds mlp_offload._C with the CUDA layer (tools/gpu_check/build_ext.sh,
#      third-party libraries from the .debs in .dev/debs; falls back to a build
#      without CUDA, where torch pins and computes the gradient statistics);
#   2. runs the GPU tests (tests/test_cuda_path.py and the build-info checks);
#   3. runs a small GPU training benchmark against plain torch AdamW
#      (tools/gpu_check/benchmark.py);
# and prints a short table last. Logs go to $OUT (or .dev/gpu_check_out).
#
# Prepare on the Debian machine first: tools/gpu_check/fetch_deps.sh (fills
# .dev), then carry .dev. Exit status: 0 when the build and the tests pass.
# REUSE_BUILD=1 skips the build when .dev/pkg already holds one (a rerun on
# a machine that is still warm).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
out="${OUT:-$root/.dev/gpu_check_out}"
mkdir -p "$out"
declare -a rows
t_all=$(date +%s)
# The whole check must end inside one device call (600 s at most): each
# phase gets at most what is left of BUDGET_S, and none starts with under
# 20 s left (the table then says so).
budget="${BUDGET_S:-570}"

phase() {  # phase NAME TIMEOUT_S COMMAND...: runs, logs, records a table row
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s) rc
  local left=$(( budget - (t0 - t_all) ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "=== $name: skipped, ${left}s of the ${budget}s budget left"
    rows+=("$(printf '%-10s | %-4s | out of time (budget %ss)' "$name" skip "$budget")")
    return 124
  fi
  echo "=== $name (up to ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  tail -n 25 "$out/$name.log"
  rows+=("$(printf '%-10s | %-4s | %4ss | log %s' "$name" \
            "$([[ $rc == 0 ]] && echo ok || echo "FAIL($rc)")" "$(( $(date +%s) - t0 ))" \
            "$out/$name.log")")
  return $rc
}

{
  echo "host: $(hostname)  $(date -u +%FT%TZ)"
  nvidia-smi -L 2>&1 | head -4
  "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc" --version 2>&1 | tail -1
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} 2>&1 | tee "$out/env.log"

if ! "$PY" -c 'import pytest' 2>/dev/null; then
  export PYTHONPATH="$root/.dev/pylib${PYTHONPATH:+:$PYTHONPATH}"
fi

cuda_build=cuda
if [[ "${REUSE_BUILD:-0}" == 1 && -f "$root/.dev/pkg/mlp_offload/_C.so" ]]; then
  echo "=== build: reusing .dev/pkg (REUSE_BUILD=1)"
  cp python/mlp_offload/*.py "$root/.dev/pkg/mlp_offload/"
  cuda_build=reused
elif ! phase build 360 tools/gpu_check/build_ext.sh --cuda --out "$root/.dev/pkg"; then
  cuda_build=none
  phase build_cpu 300 tools/gpu_check/build_ext.sh --no-cuda --out "$root/.dev/pkg" \
    || { printf '%s\n' "${rows[@]}"; exit 1; }
fi
export PYTHONPATH="$root/.dev/pkg${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import mlp_offload, json; from mlp_offload import _C
print(json.dumps(mlp_offload.build_info())); print("device_count", _C.cuda.device_count())' \
  2>&1 | tee "$out/build_info.log"

status=0
phase tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_path.py \
  tests/test_build_info.py --junitxml="$out/tests.xml" || status=1
summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$out/tests.log" | tail -1)"
phase bench 240 "$PY" tools/gpu_check/benchmark.py --tiers "${TMPDIR:-/tmp}/mlp_offload_bench" \
  || true

echo
echo "================ GPU check (issue 9) — $(( $(date +%s) - t_all ))s, extension: $cuda_build"
printf '%s\n' "${rows[@]}"
echo "tests: ${summary:-?}"
grep -E '^(optimizer|torch|MLPOffload)' "$out/bench.log" 2>/dev/null
exit $status
