#include "mlp_offload/planner.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"

namespace mlp_offload {
namespace {

constexpr double kGB = 1e9;

TierSpec Tier(const std::string& path, double r, double w, uint64_t cap = 0) {
  TierSpec t;
  t.path = path;
  t.read_bytes_per_sec = r;
  t.write_bytes_per_sec = w;
  t.capacity_bytes = cap;
  return t;
}

PlannerInput Input(int n, uint64_t numel, std::vector<TierSpec> tiers,
                   uint64_t budget) {
  PlannerInput in;
  in.subgroup_numel.assign(n, numel);
  in.arrays_per_param = 3;
  in.tiers = std::move(tiers);
  in.host_budget_bytes = budget;
  return in;
}

uint64_t Buf(uint64_t numel, bool eager = false) {
  return 4096 + AlignedRecordBytes(numel, 3) +
         (eager ? AlignedRecordBytes(numel, 1) : 0);
}

TEST(PlannerTest, OneTierNoCacheStreamsEverything) {
  PlannerInput in =
      Input(10, 1 << 20, {Tier("/a", 1 * kGB, 1 * kGB)}, 4 * Buf(1 << 20));
  in.techniques = Techniques::Baseline();
  in.techniques.delayed_grad_conversion = true;
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_cached, 0);
  EXPECT_EQ(plan->num_buffers, 3);
  for (int t : plan->tier_of_subgroup) EXPECT_EQ(t, 0);
  uint64_t rec = (1 << 20) * 12ull;
  EXPECT_EQ(plan->traffic[0].bytes_read, 10 * rec);
  EXPECT_EQ(plan->traffic[0].bytes_written, 10 * rec);
  // Not duplex: reads and writes share the device.
  EXPECT_NEAR(plan->predicted_io_seconds, 20.0 * rec / kGB, 1e-9);
  // Same order every step.
  EXPECT_EQ(plan->Order(0), plan->Order(1));
}

TEST(PlannerTest, BandwidthProportionalPlacementOverThreeTiers) {
  PlannerInput in =
      Input(600, 1 << 16,
            {Tier("/a", 3 * kGB, 3 * kGB), Tier("/b", 2 * kGB, 2 * kGB),
             Tier("/c", 1 * kGB, 1 * kGB)},
            8 * Buf(1 << 16));
  in.techniques.cache_reuse = false;
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int> count(3, 0);
  for (int t : plan->tier_of_subgroup) ++count[t];
  EXPECT_EQ(count[0], 300);
  EXPECT_EQ(count[1], 200);
  EXPECT_EQ(count[2], 100);
  // All tiers finish together.
  EXPECT_NEAR(plan->traffic[0].seconds, plan->traffic[2].seconds,
              1e-3 * plan->traffic[0].seconds);
  // Interleaved: every window of 6 consecutive subgroups touches every tier.
  for (int i = 0; i + 6 <= 600; i += 6) {
    std::set<int> seen(plan->tier_of_subgroup.begin() + i,
                       plan->tier_of_subgroup.begin() + i + 6);
    EXPECT_EQ(seen.size(), 3u) << i;
  }
}

TEST(PlannerTest, CapacityLimitsATierAndTheRestGoesElsewhere) {
  uint64_t numel = 1 << 16;
  uint64_t disk = 2 * Buf(numel);
  PlannerInput in = Input(100, numel,
                          {Tier("/fast", 10 * kGB, 10 * kGB, 10 * disk),
                           Tier("/slow", 1 * kGB, 1 * kGB)},
                          4 * Buf(numel));
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int fast = std::count(plan->tier_of_subgroup.begin(),
                        plan->tier_of_subgroup.end(), 0);
  EXPECT_EQ(fast, 10);
}

TEST(PlannerTest, FullTiersAreAClearError) {
  uint64_t numel = 1 << 16;
  PlannerInput in =
      Input(100, numel,
            {Tier("/a", kGB, kGB, 1 << 20), Tier("/b", kGB, kGB, 1 << 20)},
            4 * Buf(numel));
  auto plan = MakePlan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("the state needs"), std::string::npos);
}

