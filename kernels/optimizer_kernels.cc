// Optimizer kernels: the per-target SIMD code (compiled once per Highway
// target through foreach_target.h) and, under HWY_ONCE, the public entry
// points that derive the coefficients, split the span into fixed chunks and
// dispatch every chunk to the best target of the running CPU.
//
// Every optimizer's math lives in one class template over the vector tag:
// the body of a chunk instantiates it with full vectors, the tail with
// one-lane vectors (CappedTag<float, 1>), so there is no separate scalar
// version of any update.
#include "kernels/optimizer_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/internal/chunking.h"
#include "kernels/internal/update_args.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/thread_pool.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/optimizer_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mlp_offload {
namespace internal_kernels {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// x86 targets from AVX2 up have F16C, whose conversions round to nearest
// even and handle subnormals, Inf and NaN exactly. Highway 1.0.3's fallback
// for older targets truncates and turns Inf/NaN into finite numbers, so
// everywhere else the conversion is done on the bits (F16BitsToF32 /
// F32ToF16Bits below).
#undef MLP_OFFLOAD_HW_F16
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define MLP_OFFLOAD_HW_F16 1
#else
#define MLP_OFFLOAD_HW_F16 0
#endif

// Sentinel for "no model-dtype copy of the parameters".
constexpr int kNoOut = -1;

// ----------------------------------------------------------------------------
// Dtype conversions. All take a float tag D and work on the matching u32 /
// u16 lanes, so they are valid for full and one-lane vectors alike.

template <class D>
HWY_INLINE hn::Vec<D> BF16BitsToF32(D d,
                                    hn::Vec<hn::Rebind<uint16_t, D>> bits) {
  const hn::RebindToUnsigned<D> du32;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du32, bits)));
}

#if !MLP_OFFLOAD_HW_F16
template <class D>
HWY_INLINE hn::Vec<D> F16BitsToF32(D d, hn::Vec<hn::Rebind<uint16_t, D>> bits) {
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const auto h = hn::PromoteTo(du32, bits);
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du32, 0x8000u)));
  const auto exp = hn::And(hn::ShiftRight<10>(h), hn::Set(du32, 0x1Fu));
  const auto mant = hn::And(h, hn::Set(du32, 0x3FFu));
  // Normal: rebias the exponent from 15 to 127.
  const auto normal =
      hn::Or(hn::ShiftLeft<23>(hn::Add(exp, hn::Set(du32, 112u))),
             hn::ShiftLeft<13>(mant));
  // Inf/NaN: NaNs keep their payload and come out quiet, as with F16C.
  const auto quiet = hn::IfThenZeroElse(hn::Eq(mant, hn::Zero(du32)),
                                        hn::Set(du32, 0x00400000u));
  const auto inf_nan = hn::Or(hn::Or(hn::Set(du32, 0x7F800000u), quiet),
                              hn::ShiftLeft<13>(mant));
  // Zero/subnormal: mant * 2^-24 is an fp32 normal, so the product is exact
  // and immune to flush-to-zero / denormals-are-zero modes.
  const auto subnormal =
      hn::BitCast(du32, hn::Mul(hn::ConvertTo(d, hn::BitCast(di32, mant)),
                                hn::Set(d, 1.0f / 16777216.0f)));
  auto magnitude =
      hn::IfThenElse(hn::Eq(exp, hn::Zero(du32)), subnormal, normal);
  magnitude =
      hn::IfThenElse(hn::Eq(exp, hn::Set(du32, 0x1Fu)), inf_nan, magnitude);
  return hn::BitCast(d, hn::Or(sign, magnitude));
}

// fp32 -> fp16 bits (in u32 lanes), round to nearest even.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> F32ToF16Bits(D d, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const auto bits = hn::BitCast(du32, v);
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 0x8000u));
  const auto abs_bits = hn::And(bits, hn::Set(du32, 0x7FFFFFFFu));
  const auto abs_i = hn::BitCast(di32, abs_bits);
  // Normal range: rebias 127 -> 15 and round away the 13 low mantissa bits
  // to nearest even. A carry into the exponent is the right result, and every
  // magnitude from 65520 up (Inf included) lands on or past 0x7C00 (Inf).
  const auto rebiased = hn::Sub(abs_bits, hn::Set(du32, 112u << 23));
  const auto lsb = hn::And(hn::ShiftRight<13>(rebiased), hn::Set(du32, 1u));
  const auto rounded = hn::ShiftRight<13>(
      hn::Add(hn::Add(rebiased, hn::Set(du32, 0xFFFu)), lsb));
  const auto normal =
      hn::Min(hn::BitCast(di32, rounded), hn::Set(di32, 0x7C00));
  // Below 2^-14 (fp16 subnormals): adding 0.5 aligns the fp16 quantum 2^-24
  // with the ulp of 0.5, so the FPU's own round-to-nearest-even does the
  // rounding and the low bits of the sum are the fp16 mantissa (0x400 when it
  // rounds up to the smallest normal, which is also correct).
  const auto subnormal = hn::Sub(
      hn::BitCast(du32, hn::Add(hn::BitCast(d, abs_bits), hn::Set(d, 0.5f))),
      hn::Set(du32, 0x3F000000u));
  // NaN: keep the top of the payload and force the quiet bit, as F16C does.
  const auto nan =
      hn::Or(hn::Set(du32, 0x7E00u),
             hn::And(hn::ShiftRight<13>(abs_bits), hn::Set(du32, 0x3FFu)));
  auto magnitude = hn::IfThenElse(hn::Lt(abs_i, hn::Set(di32, 0x38800000)),
                                  hn::BitCast(di32, subnormal), normal);
  magnitude = hn::IfThenElse(hn::Gt(abs_i, hn::Set(di32, 0x7F800000)),
                             hn::BitCast(di32, nan), magnitude);
  return hn::Or(sign, hn::BitCast(du32, magnitude));
}
#endif  // !MLP_OFFLOAD_HW_F16

