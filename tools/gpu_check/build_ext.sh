#!/usr/bin/env bash
# Builds the extension mlp_offload._C WITHOUT Bazel, for machines that have a
# compiler, Python and (optionally) nvcc but no Bazel and no Debian -dev
# packages: a GPU machine lent for the checks of tools/gpu_check.sh.
#
# Abseil, Highway, liburing and pybind11 come from Debian 12 .deb files,
# fetched once on a Debian machine into the ignored folder .dev/debs:
#   mkdir -p .dev/debs && (cd .dev/debs && apt-get download \
#     libabsl-dev libabsl20220623 libhwy-dev libhwy1 liburing-dev liburing2 pybind11-dev)
# and unpacked here (dpkg-deb, or ar + tar where there is no dpkg) into
# .dev/deps. The extension finds their shared libraries through its RPATH.
#
# Usage: tools/gpu_check/build_ext.sh [--cuda|--no-cuda] [--out DIR] [--list-sources]
#   --cuda     compile gpu/ with $CUDA_PATH/bin/nvcc (default /usr/local/cuda)
#              and define MLP_OFFLOAD_WITH_CUDA, as Bazel's --config=cuda does
#   --out DIR  where the importable package goes (default .dev/pkg): DIR/mlp_offload
#   --list-sources  print the project sources it compiles and exit; the test
#              //tests:test_gpu_check_sources checks them against the Bazel
#              target's (bazel query), so this list cannot drift
# Environment: PYTHON (default python3), the interpreter whose headers are
# used; JOBS (default nproc); CUDA_ARCH (default 90: sm_90 SASS + PTX).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

cuda=0
out="$root/.dev/pkg"
list_only=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --no-cuda) cuda=0 ;;
    --out) out="$2"; shift ;;
    --list-sources) list_only=1 ;;
    *) echo "build_ext.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
CUDA_PATH="${CUDA_PATH:-/usr/local/cuda}"
CUDA_ARCH="${CUDA_ARCH:-90}"

# The C++ sources of //python:mlp_offload/_C.so (and of the CUDA layer).
srcs=(io/aligned_buffer.cc io/bandwidth_probe.cc io/fault_injection.cc io/file.cc
      io/io_engine.cc io/shared_throttle.cc io/threadpool_engine.cc io/tier_lock.cc
      io/uring_engine.cc io/internal/delay_queue.cc io/internal/paced_engine.cc
      io/internal/request.cc
      kernels/checksum.cc kernels/memory_probe.cc kernels/optimizer_kernels.cc
      kernels/target_info.cc
      mlp_offload/base/status_macros.cc mlp_offload/base/thread_pool.cc
      mlp_offload/base/threads.cc
      mlp_offload/engine.cc mlp_offload/planner.cc mlp_offload/state_store.cc
      python/bindings/cuda_bindings.cc python/bindings/engine_bindings.cc
      python/bindings/io_bindings.cc python/bindings/kernels_bindings.cc
      python/bindings/module.cc python/bindings/status.cc)
cuda_srcs=(gpu/host_pinning.cc gpu/grad_stats.cc)
cuda_kernels=gpu/internal/cuda_api.cu
[[ $cuda == 1 ]] && srcs+=("${cuda_srcs[@]}")
if [[ $list_only == 1 ]]; then
  printf '%s\n' "${srcs[@]}"
  [[ $cuda == 1 ]] && echo "$cuda_kernels"
  exit 0
fi
debs="$root/.dev/debs"
deps="$root/.dev/deps"
build="$root/.dev/build/$([[ $cuda == 1 ]] && echo cuda || echo cpu)"

