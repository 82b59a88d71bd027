// The probe's inner loop is dispatched like the kernels (same vector width,
// same unaligned loads and stores, same chunks), and does as little
// arithmetic as possible so that only memory limits it.
#include "kernels/memory_probe.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/internal/chunking.h"
#include "mlp_offload/base/thread_pool.h"

// Shared by every target's code, so defined once (this file is re-included
// per target by foreach_target.h).
#ifndef MLP_OFFLOAD_KERNELS_MEMORY_PROBE_ARRAYS_
#define MLP_OFFLOAD_KERNELS_MEMORY_PROBE_ARRAYS_
namespace mlp_offload {
namespace internal_kernels {
struct ProbeArrays {
  float* update[4];
  const void* read;
  void* write;
};
}  // namespace internal_kernels
}  // namespace mlp_offload
#endif  // MLP_OFFLOAD_KERNELS_MEMORY_PROBE_ARRAYS_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/memory_probe.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mlp_offload {
namespace internal_kernels {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

template <int kUpdate, int kReadBytes, int kWriteBytes, class D>
HWY_INLINE size_t ProbeRange(D d, const ProbeArrays& arrays, size_t i,
                             size_t end) {
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const hn::Rebind<uint16_t, D> du16;
  float* HWY_RESTRICT s0 = arrays.update[0];
  float* HWY_RESTRICT s1 = arrays.update[1];
  float* HWY_RESTRICT s2 = arrays.update[2];
  float* HWY_RESTRICT s3 = arrays.update[3];
  const void* HWY_RESTRICT read = arrays.read;
  void* HWY_RESTRICT write = arrays.write;
  // s = s * 0.5 + x keeps the values bounded (no denormals, no overflow).
  const auto half = hn::Set(d, 0.5f);
  const size_t N = hn::Lanes(d);
  // A read-only pattern sums what it reads, so that the loads stay.
  constexpr bool kReadOnly = kUpdate == 0 && kWriteBytes == 0;
  auto sum = hn::Zero(d);
  for (; i + N <= end; i += N) {
    auto x = hn::Set(d, 1.0f);
    if constexpr (kReadBytes == 4) {
      x = hn::LoadU(d, static_cast<const float*>(read) + i);
    } else if constexpr (kReadBytes == 2) {
      x = hn::BitCast(
          d,
          hn::ShiftLeft<16>(hn::PromoteTo(
              du32, hn::LoadU(du16, static_cast<const uint16_t*>(read) + i))));
    }
    x = hn::Abs(x);
    if constexpr (kReadOnly) sum = hn::Add(sum, x);
    auto y = x;
    if constexpr (kUpdate >= 1) {
      y = hn::MulAdd(hn::LoadU(d, s0 + i), half, x);
      hn::StoreU(y, d, s0 + i);
    }
    if constexpr (kUpdate >= 2) {
      hn::StoreU(hn::MulAdd(hn::LoadU(d, s1 + i), half, x), d, s1 + i);
    }
    if constexpr (kUpdate >= 3) {
      hn::StoreU(hn::MulAdd(hn::LoadU(d, s2 + i), half, x), d, s2 + i);
    }
    if constexpr (kUpdate >= 4) {
      hn::StoreU(hn::MulAdd(hn::LoadU(d, s3 + i), half, x), d, s3 + i);
    }
    if constexpr (kWriteBytes == 4) {
      hn::StoreU(y, d, static_cast<float*>(write) + i);
    } else if constexpr (kWriteBytes == 2) {
      const auto bits = hn::ShiftRight<16>(hn::BitCast(du32, y));
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, bits)), du16,
                 static_cast<uint16_t*>(write) + i);
    }
  }
  if constexpr (kReadOnly) {
    // Never true (a sum of absolute values), but the compiler cannot know.
    if (hn::GetLane(hn::SumOfLanes(d, sum)) < 0.0f) {
      *static_cast<volatile float*>(const_cast<void*>(read)) = 0.0f;
    }
  }
  return i;
}

template <int kUpdate, int kReadBytes, int kWriteBytes>
void ProbeChunkT(const ProbeArrays& arrays, size_t begin, size_t end) {
  const size_t i = ProbeRange<kUpdate, kReadBytes, kWriteBytes>(
      hn::ScalableTag<float>(), arrays, begin, end);
  ProbeRange<kUpdate, kReadBytes, kWriteBytes>(hn::CappedTag<float, 1>(),
                                               arrays, i, end);
}

template <int kUpdate, int kReadBytes>
void ProbeChunkByWrite(const ProbeArrays& arrays, int write_bytes, size_t begin,
                       size_t end) {
  switch (write_bytes) {
    case 4:
      return ProbeChunkT<kUpdate, kReadBytes, 4>(arrays, begin, end);
    case 2:
      return ProbeChunkT<kUpdate, kReadBytes, 2>(arrays, begin, end);
    default:
      return ProbeChunkT<kUpdate, kReadBytes, 0>(arrays, begin, end);
  }
}

template <int kUpdate>
void ProbeChunkByRead(const ProbeArrays& arrays, int read_bytes,
                      int write_bytes, size_t begin, size_t end) {
  switch (read_bytes) {
    case 4:
      return ProbeChunkByWrite<kUpdate, 4>(arrays, write_bytes, begin, end);
    case 2:
      return ProbeChunkByWrite<kUpdate, 2>(arrays, write_bytes, begin, end);
    default:
      return ProbeChunkByWrite<kUpdate, 0>(arrays, write_bytes, begin, end);
  }
}

