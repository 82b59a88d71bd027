// cudaHostRegister-based pinning hooks for io/aligned_buffer.h.
#include "gpu/host_pinning.h"

#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "gpu/internal/cuda_api.h"
#include "io/aligned_buffer.h"

namespace mlp_offload {
namespace {

std::atomic<int> pin_device{0};
std::atomic<uint64_t> registered_bytes{0};
std::atomic<int64_t> registered_buffers{0};

// The device each registered buffer was registered with: an unregistration
// is made in that device's context, whichever device later installs the
// hooks (two optimizers on two devices in one process).
std::mutex devices_mu;
std::unordered_map<const void*, int>& DeviceOfBuffer() {
  static auto* devices = new std::unordered_map<const void*, int>();
  return *devices;
}

absl::Status Pin(void* data, size_t bytes) {
  const char* error = "";
  const int rc =
      internal_gpu::HostRegister(pin_device.load(), data, bytes, &error);
  if (rc != 0) {
    // cudaErrorMemoryAllocation (2): the OS would not lock that much memory.
    const std::string message = absl::StrCat(
        "cudaHostRegister of ", bytes, " bytes failed (", rc, "): ", error);
    return rc == 2 ? absl::ResourceExhaustedError(message)
                   : absl::InternalError(message);
  }
  {
    std::lock_guard<std::mutex> lock(devices_mu);
    DeviceOfBuffer()[data] = pin_device.load();
  }
  registered_bytes.fetch_add(bytes, std::memory_order_relaxed);
  registered_buffers.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void Unpin(void* data, size_t bytes) {
  int device = pin_device.load();
  {
    std::lock_guard<std::mutex> lock(devices_mu);
    auto it = DeviceOfBuffer().find(data);
    if (it != DeviceOfBuffer().end()) {
      device = it->second;
      DeviceOfBuffer().erase(it);
    }
  }
  const char* error = "";
  // A failure (the context is already torn down at exit) leaves nothing to
  // undo: the memory is freed right after, and the driver drops the
  // registration with the context. The buffer stays counted as registered,
  // so that CudaRegisteredHostBytes shows what was not unregistered.
  if (internal_gpu::HostUnregister(device, data, &error) != 0) return;
  registered_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  registered_buffers.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const char* error = "";
  if (internal_gpu::DeviceCount(&count, &error) != 0) {
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: ", error));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  return count;
}

absl::Status InstallCudaHostPinning(int device) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (device < 0 || device >= *count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", device, " does not exist (", *count, " visible)"));
  }
  pin_device.store(device);
  HostPinningHooks hooks;
  hooks.pin = &Pin;
  hooks.unpin = &Unpin;
  SetHostPinningHooks(hooks);
  return absl::OkStatus();
}

void UninstallCudaHostPinning() { SetHostPinningHooks(HostPinningHooks()); }

uint64_t CudaRegisteredHostBytes() {
  return registered_bytes.load(std::memory_order_relaxed);
}

int64_t CudaRegisteredHostBuffers() {
  return registered_buffers.load(std::memory_order_relaxed);
}

}  // namespace mlp_offload