TEST(PlannerTest, BudgetHoldingEverythingMeansNoIo) {
  PlannerInput in = Input(8, 1 << 16, {Tier("/a", kGB, kGB)}, 8 * Buf(1 << 16));
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_cached, 8);
  EXPECT_EQ(plan->traffic[0].bytes_read, 0u);
  EXPECT_EQ(plan->traffic[0].bytes_written, 0u);
  EXPECT_EQ(plan->predicted_seconds, 0.0);
}

TEST(PlannerTest, BudgetTooSmallNamesTheMinimum) {
  PlannerInput in = Input(8, 1 << 16, {Tier("/a", kGB, kGB)}, Buf(1 << 16) + 5);
  auto plan = MakePlan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find(std::to_string(2 * Buf(1 << 16))),
            std::string::npos)
      << plan.status();
}

TEST(PlannerTest, BadInputsAreRefused) {
  PlannerInput in = Input(4, 1 << 16, {}, 1 << 30);
  EXPECT_EQ(MakePlan(in).status().code(), absl::StatusCode::kInvalidArgument);
  in = Input(4, 1 << 16, {Tier("/a", 0, 0)}, 1 << 30);
  EXPECT_NE(MakePlan(in).status().message().find("no read/write bandwidth"),
            std::string::npos);
  in = Input(4, 1 << 16, {Tier("/a", kGB, kGB)}, 1 << 30);
  in.subgroup_numel[2] = 0;
  EXPECT_NE(MakePlan(in).status().message().find("subgroup 2 has size 0"),
            std::string::npos);
}

TEST(PlannerTest, AlternatingOrderAndCacheSavesTraffic) {
  uint64_t numel = 1 << 16;
  PlannerInput in = Input(20, numel, {Tier("/a", kGB, kGB)}, 8 * Buf(numel));
  in.techniques.multipath = false;
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->num_buffers, 3);
  EXPECT_EQ(plan->num_cached, 5);
  std::vector<int> fwd = plan->Order(0), rev = plan->Order(1);
  std::reverse(rev.begin(), rev.end());
  EXPECT_EQ(fwd, rev);
  // The last 5 of step 0 are kept and are the first 5 of step 1.
  for (int p = 15; p < 20; ++p) EXPECT_TRUE(plan->KeptAfterUpdate(0, p));
  EXPECT_FALSE(plan->KeptAfterUpdate(0, 14));
  uint64_t rec = numel * 12;
  EXPECT_EQ(plan->traffic[0].bytes_read, 15 * rec);
  EXPECT_EQ(plan->traffic[0].bytes_written, 15 * rec);
}

TEST(PlannerTest, BaselineMovesFp32GradientsToo) {
  uint64_t numel = 1 << 16;
  PlannerInput in =
      Input(10, numel, {Tier("/a", kGB, kGB), Tier("/b", kGB, kGB)},
            8 * Buf(numel, true));
  in.techniques = Techniques::Baseline();
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->traffic[0].bytes_read, 10 * numel * 16);
  EXPECT_EQ(plan->traffic[1].bytes_read, 0u);  // one path only
  EXPECT_EQ(plan->buffer_bytes, Buf(numel, true));
}

TEST(PlannerTest, SharedDeviceAndRanksSplitBandwidth) {
  TierSpec a = Tier("/a", 2 * kGB, 2 * kGB), b = Tier("/b", 2 * kGB, 2 * kGB);
  a.bandwidth_pool = b.bandwidth_pool = "dev0";
  PlannerInput in = Input(10, 1 << 16, {a, b}, 4 * Buf(1 << 16));
  in.techniques.cache_reuse = false;
  in.ranks = 2;
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok());
  double bytes = plan->traffic[0].bytes_read + plan->traffic[0].bytes_written;
  // 2 GB/s shared by two tiers and two ranks: 0.5 GB/s each.
  EXPECT_NEAR(plan->traffic[0].seconds, bytes / (0.5 * kGB), 1e-9);
}

TEST(PlannerTest, ThrottledTiersAreDuplex) {
  TierSpec a = Tier("/a", 0, 0);
  a.throttle_read_bytes_per_sec = 100e6;
  a.throttle_write_bytes_per_sec = 100e6;
  PlannerInput in = Input(10, 1 << 16, {a}, 4 * Buf(1 << 16));
  in.techniques.cache_reuse = false;
  auto plan = MakePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NEAR(plan->traffic[0].seconds, plan->traffic[0].bytes_read / 100e6,
              1e-9);
}

}  // namespace
}  // namespace mlp_offload
