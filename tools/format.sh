#!/usr/bin/env bash
# Checks that the C++ sources follow .clang-format (Google style).
#   tools/format.sh          list the files that are not formatted; exit 1 if any
#   tools/format.sh --fix    reformat them in place
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cf="$(command -v clang-format || command -v clang-format-14 || true)"
[[ -n "$cf" ]] || { echo "clang-format not found: apt-get install clang-format" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu')
if [[ "${1:-}" == "--fix" ]]; then
  "$cf" -i --style=file "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! diff -q <("$cf" --style=file "$f") "$f" >/dev/null; then
    echo "not formatted: $f"
    bad=1
  fi
done
exit "$bad"
