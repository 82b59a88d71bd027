// The state records' payload checksum in each format the engine reads, side
// by side on the same buffers: GB/s on one thread and on the pool, over one
// chunk that stays in cache and over a span that streams from memory, and
// next to them the memory's read bandwidth (the STREAM-like probe with one
// read-only stream), the ceiling of a hash that keeps up with memory.
//
//   bazel run -c opt //mlp_offload:checksum_benchmark -- --bytes=536870912
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/memory_probe.h"
#include "kernels/target_info.h"
#include "mlp_offload/base/thread_pool.h"
#include "mlp_offload/state_store.h"

ABSL_FLAG(int64_t, bytes, int64_t{512} << 20,
          "bytes of the span streamed from memory");
ABSL_FLAG(int, threads, 2, "pool threads (and the probe's)");
ABSL_FLAG(int, reps, 7, "timed passes per case; the best is printed");

namespace mlp_offload {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// Best GB/s of `reps` rounds of hashing `span` bytes from `data`, each
// round hashing `passes` times (so an in-cache round is long enough to time).
double Rate(const unsigned char* data, size_t span, int passes, int reps,
            ThreadPool* pool, uint32_t format, uint64_t* sink) {
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first round warms up
    const auto start = std::chrono::steady_clock::now();
    for (int p = 0; p < passes; ++p) {
      *sink += PayloadChecksum(data, span, pool, format);
    }
    if (r > 0) best = std::min(best, Seconds(start));
  }
  return static_cast<double>(span) * passes / best / 1e9;
}

int Run() {
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bytes));
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  if (bytes < kChecksumChunkBytes || threads < 1 || reps < 1) {
    std::fprintf(stderr, "need --bytes >= 1M, --threads >= 1, --reps >= 1\n");
    return 2;
  }
  std::vector<unsigned char> data(bytes);
  std::mt19937_64 rng(7);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::copy_n(reinterpret_cast<const unsigned char*>(&v), 8, &data[i]);
  }
  ThreadPool pool(threads);
  StreamPattern read_only;
  read_only.update_streams = 0;
  read_only.read_bytes = 4;
  const size_t elements = bytes / 4;
  auto one = MeasureStreamBandwidth(read_only, elements, reps, nullptr);
  auto all = MeasureStreamBandwidth(read_only, elements, reps, &pool);
  if (!one.ok() || !all.ok()) {
    std::fprintf(stderr, "memory probe: %s\n",
                 (!one.ok() ? one.status() : all.status()).ToString().c_str());
    return 1;
  }
  std::printf(
      "SIMD target %s; memory read bandwidth (probe): %.1f GB/s on "
      "1 thread, %.1f GB/s on %d\n",
      SimdTargetName().c_str(), *one, *all, threads);
  std::printf("%-8s %-22s %10s %10s\n", "format", "span", "1 thread",
              (std::to_string(threads) + " threads").c_str());
  uint64_t sink = 0;
  const int in_cache_passes = 64;
  for (uint32_t format = kOldestStateFormatVersion;
       format <= kStateFormatVersion; ++format) {
    const double c1 = Rate(data.data(), kChecksumChunkBytes, in_cache_passes,
                           reps, nullptr, format, &sink);
    // Two chunks per thread, so every thread of the pool hashes in cache.
    const size_t cached_span = 2 * kChecksumChunkBytes * threads;
    const double cn = Rate(data.data(), std::min(cached_span, bytes),
                           in_cache_passes / 2, reps, &pool, format, &sink);
    const double m1 = Rate(data.data(), bytes, 1, reps, nullptr, format, &sink);
    const double mn = Rate(data.data(), bytes, 1, reps, &pool, format, &sink);
    std::printf("%-8u %-22s %7.1f GB/s %6.1f GB/s\n", format,
                "in cache (1-2 MiB/thr)", c1, cn);
    std::printf(
        "%-8u %-22s %7.1f GB/s %6.1f GB/s\n", format,
        ("from memory (" + std::to_string(bytes >> 20) + " MiB)").c_str(), m1,
        mn);
  }
  std::printf("(sum of the checksums: %016llx)\n",
              static_cast<unsigned long long>(sink));
  return 0;
}

}  // namespace
}  // namespace mlp_offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlp_offload::Run();
}
