// The dispatched target is found by dispatching a function that returns its
// own compile-time target, the same way every kernel is dispatched.
#include "kernels/target_info.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/target_info.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mlp_offload {
namespace HWY_NAMESPACE {

const char* ThisTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace mlp_offload
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mlp_offload {

HWY_EXPORT(ThisTargetName);

std::string SimdTargetName() { return HWY_DYNAMIC_DISPATCH(ThisTargetName)(); }

std::vector<std::string> SupportedSimdTargets() {
  std::vector<std::string> names;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    names.emplace_back(hwy::TargetName(target));
  }
  return names;
}

}  // namespace mlp_offload
#endif  // HWY_ONCE
