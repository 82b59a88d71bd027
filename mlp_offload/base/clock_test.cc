#include "mlp_offload/base/clock.h"

#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace {

TEST(ClockTest, DurationConversionClampsAndRoundTrips) {
  EXPECT_EQ(ToMonoDuration(absl::Milliseconds(-5)),
            MonoClock::duration::zero());
  EXPECT_EQ(ToMonoDuration(-absl::InfiniteDuration()),
            MonoClock::duration::zero());
  EXPECT_EQ(ToMonoDuration(absl::Milliseconds(1500)),
            std::chrono::milliseconds(1500));
  EXPECT_EQ(ToAbslDuration(std::chrono::microseconds(250)),
            absl::Microseconds(250));
  // Infinite saturates at a century, so a deadline that far is still
  // after now and adding it to now does not overflow.
  const auto century = ToMonoDuration(absl::InfiniteDuration());
  EXPECT_EQ(century, ToMonoDuration(absl::Hours(24 * 365 * 1000)));
  EXPECT_GT(century, std::chrono::hours(24 * 365 * 99));
  EXPECT_GT(MonoAfter(absl::InfiniteDuration()), MonoNow());
}

TEST(ClockTest, SecondsSinceCountsElapsedTime) {
  const MonoTime start = MonoNow();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double s = SecondsSince(start);
  EXPECT_GE(s, 0.019);
  EXPECT_LT(s, 60.0);
}

TEST(ClockTest, AwaitWithDeadlineTimesOutAndWakes) {
  Mutex mu;
  bool flag = false;
  {
    MutexLock lock(&mu);
    // A past deadline returns at once with the predicate's value.
    EXPECT_FALSE(mu.AwaitWithDeadline([&] { return flag; }, MonoNow()));
    const MonoTime start = MonoNow();
    EXPECT_FALSE(mu.AwaitWithDeadline([&] { return flag; },
                                      MonoAfter(absl::Milliseconds(30))));
    EXPECT_GE(SecondsSince(start), 0.029);
  }
  // A far deadline (no overflow): returns when another thread sets the flag.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    MutexLock lock(&mu);
    flag = true;
  });
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithDeadline([&] { return flag; },
                                     MonoAfter(absl::InfiniteDuration())));
  }
  setter.join();
}

}  // namespace
}  // namespace mlp_offload
