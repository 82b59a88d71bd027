// absl::Status face of the gradient statistics kernel
// (gpu/internal/cuda_api.cu).
#include "gpu/grad_stats.h"

#include "absl/strings/str_cat.h"
#include "gpu/internal/cuda_api.h"

namespace mlp_offload {

absl::Status EnqueueGradStats(int device, const void* grad, DType dtype,
                              uint64_t n, float* sumsq, int32_t* nonfinite,
                              void* stream) {
  int type;
  switch (dtype) {
    case DType::kFloat32:
      type = internal_gpu::kGradFloat32;
      break;
    case DType::kBFloat16:
      type = internal_gpu::kGradBFloat16;
      break;
    case DType::kFloat16:
      type = internal_gpu::kGradFloat16;
      break;
    default:
      return absl::InvalidArgumentError(
          "EnqueueGradStats: unsupported gradient dtype");
  }
  const char* error = "";
  const int rc = internal_gpu::LaunchGradStats(device, grad, type, n, sumsq,
                                               nonfinite, stream, &error);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat(
        "gradient statistics kernel launch failed (", rc, "): ", error));
  }
  return absl::OkStatus();
}

}  // namespace mlp_offload
