// Tests of the optimizer kernels on every SIMD target compiled in and
// supported by this CPU (dispatch forced with hwy::SetSupportedTargetsForTest)
// against a float64 reference written here, on fresh random data.
#include "kernels/optimizer_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hwy/highway.h"
#include "hwy/targets.h"
#include "kernels/internal/per_target_test.h"
#include "kernels/target_info.h"
#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {
namespace {

// ----------------------------------------------------------------------------
// Bit-exact scalar references for the dtype conversions, written with double
// arithmetic and nearbyint (ties to even in the default rounding mode) rather
// than with the bit tricks of the kernels, so that the two are independent.

uint32_t BitsOf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t RefF32ToBF16(float f) {
  const uint32_t bits = BitsOf(f);
  const uint16_t sign = (bits >> 16) & 0x8000;
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f) || a == 0.0) return static_cast<uint16_t>(bits >> 16);
  int e;
  std::frexp(a, &e);                      // a in [2^(e-1), 2^e)
  const int exp = std::max(e - 1, -126);  // subnormals share the min quantum
  const double quantum = std::ldexp(1.0, exp - 7);
  const double r = std::nearbyint(a / quantum) * quantum;
  if (r >= std::ldexp(1.0, 128)) return sign | 0x7F80;
  return sign | static_cast<uint16_t>(BitsOf(static_cast<float>(r)) >> 16);
}

uint16_t RefF32ToF16(float f) {
  const uint32_t bits = BitsOf(f);
  const uint16_t sign = (bits >> 16) & 0x8000;
  if (std::isnan(f)) {
    return sign | 0x7E00 | static_cast<uint16_t>((bits >> 13) & 0x3FF);
  }
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;  // rounds to Inf (Inf included)
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);
  const int exp = std::max(e - 1, -14);
  const double quantum = std::ldexp(1.0, exp - 10);
  const double r = std::nearbyint(a / quantum);
  const double v = r * quantum;
  if (v < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(r);
  int e2;
  std::frexp(v, &e2);
  const int ue = e2 - 1;
  const auto mant =
      static_cast<uint16_t>(v / std::ldexp(1.0, ue - 10) - 1024.0);
  return sign | static_cast<uint16_t>((ue + 15) << 10) | mant;
}

float RefF16ToF32(uint16_t h) {
  const bool negative = (h & 0x8000) != 0;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  if (e == 31) {
    if (m == 0) {
      return negative ? -std::numeric_limits<float>::infinity()
                      : std::numeric_limits<float>::infinity();
    }
    // NaN: payload kept, quiet bit set.
    return FloatOf((negative ? 0x80000000u : 0u) | 0x7FC00000u |
                   (static_cast<uint32_t>(m) << 13));
  }
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return static_cast<float>(negative ? -v : v);
}

float RefBF16ToF32(uint16_t h) {
  return FloatOf(static_cast<uint32_t>(h) << 16);
}

uint16_t RefFromF32(float f, DType dtype) {
  return dtype == DType::kBFloat16 ? RefF32ToBF16(f) : RefF32ToF16(f);
}

// ----------------------------------------------------------------------------
// Float64 reference of one element's update. Besides each result it returns
// its magnitude: the sum of the absolute values of the terms that were added
// to produce it (propagated through the formulas). An fp32 computation's
// error is bounded relative to that magnitude, not to the result, which can
// be near zero after cancellation; the tests require |kernel - ref| <=
// 1e-6 * magnitude (a few fp32 roundings).
struct RefResult {
  double p = 0, mag_p = 0;
  double s[3] = {0, 0, 0};
  double mag_s[3] = {0, 0, 0};
};

