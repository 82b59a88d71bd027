// The constants of StripeHash64 (kernels/checksum.h). Not API: shared by the
// SIMD code and the tests' independent reference implementation. They are
// part of the on-disk format of the state records: never change them.
#ifndef MLP_OFFLOAD_KERNELS_INTERNAL_STRIPE_HASH_KEYS_H_
#define MLP_OFFLOAD_KERNELS_INTERNAL_STRIPE_HASH_KEYS_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace mlp_offload {
namespace internal_kernels {

// A stripe is 8 64-bit words (64 bytes); a block is 16 stripes (1 KiB).
inline constexpr size_t kHashLanes = 8;
inline constexpr size_t kHashStripes = 16;
inline constexpr size_t kHashStripeBytes = 8 * kHashLanes;
inline constexpr size_t kHashBlockBytes = kHashStripeBytes * kHashStripes;

inline constexpr uint64_t kHashPrime1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kHashPrime2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kHashPrime3 = 0x165667B19E3779F9ull;
// The block scramble's multiplier (odd, below 2^32: two 32x32->64 products).
inline constexpr uint64_t kHashPrime32 = 0x9E3779B1u;

// stripe[s][l]: the key word of lane l in a block's stripe s; scramble[l]
// goes into lane l at every block's end; init[l] starts lane l.
struct StripeHashKeys {
  uint64_t stripe[kHashStripes][kHashLanes];
  uint64_t scramble[kHashLanes];
  uint64_t init[kHashLanes];
};

// The keys are a SplitMix64 sequence from a fixed start.
constexpr StripeHashKeys MakeStripeHashKeys() {
  StripeHashKeys k{};
  uint64_t x = 0x4D4C504F46464C44ull;  // "DLFFOPLM"
  auto next = [&x]() {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t s = 0; s < kHashStripes; ++s) {
    for (size_t l = 0; l < kHashLanes; ++l) k.stripe[s][l] = next();
  }
  for (size_t l = 0; l < kHashLanes; ++l) k.scramble[l] = next();
  for (size_t l = 0; l < kHashLanes; ++l) k.init[l] = next();
  return k;
}

alignas(64) inline constexpr StripeHashKeys kStripeHashKeys =
    MakeStripeHashKeys();

inline constexpr uint64_t HashRotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
// A bijective finaliser (every bit of the input reaches every bit).
inline constexpr uint64_t HashAvalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kHashPrime2;
  h ^= h >> 29;
  h *= kHashPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace internal_kernels
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_INTERNAL_STRIPE_HASH_KEYS_H_
