// Aligned host buffers for O_DIRECT, optionally pinned through hooks.
#include "io/aligned_buffer.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace {

// Function-local statics: initialised on first use, whatever the order of
// static initialisers that allocate buffers.
::mlp_offload::Mutex& HooksMutex() {
  static auto* mu = new ::mlp_offload::Mutex;
  return *mu;
}
HostPinningHooks& Hooks() {
  static auto* hooks = new HostPinningHooks;
  return *hooks;
}

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

}  // namespace

void SetHostPinningHooks(const HostPinningHooks& hooks) {
  ::mlp_offload::MutexLock lock(&HooksMutex());
  Hooks() = hooks;
}

bool HostPinningAvailable() {
  ::mlp_offload::MutexLock lock(&HooksMutex());
  return Hooks().pin != nullptr && Hooks().unpin != nullptr;
}

absl::StatusOr<AlignedBuffer> AlignedBuffer::Allocate(size_t bytes,
                                                      size_t alignment) {
  // posix_memalign also needs a multiple of sizeof(void*).
  if (!IsPowerOfTwo(alignment) || alignment < sizeof(void*)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AlignedBuffer::Allocate: alignment ", alignment,
                     " is not a power of two >= ", sizeof(void*)));
  }
  AlignedBuffer buffer;
  if (bytes == 0) return buffer;
  if (bytes > SIZE_MAX - alignment) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "AlignedBuffer::Allocate: ", bytes, " bytes is too large"));
  }
  const size_t rounded = (bytes + alignment - 1) & ~(alignment - 1);
  void* data = nullptr;
  const int rc = posix_memalign(&data, alignment, rounded);
  if (rc != 0 || data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "AlignedBuffer::Allocate: posix_memalign of ", rounded,
        " bytes aligned to ", alignment, " failed: ", std::strerror(rc)));
  }
  // Zero-filled so a buffer written to disk before being filled never leaks
  // old heap contents into a tier file.
  std::memset(data, 0, rounded);
  buffer.data_ = data;
  buffer.size_ = rounded;
  return buffer;
}

absl::StatusOr<AlignedBuffer> AlignedBuffer::AllocatePinned(size_t bytes,
                                                            size_t alignment) {
  absl::StatusOr<AlignedBuffer> buffer = Allocate(bytes, alignment);
  if (!buffer.ok() || buffer->empty()) return buffer;
  HostPinningHooks hooks;
  {
    ::mlp_offload::MutexLock lock(&HooksMutex());
    hooks = Hooks();
  }
  if (hooks.pin == nullptr || hooks.unpin == nullptr) return buffer;
  absl::Status pinned = hooks.pin(buffer->data_, buffer->size_);
  if (!pinned.ok()) {
    return absl::Status(pinned.code(), absl::StrCat("pinning ", buffer->size_,
                                                    " bytes of host memory: ",
                                                    pinned.message()));
  }
  buffer->unpin_ = hooks.unpin;
  return buffer;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      unpin_(std::exchange(other.unpin_, nullptr)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    unpin_ = std::exchange(other.unpin_, nullptr);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { Reset(); }

void AlignedBuffer::Reset() {
  if (data_ == nullptr) return;
  if (unpin_ != nullptr) unpin_(data_, size_);
  std::free(data_);
  data_ = nullptr;
  size_ = 0;
  unpin_ = nullptr;
}

}  // namespace mlp_offload
