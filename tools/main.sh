#!/usr/bin/env bash
# The README's main-job command: set up (idempotent), build the wheel with
# -c opt, install it into the venv, and run `mlp-offload train` with its
# defaults (extra arguments go to it).
set -euo pipefail
here="$(pwd)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./tools/setup.sh
bazel build --config=opt //python:wheel
wheel="$(ls -t bazel-bin/python/mlp_offload-*.whl | head -1)"
.venv/bin/python -m pip install -q --no-deps --force-reinstall "$wheel"
# Back where the user ran it (the PNG lands there); the package imported is
# the installed wheel (the source package lives under python/, not here).
cd "$here"
exec "$root/.venv/bin/mlp-offload" train "$@"
