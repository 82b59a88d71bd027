#!/usr/bin/env bash
# Runs every test under AddressSanitizer+UBSan (`bazel test --config=asan
# //...`), and the C++ tests of the io layer, the engine, the kernels and the
# base library under ThreadSanitizer.
# Usage: tools/sanitizers.sh [asan|tsan|all]   (default: all)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./tools/setup.sh
which="${1:-all}"
tsan_targets=(//io/... //mlp_offload/... //mlp_offload/base/... //kernels/...)
if [[ "$which" == asan || "$which" == all ]]; then
  # Everything, the Python tests included: tests/run_pytest.py preloads the
  # ASan runtime into the (uninstrumented) interpreter.
  bazel test --config=asan //...
fi
if [[ "$which" == tsan || "$which" == all ]]; then
  # The fuzzer is built by clang with its own sanitizers; skip it under tsan.
  bazel test --config=tsan "${tsan_targets[@]}" -- -//mlp_offload:state_store_fuzz_test
fi
