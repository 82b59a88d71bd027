// StripeHash64 against a plain implementation written from checksum.h's
// description, on every SIMD target; and the corruptions it exists to catch.
#include "kernels/checksum.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/internal/per_target_test.h"
#include "kernels/internal/stripe_hash_keys.h"
#include "kernels/target_info.h"

namespace mlp_offload {
namespace {

using internal_kernels::kStripeHashKeys;

uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0x165667B19E3779F9ull;
  h ^= h >> 32;
  return h;
}

// The algorithm word by word, as checksum.h describes it: little-endian
// words read byte by byte, the zero padding by index, no shared code with
// the library beyond the key table.
uint64_t Reference(const std::vector<unsigned char>& bytes, uint64_t seed) {
  const size_t n = bytes.size();
  auto word = [&](size_t at) {
    uint64_t w = 0;
    for (int b = 7; b >= 0; --b) {
      w = (w << 8) | (at + b < n ? bytes[at + b] : 0);
    }
    return w;
  };
  uint64_t lane[8];
  const uint64_t start = Avalanche(seed + 0x165667B19E3779F9ull);
  for (int l = 0; l < 8; ++l) lane[l] = kStripeHashKeys.init[l] ^ start;
  const size_t stripes = (n + 63) / 64;
  for (size_t i = 0; i < stripes; ++i) {
    const size_t s = i % 16;
    for (int l = 0; l < 8; ++l) {
      const uint64_t w = word(64 * i + 8 * l);
      const uint64_t k = w ^ kStripeHashKeys.stripe[s][l];
      lane[l] += (k & 0xFFFFFFFF) * (k >> 32);
      lane[l ^ 1] += w;
    }
    const bool block_done = s == 15 && 64 * (i + 1) <= n;
    if (block_done) {
      for (int l = 0; l < 8; ++l) {
        uint64_t a = lane[l] ^ (lane[l] >> 47) ^ kStripeHashKeys.scramble[l];
        lane[l] = a * 0x9E3779B1ull;
      }
    }
  }
  uint64_t h = seed ^ (n * 0x9E3779B185EBCA87ull);
  for (int l = 0; l < 8; ++l) {
    const uint64_t x = h ^ Avalanche(lane[l] + kStripeHashKeys.init[l]);
    h = ((x << 27) | (x >> 37)) * 0x9E3779B185EBCA87ull + 0x165667B19E3779F9ull;
  }
  return Avalanche(h);
}

std::vector<unsigned char> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<unsigned char> v(n);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

uint64_t Hash(const std::vector<unsigned char>& v, uint64_t seed = 0) {
  return StripeHash64(v.data(), v.size(), seed);
}

class ChecksumTargetTest : public PerTargetTest {};

INSTANTIATE_TEST_SUITE_P(AllTargets, ChecksumTargetTest, AllSimdTargets(),
                         SimdTargetParamName);

TEST_P(ChecksumTargetTest, MatchesThePlainImplementation) {
  ASSERT_EQ(SimdTargetName(), hwy::TargetName(GetParam()));
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "random seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 2200; ++n) sizes.push_back(n);
  for (size_t n : std::vector<size_t>{4095, 4096, 4097, 65536 + 960,
                                      (size_t{1} << 20) + 13}) {
    sizes.push_back(n);
  }
  for (size_t n : sizes) {
    const std::vector<unsigned char> v = RandomBytes(n, rng);
    const uint64_t hash_seed = n % 3 == 0 ? 0 : rng();
    ASSERT_EQ(Hash(v, hash_seed), Reference(v, hash_seed)) << n << " bytes";
  }
}

TEST_P(ChecksumTargetTest, TheSameBytesHashTheSameAtAnyAddress) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "random seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<unsigned char> v = RandomBytes(5000, rng);
  std::vector<unsigned char> shifted(v.size() + 64);
  for (size_t offset = 0; offset < 64; ++offset) {
    std::memcpy(shifted.data() + offset, v.data(), v.size());
    ASSERT_EQ(StripeHash64(shifted.data() + offset, v.size(), 9), Hash(v, 9))
        << "offset " << offset;
  }
}