// fp32 -> bf16 bits (in u32 lanes), round to nearest even. Highway 1.0.3's
// DemoteTo truncates, hence the integer rounding.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> F32ToBF16Bits(D d, hn::Vec<D> v) {
  const hn::RebindToUnsigned<D> du32;
  const auto bits = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1u));
  const auto rounded =
      hn::ShiftRight<16>(hn::Add(hn::Add(bits, hn::Set(du32, 0x7FFFu)), lsb));
  // Rounding a NaN could carry it into Inf: truncate and set the quiet bit.
  const auto nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du32, 0x40u));
  return hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), nan, rounded);
}

// Loads Lanes(d) elements of dtype kT at base[i] as fp32.
template <DType kT, class D>
HWY_INLINE hn::Vec<D> LoadAsF32(D d, const void* HWY_RESTRICT base, size_t i) {
  if constexpr (kT == DType::kFloat32) {
    return hn::LoadU(d, static_cast<const float*>(base) + i);
  } else if constexpr (kT == DType::kBFloat16) {
    const hn::Rebind<uint16_t, D> du16;
    return BF16BitsToF32(
        d, hn::LoadU(du16, static_cast<const uint16_t*>(base) + i));
  } else {
#if MLP_OFFLOAD_HW_F16
    const hn::Rebind<hwy::float16_t, D> df16;
    return hn::PromoteTo(
        d, hn::LoadU(df16, static_cast<const hwy::float16_t*>(base) + i));
#else
    const hn::Rebind<uint16_t, D> du16;
    return F16BitsToF32(
        d, hn::LoadU(du16, static_cast<const uint16_t*>(base) + i));
#endif
  }
}

// Stores Lanes(d) fp32 values at base[i] as dtype kT (round to nearest even).
template <DType kT, class D>
HWY_INLINE void StoreFromF32(D d, hn::Vec<D> v, void* HWY_RESTRICT base,
                             size_t i) {
  if constexpr (kT == DType::kFloat32) {
    hn::StoreU(v, d, static_cast<float*>(base) + i);
  } else {
    const hn::Rebind<uint16_t, D> du16;
    const hn::RebindToSigned<D> di32;
    uint16_t* out = static_cast<uint16_t*>(base) + i;
    if constexpr (kT == DType::kBFloat16) {
      // The bits are < 2^16, so the saturating i32 -> u16 demotion is exact.
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, F32ToBF16Bits(d, v))),
                 du16, out);
    } else {
#if MLP_OFFLOAD_HW_F16
      const hn::Rebind<hwy::float16_t, D> df16;
      hn::StoreU(hn::DemoteTo(df16, v), df16,
                 reinterpret_cast<hwy::float16_t*>(out));
#else
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, F32ToF16Bits(d, v))),
                 du16, out);
#endif
    }
  }
}

// ----------------------------------------------------------------------------
// The update math, one class per optimizer. operator() takes the scaled fp32
// gradient and the old parameter, reads and writes the state at index i, and
// returns the new parameter. Coefficients are copied into vectors and the
// state pointers into members once per range, so the compiler need not
// reload them after each store (a float store may alias a float field).

template <class D>
class AdamUpdate {  // Adam (L2) and AdamW (decoupled): see UpdateArgs.
 public:
  using V = hn::Vec<D>;
  AdamUpdate(D d, const UpdateArgs& a)
      : m_(a.state[0]),
        v_(a.state[1]),
        vmax_(a.state[2]),
        amsgrad_(a.amsgrad),
        has_l2_(a.has_l2),
        negate_(hn::Set(d, a.negate_mask)),
        l2_(hn::Set(d, a.l2_decay)),
        decay_(hn::Set(d, a.param_decay)),
        one_minus_beta1_(hn::Set(d, a.one_minus_beta1)),
        beta2_(hn::Set(d, a.beta2)),
        one_minus_beta2_(hn::Set(d, a.one_minus_beta2)),
        step_size_(hn::Set(d, a.step_size)),
        inv_sqrt_bc2_(hn::Set(d, a.inv_sqrt_bc2)),
        eps_(hn::Set(d, a.eps)) {}

