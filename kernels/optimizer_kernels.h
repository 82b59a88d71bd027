// CPU optimizer kernels over raw spans: Adam, AdamW, SGD, Adagrad, Lion.
//
// One fused pass per call: the gradient is read in its training dtype
// (fp32/bf16/fp16), scaled (1/loss-scale, clip coefficient) and converted to
// fp32 in registers, the fp32 master parameters and state are updated in
// place, and optionally a copy of the new parameters is written in the
// model's dtype (round-to-nearest-even). Highway dynamic dispatch picks the
// best SIMD target at run time. Semantics are those of torch.optim's
// single-tensor implementations; the step count is passed in by the caller.
//
// Knows nothing of files, tiers or torch.
#ifndef MLP_OFFLOAD_KERNELS_OPTIMIZER_KERNELS_H_
#define MLP_OFFLOAD_KERNELS_OPTIMIZER_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {

// Element type of gradients and of the model's copy of the parameters.
enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Bytes per element of `dtype` (4 or 2).
size_t DTypeSize(DType dtype);
// "float32", "bfloat16" or "float16".
const char* DTypeName(DType dtype);
// Parses "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"/"half";
// InvalidArgument naming the string otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

enum class OptimizerKind : uint8_t { kAdam, kAdamW, kSGD, kAdagrad, kLion };

// "adam", "adamw", "sgd", "adagrad", "lion".
const char* OptimizerKindName(OptimizerKind kind);
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);

// Hyperparameters of one update. Fields not used by `kind` are ignored.
// Double, as torch's Python floats: the kernels' fp32 coefficients (1 - beta2,
// the bias corrections, lr / bias_correction1) are derived in double first,
// so they round as torch's do (1 - float(0.999) is 1.3e-5 off 0.001).
struct OptimizerHyperparams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double weight_decay =
      0.0;  // L2 for Adam/SGD/Adagrad; decoupled for AdamW/Lion
  bool maximize = false;
  // Adam, AdamW, Lion (Lion uses beta1 for the update, beta2 for the moment).
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;  // also Adagrad's eps
  bool amsgrad = false;
  bool bias_correction = true;
  // SGD.
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Adagrad.
  double lr_decay = 0.0;
  double initial_accumulator_value = 0.0;
  // 1-based count of updates applied to this state, this one included (what
  // torch keeps in state["step"] after incrementing it). SGD with momentum
  // initialises its buffer from the gradient when step == 1.
  int64_t step = 1;
};

// InvalidArgument naming the field if a hyperparameter is out of range
// (negative lr, beta outside [0, 1), nesterov without momentum, step < 1...).
absl::Status ValidateHyperparams(const OptimizerHyperparams& hp);

// Number of fp32 state arrays the optimizer keeps per parameter, in the order
// used by UpdateSpans::state:
//   Adam/AdamW: exp_avg, exp_avg_sq (+ max_exp_avg_sq if amsgrad)  -> 2 or 3
//   SGD: momentum_buffer if momentum != 0                          -> 0 or 1
//   Adagrad: sum                                                   -> 1
//   Lion: exp_avg                                                  -> 1
int NumStateArrays(const OptimizerHyperparams& hp);

// torch's state-dict key of state array `index` ("exp_avg", "sum", ...).
const char* StateArrayName(const OptimizerHyperparams& hp, int index);

// Fills the state arrays with their initial values (zeros; Adagrad's sum with
// initial_accumulator_value).
void InitState(const OptimizerHyperparams& hp, float* const state[3], size_t n,
               ThreadPool* pool);

// The spans of one update. Pointers need no particular alignment.
struct UpdateSpans {
  float* param = nullptr;  // fp32 master, updated in place
  float* state[3] = {nullptr, nullptr, nullptr};  // NumStateArrays() used
  const void* grad = nullptr;                     // n elements of grad_dtype
  DType grad_dtype = DType::kFloat32;
  void* param_out = nullptr;  // optional: n of param_out_dtype
  DType param_out_dtype = DType::kFloat32;
  size_t n = 0;
};

struct GradTransform {
  // The gradient is multiplied by this before use (1/loss_scale times a clip
  // coefficient); 1 leaves it unchanged.
  float grad_scale = 1.0f;
  // If true, the gradient is checked first and, when any element is NaN/Inf,
  // nothing at all is written (param, state and param_out are untouched).
  bool skip_if_nonfinite = false;
};

struct UpdateResult {
  bool nonfinite = false;  // some gradient element was NaN or Inf
  bool skipped = false;    // nothing was written (skip_if_nonfinite hit)
};

// Runs one optimizer update over `spans`, split in fixed-size chunks over
// `pool` (nullptr: calling thread). Results are bit-identical for any thread
// count. InvalidArgument for bad hyperparameters or missing spans.
[[nodiscard]] absl::StatusOr<UpdateResult> ApplyOptimizer(
    const OptimizerHyperparams& hp, const UpdateSpans& spans,
    const GradTransform& transform, ThreadPool* pool);

struct GradStats {
  bool nonfinite = false;
  double sum_squares = 0.0;  // of the scaled fp32 values; NaN if nonfinite
};

// One read-only pass over a gradient: the non-finite flag and the sum of
// squares (for a global norm / clip coefficient), deterministic for any
// thread count.
GradStats ComputeGradStats(const void* grad, DType dtype, size_t n,
                           float grad_scale, ThreadPool* pool);

// One read-only pass over a gradient: whether any element, scaled, is NaN or
// infinite (ComputeGradStats's flag without the sum of squares, which costs
// a double-precision pass: the pre-check of a step that skips on non-finite
// gradients).
bool AnyNonfinite(const void* grad, DType dtype, size_t n, float grad_scale,
                  ThreadPool* pool);

// Elementwise dtype conversions (round-to-nearest-even when narrowing), used
// by the baseline's eager gradient conversion and by checkpoints.
void ConvertToFloat32(const void* src, DType src_dtype, float* dst, size_t n,
                      ThreadPool* pool);
void ConvertFromFloat32(const float* src, void* dst, DType dst_dtype, size_t n,
                        ThreadPool* pool);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_OPTIMIZER_KERNELS_H_
