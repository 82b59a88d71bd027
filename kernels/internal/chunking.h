// How the kernels split a span into tasks for the thread pool. Not API.
#ifndef MLP_OFFLOAD_KERNELS_INTERNAL_CHUNKING_H_
#define MLP_OFFLOAD_KERNELS_INTERNAL_CHUNKING_H_

#include <cstddef>
#include <functional>

#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {
namespace internal_kernels {

// Elements per task of the thread pool. Chunk boundaries depend only on this
// constant, never on the thread count, so every element sees the same vector
// width and the same tail handling whatever the pool size: results are
// bit-identical for any number of threads. 64 Ki fp32 elements are 256 KiB
// per stream: large enough to amortise a task, small enough to balance.
inline constexpr size_t kChunkElements = size_t{1} << 16;

inline size_t NumChunks(size_t n) {
  return (n + kChunkElements - 1) / kChunkElements;
}
inline size_t ChunkBegin(size_t chunk) { return chunk * kChunkElements; }
inline size_t ChunkEnd(size_t chunk, size_t n) {
  const size_t end = (chunk + 1) * kChunkElements;
  return end < n ? end : n;
}

// Runs fn(chunk) for every chunk of n elements, on the pool when there is
// more than one chunk and more than one thread (nullptr: calling thread).
inline void ForEachChunk(size_t n, ThreadPool* pool,
                         const std::function<void(size_t)>& fn) {
  const size_t num_chunks = NumChunks(n);
  if (pool == nullptr || pool->num_threads() <= 1 || num_chunks <= 1) {
    for (size_t c = 0; c < num_chunks; ++c) fn(c);
    return;
  }
  pool->ParallelFor(num_chunks, fn);
}

}  // namespace internal_kernels
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_INTERNAL_CHUNKING_H_