TEST(ChecksumTest, EveryTargetGivesTheSameHash) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "random seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<unsigned char> v = RandomBytes((1 << 20) + 777, rng);
  std::vector<uint64_t> hashes;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    hashes.push_back(Hash(v, 3));
  }
  hwy::SetSupportedTargetsForTest(0);
  ASSERT_FALSE(hashes.empty());
  for (uint64_t h : hashes) EXPECT_EQ(h, hashes[0]);
}

TEST(ChecksumTest, AnySingleBitFlipChangesTheHash) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "random seed " << seed);
  std::mt19937_64 rng(seed);
  // Three blocks and a partial stripe: every lane, stripe and block place.
  std::vector<unsigned char> v = RandomBytes(3 * 1024 + 40, rng);
  const uint64_t clean = Hash(v);
  for (size_t byte = 0; byte < v.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      v[byte] ^= static_cast<unsigned char>(1u << bit);
      ASSERT_NE(Hash(v), clean) << "byte " << byte << " bit " << bit;
      v[byte] ^= static_cast<unsigned char>(1u << bit);
    }
  }
  EXPECT_EQ(Hash(v), clean);
}

TEST(ChecksumTest, MovedDataChangesTheHash) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "random seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<unsigned char> v = RandomBytes(64 * 1024, rng);
  const uint64_t clean = Hash(v);
  auto swapped = [&](size_t a, size_t b, size_t len) {
    std::vector<unsigned char> w = v;
    std::swap_ranges(w.begin() + a, w.begin() + a + len, w.begin() + b);
    return Hash(w);
  };
  // Two words of a stripe, two stripes of a block, two blocks, two pages.
  EXPECT_NE(swapped(0, 8, 8), clean);
  EXPECT_NE(swapped(64, 192, 64), clean);
  EXPECT_NE(swapped(1024, 5 * 1024, 1024), clean);
  EXPECT_NE(swapped(4096, 3 * 4096, 4096), clean);
  // A page written where the next one belongs (a misdirected write).
  std::vector<unsigned char> w = v;
  std::copy(v.begin(), v.begin() + 4096, w.begin() + 4096);
  EXPECT_NE(Hash(w), clean);
}

TEST(ChecksumTest, ZerosOfEveryLengthAndSeedDiffer) {
  std::unordered_set<uint64_t> seen;
  std::vector<unsigned char> zeros;
  for (size_t n = 0; n <= 4096; ++n) {
    zeros.assign(n, 0);
    for (uint64_t seed : {0, 1, 2}) {
      EXPECT_TRUE(seen.insert(Hash(zeros, seed)).second)
          << n << " zero bytes, seed " << seed;
    }
  }
}

// Hashes of 1100 bytes, zero but for a counter at byte `at`.
void CountUpAt(size_t at) {
  std::unordered_set<uint64_t> seen;
  std::vector<int> ones(64, 0);
  constexpr int kInputs = 200000;
  std::vector<unsigned char> v(1100, 0);
  for (uint32_t i = 0; i < kInputs; ++i) {
    std::memcpy(v.data() + at, &i, sizeof(i));
    const uint64_t h = Hash(v);
    ASSERT_TRUE(seen.insert(h).second) << "input " << i;
    for (int b = 0; b < 64; ++b) ones[b] += (h >> b) & 1;
  }
  for (int b = 0; b < 64; ++b) {
    // Binomial(200000, 0.5): a standard deviation of 224; 8 of them.
    EXPECT_NEAR(ones[b], kInputs / 2, 1800) << "bit " << b;
  }
}

TEST(ChecksumTest, ManyInputsCollideNowhereAndSetBitsEvenly) {
  // 200000 inputs counting up (the weakest kind: few bits differ), the
  // counter in the first block (the SIMD loop's) and in the tail stripes:
  // no two hashes collide, and each output bit is set in about half.
  for (size_t at : {size_t{100}, size_t{1030}}) {
    SCOPED_TRACE(::testing::Message() << "counter at byte " << at);
    CountUpAt(at);
  }
}

}  // namespace
}  // namespace mlp_offload
