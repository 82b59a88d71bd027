#!/usr/bin/env bash
# Source rules that clang-format cannot check; exit 1 naming each breach.
#   - No absl::Now() in C++ code: it is the wall clock (steps with NTP, and
#     Debian's Abseil extrapolates it from the cycle counter), so intervals
#     and deadlines use mlp_offload/base/clock.h (steady_clock) instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bad=0
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu')
# Code lines only: a comment may name the function.
while IFS= read -r hit; do
  echo "wall clock in code (use mlp_offload/base/clock.h): $hit"
  bad=1
done < <(grep -nH 'absl::Now()' "${files[@]}" | grep -vE '^[^:]+:[0-9]+:\s*//' || true)
exit "$bad"