RefResult RefUpdate(const OptimizerHyperparams& hp, double grad_scale,
                    double grad, double p, const double s[3]) {
  RefResult r;
  double g = grad * grad_scale;
  if (hp.maximize) g = -g;
  const double wd = hp.weight_decay, lr = hp.lr;
  const double step = static_cast<double>(hp.step);
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      double mag_g = std::fabs(g);
      double p1 = p;
      if (hp.kind == OptimizerKind::kAdam) {
        // As torch: no decay term at all for weight_decay 0 (0 * inf = NaN).
        if (wd != 0) {
          g += wd * p;
          mag_g += std::fabs(wd * p);
        }
      } else {
        p1 = p * (1.0 - lr * wd);
      }
      const double b1 = hp.beta1, b2 = hp.beta2;
      const double m = b1 * s[0] + (1.0 - b1) * g;
      const double mag_m = std::fabs(s[0]) + (1.0 - b1) * mag_g;
      const double v = b2 * s[1] + (1.0 - b2) * g * g;
      const double mag_v = b2 * std::fabs(s[1]) + (1.0 - b2) * mag_g * mag_g;
      double v_used = v;
      r.s[0] = m, r.mag_s[0] = mag_m;
      r.s[1] = v, r.mag_s[1] = mag_v;
      if (hp.amsgrad) {
        // torch.maximum: NaN if either is.
        v_used =
            std::isnan(s[2]) || std::isnan(v) ? s[2] + v : std::max(s[2], v);
        r.s[2] = v_used;
        r.mag_s[2] = std::max(std::fabs(s[2]), mag_v);
      }
      const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, step) : 1.0;
      const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, step) : 1.0;
      const double denom = std::sqrt(v_used) / std::sqrt(bc2) + double{hp.eps};
      const double step_size = lr / bc1;
      r.p = p1 - step_size * m / denom;
      r.mag_p = std::fabs(p1) + step_size * mag_m / denom;
      return r;
    }
    case OptimizerKind::kSGD: {
      double mag_g = std::fabs(g);
      if (wd != 0) {
        mag_g += std::fabs(wd * p);
        g += wd * p;
      }
      double d = g, mag_d = mag_g;
      if (hp.momentum != 0.0f) {
        const double mom = hp.momentum;
        double buf, mag_buf;
        if (hp.step == 1) {
          buf = g, mag_buf = mag_g;
        } else {
          buf = mom * s[0] + (1.0 - double{hp.dampening}) * g;
          mag_buf = mom * std::fabs(s[0]) +
                    std::fabs(1.0 - double{hp.dampening}) * mag_g;
        }
        r.s[0] = buf, r.mag_s[0] = mag_buf;
        if (hp.nesterov) {
          d = g + mom * buf, mag_d = mag_g + mom * mag_buf;
        } else {
          d = buf, mag_d = mag_buf;
        }
      }
      r.p = p - lr * d;
      r.mag_p = std::fabs(p) + lr * mag_d;
      return r;
    }
    case OptimizerKind::kAdagrad: {
      double mag_g = std::fabs(g);
      if (wd != 0) {
        mag_g += std::fabs(wd * p);
        g += wd * p;
      }
      const double clr = lr / (1.0 + (step - 1.0) * double{hp.lr_decay});
      const double sum = s[0] + g * g;
      r.s[0] = sum, r.mag_s[0] = std::fabs(s[0]) + mag_g * mag_g;
      const double std_dev = std::sqrt(sum) + double{hp.eps};
      r.p = p - clr * g / std_dev;
      r.mag_p = std::fabs(p) + clr * mag_g / std_dev;
      return r;
    }
    case OptimizerKind::kLion: {
      const double b1 = hp.beta1, b2 = hp.beta2;
      const double c = b1 * s[0] + (1.0 - b1) * g;
      const double mag_c = b1 * std::fabs(s[0]) + (1.0 - b1) * std::fabs(g);
      const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      const double p1 = p * (1.0 - lr * wd);
      r.p = p1 - lr * sign;
      r.mag_p = std::fabs(p1) + lr;
      // Within rounding of zero the sign of c is not defined by fp32 math:
      // either neighbouring answer is accepted.
      if (std::fabs(c) <= 1e-6 * mag_c) r.mag_p += 2.0 * lr * 1e6;
      r.s[0] = b2 * s[0] + (1.0 - b2) * g;
      r.mag_s[0] = b2 * std::fabs(s[0]) + (1.0 - b2) * std::fabs(g);
      return r;
    }
  }
  return r;
}

constexpr double kTolerance = 1e-6;

// ----------------------------------------------------------------------------
// Test problems.

struct NamedConfig {
  std::string name;
  OptimizerHyperparams hp;
};

std::vector<NamedConfig> AllConfigs() {
  std::vector<NamedConfig> configs;
  auto add = [&](std::string name, OptimizerKind kind, int64_t step,
                 auto&& tweak) {
    OptimizerHyperparams hp;
    hp.kind = kind;
    hp.step = step;
    tweak(hp);
    configs.push_back({std::move(name), hp});
  };
  add("adam", OptimizerKind::kAdam, 1, [](OptimizerHyperparams&) {});
  add("adam_l2_amsgrad", OptimizerKind::kAdam, 7, [](OptimizerHyperparams& h) {
    h.weight_decay = 0.05f, h.amsgrad = true, h.lr = 3e-3f;
  });
  add("adam_maximize_nobc", OptimizerKind::kAdam, 3,
      [](OptimizerHyperparams& h) {
        h.maximize = true, h.bias_correction = false, h.beta1 = 0.8f;
        h.beta2 = 0.95f, h.eps = 1e-6f;
      });
  add("adamw", OptimizerKind::kAdamW, 10,
      [](OptimizerHyperparams& h) { h.weight_decay = 0.1f, h.lr = 1e-2f; });
  add("adamw_amsgrad_maximize", OptimizerKind::kAdamW, 2,
      [](OptimizerHyperparams& h) {
        h.weight_decay = 0.01f, h.amsgrad = true, h.maximize = true;
      });
  add("sgd", OptimizerKind::kSGD, 1,
      [](OptimizerHyperparams& h) { h.lr = 0.1f; });
  add("sgd_momentum_first_step", OptimizerKind::kSGD, 1,
      [](OptimizerHyperparams& h) {
        h.lr = 0.05f, h.momentum = 0.9f, h.dampening = 0.1f;
        h.weight_decay = 1e-3f;
      });
  add("sgd_momentum_dampening_wd", OptimizerKind::kSGD, 4,
      [](OptimizerHyperparams& h) {
        h.lr = 0.05f, h.momentum = 0.9f, h.dampening = 0.1f;
        h.weight_decay = 1e-3f;
      });
  add("sgd_nesterov_maximize", OptimizerKind::kSGD, 6,
      [](OptimizerHyperparams& h) {
        h.lr = 0.02f, h.momentum = 0.8f, h.nesterov = true, h.maximize = true;
      });
  // What torch's step does after a schedule changed momentum or dampening
  // under nesterov (its constructor alone refuses these): no momentum at
  // all, and nesterov over the dampened buffer.
  add("sgd_nesterov_momentum_0", OptimizerKind::kSGD, 4,
      [](OptimizerHyperparams& h) {
        h.lr = 0.03f, h.momentum = 0.0f, h.nesterov = true;
      });
  add("sgd_nesterov_dampening", OptimizerKind::kSGD, 3,
      [](OptimizerHyperparams& h) {
        h.lr = 0.02f, h.momentum = 0.9f, h.dampening = 0.2f, h.nesterov = true;
      });
  add("adagrad", OptimizerKind::kAdagrad, 1,
      [](OptimizerHyperparams& h) { h.lr = 0.01f; });
  add("adagrad_decay_wd_maximize", OptimizerKind::kAdagrad, 5,
      [](OptimizerHyperparams& h) {
        h.lr = 0.01f, h.lr_decay = 0.01f, h.weight_decay = 0.02f;
        h.maximize = true, h.eps = 1e-10f;
      });
  add("lion", OptimizerKind::kLion, 1, [](OptimizerHyperparams& h) {
    h.lr = 1e-4f, h.beta1 = 0.9f, h.beta2 = 0.99f;
  });
  add("lion_wd_maximize", OptimizerKind::kLion, 9, [](OptimizerHyperparams& h) {
    h.lr = 3e-4f, h.weight_decay = 0.1f, h.maximize = true;
    h.beta1 = 0.95f, h.beta2 = 0.98f;
  });
  return configs;
}