  HWY_INLINE V operator()(D d, V g, V p, size_t i) const {
    g = hn::Xor(g, negate_);
    if (has_l2_) g = hn::MulAdd(l2_, p, g);
    p = hn::Mul(p, decay_);
    V m = hn::LoadU(d, m_ + i);
    V v = hn::LoadU(d, v_ + i);
    m = hn::MulAdd(hn::Sub(g, m), one_minus_beta1_, m);  // torch's lerp
    // (1 - beta2) g first, as torch's addcmul: g * g alone overflows for
    // |g| > 1.8e19, whose scaled square is still finite.
    v = hn::MulAdd(hn::Mul(g, one_minus_beta2_), g, hn::Mul(v, beta2_));
    hn::StoreU(m, d, m_ + i);
    hn::StoreU(v, d, v_ + i);
    V v_used = v;
    if (amsgrad_) {
      // torch.maximum: NaN if either is (Max alone gives either, by target).
      const V vmax = hn::LoadU(d, vmax_ + i);
      v_used = hn::IfThenElse(hn::Or(hn::IsNaN(vmax), hn::IsNaN(v)),
                              hn::Add(vmax, v), hn::Max(vmax, v));
      hn::StoreU(v_used, d, vmax_ + i);
    }
    const V denom = hn::MulAdd(hn::Sqrt(v_used), inv_sqrt_bc2_, eps_);
    return hn::NegMulAdd(step_size_, hn::Div(m, denom), p);
  }

 private:
  float* HWY_RESTRICT m_;
  float* HWY_RESTRICT v_;
  float* HWY_RESTRICT vmax_;
  bool amsgrad_, has_l2_;
  V negate_, l2_, decay_, one_minus_beta1_, beta2_, one_minus_beta2_,
      step_size_, inv_sqrt_bc2_, eps_;
};

template <class D>
class SgdUpdate {
 public:
  using V = hn::Vec<D>;
  SgdUpdate(D d, const UpdateArgs& a)
      : buf_(a.state[0]),
        has_momentum_(a.has_momentum),
        nesterov_(a.nesterov),
        first_step_(a.first_step),
        has_l2_(a.has_l2),
        negate_(hn::Set(d, a.negate_mask)),
        l2_(hn::Set(d, a.l2_decay)),
        lr_(hn::Set(d, a.lr)),
        momentum_(hn::Set(d, a.momentum)),
        one_minus_dampening_(hn::Set(d, a.one_minus_dampening)) {}

  HWY_INLINE V operator()(D d, V g, V p, size_t i) const {
    g = hn::Xor(g, negate_);
    if (has_l2_) g = hn::MulAdd(l2_, p, g);
    if (has_momentum_) {
      // The first step copies the gradient rather than scaling a buffer that
      // may hold anything (torch clones the gradient).
      const V buf =
          first_step_ ? g
                      : hn::MulAdd(g, one_minus_dampening_,
                                   hn::Mul(hn::LoadU(d, buf_ + i), momentum_));
      hn::StoreU(buf, d, buf_ + i);
      g = nesterov_ ? hn::MulAdd(buf, momentum_, g) : buf;
    }
    return hn::NegMulAdd(lr_, g, p);
  }

 private:
  float* HWY_RESTRICT buf_;
  bool has_momentum_, nesterov_, first_step_, has_l2_;
  V negate_, l2_, lr_, momentum_, one_minus_dampening_;
};

template <class D>
class AdagradUpdate {
 public:
  using V = hn::Vec<D>;
  AdagradUpdate(D d, const UpdateArgs& a)
      : sum_(a.state[0]),
        has_l2_(a.has_l2),
        negate_(hn::Set(d, a.negate_mask)),
        l2_(hn::Set(d, a.l2_decay)),
        clr_(hn::Set(d, a.step_size)),
        eps_(hn::Set(d, a.eps)) {}

  HWY_INLINE V operator()(D d, V g, V p, size_t i) const {
    g = hn::Xor(g, negate_);
    if (has_l2_) g = hn::MulAdd(l2_, p, g);
    const V sum = hn::MulAdd(g, g, hn::LoadU(d, sum_ + i));
    hn::StoreU(sum, d, sum_ + i);
    return hn::NegMulAdd(clr_, hn::Div(g, hn::Add(hn::Sqrt(sum), eps_)), p);
  }

 private:
  float* HWY_RESTRICT sum_;
  bool has_l2_;
  V negate_, l2_, clr_, eps_;
};

template <class D>
class LionUpdate {
 public:
  using V = hn::Vec<D>;
  LionUpdate(D d, const UpdateArgs& a)
      : m_(a.state[0]),
        negate_(hn::Set(d, a.negate_mask)),
        decay_(hn::Set(d, a.param_decay)),
        lr_(hn::Set(d, a.lr)),
        beta1_(hn::Set(d, a.beta1)),
        one_minus_beta1_(hn::Set(d, a.one_minus_beta1)),
        beta2_(hn::Set(d, a.beta2)),
        one_minus_beta2_(hn::Set(d, a.one_minus_beta2)),
        one_(hn::Set(d, 1.0f)) {}

