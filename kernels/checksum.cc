// StripeHash64 (see checksum.h): the blocks' inner loop per Highway target,
// eight 64-bit lanes held in 8 / N vectors of N lanes; the tail stripes, the
// partial stripe and the final fold in plain code shared by every target.
#include "kernels/checksum.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/internal/stripe_hash_keys.h"

// Shared by every target's code, so defined once (this file is re-included
// per target by foreach_target.h).
#ifndef MLP_OFFLOAD_KERNELS_CHECKSUM_SHARED_
#define MLP_OFFLOAD_KERNELS_CHECKSUM_SHARED_
namespace mlp_offload {
namespace internal_kernels {

// One stripe of eight words into the lanes (the plain form of the SIMD
// loop).
inline void StripeIntoLanes(const unsigned char* p, size_t s, uint64_t* acc) {
  uint64_t w[kHashLanes];
  std::memcpy(w, p, kHashStripeBytes);
  for (size_t l = 0; l < kHashLanes; ++l) {
    const uint64_t k = w[l] ^ kStripeHashKeys.stripe[s][l];
    acc[l] += (k & 0xFFFFFFFFu) * (k >> 32) + w[l ^ 1];
  }
}

inline void ScrambleLanes(uint64_t* acc) {
  for (size_t l = 0; l < kHashLanes; ++l) {
    const uint64_t a = acc[l] ^ (acc[l] >> 47) ^ kStripeHashKeys.scramble[l];
    acc[l] = a * kHashPrime32;
  }
}

// What follows the last whole block: its whole stripes, the zero-padded
// partial one, then the fold of the lanes with the length and the seed.
inline uint64_t FinishStripeHash(const unsigned char* p, size_t rest, size_t n,
                                 uint64_t seed, uint64_t* acc) {
  size_t s = 0;
  for (; rest >= kHashStripeBytes; ++s) {
    StripeIntoLanes(p, s, acc);
    p += kHashStripeBytes;
    rest -= kHashStripeBytes;
  }
  if (rest > 0) {
    unsigned char last[kHashStripeBytes] = {};
    std::memcpy(last, p, rest);
    StripeIntoLanes(last, s, acc);
  }
  uint64_t h = seed ^ (static_cast<uint64_t>(n) * kHashPrime1);
  for (size_t l = 0; l < kHashLanes; ++l) {
    h = HashRotl(h ^ HashAvalanche(acc[l] + kStripeHashKeys.init[l]), 27) *
            kHashPrime1 +
        kHashPrime3;
  }
  return HashAvalanche(h);
}

inline void InitLanes(uint64_t seed, uint64_t* acc) {
  const uint64_t mixed = HashAvalanche(seed + kHashPrime3);
  for (size_t l = 0; l < kHashLanes; ++l) {
    acc[l] = kStripeHashKeys.init[l] ^ mixed;
  }
}

}  // namespace internal_kernels
}  // namespace mlp_offload
#endif  // MLP_OFFLOAD_KERNELS_CHECKSUM_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/checksum.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mlp_offload {
namespace internal_kernels {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// Hashes the whole blocks of `blocks` KiB at p into acc.
void HashBlocks(const unsigned char* p, size_t blocks, uint64_t* acc) {
#if HWY_TARGET == HWY_SCALAR || HWY_HAVE_SCALABLE
  // One-lane vectors cannot pair lanes, and vectors of a size known only at
  // run time (SVE, RVV) neither fill the fixed eight lanes nor go in arrays:
  // the plain form.
  for (size_t b = 0; b < blocks; ++b, p += kHashBlockBytes) {
    for (size_t s = 0; s < kHashStripes; ++s) {
      StripeIntoLanes(p + s * kHashStripeBytes, s, acc);
    }
    ScrambleLanes(acc);
  }
#else
  const hn::CappedTag<uint64_t, kHashLanes> d;
  const hn::Repartition<uint32_t, decltype(d)> d32;
  using V = hn::Vec<decltype(d)>;
  constexpr size_t N = hn::MaxLanes(d);
  static_assert(N >= 2 && kHashLanes % N == 0, "lanes must pair up");
  constexpr size_t kVecs = kHashLanes / N;
  constexpr size_t kPrefetchBlocks = 4;
  V lanes[kVecs];
  for (size_t v = 0; v < kVecs; ++v) lanes[v] = hn::LoadU(d, acc + v * N);
  const auto prime = hn::BitCast(d32, hn::Set(d, kHashPrime32));
  for (size_t b = 0; b < blocks; ++b, p += kHashBlockBytes) {
    // Streaming from memory, the block 4 KiB ahead asked for: 6-10% faster
    // than the hardware prefetcher alone (checksum_benchmark, 512 MiB, 1
    // and 2 threads: 9.3-9.9 / 18.4-19.7 GB/s against 9.1-9.2 / 17.7-17.9).
    if (b + kPrefetchBlocks < blocks) {
      for (size_t line = 0; line < kHashBlockBytes; line += 64) {
        hwy::Prefetch(p + kPrefetchBlocks * kHashBlockBytes + line);
      }
    }
    for (size_t s = 0; s < kHashStripes; ++s) {
      const uint64_t* words =
          reinterpret_cast<const uint64_t*>(p + s * kHashStripeBytes);
      for (size_t v = 0; v < kVecs; ++v) {
        const V w = hn::LoadU(d, words + v * N);
        const V k = hn::Xor(w, hn::LoadU(d, kStripeHashKeys.stripe[s] + v * N));
        const V product = hn::MulEven(hn::BitCast(d32, k),
                                      hn::BitCast(d32, hn::ShiftRight<32>(k)));
        lanes[v] = hn::Add(lanes[v], hn::Add(product, hn::Shuffle01(w)));
      }
    }
    for (size_t v = 0; v < kVecs; ++v) {
      const V a = hn::Xor(hn::Xor(lanes[v], hn::ShiftRight<47>(lanes[v])),
                          hn::LoadU(d, kStripeHashKeys.scramble + v * N));
      // a * prime mod 2^64 = lo32(a) * prime + (hi32(a) * prime << 32).
      const V lo = hn::MulEven(hn::BitCast(d32, a), prime);
      const V hi = hn::MulEven(hn::BitCast(d32, hn::ShiftRight<32>(a)), prime);
      lanes[v] = hn::Add(lo, hn::ShiftLeft<32>(hi));
    }
  }
  for (size_t v = 0; v < kVecs; ++v) hn::StoreU(lanes[v], d, acc + v * N);
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace internal_kernels
}  // namespace mlp_offload
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mlp_offload {
namespace internal_kernels {
HWY_EXPORT(HashBlocks);

void DispatchHashBlocks(const unsigned char* p, size_t blocks, uint64_t* acc) {
  HWY_DYNAMIC_DISPATCH(HashBlocks)(p, blocks, acc);
}
}  // namespace internal_kernels

uint64_t StripeHash64(const void* data, size_t n, uint64_t seed) {
  namespace ik = internal_kernels;
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t acc[ik::kHashLanes];
  ik::InitLanes(seed, acc);
  const size_t blocks = n / ik::kHashBlockBytes;
  if (blocks > 0) ik::DispatchHashBlocks(p, blocks, acc);
  const size_t whole = blocks * ik::kHashBlockBytes;
  return ik::FinishStripeHash(p + whole, n - whole, n, seed, acc);
}

}  // namespace mlp_offload
#endif  // HWY_ONCE