std::mt19937_64 FreshRng(uint64_t* seed_out) {
  const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                        std::random_device{}();
  *seed_out = seed;
  return std::mt19937_64(seed);
}

// Random initial values for one update of n elements. Every array has one
// spare element in front, and the spans start one element in, so that no
// pointer is vector-aligned.
struct Problem {
  size_t n = 0;
  std::vector<float> param;
  std::vector<float> state[3];
  std::vector<float> grad_f32;
  std::vector<uint16_t> grad_bf16, grad_f16;

  Problem(size_t n_in, std::mt19937_64& rng) : n(n_in) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, float scale, bool positive) {
      v.resize(n + 1);
      for (float& x : v) {
        x = normal(rng) * scale;
        if (positive) x = std::fabs(x);
      }
    };
    fill(param, 1.0f, false);
    fill(state[0], 0.1f, false);
    fill(state[1], 0.01f, true);
    fill(state[2], 0.02f, true);
    fill(grad_f32, 1.0f, false);
    grad_bf16.resize(n + 1);
    grad_f16.resize(n + 1);
    for (size_t i = 0; i <= n; ++i) {
      grad_bf16[i] = RefF32ToBF16(grad_f32[i]);
      grad_f16[i] = RefF32ToF16(grad_f32[i]);
    }
  }

  const void* grad(DType dtype) const {
    switch (dtype) {
      case DType::kFloat32:
        return grad_f32.data() + 1;
      case DType::kBFloat16:
        return grad_bf16.data() + 1;
      case DType::kFloat16:
        return grad_f16.data() + 1;
    }
    return nullptr;
  }

  // The gradient element as the kernel must see it (exact fp32 value).
  double GradValue(DType dtype, size_t i) const {
    switch (dtype) {
      case DType::kFloat32:
        return grad_f32[i + 1];
      case DType::kBFloat16:
        return RefBF16ToF32(grad_bf16[i + 1]);
      case DType::kFloat16:
        return RefF16ToF32(grad_f16[i + 1]);
    }
    return 0;
  }
};

// Mutable copies of a problem's parameter and state arrays, plus the model
// dtype output.
struct Outputs {
  std::vector<float> param;
  std::vector<float> state[3];
  std::vector<uint8_t> param_out;

  explicit Outputs(const Problem& pb)
      : param(pb.param), state{pb.state[0], pb.state[1], pb.state[2]} {
    param_out.assign((pb.n + 1) * 4, 0xAB);
  }

  UpdateSpans Spans(const Problem& pb, DType grad_dtype, bool with_out,
                    DType out_dtype) {
    UpdateSpans spans;
    spans.param = param.data() + 1;
    for (int k = 0; k < 3; ++k) spans.state[k] = state[k].data() + 1;
    spans.grad = pb.grad(grad_dtype);
    spans.grad_dtype = grad_dtype;
    if (with_out) {
      spans.param_out = param_out.data() + DTypeSize(out_dtype);
      spans.param_out_dtype = out_dtype;
    }
    spans.n = pb.n;
    return spans;
  }
};