  HWY_INLINE V operator()(D d, V g, V p, size_t i) const {
    g = hn::Xor(g, negate_);
    const V m = hn::LoadU(d, m_ + i);
    const V c = hn::MulAdd(one_minus_beta1_, g, hn::Mul(beta1_, m));
    // sign(c): +-1, 0 for 0, NaN for NaN (as torch.sign).
    V sign = hn::IfThenZeroElse(hn::Eq(c, hn::Zero(d)), hn::CopySign(one_, c));
    sign = hn::IfThenElse(hn::IsNaN(c), c, sign);
    hn::StoreU(hn::MulAdd(one_minus_beta2_, g, hn::Mul(beta2_, m)), d, m_ + i);
    return hn::NegMulAdd(lr_, sign, hn::Mul(p, decay_));
  }

 private:
  float* HWY_RESTRICT m_;
  V negate_, decay_, lr_, beta1_, one_minus_beta1_, beta2_, one_minus_beta2_,
      one_;
};

// ----------------------------------------------------------------------------
// Range loops. Each processes whole vectors of d from i while they fit before
// `end` and returns where it stopped; called with a full tag for the body and
// with a one-lane tag for the rest.

template <template <class> class Op, DType kGrad, int kOut, class D>
HWY_INLINE size_t UpdateRange(D d, const UpdateArgs& a, size_t i, size_t end,
                              hn::Vec<D>& nonfinite) {
  const Op<D> op(d, a);
  float* HWY_RESTRICT param = a.param;
  const void* HWY_RESTRICT grad = a.grad;
  void* HWY_RESTRICT out = a.param_out;
  const auto scale = hn::Set(d, a.grad_scale);
  const auto zero = hn::Zero(d);
  const size_t N = hn::Lanes(d);
  for (; i + N <= end; i += N) {
    const auto g = hn::Mul(LoadAsF32<kGrad>(d, grad, i), scale);
    // 0 * g is NaN exactly when g is NaN or Inf, and NaN sticks in the sum:
    // one FMA per vector and no branch.
    nonfinite = hn::MulAdd(g, zero, nonfinite);
    const auto p = op(d, g, hn::LoadU(d, param + i), i);
    hn::StoreU(p, d, param + i);
    if constexpr (kOut != kNoOut) {
      StoreFromF32<static_cast<DType>(kOut)>(d, p, out, i);
    }
  }
  return i;
}

template <class D>
HWY_INLINE bool AnyNaN(D d, hn::Vec<D> v) {
  return !hn::AllFalse(d, hn::IsNaN(v));
}

template <template <class> class Op, DType kGrad, int kOut>
bool UpdateChunkT(const UpdateArgs& a, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  auto nonfinite = hn::Zero(d);
  const size_t i = UpdateRange<Op, kGrad, kOut>(d, a, begin, end, nonfinite);
  const hn::CappedTag<float, 1> d1;
  auto nonfinite1 = hn::Zero(d1);
  UpdateRange<Op, kGrad, kOut>(d1, a, i, end, nonfinite1);
  return AnyNaN(d, nonfinite) || AnyNaN(d1, nonfinite1);
}

template <template <class> class Op, DType kGrad>
bool UpdateChunkByOut(const UpdateArgs& a, size_t begin, size_t end) {
  if (a.param_out == nullptr) {
    return UpdateChunkT<Op, kGrad, kNoOut>(a, begin, end);
  }
  switch (a.param_out_dtype) {
    case DType::kFloat32:
      return UpdateChunkT<Op, kGrad, static_cast<int>(DType::kFloat32)>(
          a, begin, end);
    case DType::kBFloat16:
      return UpdateChunkT<Op, kGrad, static_cast<int>(DType::kBFloat16)>(
          a, begin, end);
    case DType::kFloat16:
      return UpdateChunkT<Op, kGrad, static_cast<int>(DType::kFloat16)>(
          a, begin, end);
  }
  return false;
}

template <template <class> class Op>
bool UpdateChunkByGrad(const UpdateArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kFloat32:
      return UpdateChunkByOut<Op, DType::kFloat32>(a, begin, end);
    case DType::kBFloat16:
      return UpdateChunkByOut<Op, DType::kBFloat16>(a, begin, end);
    case DType::kFloat16:
      return UpdateChunkByOut<Op, DType::kFloat16>(a, begin, end);
  }
  return false;
}

// Updates [begin, end); returns whether any scaled gradient was NaN/Inf.
bool UpdateChunk(const UpdateArgs& a, size_t begin, size_t end) {
  switch (a.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return UpdateChunkByGrad<AdamUpdate>(a, begin, end);
    case OptimizerKind::kSGD:
      return UpdateChunkByGrad<SgdUpdate>(a, begin, end);
    case OptimizerKind::kAdagrad:
      return UpdateChunkByGrad<AdagradUpdate>(a, begin, end);
    case OptimizerKind::kLion:
      return UpdateChunkByGrad<LionUpdate>(a, begin, end);
  }
  return false;
}

// ----------------------------------------------------------------------------
// Gradient-only passes.

