// A test fixture whose tests run once per SIMD target compiled in and
// supported by this CPU (dispatch forced with hwy::SetSupportedTargetsForTest),
// named after the target. Tests only:
//
//   class MyTest : public PerTargetTest {};
//   INSTANTIATE_TEST_SUITE_P(AllTargets, MyTest, AllSimdTargets(),
//                            SimdTargetParamName);
#ifndef MLP_OFFLOAD_KERNELS_INTERNAL_PER_TARGET_TEST_H_
#define MLP_OFFLOAD_KERNELS_INTERNAL_PER_TARGET_TEST_H_

#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "hwy/targets.h"

namespace mlp_offload {

class PerTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { hwy::SetSupportedTargetsForTest(GetParam()); }
  void TearDown() override { hwy::SetSupportedTargetsForTest(0); }
};

inline auto AllSimdTargets() {
  return ::testing::ValuesIn(hwy::SupportedAndGeneratedTargets());
}

inline std::string SimdTargetParamName(
    const ::testing::TestParamInfo<int64_t>& info) {
  return hwy::TargetName(info.param);
}

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_INTERNAL_PER_TARGET_TEST_H_