// Checks one update's results against the reference; returns the number of
// mismatching elements (reporting the first few).
size_t CheckAgainstReference(const OptimizerHyperparams& hp, float grad_scale,
                             const Problem& pb, DType grad_dtype,
                             const Outputs& out, bool with_out,
                             DType out_dtype) {
  size_t failures = 0;
  const int num_arrays = NumStateArrays(hp);
  auto report = [&](const char* what, size_t i, double got, double want,
                    double mag) {
    if (++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got << ", want " << want
                    << " (magnitude " << mag << ")";
    }
  };
  for (size_t i = 0; i < pb.n; ++i) {
    const double s[3] = {pb.state[0][i + 1], pb.state[1][i + 1],
                         pb.state[2][i + 1]};
    const RefResult ref = RefUpdate(hp, grad_scale, pb.GradValue(grad_dtype, i),
                                    pb.param[i + 1], s);
    const float p = out.param[i + 1];
    if (!(std::fabs(p - ref.p) <= kTolerance * ref.mag_p)) {
      report("param", i, p, ref.p, ref.mag_p);
    }
    for (int k = 0; k < num_arrays; ++k) {
      const float got = out.state[k][i + 1];
      if (!(std::fabs(got - ref.s[k]) <= kTolerance * ref.mag_s[k])) {
        report(StateArrayName(hp, k), i, got, ref.s[k], ref.mag_s[k]);
      }
    }
    // Unused state arrays must be untouched.
    for (int k = num_arrays; k < 3; ++k) {
      if (BitsOf(out.state[k][i + 1]) != BitsOf(pb.state[k][i + 1])) {
        report("unused state", i, out.state[k][i + 1], pb.state[k][i + 1], 0);
      }
    }
    // The fused model-dtype copy is exactly the fp32 result rounded.
    if (with_out) {
      const size_t size = DTypeSize(out_dtype);
      const uint8_t* at = out.param_out.data() + (i + 1) * size;
      if (out_dtype == DType::kFloat32) {
        float f;
        std::memcpy(&f, at, 4);
        if (BitsOf(f) != BitsOf(p)) report("param_out", i, f, p, 0);
      } else {
        uint16_t h;
        std::memcpy(&h, at, 2);
        const uint16_t want = RefFromF32(p, out_dtype);
        if (h != want) report("param_out bits", i, h, want, 0);
      }
    }
  }
  // Nothing written outside the span.
  if (with_out) {
    for (size_t b = 0; b < DTypeSize(out_dtype); ++b) {
      if (out.param_out[b] != 0xAB) report("param_out before span", b, 0, 0, 0);
    }
    for (size_t b = (pb.n + 1) * DTypeSize(out_dtype); b < out.param_out.size();
         ++b) {
      if (out.param_out[b] != 0xAB) report("param_out after span", b, 0, 0, 0);
    }
  }
  if (BitsOf(out.param[0]) != BitsOf(pb.param[0])) {
    report("param before span", 0, out.param[0], pb.param[0], 0);
  }
  return failures;
}

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16,
                                DType::kFloat16};
constexpr size_t kSizes[] = {0, 1, 7, 8, 9, 1000003};
constexpr size_t kLarge = 1000003;

// ----------------------------------------------------------------------------
// Every test below runs once per SIMD target (compiled in and supported).

class KernelTargetTest : public PerTargetTest {};

INSTANTIATE_TEST_SUITE_P(AllTargets, KernelTargetTest, AllSimdTargets(),
                         SimdTargetParamName);

TEST_P(KernelTargetTest, DispatchRunsTheForcedTarget) {
  EXPECT_EQ(SimdTargetName(), hwy::TargetName(GetParam()));
}

TEST_P(KernelTargetTest, EveryOptimizerMatchesFloat64Reference) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const std::vector<NamedConfig> configs = AllConfigs();
  for (size_t n : kSizes) {
    const Problem signed_state(n, rng);
    // Adagrad's accumulator is a sum of squares: never negative.
    Problem adagrad_state = signed_state;
    for (float& x : adagrad_state.state[0]) x = std::fabs(x);
    for (const NamedConfig& config : configs) {
      const Problem& pb = config.hp.kind == OptimizerKind::kAdagrad
                              ? adagrad_state
                              : signed_state;
      for (DType grad_dtype : kAllDTypes) {
        for (int out = -1; out < 3; ++out) {
          // The large size runs every optimizer with fp32 in and no copy out,
          // and every dtype combination for AdamW and SGD with momentum.
          const bool full_matrix = config.name == "adamw" ||
                                   config.name == "sgd_momentum_dampening_wd";
          if (n == kLarge && !full_matrix &&
              (grad_dtype != DType::kFloat32 || out != -1)) {
            continue;
          }
          const bool with_out = out >= 0;
          const DType out_dtype = with_out ? kAllDTypes[out] : DType::kFloat32;
          SCOPED_TRACE(absl::StrCat(
              config.name, " n=", n, " grad=", DTypeName(grad_dtype),
              " out=", with_out ? DTypeName(out_dtype) : "none"));
          const float grad_scale = grad_dtype == DType::kFloat32 ? 1.0f : 0.25f;
          Outputs outputs(pb);
          GradTransform transform;
          transform.grad_scale = grad_scale;
          absl::StatusOr<UpdateResult> result = ApplyOptimizer(
              config.hp, outputs.Spans(pb, grad_dtype, with_out, out_dtype),
              transform, nullptr);
          ASSERT_TRUE(result.ok()) << result.status();
          EXPECT_FALSE(result->nonfinite);
          EXPECT_FALSE(result->skipped);
          ASSERT_EQ(CheckAgainstReference(config.hp, grad_scale, pb, grad_dtype,
                                          outputs, with_out, out_dtype),
                    0u);
        }
      }
    }
  }
}