// x * 0 is 0 for a finite scaled gradient element x and NaN for an
// infinite or NaN one; summed into `nonfinite`, NaN stays. Four independent
// sums: one would chain every vector through the FMA's latency.
template <DType kGrad, class D>
HWY_INLINE size_t NonfiniteRange(D d, const void* HWY_RESTRICT grad,
                                 float grad_scale, size_t i, size_t end,
                                 hn::Vec<D>& nonfinite) {
  const auto scale = hn::Set(d, grad_scale);
  const auto zero = hn::Zero(d);
  const size_t N = hn::Lanes(d);
  auto flag = [&](size_t at, hn::Vec<D> acc) {
    return hn::MulAdd(hn::Mul(LoadAsF32<kGrad>(d, grad, at), scale), zero, acc);
  };
  auto a0 = nonfinite, a1 = zero, a2 = zero, a3 = zero;
  for (; i + 4 * N <= end; i += 4 * N) {
    a0 = flag(i, a0);
    a1 = flag(i + N, a1);
    a2 = flag(i + 2 * N, a2);
    a3 = flag(i + 3 * N, a3);
  }
  for (; i + N <= end; i += N) a0 = flag(i, a0);
  nonfinite = hn::Add(hn::Add(a0, a1), hn::Add(a2, a3));
  return i;
}

template <DType kGrad>
bool NonfiniteChunkT(const void* grad, float grad_scale, size_t begin,
                     size_t end) {
  const hn::ScalableTag<float> d;
  auto nonfinite = hn::Zero(d);
  const size_t i =
      NonfiniteRange<kGrad>(d, grad, grad_scale, begin, end, nonfinite);
  const hn::CappedTag<float, 1> d1;
  auto nonfinite1 = hn::Zero(d1);
  NonfiniteRange<kGrad>(d1, grad, grad_scale, i, end, nonfinite1);
  return AnyNaN(d, nonfinite) || AnyNaN(d1, nonfinite1);
}

bool NonfiniteChunk(const void* grad, DType dtype, float grad_scale,
                    size_t begin, size_t end) {
  switch (dtype) {
    case DType::kFloat32:
      return NonfiniteChunkT<DType::kFloat32>(grad, grad_scale, begin, end);
    case DType::kBFloat16:
      return NonfiniteChunkT<DType::kBFloat16>(grad, grad_scale, begin, end);
    case DType::kFloat16:
      return NonfiniteChunkT<DType::kFloat16>(grad, grad_scale, begin, end);
  }
  return false;
}

#if HWY_HAVE_FLOAT64
// Squares are summed in double: the fp32 values are promoted, so the sum
// over a chunk of 2^16 elements keeps full fp32 accuracy.
template <DType kGrad, class DD>
HWY_INLINE size_t SumSquaresRange(DD dd, const void* HWY_RESTRICT grad,
                                  float grad_scale, size_t i, size_t end,
                                  hn::Vec<DD>& sum) {
  const hn::Rebind<float, DD> df;
  const auto scale = hn::Set(df, grad_scale);
  const size_t N = hn::Lanes(dd);
  for (; i + N <= end; i += N) {
    const auto g =
        hn::PromoteTo(dd, hn::Mul(LoadAsF32<kGrad>(df, grad, i), scale));
    sum = hn::MulAdd(g, g, sum);
  }
  return i;
}

template <DType kGrad>
double SumSquaresChunkT(const void* grad, float grad_scale, size_t begin,
                        size_t end) {
  const hn::ScalableTag<double> dd;
  auto sum = hn::Zero(dd);
  const size_t i =
      SumSquaresRange<kGrad>(dd, grad, grad_scale, begin, end, sum);
  const hn::CappedTag<double, 1> d1;
  auto sum1 = hn::Zero(d1);
  SumSquaresRange<kGrad>(d1, grad, grad_scale, i, end, sum1);
  return hn::GetLane(hn::SumOfLanes(dd, sum)) +
         hn::GetLane(hn::SumOfLanes(d1, sum1));
}
#else
// No double lanes (e.g. 32-bit Arm): fp32 vectors, each vector's squares
// added to a double.
template <DType kGrad, class D>
HWY_INLINE size_t SumSquaresRange(D d, const void* HWY_RESTRICT grad,
                                  float grad_scale, size_t i, size_t end,
                                  double& sum) {
  const auto scale = hn::Set(d, grad_scale);
  const size_t N = hn::Lanes(d);
  for (; i + N <= end; i += N) {
    const auto g = hn::Mul(LoadAsF32<kGrad>(d, grad, i), scale);
    sum += static_cast<double>(hn::GetLane(hn::SumOfLanes(d, hn::Mul(g, g))));
  }
  return i;
}

template <DType kGrad>
double SumSquaresChunkT(const void* grad, float grad_scale, size_t begin,
                        size_t end) {
  double sum = 0.0;
  const hn::ScalableTag<float> d;
  const size_t i = SumSquaresRange<kGrad>(d, grad, grad_scale, begin, end, sum);
  const hn::CappedTag<float, 1> d1;
  SumSquaresRange<kGrad>(d1, grad, grad_scale, i, end, sum);
  return sum;
}
#endif  // HWY_HAVE_FLOAT64

