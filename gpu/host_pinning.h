// Page-locking of the io layer's aligned host buffers with cudaHostRegister,
// so that one buffer serves both O_DIRECT I/O and device DMA (no staging
// copy). Built only under --config=cuda; the io layer itself never depends on
// CUDA: it calls the hooks that InstallCudaHostPinning sets.
#ifndef MLP_OFFLOAD_GPU_HOST_PINNING_H_
#define MLP_OFFLOAD_GPU_HOST_PINNING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlp_offload {

// Number of visible CUDA devices; Unavailable (naming the runtime's reason)
// when there is no driver or no device.
[[nodiscard]] absl::StatusOr<int> CudaDeviceCount();

// Installs cudaHostRegister/cudaHostUnregister as the io layer's pinning
// hooks (AlignedBuffer::AllocatePinned), registering with `device` current
// (the device whose context the caller already uses). Unavailable when there
// is no CUDA device, InvalidArgument for a device out of range; then nothing
// is installed. Calling it again switches the device for the buffers pinned
// from then on; each buffer is unregistered with the device it was
// registered with.
[[nodiscard]] absl::Status InstallCudaHostPinning(int device = 0);

// Removes the hooks (buffers pinned earlier are still unpinned correctly).
void UninstallCudaHostPinning();

// Bytes currently registered through the hooks, and the number of
// registrations: both return to zero once every pinned buffer is freed (a
// buffer whose unregistration failed stays counted).
uint64_t CudaRegisteredHostBytes();
int64_t CudaRegisteredHostBuffers();

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_GPU_HOST_PINNING_H_