void ProbeChunk(const ProbeArrays& arrays, int update_streams, int read_bytes,
                int write_bytes, size_t begin, size_t end) {
  switch (update_streams) {
    case 0:
      return ProbeChunkByRead<0>(arrays, read_bytes, write_bytes, begin, end);
    case 1:
      return ProbeChunkByRead<1>(arrays, read_bytes, write_bytes, begin, end);
    case 2:
      return ProbeChunkByRead<2>(arrays, read_bytes, write_bytes, begin, end);
    case 3:
      return ProbeChunkByRead<3>(arrays, read_bytes, write_bytes, begin, end);
    default:
      return ProbeChunkByRead<4>(arrays, read_bytes, write_bytes, begin, end);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace internal_kernels
}  // namespace mlp_offload
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mlp_offload {
namespace internal_kernels {

HWY_EXPORT(ProbeChunk);

namespace {

bool ValidStreamBytes(size_t bytes) {
  return bytes == 0 || bytes == 2 || bytes == 4;
}

}  // namespace
}  // namespace internal_kernels

size_t StreamPatternBytes(const StreamPattern& pattern) {
  return 8 * static_cast<size_t>(pattern.update_streams) + pattern.read_bytes +
         pattern.write_bytes;
}

void RunStreamPattern(const StreamPattern& pattern, float* const update[4],
                      const void* read, void* write, size_t n,
                      ThreadPool* pool) {
  using internal_kernels::kChunkElements;
  internal_kernels::ProbeArrays arrays = {};
  for (int k = 0; k < pattern.update_streams && k < 4; ++k) {
    arrays.update[k] = update[k];
  }
  arrays.read = read;
  arrays.write = write;
  const int update_streams = pattern.update_streams;
  const int read_bytes = static_cast<int>(pattern.read_bytes);
  const int write_bytes = static_cast<int>(pattern.write_bytes);
  internal_kernels::ForEachChunk(n, pool, [&](size_t c) {
    const size_t begin = c * kChunkElements;
    HWY_DYNAMIC_DISPATCH(internal_kernels::ProbeChunk)
    (arrays, update_streams, read_bytes, write_bytes, begin,
     std::min(n, begin + kChunkElements));
  });
}

absl::StatusOr<double> MeasureStreamBandwidth(const StreamPattern& pattern,
                                              size_t n, int repetitions,
                                              ThreadPool* pool) {
  using internal_kernels::kChunkElements;
  if (pattern.update_streams < 0 || pattern.update_streams > 4 ||
      !internal_kernels::ValidStreamBytes(pattern.read_bytes) ||
      !internal_kernels::ValidStreamBytes(pattern.write_bytes) ||
      StreamPatternBytes(pattern) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported stream pattern: ", pattern.update_streams,
                     " update streams, read ", pattern.read_bytes, " B, write ",
                     pattern.write_bytes, " B"));
  }
  // Bounded so that no array's size in bytes can wrap (2^40 elements is
  // 4 TiB per array, beyond any host).
  if (n == 0 || n > (size_t{1} << 40) || repetitions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("need n in [1, 2^40] and repetitions >= 1, got n=", n,
                     " repetitions=", repetitions));
  }
  // Allocated without touching the pages; the first pass below touches them
  // chunk by chunk on the pool, as the kernels' InitState does.
  std::vector<std::unique_ptr<float[]>> update(pattern.update_streams);
  for (auto& array : update) array.reset(new float[n]);
  std::unique_ptr<float[]> read(
      pattern.read_bytes ? new float[(n * pattern.read_bytes + 3) / 4]
                         : nullptr);
  std::unique_ptr<float[]> write(
      pattern.write_bytes ? new float[(n * pattern.write_bytes + 3) / 4]
                          : nullptr);
  internal_kernels::ForEachChunk(n, pool, [&](size_t c) {
    const size_t begin = c * kChunkElements;
    const size_t end = std::min(n, begin + kChunkElements);
    for (auto& array : update) std::fill(&array[begin], &array[end], 1.0f);
    if (read) {
      auto* bytes = reinterpret_cast<uint8_t*>(read.get());
      std::fill(bytes + begin * pattern.read_bytes,
                bytes + end * pattern.read_bytes, uint8_t{0x3C});
    }
    if (write) {
      auto* bytes = reinterpret_cast<uint8_t*>(write.get());
      std::fill(bytes + begin * pattern.write_bytes,
                bytes + end * pattern.write_bytes, uint8_t{0});
    }
  });
  float* const update_ptrs[4] = {
      pattern.update_streams > 0 ? update[0].get() : nullptr,
      pattern.update_streams > 1 ? update[1].get() : nullptr,
      pattern.update_streams > 2 ? update[2].get() : nullptr,
      pattern.update_streams > 3 ? update[3].get() : nullptr};
  double best_seconds = 0.0;
  for (int rep = 0; rep <= repetitions; ++rep) {  // rep 0 warms up
    const auto start = std::chrono::steady_clock::now();
    RunStreamPattern(pattern, update_ptrs, read.get(), write.get(), n, pool);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (rep > 0 && (best_seconds == 0.0 || seconds < best_seconds)) {
      best_seconds = seconds;
    }
  }
  const double bytes =
      static_cast<double>(StreamPatternBytes(pattern)) * static_cast<double>(n);
  return bytes / std::max(best_seconds, 1e-9) / 1e9;
}

}  // namespace mlp_offload
#endif  // HWY_ONCE