// Sum of squares of the scaled fp32 gradient over [begin, end): NaN or Inf
// when any element is NaN/Inf (no finite fp32 square can overflow a double).
double SumSquaresChunk(const void* grad, DType dtype, float grad_scale,
                       size_t begin, size_t end) {
  switch (dtype) {
    case DType::kFloat32:
      return SumSquaresChunkT<DType::kFloat32>(grad, grad_scale, begin, end);
    case DType::kBFloat16:
      return SumSquaresChunkT<DType::kBFloat16>(grad, grad_scale, begin, end);
    case DType::kFloat16:
      return SumSquaresChunkT<DType::kFloat16>(grad, grad_scale, begin, end);
  }
  return 0.0;
}

// ----------------------------------------------------------------------------
// Conversions.

template <DType kSrc, DType kDst, class D>
HWY_INLINE size_t ConvertRange(D d, const void* HWY_RESTRICT src,
                               void* HWY_RESTRICT dst, size_t i, size_t end) {
  const size_t N = hn::Lanes(d);
  for (; i + N <= end; i += N) {
    StoreFromF32<kDst>(d, LoadAsF32<kSrc>(d, src, i), dst, i);
  }
  return i;
}

template <DType kSrc, DType kDst>
void ConvertChunkT(const void* src, void* dst, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const size_t i = ConvertRange<kSrc, kDst>(d, src, dst, begin, end);
  ConvertRange<kSrc, kDst>(hn::CappedTag<float, 1>(), src, dst, i, end);
}

// One side of every conversion is fp32.
void ConvertChunk(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                  size_t begin, size_t end) {
  if (src_dtype == DType::kFloat32) {
    switch (dst_dtype) {
      case DType::kFloat32:
        return ConvertChunkT<DType::kFloat32, DType::kFloat32>(src, dst, begin,
                                                               end);
      case DType::kBFloat16:
        return ConvertChunkT<DType::kFloat32, DType::kBFloat16>(src, dst, begin,
                                                                end);
      case DType::kFloat16:
        return ConvertChunkT<DType::kFloat32, DType::kFloat16>(src, dst, begin,
                                                               end);
    }
  }
  switch (src_dtype) {
    case DType::kFloat32:
      return;  // handled above
    case DType::kBFloat16:
      return ConvertChunkT<DType::kBFloat16, DType::kFloat32>(src, dst, begin,
                                                              end);
    case DType::kFloat16:
      return ConvertChunkT<DType::kFloat16, DType::kFloat32>(src, dst, begin,
                                                             end);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace internal_kernels
}  // namespace mlp_offload
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mlp_offload {
namespace internal_kernels {

HWY_EXPORT(UpdateChunk);
HWY_EXPORT(NonfiniteChunk);
HWY_EXPORT(SumSquaresChunk);
HWY_EXPORT(ConvertChunk);

namespace {

bool IsValidDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

absl::Status InvalidField(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer hyperparameter ", field, ": ", why));
}

// NaN fails every comparison, so `!(x >= 0)` also rejects NaN.
absl::Status CheckNonNegative(absl::string_view field, double x) {
  if (!(x >= 0.0) || std::isinf(x)) {
    return InvalidField(field,
                        absl::StrCat("must be finite and >= 0, got ", x));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(absl::string_view field, double x) {
  if (!(x >= 0.0 && x < 1.0)) {
    return InvalidField(field, absl::StrCat("must be in [0, 1), got ", x));
  }
  return absl::OkStatus();
}

// Derives the fp32 coefficients of one call. Bias corrections and learning
// rate decay are computed in double, once.
UpdateArgs MakeArgs(const OptimizerHyperparams& hp, const UpdateSpans& spans,
                    const GradTransform& transform) {
  UpdateArgs a;
  a.kind = hp.kind;
  a.param = spans.param;
  for (int k = 0; k < 3; ++k) a.state[k] = spans.state[k];
  a.grad = spans.grad;
  a.grad_dtype = spans.grad_dtype;
  a.param_out = spans.param_out;
  a.param_out_dtype = spans.param_out_dtype;
  a.grad_scale = transform.grad_scale;
  a.negate_mask = hp.maximize ? -0.0f : 0.0f;

  const double lr = hp.lr;
  const double wd = hp.weight_decay;
  const double step = static_cast<double>(hp.step);
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const double b1 = hp.beta1, b2 = hp.beta2;
      const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, step) : 1.0;
      const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, step) : 1.0;
      if (hp.kind == OptimizerKind::kAdam) {
        a.l2_decay = static_cast<float>(hp.weight_decay);
        a.has_l2 = hp.weight_decay != 0;
      } else {
        a.param_decay = static_cast<float>(1.0 - lr * wd);
      }
      a.one_minus_beta1 = static_cast<float>(1.0 - b1);
      a.beta2 = static_cast<float>(b2);
      a.one_minus_beta2 = static_cast<float>(1.0 - b2);
      a.step_size = static_cast<float>(lr / bc1);
      a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
      a.eps = static_cast<float>(hp.eps);
      a.amsgrad = hp.amsgrad;
      break;
    }
    case OptimizerKind::kSGD:
      a.l2_decay = static_cast<float>(hp.weight_decay);
      a.has_l2 = hp.weight_decay != 0;
      a.lr = static_cast<float>(hp.lr);
      a.has_momentum = hp.momentum != 0.0;
      a.momentum = static_cast<float>(hp.momentum);
      a.one_minus_dampening = static_cast<float>(1.0 - hp.dampening);
      a.nesterov = hp.nesterov;
      a.first_step = hp.step == 1;
      break;
    case OptimizerKind::kAdagrad:
      a.l2_decay = static_cast<float>(hp.weight_decay);
      a.has_l2 = hp.weight_decay != 0;
      a.step_size = static_cast<float>(lr / (1.0 + (step - 1.0) * hp.lr_decay));
      a.eps = static_cast<float>(hp.eps);
      break;
    case OptimizerKind::kLion:
      a.param_decay = static_cast<float>(1.0 - lr * wd);
      a.lr = static_cast<float>(hp.lr);
      a.beta1 = static_cast<float>(hp.beta1);
      a.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
      a.beta2 = static_cast<float>(hp.beta2);
      a.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
      break;
  }
  return a;
}

}  // namespace
}  // namespace internal_kernels