// torch adds the weight-decay term only when weight_decay != 0, so a
// parameter at +-inf stays there and its state stays finite; an
// unconditional g += 0 * p would make both NaN.
TEST_P(KernelTargetTest, InfiniteParametersWithoutDecayKeepFiniteState) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const size_t n = 1003;  // vector body and tail
  const Problem finite(n, rng);
  Problem with_inf = finite;
  const float inf = std::numeric_limits<float>::infinity();
  const size_t pos_plus[] = {0, 500, n - 1};
  with_inf.param[1 + 0] = inf;
  with_inf.param[1 + 500] = inf;
  with_inf.param[1 + n - 1] = inf;
  with_inf.param[1 + 5] = -inf;
  for (NamedConfig config : AllConfigs()) {
    config.hp.weight_decay = 0.0f;
    SCOPED_TRACE(config.name);
    Outputs want(finite), got(with_inf);
    if (config.hp.kind == OptimizerKind::kAdagrad) {
      // Adagrad's accumulator is state[0]: never negative.
      for (Outputs* o : {&want, &got}) {
        for (float& x : o->state[0]) x = std::fabs(x);
      }
    }
    for (Outputs* o : {&want, &got}) {
      const Problem& pb = o == &want ? finite : with_inf;
      absl::StatusOr<UpdateResult> result = ApplyOptimizer(
          config.hp, o->Spans(pb, DType::kFloat32, false, DType::kFloat32),
          GradTransform(), nullptr);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_FALSE(result->nonfinite);
    }
    for (size_t pos : pos_plus) EXPECT_EQ(got.param[1 + pos], inf) << pos;
    EXPECT_EQ(got.param[1 + 5], -inf);
    for (size_t i = 1; i <= n; ++i) {
      if (i - 1 == 5 || i - 1 == 0 || i - 1 == 500 || i - 1 == n - 1) continue;
      ASSERT_EQ(BitsOf(got.param[i]), BitsOf(want.param[i])) << i - 1;
    }
    // The state does not depend on the parameter without decay: bit for bit
    // what the finite problem produced, at the infinite positions too.
    for (int k = 0; k < NumStateArrays(config.hp); ++k) {
      for (size_t i = 1; i <= n; ++i) {
        ASSERT_EQ(BitsOf(got.state[k][i]), BitsOf(want.state[k][i]))
            << StateArrayName(config.hp, k) << "[" << i - 1 << "]";
      }
    }
  }
}

TEST_P(KernelTargetTest, NonfiniteGradientIsFlaggedInTheFusedPass) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  OptimizerHyperparams hp;  // AdamW
  const size_t n = 100003;
  const Problem clean(n, rng);
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  // Positions in the vector body, in the one-lane tail, and in a later chunk.
  const size_t positions[] = {0, 5, 65536 + 17, n - 1};
  for (DType dtype : kAllDTypes) {
    for (float bad : bad_values) {
      for (size_t pos : positions) {
        for (bool skip : {false, true}) {
          SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " value=", bad,
                                    " pos=", pos, " skip=", skip));
          Problem pb = clean;
          pb.grad_f32[pos + 1] = bad;
          pb.grad_bf16[pos + 1] = RefF32ToBF16(bad);
          pb.grad_f16[pos + 1] = RefF32ToF16(bad);
          Outputs outputs(pb);
          GradTransform transform;
          transform.skip_if_nonfinite = skip;
          absl::StatusOr<UpdateResult> result = ApplyOptimizer(
              hp, outputs.Spans(pb, dtype, true, DType::kBFloat16), transform,
              nullptr);
          ASSERT_TRUE(result.ok()) << result.status();
          EXPECT_TRUE(result->nonfinite);
          EXPECT_EQ(result->skipped, skip);
          if (skip) {
            // Nothing written at all.
            EXPECT_EQ(outputs.param, pb.param);
            for (int k = 0; k < 3; ++k)
              EXPECT_EQ(outputs.state[k], pb.state[k]);
            for (uint8_t b : outputs.param_out) ASSERT_EQ(b, 0xAB);
          } else {
            EXPECT_NE(outputs.param, pb.param);
          }
        }
      }
    }
  }
}

TEST_P(KernelTargetTest, AmsgradsMaximumKeepsNaNAsTorchsDoes) {
  // torch.maximum propagates NaN: a NaN max_exp_avg_sq stays NaN, and a
  // NaN gradient makes it NaN (nonfinite="ignore" steps them). x86's max
  // returned the other operand, so a NaN max could turn finite again.
  OptimizerHyperparams hp;
  hp.amsgrad = true;
  const size_t n = 37;  // a vector body and a one-lane tail on every target
  std::vector<float> param(n, 1.0f), m(n, 0.1f), v(n, 0.2f), vmax(n, 0.3f);
  std::vector<float> grad(n, 0.5f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const size_t nan_max[] = {3, n - 2}, nan_grad[] = {10, n - 1};
  for (size_t i : nan_max) vmax[i] = nan;
  for (size_t i : nan_grad) grad[i] = nan;
  UpdateSpans spans;
  spans.param = param.data();
  spans.state[0] = m.data();
  spans.state[1] = v.data();
  spans.state[2] = vmax.data();
  spans.grad = grad.data();
  spans.n = n;
  absl::StatusOr<UpdateResult> result =
      ApplyOptimizer(hp, spans, GradTransform{}, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->nonfinite);
  for (size_t i = 0; i < n; ++i) {
    const bool bad = i == nan_max[0] || i == nan_max[1] || i == nan_grad[0] ||
                     i == nan_grad[1];
    EXPECT_EQ(std::isnan(vmax[i]), bad) << i << ": " << vmax[i];
    EXPECT_EQ(std::isnan(param[i]), bad) << i << ": " << param[i];
  }
}

TEST_P(KernelTargetTest, ScaleOverflowCountsAsNonfinite) {
  OptimizerHyperparams hp;
  std::vector<float> param(9, 1.0f), m(9, 0.0f), v(9, 0.0f);
  std::vector<float> grad(9, 1.0f);
  grad[3] = 1e30f;  // finite, but not once scaled
  UpdateSpans spans;
  spans.param = param.data();
  spans.state[0] = m.data();
  spans.state[1] = v.data();
  spans.grad = grad.data();
  spans.n = grad.size();
  GradTransform transform;
  transform.grad_scale = 1e10f;
  absl::StatusOr<UpdateResult> result =
      ApplyOptimizer(hp, spans, transform, nullptr);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->nonfinite);
  transform.grad_scale = 1e-10f;
  result = ApplyOptimizer(hp, spans, transform, nullptr);
  ASSERT_TRUE(result.ok());
  EXPECT_FALSE(result->nonfinite);
}

