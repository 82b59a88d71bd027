// Global-norm and non-finite statistics of gradients that live on a CUDA
// device, computed there (before the device-to-host copy) so gradient
// clipping and loss-scale checks need no extra pass over host memory.
// Built only under --config=cuda.
#ifndef MLP_OFFLOAD_GPU_GRAD_STATS_H_
#define MLP_OFFLOAD_GPU_GRAD_STATS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/optimizer_kernels.h"

namespace mlp_offload {

// Enqueues on `stream` (a cudaStream_t of CUDA device `device`, as an opaque
// pointer) the accumulation
// of the sum of squares of `n` gradient elements of `dtype` at device address
// `grad` into *sumsq (fp32, device) and of a NaN/Inf flag into *nonfinite
// (int32, device, set to 1, never cleared). Asynchronous. InvalidArgument for
// an unsupported dtype, Internal for a launch failure.
[[nodiscard]] absl::Status EnqueueGradStats(int device, const void* grad,
                                            DType dtype, uint64_t n,
                                            float* sumsq, int32_t* nonfinite,
                                            void* stream);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_GPU_GRAD_STATS_H_