using internal_kernels::ChunkBegin;
using internal_kernels::ChunkEnd;
using internal_kernels::ForEachChunk;
using internal_kernels::NumChunks;

size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  absl::string_view bare = name;
  // str(tensor.dtype) spells it "torch.float32".
  if (bare.substr(0, 6) == "torch.") bare.remove_prefix(6);
  if (bare == "float32" || bare == "fp32") return DType::kFloat32;
  if (bare == "bfloat16" || bare == "bf16") return DType::kBFloat16;
  if (bare == "float16" || bare == "fp16" || bare == "half") {
    return DType::kFloat16;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", name, "\" (expected float32, bfloat16 or float16)"));
}

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSGD:
      return "sgd";
    case OptimizerKind::kAdagrad:
      return "adagrad";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "unknown";
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  for (OptimizerKind kind :
       {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kSGD,
        OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
    if (name == OptimizerKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer \"", name,
                   "\" (expected adam, adamw, sgd, adagrad or lion)"));
}

absl::Status ValidateHyperparams(const OptimizerHyperparams& hp) {
  using internal_kernels::CheckBeta;
  using internal_kernels::CheckNonNegative;
  using internal_kernels::InvalidField;
  if (hp.step < 1) {
    return InvalidField("step", absl::StrCat("must be >= 1, got ", hp.step));
  }
  MLP_RETURN_IF_ERROR(CheckNonNegative("lr", hp.lr));
  MLP_RETURN_IF_ERROR(CheckNonNegative("weight_decay", hp.weight_decay));
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      MLP_RETURN_IF_ERROR(CheckBeta("beta1", hp.beta1));
      MLP_RETURN_IF_ERROR(CheckBeta("beta2", hp.beta2));
      MLP_RETURN_IF_ERROR(CheckNonNegative("eps", hp.eps));
      return absl::OkStatus();
    case OptimizerKind::kSGD:
      MLP_RETURN_IF_ERROR(CheckNonNegative("momentum", hp.momentum));
      if (!std::isfinite(hp.dampening)) {
        return InvalidField("dampening", "must be finite");
      }
      // No check of nesterov against momentum and dampening: torch makes it
      // in SGD's constructor only, and its step applies nesterov to
      // whatever momentum and dampening a schedule sets later (none at
      // momentum 0), as the kernel does.
      return absl::OkStatus();
    case OptimizerKind::kAdagrad:
      MLP_RETURN_IF_ERROR(CheckNonNegative("lr_decay", hp.lr_decay));
      MLP_RETURN_IF_ERROR(CheckNonNegative("initial_accumulator_value",
                                           hp.initial_accumulator_value));
      MLP_RETURN_IF_ERROR(CheckNonNegative("eps", hp.eps));
      return absl::OkStatus();
    case OptimizerKind::kLion:
      MLP_RETURN_IF_ERROR(CheckBeta("beta1", hp.beta1));
      MLP_RETURN_IF_ERROR(CheckBeta("beta2", hp.beta2));
      return absl::OkStatus();
  }
  return InvalidField(
      "kind", absl::StrCat("unknown value ", static_cast<int>(hp.kind)));
}

int NumStateArrays(const OptimizerHyperparams& hp) {
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return hp.amsgrad ? 3 : 2;
    case OptimizerKind::kSGD:
      return hp.momentum != 0.0 ? 1 : 0;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kLion:
      return 1;
  }
  return 0;
}

const char* StateArrayName(const OptimizerHyperparams& hp, int index) {
  if (index < 0 || index >= NumStateArrays(hp)) return nullptr;
  switch (hp.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      static const char* const kNames[] = {"exp_avg", "exp_avg_sq",
                                           "max_exp_avg_sq"};
      return kNames[index];
    }
    case OptimizerKind::kSGD:
      return "momentum_buffer";
    case OptimizerKind::kAdagrad:
      return "sum";
    case OptimizerKind::kLion:
      return "exp_avg";
  }
  return nullptr;
}

