#!/usr/bin/env bash
# Runs the libFuzzer target for a bounded time from a seed corpus of valid
# encodings (written by the seed generator) and fails on any crash.
set -euo pipefail
fuzzer="$1"
seeds="$2"
secs="${FUZZ_SECONDS:-20}"
work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
mkdir -p "$work"
cp "$seeds"/* "$work"/
"$fuzzer" -max_total_time="$secs" -max_len=8192 -timeout=10 -print_final_stats=1 "$work" 2>&1 | tail -20
