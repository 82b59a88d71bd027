#include "kernels/memory_probe.h"

#include <cmath>

#include "gtest/gtest.h"
#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {
namespace {

TEST(MemoryProbeTest, BytesPerElementOfOptimizerPatterns) {
  EXPECT_EQ(StreamPatternBytes(StreamPattern{3, 4, 0}), 28u);  // fp32 AdamW
  EXPECT_EQ(StreamPatternBytes(StreamPattern{3, 2, 2}), 28u);  // bf16 in/out
  EXPECT_EQ(StreamPatternBytes(StreamPattern{1, 4, 0}), 12u);  // plain SGD
}

TEST(MemoryProbeTest, EveryPatternRunsAndReportsAPositiveRate) {
  ThreadPool pool(2);
  for (int update = 0; update <= 4; ++update) {
    for (size_t read : {0, 2, 4}) {
      for (size_t write : {0, 2, 4}) {
        if (update == 0 && read == 0 && write == 0) continue;
        // Not a speed test: only that the probe runs (tail included: 70001
        // is no multiple of any vector width) and returns a finite rate.
        absl::StatusOr<double> gbps = MeasureStreamBandwidth(
            StreamPattern{update, read, write}, 70001, 1, &pool);
        ASSERT_TRUE(gbps.ok()) << gbps.status();
        EXPECT_GT(*gbps, 0.0);
        EXPECT_TRUE(std::isfinite(*gbps));
      }
    }
  }
}

TEST(MemoryProbeTest, RejectsUnsupportedPatterns) {
  EXPECT_FALSE(
      MeasureStreamBandwidth(StreamPattern{5, 4, 0}, 10, 1, nullptr).ok());
  EXPECT_FALSE(
      MeasureStreamBandwidth(StreamPattern{3, 3, 0}, 10, 1, nullptr).ok());
  EXPECT_FALSE(
      MeasureStreamBandwidth(StreamPattern{0, 0, 0}, 10, 1, nullptr).ok());
  EXPECT_FALSE(
      MeasureStreamBandwidth(StreamPattern{3, 4, 0}, 0, 1, nullptr).ok());
  EXPECT_FALSE(
      MeasureStreamBandwidth(StreamPattern{3, 4, 0}, 10, 0, nullptr).ok());
}

}  // namespace
}  // namespace mlp_offload