void InitState(const OptimizerHyperparams& hp, float* const state[3], size_t n,
               ThreadPool* pool) {
  const int num_arrays = NumStateArrays(hp);
  const float value = hp.kind == OptimizerKind::kAdagrad
                          ? static_cast<float>(hp.initial_accumulator_value)
                          : 0.0f;
  // Filled chunk by chunk on the pool so that first touch spreads the pages
  // the way the update will read them.
  ForEachChunk(n, pool, [&](size_t c) {
    for (int k = 0; k < num_arrays; ++k) {
      if (state[k] == nullptr) continue;
      std::fill(state[k] + ChunkBegin(c), state[k] + ChunkEnd(c, n), value);
    }
  });
}

absl::StatusOr<UpdateResult> ApplyOptimizer(const OptimizerHyperparams& hp,
                                            const UpdateSpans& spans,
                                            const GradTransform& transform,
                                            ThreadPool* pool) {
  MLP_RETURN_IF_ERROR(ValidateHyperparams(hp));
  if (!std::isfinite(transform.grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_scale must be finite, got ", transform.grad_scale));
  }
  if (!internal_kernels::IsValidDType(spans.grad_dtype) ||
      !internal_kernels::IsValidDType(spans.param_out_dtype)) {
    return absl::InvalidArgumentError("invalid grad or param_out dtype");
  }
  UpdateResult result;
  const size_t n = spans.n;
  if (n == 0) return result;
  if (spans.param == nullptr) {
    return absl::InvalidArgumentError("UpdateSpans.param is null");
  }
  if (spans.grad == nullptr) {
    return absl::InvalidArgumentError("UpdateSpans.grad is null");
  }
  const int num_arrays = NumStateArrays(hp);
  for (int k = 0; k < num_arrays; ++k) {
    if (spans.state[k] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UpdateSpans.state[", k, "] (", StateArrayName(hp, k), ") is null"));
    }
  }

  if (transform.skip_if_nonfinite &&
      AnyNonfinite(spans.grad, spans.grad_dtype, n, transform.grad_scale,
                   pool)) {
    result.nonfinite = true;
    result.skipped = true;
    return result;
  }

  const internal_kernels::UpdateArgs args =
      internal_kernels::MakeArgs(hp, spans, transform);
  std::vector<uint8_t> flags(NumChunks(n), 0);
  ForEachChunk(n, pool, [&](size_t c) {
    flags[c] = HWY_DYNAMIC_DISPATCH(internal_kernels::UpdateChunk)(
        args, ChunkBegin(c), ChunkEnd(c, n));
  });
  for (uint8_t f : flags) result.nonfinite |= (f != 0);
  return result;
}

bool AnyNonfinite(const void* grad, DType dtype, size_t n, float grad_scale,
                  ThreadPool* pool) {
  std::vector<uint8_t> flags(NumChunks(n), 0);
  ForEachChunk(n, pool, [&](size_t c) {
    flags[c] = HWY_DYNAMIC_DISPATCH(internal_kernels::NonfiniteChunk)(
        grad, dtype, grad_scale, ChunkBegin(c), ChunkEnd(c, n));
  });
  for (uint8_t f : flags) {
    if (f) return true;
  }
  return false;
}

GradStats ComputeGradStats(const void* grad, DType dtype, size_t n,
                           float grad_scale, ThreadPool* pool) {
  GradStats stats;
  if (n == 0) return stats;
  std::vector<double> sums(NumChunks(n), 0.0);
  ForEachChunk(n, pool, [&](size_t c) {
    sums[c] = HWY_DYNAMIC_DISPATCH(internal_kernels::SumSquaresChunk)(
        grad, dtype, grad_scale, ChunkBegin(c), ChunkEnd(c, n));
  });
  // Chunk order, whatever thread computed each: deterministic.
  double total = 0.0;
  for (double s : sums) total += s;
  stats.nonfinite = !std::isfinite(total);
  stats.sum_squares = stats.nonfinite ? std::nan("") : total;
  return stats;
}

void ConvertToFloat32(const void* src, DType src_dtype, float* dst, size_t n,
                      ThreadPool* pool) {
  ForEachChunk(n, pool, [&](size_t c) {
    HWY_DYNAMIC_DISPATCH(internal_kernels::ConvertChunk)
    (src, src_dtype, dst, DType::kFloat32, ChunkBegin(c), ChunkEnd(c, n));
  });
}

void ConvertFromFloat32(const float* src, void* dst, DType dst_dtype, size_t n,
                        ThreadPool* pool) {
  ForEachChunk(n, pool, [&](size_t c) {
    HWY_DYNAMIC_DISPATCH(internal_kernels::ConvertChunk)
    (src, DType::kFloat32, dst, dst_dtype, ChunkBegin(c), ChunkEnd(c, n));
  });
}

}  // namespace mlp_offload
#endif  // HWY_ONCE