TEST_P(KernelTargetTest, ResultsAreBitIdenticalForAnyThreadCount) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const Problem pb(kLarge, rng);
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kAdam;
  hp.amsgrad = true;
  hp.weight_decay = 0.01f;
  hp.step = 4;
  Outputs serial(pb);
  ASSERT_TRUE(
      ApplyOptimizer(hp,
                     serial.Spans(pb, DType::kBFloat16, true, DType::kBFloat16),
                     GradTransform(), nullptr)
          .ok());
  const GradStats serial_stats = ComputeGradStats(
      pb.grad(DType::kFloat32), DType::kFloat32, pb.n, 0.5f, nullptr);
  for (int threads : {1, 2, 3, 5}) {
    SCOPED_TRACE(absl::StrCat(threads, " threads"));
    ThreadPool pool(threads);
    Outputs parallel(pb);
    absl::StatusOr<UpdateResult> result = ApplyOptimizer(
        hp, parallel.Spans(pb, DType::kBFloat16, true, DType::kBFloat16),
        GradTransform(), &pool);
    ASSERT_TRUE(result.ok());
    EXPECT_FALSE(result->nonfinite);
    EXPECT_EQ(std::memcmp(parallel.param.data(), serial.param.data(),
                          serial.param.size() * 4),
              0);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(std::memcmp(parallel.state[k].data(), serial.state[k].data(),
                            serial.state[k].size() * 4),
                0);
    }
    EXPECT_EQ(parallel.param_out, serial.param_out);
    const GradStats stats = ComputeGradStats(
        pb.grad(DType::kFloat32), DType::kFloat32, pb.n, 0.5f, &pool);
    EXPECT_EQ(std::memcmp(&stats.sum_squares, &serial_stats.sum_squares, 8), 0);
  }
}

TEST_P(KernelTargetTest, GradStatsMatchFloat64Reference) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ThreadPool pool(2);
  for (size_t n : kSizes) {
    const Problem pb(n, rng);
    for (DType dtype : kAllDTypes) {
      SCOPED_TRACE(absl::StrCat("n=", n, " ", DTypeName(dtype)));
      const float scale = 0.125f;
      double want = 0.0;
      for (size_t i = 0; i < n; ++i) {
        const double g = pb.GradValue(dtype, i) * scale;
        want += g * g;
      }
      const GradStats stats =
          ComputeGradStats(pb.grad(dtype), dtype, n, scale, &pool);
      EXPECT_FALSE(stats.nonfinite);
      EXPECT_NEAR(stats.sum_squares, want, 1e-12 * want);
    }
  }
  std::vector<uint16_t> grad(20, RefF32ToBF16(1.0f));
  grad[13] = RefF32ToBF16(std::numeric_limits<float>::infinity());
  const GradStats stats = ComputeGradStats(grad.data(), DType::kBFloat16,
                                           grad.size(), 1.0f, nullptr);
  EXPECT_TRUE(stats.nonfinite);
  EXPECT_TRUE(std::isnan(stats.sum_squares));
}

