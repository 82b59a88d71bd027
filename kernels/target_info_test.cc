#include "kernels/target_info.h"

#include <algorithm>

#include "gtest/gtest.h"

namespace mlp_offload {
namespace {

TEST(TargetInfoTest, DispatchedTargetIsTheBestSupportedOne) {
  std::vector<std::string> supported = SupportedSimdTargets();
  ASSERT_FALSE(supported.empty());
  // SupportedAndGeneratedTargets lists the best target first, and dynamic
  // dispatch must pick exactly that one.
  EXPECT_EQ(SimdTargetName(), supported.front());
}

}  // namespace
}  // namespace mlp_offload
