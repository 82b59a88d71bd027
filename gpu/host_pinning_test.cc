// AlignedBuffer::AllocatePinned with the CUDA hooks: buffers really are
// registered while alive and unregistered when freed.
#include "gpu/host_pinning.h"

#include <utility>

#include "gtest/gtest.h"
#include "io/aligned_buffer.h"

namespace mlp_offload {
namespace {

class HostPinningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = InstallCudaHostPinning();
    if (!s.ok()) GTEST_SKIP() << "needs a CUDA device: " << s.message();
  }
  void TearDown() override { UninstallCudaHostPinning(); }
};

TEST(HostPinningNoDeviceTest, InstallFailsCleanlyOrSucceeds) {
  // Either outcome is fine; what matters is that it never aborts and that a
  // failure installs nothing.
  absl::Status s = InstallCudaHostPinning();
  EXPECT_EQ(HostPinningAvailable(), s.ok()) << s.message();
  UninstallCudaHostPinning();
  EXPECT_FALSE(HostPinningAvailable());
}

TEST_F(HostPinningTest, PinsWhileAliveAndUnpinsOnFree) {
  const uint64_t before = CudaRegisteredHostBytes();
  {
    absl::StatusOr<AlignedBuffer> a = AlignedBuffer::AllocatePinned(1 << 20);
    ASSERT_TRUE(a.ok()) << a.status().message();
    EXPECT_TRUE(a->pinned());
    EXPECT_EQ(CudaRegisteredHostBytes(), before + a->size());
    AlignedBuffer moved = std::move(*a);
    EXPECT_TRUE(moved.pinned());
    EXPECT_EQ(CudaRegisteredHostBytes(), before + moved.size());
  }
  EXPECT_EQ(CudaRegisteredHostBytes(), before);
}

}  // namespace
}  // namespace mlp_offload
