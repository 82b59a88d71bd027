// The few CUDA runtime calls the GPU layer needs, behind a plain C++
// interface with no CUDA types, so that only cuda_api.cu (compiled by nvcc)
// sees the CUDA headers. Every call returns a cudaError_t value (0: success)
// and, on failure, the runtime's message in *error.
#ifndef MLP_OFFLOAD_GPU_INTERNAL_CUDA_API_H_
#define MLP_OFFLOAD_GPU_INTERNAL_CUDA_API_H_

#include <cstddef>
#include <cstdint>

namespace mlp_offload {
namespace internal_gpu {

// Number of visible CUDA devices (0 and an error when there is no driver).
int DeviceCount(int* count, const char** error);

// cudaHostRegister(data, bytes, cudaHostRegisterPortable) / cudaHostUnregister,
// made with `device` current: the registration then lives in that device's
// primary context (the one torch uses), not in a context created on device 0,
// and is portable, i.e. pinned for every context. These calls and the
// kernel launch leave the thread's current device as they found it.
int HostRegister(int device, void* data, size_t bytes, const char** error);
int HostUnregister(int device, void* data, const char** error);

// Element types of a gradient, as the kernel reads them.
enum GradType : int { kGradFloat32 = 0, kGradBFloat16 = 1, kGradFloat16 = 2 };

// Enqueues, on `stream` (a cudaStream_t of `device`, made current first: the
// caller may be any thread, e.g. autograd's; null: the legacy default stream),
// a kernel that adds the sum of squares of the `n` elements at device address
// `grad` to *sumsq (one fp32 on the device) and sets *nonfinite (one int32 on
// the device) to 1 if any element is NaN or Inf. Asynchronous: the result is
// ready when the stream reaches that point.
int LaunchGradStats(int device, const void* grad, int type, uint64_t n,
                    float* sumsq, int* nonfinite, void* stream,
                    const char** error);

}  // namespace internal_gpu
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_GPU_INTERNAL_CUDA_API_H_