// AnyNonfinite is ComputeGradStats's flag in a cheaper pass: the same answer
// for finite gradients, one NaN or infinity anywhere (the vector loop, its
// four-way unrolled part, the tail), and a scale that overflows finite
// values to infinity.
TEST_P(KernelTargetTest, AnyNonfiniteAgreesWithGradStats) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  ThreadPool pool(2);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{63}, size_t{64},
                   size_t{65}, size_t{200003}}) {
    std::vector<float> g(n);
    for (float& x : g) x = std::uniform_real_distribution<float>(-4, 4)(rng);
    std::vector<size_t> where = {0, n / 2, n - 1};
    for (int k = 0; k < 4 && n > 0; ++k) {
      where.push_back(std::uniform_int_distribution<size_t>(0, n - 1)(rng));
    }
    for (DType dtype : kAllDTypes) {
      std::vector<uint16_t> half(n);
      auto as = [&](const std::vector<float>& v) -> const void* {
        if (dtype == DType::kFloat32) return v.data();
        for (size_t i = 0; i < n; ++i) {
          half[i] = dtype == DType::kBFloat16 ? RefF32ToBF16(v[i])
                                              : RefF32ToF16(v[i]);
        }
        return half.data();
      };
      auto check = [&](const std::vector<float>& v, float scale, bool want) {
        const void* grad = as(v);
        for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
          EXPECT_EQ(AnyNonfinite(grad, dtype, n, scale, p), want);
          EXPECT_EQ(ComputeGradStats(grad, dtype, n, scale, p).nonfinite, want);
        }
      };
      SCOPED_TRACE(absl::StrCat("n=", n, " ", DTypeName(dtype)));
      check(g, 0.5f, false);
      if (n == 0) continue;
      for (size_t at : where) {
        std::vector<float> v = g;
        v[at] = 3.0f;  // scaled by the largest float: infinite
        check(v, std::numeric_limits<float>::max(), true);
        for (float bad : {inf, -inf, nan}) {
          SCOPED_TRACE(absl::StrCat("element ", at, " = ", bad));
          v = g;
          v[at] = bad;
          check(v, 1.0f, true);
        }
      }
    }
  }
}

// Values that exercise rounding: every tie between neighbouring bf16 and fp16
// values and the floats right next to it, subnormals of both formats, the
// overflow threshold, signed zeros, infinities and NaNs (quiet and
// signalling, with payloads), and random bit patterns.
std::vector<float> RoundingCases(std::mt19937_64& rng) {
  std::vector<float> cases;
  auto add_with_neighbours = [&](float f) {
    cases.push_back(f);
    cases.push_back(std::nextafter(f, std::numeric_limits<float>::infinity()));
    cases.push_back(std::nextafter(f, -std::numeric_limits<float>::infinity()));
  };
  for (uint32_t h = 0; h < 0x10000; ++h) {
    // bf16 tie: half-way to the next bf16.
    add_with_neighbours(FloatOf((h << 16) | 0x8000u));
    // fp16 tie between h and h + 1, for finite non-negative h.
    if (h < 0x7C00) {
      const double lo = RefF16ToF32(static_cast<uint16_t>(h));
      const double hi =
          h + 1 == 0x7C00 ? 65536.0 : RefF16ToF32(static_cast<uint16_t>(h + 1));
      const float mid = static_cast<float>((lo + hi) / 2);
      add_with_neighbours(mid);
      add_with_neighbours(-mid);
      cases.push_back(static_cast<float>(lo));
    }
  }
  for (float f :
       {0.0f, -0.0f, 65504.0f, 65519.996f, 65520.0f, 1e-45f,
        std::numeric_limits<float>::min(),
        std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
        std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    add_with_neighbours(f);
  }
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FBFFFFFu,
                       0xFF812345u, 0x7FFFFFFFu, 0x7F80FFFFu}) {
    cases.push_back(FloatOf(nan));
  }
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) cases.push_back(FloatOf(bits(rng)));
  return cases;
}

TEST_P(KernelTargetTest, NarrowingIsBitExactRoundToNearestEven) {
  uint64_t seed;
  std::mt19937_64 rng = FreshRng(&seed);
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const std::vector<float> cases = RoundingCases(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    // One element in, so the output is unaligned.
    std::vector<uint16_t> out(cases.size() + 1, 0);
    ConvertFromFloat32(cases.data(), out.data() + 1, dtype, cases.size(),
                       nullptr);
    size_t failures = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const uint16_t want = RefFromF32(cases[i], dtype);
      if (out[i + 1] != want && ++failures <= 10) {
        ADD_FAILURE() << std::hex << "f32 bits 0x" << BitsOf(cases[i])
                      << ": got 0x" << out[i + 1] << ", want 0x" << want;
      }
    }
    EXPECT_EQ(failures, 0u);
  }
}

TEST_P(KernelTargetTest, WideningIsExactForEveryBitPattern) {
  std::vector<uint16_t> all(0x10000 + 1);
  for (uint32_t h = 0; h < 0x10000; ++h) all[h + 1] = static_cast<uint16_t>(h);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<float> out(0x10000 + 1);
    ConvertToFloat32(all.data() + 1, dtype, out.data() + 1, 0x10000, nullptr);
    size_t failures = 0;
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const auto bits16 = static_cast<uint16_t>(h);
      const float want = dtype == DType::kBFloat16 ? RefBF16ToF32(bits16)
                                                   : RefF16ToF32(bits16);
      if (BitsOf(out[h + 1]) != BitsOf(want) && ++failures <= 10) {
        ADD_FAILURE() << std::hex << "bits 0x" << h << ": got 0x"
                      << BitsOf(out[h + 1]) << ", want 0x" << BitsOf(want);
      }
    }
    EXPECT_EQ(failures, 0u);
  }
}

