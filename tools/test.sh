#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run every test.
# Extra arguments go to `bazel test` (e.g. --config=asan).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./tools/setup.sh
exec bazel test //... "$@"
