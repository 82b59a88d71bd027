// Host buffers aligned for O_DIRECT (and, under --config=cuda, pinnable for
// DMA). Move-only; freed on destruction.
#ifndef MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_
#define MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_

#include <cstddef>

#include "absl/status/statusor.h"

namespace mlp_offload {

// Alignment of offsets, lengths and addresses for O_DIRECT on the
// filesystems we target (the logical block size is at most this).
inline constexpr size_t kDirectIoAlignment = 4096;

class AlignedBuffer {
 public:
  // Allocates `bytes` rounded up to a multiple of `alignment` (a power of
  // two), aligned to `alignment`, zero-filled. ResourceExhausted when the
  // allocation fails, InvalidArgument for a bad alignment.
  static absl::StatusOr<AlignedBuffer> Allocate(size_t bytes,
                                                size_t alignment = kDirectIoAlignment);

  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size() const { return size_; }  // the rounded-up size
  bool empty() const { return data_ == nullptr; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_