# ---- third-party headers and libraries from the .debs
if [[ ! -f "$deps/.unpacked" ]]; then
  shopt -s nullglob
  files=("$debs"/*.deb)
  if [[ ${#files[@]} -eq 0 ]]; then
    echo "build_ext.sh: no .deb files in $debs (see the header of this script)" >&2
    exit 1
  fi
  rm -rf "$deps" && mkdir -p "$deps"
  for f in "${files[@]}"; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$deps"
    else
      tmp="$(mktemp -d)"
      (cd "$tmp" && ar x "$f")
      tar -xf "$tmp"/data.tar.* -C "$deps"
      rm -rf "$tmp"
    fi
  done
  touch "$deps/.unpacked"
fi
inc="$deps/usr/include"
lib="$deps/usr/lib/x86_64-linux-gnu"

py_inc="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[[ -f "$py_inc/Python.h" ]] || { echo "build_ext.sh: no Python.h in $py_inc" >&2; exit 1; }
pybind_inc="$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2>/dev/null || echo "$inc")"
version="$(sed -n 's/^VERSION = "\(.*\)"/\1/p' python/BUILD)"

# Same copts as bazel/copts.bzl, plus what Bazel's toolchain adds for a .so.
cxxflags=(-std=c++17 -O2 -fPIC -fvisibility=hidden -DNDEBUG -DHWY_SHARED_DEFINE
          "-DMLP_OFFLOAD_VERSION=\"$version\"" -Wall -Wextra -Wno-sign-compare
          -Wno-unused-parameter -I"$root" -isystem "$inc" -isystem "$py_inc"
          -isystem "$pybind_inc")
rm -rf "$build" && mkdir -p "$build"
objs=()
extra_libs=()
if [[ $cuda == 1 ]]; then
  cxxflags+=(-DMLP_OFFLOAD_WITH_CUDA)
  mkdir -p "$build/gpu"
  "$CUDA_PATH/bin/nvcc" -c -O2 -std=c++17 -Xcompiler -fPIC \
    -gencode "arch=compute_${CUDA_ARCH},code=sm_${CUDA_ARCH}" \
    -gencode "arch=compute_${CUDA_ARCH},code=compute_${CUDA_ARCH}" \
    -I"$root" "$cuda_kernels" -o "$build/gpu/cuda_api.o"
  objs+=("$build/gpu/cuda_api.o")
  extra_libs+=("$CUDA_PATH/lib64/libcudart_static.a" -ldl -lrt -lpthread)
fi

# In parallel; a failed file leaves no object behind, checked below.
printf '%s\n' "${srcs[@]}" | xargs -P "$JOBS" -I{} sh -c \
  'src="$1"; shift; mkdir -p "$(dirname "$0/$src")" && '"${CXX:-g++}"' "$@" -c "$src" -o "$0/$src.o"' \
  "$build" {} "${cxxflags[@]}" || true
for s in "${srcs[@]}"; do
  [[ -f "$build/$s.o" ]] || { echo "build_ext.sh: compiling $s failed" >&2; exit 1; }
  objs+=("$build/$s.o")
done

# Link line of third_party/absl.BUILD (pkg-config order).
absl=(flags_parse flags_usage flags_usage_internal flags_internal flags_marshalling
      flags_reflection flags_private_handle_accessor flags_commandlineflag
      flags_commandlineflag_internal flags_config flags_program_name statusor status
      cord cordz_info cord_internal cordz_functions cordz_handle hash city
      low_level_hash raw_hash_set hashtablez_sampler exponential_biased
      bad_variant_access bad_optional_access str_format_internal strerror
      synchronization graphcycles_internal stacktrace symbolize debugging_internal
      demangle_internal malloc_internal time civil_time time_zone strings
      strings_internal base spinlock_wait int128 throw_delegate raw_logging_internal
      log_severity)
mkdir -p "$out/mlp_offload"
"${CXX:-g++}" -shared -o "$out/mlp_offload/_C.so" "${objs[@]}" -L"$lib" \
  "-Wl,-rpath,$lib" -Wl,--as-needed "${absl[@]/#/-labsl_}" -lhwy -luring \
  "${extra_libs[@]}" -latomic -lrt -lpthread
cp python/mlp_offload/*.py "$out/mlp_offload/"
echo "build_ext.sh: built $out/mlp_offload/_C.so (cuda=$cuda, $("$PY" -V 2>&1))"
