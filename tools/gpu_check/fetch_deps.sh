#!/usr/bin/env bash
# Run on THIS (Debian 12, networked apt) machine, before a GPU session: fills
# the ignored folder .dev with what tools/gpu_check.sh needs on a GPU machine
# that has no Bazel and no Debian -dev packages:
#   .dev/debs   the .deb files of Abseil, Highway, liburing and pybind11
#   .dev/pylib  pytest and its pure-Python dependencies (from .venv), used
#               there only if that interpreter has no pytest
# Then carry ".dev" to the GPU machine (the device tool's carry=[".dev"]).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$root/.dev/debs" "$root/.dev/pylib"
(cd "$root/.dev/debs" && apt-get download libabsl-dev libabsl20220623 libhwy-dev libhwy1 \
  liburing-dev liburing2 pybind11-dev)
site="$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py; do
  [[ -e "$site/$pkg" ]] && cp -r "$site/$pkg" "$root/.dev/pylib/"
done
rm -rf "$root/.dev/deps" "$root/.dev/build" "$root/.dev/pkg"  # rebuilt there
find "$root/.dev/pylib" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$root/.dev"
