#!/usr/bin/env bash
# Installs everything the project needs on a Debian 12 machine, idempotently:
# the apt packages (Bazel, Abseil, Highway, liburing, GoogleTest, pybind11,
# Python headers, fio, clang for the fuzzers) and the Python venv at .venv
# with the pinned packages of tools/requirements.txt. A second run is a fast
# no-op. Source of truth for what "set up" means; tools/test.sh and
# tools/main.sh call it first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

APT_PACKAGES=(
  bazel-bootstrap bazel-skylib bazel-rules-java
  libabsl-dev libhwy-dev liburing-dev libgtest-dev libgmock-dev
  pybind11-dev python3-dev libpython3.11-dev python3-venv python3-pip
  g++ fio clang libclang-rt-14-dev clang-format
)

say() { echo "[setup] $*" >&2; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "not root and no sudo: install as root: apt-get install ${missing[*]}"
    SUDO=sudo
  else
    SUDO=
  fi
  say "installing apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed (is a Debian mirror reachable?)"
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install failed for: ${missing[*]}"
fi

venv="$root/.venv"
stamp="$venv/.mlp_offload_requirements"
want="$(sha256sum tools/requirements.txt | cut -d' ' -f1)"
if [[ ! -x "$venv/bin/python3" ]] || [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  # The venv comes from Debian's interpreter: its headers (python3-dev) are
  # the ones the extension is compiled against.
  [[ -x "$venv/bin/python3" ]] || /usr/bin/python3 -m venv "$venv" \
    || die "could not create the venv at $venv (python3-venv installed?)"
  say "installing Python packages into $venv"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check \
    -r tools/requirements.txt || die "pip install -r tools/requirements.txt failed"
  echo "$want" > "$stamp"
fi
say "ok: bazel $(bazel --version 2>/dev/null | head -1 || echo '?'), venv $venv"
