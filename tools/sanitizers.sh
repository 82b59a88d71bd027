#!/usr/bin/env bash
# Runs the C++ tests of the io layer, the engine and the base library under
# AddressSanitizer+UBSan and under ThreadSanitizer, plus the fuzz test.
# Usage: tools/sanitizers.sh [asan|tsan|all]   (default: all)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./tools/setup.sh
which="${1:-all}"
targets=(//io/... //mlp_offload/... //mlp_offload/base/... //kernels/...)
if [[ "$which" == asan || "$which" == all ]]; then
  bazel test --config=asan "${targets[@]}"
fi
if [[ "$which" == tsan || "$which" == all ]]; then
  # The fuzzer is built by clang with its own sanitizers; skip it under tsan.
  bazel test --config=tsan "${targets[@]}" -- -//mlp_offload:state_store_fuzz_test
fi
