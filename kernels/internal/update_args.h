// What the public entry points hand to the per-target SIMD code: the spans of
// one update and every scalar coefficient, already derived (in double, once
// per call) from the hyperparameters and the step count. Not API.
#ifndef MLP_OFFLOAD_KERNELS_INTERNAL_UPDATE_ARGS_H_
#define MLP_OFFLOAD_KERNELS_INTERNAL_UPDATE_ARGS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/optimizer_kernels.h"

namespace mlp_offload {
namespace internal_kernels {

// Per-call coefficients, all in fp32 as the vector code uses them. Fields a
// kind does not use are left at neutral values.
struct UpdateArgs {
  OptimizerKind kind = OptimizerKind::kAdamW;

  float* param = nullptr;
  float* state[3] = {nullptr, nullptr, nullptr};
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* param_out = nullptr;  // nullptr: no model-dtype copy
  DType param_out_dtype = DType::kFloat32;

  float grad_scale = 1.0f;
  // -0.0f when maximizing: XOR with it negates the gradient exactly, and XOR
  // with +0.0f leaves it bit-for-bit unchanged.
  float negate_mask = 0.0f;
  // g += l2_decay * p (Adam, SGD, Adagrad), only when has_l2: as in torch,
  // no decay term at all for weight_decay 0, so that an infinite parameter
  // does not turn its gradient into 0 * inf = NaN.
  float l2_decay = 0.0f;
  bool has_l2 = false;
  float param_decay = 1.0f;  // p *= param_decay (AdamW, Lion: 1 - lr * wd)

  // Adam/AdamW (bias corrections folded in); Lion's betas.
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;    // lr / bias_correction1 (Adam); clr (Adagrad)
  float inv_sqrt_bc2 = 1.0f;  // 1 / sqrt(bias_correction2)
  float eps = 1e-8f;
  bool amsgrad = false;

  // SGD.
  float lr = 1e-3f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  bool has_momentum = false;
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer starts as the gradient
};

}  // namespace internal_kernels
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_INTERNAL_UPDATE_ARGS_H_
