// Host buffers aligned for O_DIRECT (and, under --config=cuda, pinnable for
// DMA). Move-only; freed on destruction.
#ifndef MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_
#define MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlp_offload {

// Hooks that page-lock host memory for DMA (cudaHostRegister /
// cudaHostUnregister under --config=cuda). The default build has none; the GPU
// layer installs them once at start-up, before any pinned allocation, so the io
// layer never depends on CUDA.
struct HostPinningHooks {
  absl::Status (*pin)(void* data, size_t bytes) = nullptr;
  void (*unpin)(void* data, size_t bytes) = nullptr;
};
// Installs (or, with default-constructed hooks, removes) the pinning hooks.
// Buffers pinned earlier are unpinned with the hooks they were pinned with.
void SetHostPinningHooks(const HostPinningHooks& hooks);
// Whether pinning hooks are installed.
bool HostPinningAvailable();

// Alignment of offsets, lengths and addresses for O_DIRECT on the
// filesystems we target (the logical block size is at most this).
inline constexpr size_t kDirectIoAlignment = 4096;

class AlignedBuffer {
 public:
  // Allocates `bytes` rounded up to a multiple of `alignment` (a power of
  // two), aligned to `alignment`, zero-filled. ResourceExhausted when the
  // allocation fails, InvalidArgument for a bad alignment.
  static absl::StatusOr<AlignedBuffer> Allocate(
      size_t bytes, size_t alignment = kDirectIoAlignment);

  // Like Allocate, then pins the buffer through the installed hooks. Without
  // hooks the buffer is returned unpinned (pinned() is false): pinning only
  // speeds up device copies, it is never needed for correctness. A failing pin
  // hook's status is returned.
  static absl::StatusOr<AlignedBuffer> AllocatePinned(
      size_t bytes, size_t alignment = kDirectIoAlignment);

  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t size() const { return size_; }  // the rounded-up size
  bool empty() const { return data_ == nullptr; }
  bool pinned() const { return unpin_ != nullptr; }

 private:
  void Reset();

  void* data_ = nullptr;
  size_t size_ = 0;
  // Set while pinned: the hook that undoes the pin.
  void (*unpin_)(void*, size_t) = nullptr;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_ALIGNED_BUFFER_H_