TEST_P(KernelTargetTest, FusedGradientConversionMatchesConvertToFloat32) {
  // The gradient the fused update sees is the same fp32 value the eager
  // conversion produces: SGD with lr 1 and nothing else gives p - g.
  std::vector<uint16_t> all(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) all[h] = static_cast<uint16_t>(h);
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kSGD;
  hp.lr = 1.0f;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<float> converted(all.size());
    ConvertToFloat32(all.data(), dtype, converted.data(), all.size(), nullptr);
    std::vector<float> param(all.size(), 0.0f);
    UpdateSpans spans;
    spans.param = param.data();
    spans.grad = all.data();
    spans.grad_dtype = dtype;
    spans.n = all.size();
    ASSERT_TRUE(ApplyOptimizer(hp, spans, GradTransform(), nullptr).ok());
    for (size_t i = 0; i < all.size(); ++i) {
      if (std::isnan(converted[i])) {
        ASSERT_TRUE(std::isnan(param[i])) << i;
      } else {
        ASSERT_EQ(param[i], -converted[i]) << i;
      }
    }
  }
}

TEST_P(KernelTargetTest, InitStateFillsEveryArray) {
  ThreadPool pool(2);
  const size_t n = 200001;
  std::vector<float> a(n, 7.0f), b(n, 7.0f), c(n, 7.0f);
  float* const state[3] = {a.data(), b.data(), c.data()};
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kAdagrad;
  hp.initial_accumulator_value = 0.25f;
  InitState(hp, state, n, &pool);
  EXPECT_EQ(a, std::vector<float>(n, 0.25f));
  EXPECT_EQ(b, std::vector<float>(n, 7.0f));  // Adagrad has one array
  hp.kind = OptimizerKind::kAdam;
  hp.amsgrad = true;
  InitState(hp, state, n, &pool);
  for (const auto* v : {&a, &b, &c}) EXPECT_EQ(*v, std::vector<float>(n, 0.0f));
}

// ----------------------------------------------------------------------------
// Target-independent behaviour.

TEST(OptimizerKernelsTest, InvalidArgumentsAreRejected) {
  std::vector<float> p(4, 0.0f), m(4, 0.0f), v(4, 0.0f), g(4, 1.0f);
  UpdateSpans spans;
  spans.param = p.data();
  spans.state[0] = m.data();
  spans.state[1] = v.data();
  spans.grad = g.data();
  spans.n = 4;
  auto code = [&](const OptimizerHyperparams& hp, const UpdateSpans& s,
                  GradTransform t = GradTransform()) {
    return ApplyOptimizer(hp, s, t, nullptr).status().code();
  };
  OptimizerHyperparams hp;
  EXPECT_EQ(code(hp, spans), absl::StatusCode::kOk);
  auto bad = [&](auto&& tweak) {
    OptimizerHyperparams h;
    tweak(h);
    return code(h, spans);
  };
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.lr = -1.0f; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.beta1 = 1.0f; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.beta2 = std::nanf(""); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.eps = -1e-8f; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.step = 0; }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](OptimizerHyperparams& h) {
              h.kind = OptimizerKind::kAdagrad;
              h.lr_decay = -0.1f;
            }),
            absl::StatusCode::kInvalidArgument);
  // amsgrad needs a third state array.
  EXPECT_EQ(bad([](OptimizerHyperparams& h) { h.amsgrad = true; }),
            absl::StatusCode::kInvalidArgument);
  UpdateSpans no_grad = spans;
  no_grad.grad = nullptr;
  EXPECT_EQ(code(hp, no_grad), absl::StatusCode::kInvalidArgument);
  UpdateSpans no_param = spans;
  no_param.param = nullptr;
  EXPECT_EQ(code(hp, no_param), absl::StatusCode::kInvalidArgument);
  UpdateSpans empty;  // n == 0 needs no pointers
  EXPECT_EQ(code(hp, empty), absl::StatusCode::kOk);
  GradTransform nan_scale;
  nan_scale.grad_scale = std::nanf("");
  EXPECT_EQ(code(hp, spans, nan_scale), absl::StatusCode::kInvalidArgument);
}

TEST(OptimizerKernelsTest, NamesRoundTrip) {
  for (DType dtype : kAllDTypes) {
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(dtype));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("torch.float32"), DType::kFloat32);
  EXPECT_EQ(ParseDType("int8").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  for (OptimizerKind kind :
       {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kSGD,
        OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
    absl::StatusOr<OptimizerKind> parsed =
        ParseOptimizerKind(OptimizerKindName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_FALSE(ParseOptimizerKind("rmsprop").ok());
}

TEST(OptimizerKernelsTest, StateArraysFollowTorchStateDict) {
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kAdam;
  EXPECT_EQ(NumStateArrays(hp), 2);
  EXPECT_STREQ(StateArrayName(hp, 0), "exp_avg");
  EXPECT_STREQ(StateArrayName(hp, 1), "exp_avg_sq");
  EXPECT_EQ(StateArrayName(hp, 2), nullptr);
  hp.amsgrad = true;
  EXPECT_EQ(NumStateArrays(hp), 3);
  EXPECT_STREQ(StateArrayName(hp, 2), "max_exp_avg_sq");
  hp.kind = OptimizerKind::kSGD;
  EXPECT_EQ(NumStateArrays(hp), 0);
  hp.momentum = 0.9f;
  EXPECT_EQ(NumStateArrays(hp), 1);
  EXPECT_STREQ(StateArrayName(hp, 0), "momentum_buffer");
  hp.kind = OptimizerKind::kAdagrad;
  EXPECT_STREQ(StateArrayName(hp, 0), "sum");
  hp.kind = OptimizerKind::kLion;
  EXPECT_STREQ(StateArrayName(hp, 0), "exp_avg");
}

}  // namespace
}  // namespace mlp_offload
