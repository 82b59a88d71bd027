// A fast 64-bit checksum of a byte span (StripeHash64), for detecting state
// that was corrupted, torn or misplaced on its way through storage. Not a
// cryptographic hash: it does not resist a chosen collision.
//
// The data is read as 64-byte stripes of eight little-endian 64-bit words,
// each word w of stripe s of its 1 KiB block feeding two of eight 64-bit
// accumulators: lane l gains lo32(w ^ key[s][l]) * hi32(w ^ key[s][l]) and its
// neighbour lane l^1 gains w itself (so a word's change always reaches a
// lane, whatever the product does). At each block's end every lane is
// scrambled bijectively (xor-shift, xor key, times an odd 32-bit prime), so
// the blocks' order matters; within a block the per-stripe keys make the
// stripes' order matter. A last partial stripe is zero-padded; the length and
// the seed go into the final fold of the eight lanes.
//
// The lanes are independent but for the neighbour pairs, which lie in one
// 128-bit block, so the result is the same for every SIMD width and target
// (checked in the tests against a plain implementation). The constants are
// part of the state records' format (format version 2).
#ifndef MLP_OFFLOAD_KERNELS_CHECKSUM_H_
#define MLP_OFFLOAD_KERNELS_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace mlp_offload {

// StripeHash64 of the n bytes at data (any alignment) with the given seed, on
// the best SIMD target of this CPU. One thread; callers split large spans.
uint64_t StripeHash64(const void* data, size_t n, uint64_t seed);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_CHECKSUM_H_
