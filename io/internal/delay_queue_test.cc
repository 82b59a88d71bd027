#include "io/internal/delay_queue.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace internal_io {
namespace {

TEST(DelayQueueTest, RunsInTimeOrderAndDrainWaitsForAll) {
  DelayQueue queue;
  ::mlp_offload::Mutex mu;
  std::vector<int> order;
  // Far enough ahead that a stall of this thread while it queues (a loaded
  // machine) cannot let an item come due before an earlier one is queued.
  const MonoTime base = MonoAfter(absl::Milliseconds(300));
  for (int i : {3, 1, 2, 0}) {
    queue.RunAt(base + std::chrono::milliseconds(10 * i), [&, i] {
      ::mlp_offload::MutexLock lock(&mu);
      order.push_back(i);
    });
  }
  // Same time: FIFO.
  queue.RunAt(base + std::chrono::milliseconds(30), [&] {
    ::mlp_offload::MutexLock lock(&mu);
    order.push_back(4);
  });
  queue.Drain();
  ::mlp_offload::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

// Hurry runs what is queued on the calling thread, in time order, before it
// returns; nothing is left to run at the old times.
TEST(DelayQueueTest, HurryRunsWhatIsQueuedNowOnTheCaller) {
  DelayQueue queue;
  ::mlp_offload::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  const MonoTime base = MonoAfter(absl::Seconds(30));
  for (int i : {2, 0, 1}) {
    queue.RunAt(base + std::chrono::milliseconds(10 * i), [&, i] {
      ::mlp_offload::MutexLock lock(&mu);
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    });
  }
  const MonoTime start = MonoNow();
  queue.Hurry();
  {
    ::mlp_offload::MutexLock lock(&mu);
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
    for (const std::thread::id& t : threads) {
      EXPECT_EQ(t, std::this_thread::get_id());
    }
  }
  queue.Drain();  // nothing left: returns at once
  EXPECT_LT(SecondsSince(start), 10.0);
  ::mlp_offload::MutexLock lock(&mu);
  EXPECT_EQ(order.size(), 3u);
}

TEST(DelayQueueTest, AfterDrainRunsInline) {
  DelayQueue queue;
  queue.Drain();
  bool ran = false;
  queue.RunAt(MonoAfter(absl::Hours(1)), [&] { ran = true; });
  EXPECT_TRUE(ran);
}

TEST(DelayQueueTest, WithoutItsThreadTheCallerWaitsForTheTime) {
  FailNthThreadStartForTesting(1);
  DelayQueue queue;
  FailNthThreadStartForTesting(0);
  EXPECT_EQ(queue.start_status().code(), absl::StatusCode::kResourceExhausted)
      << queue.start_status();
  const MonoTime start = MonoNow();
  bool ran = false;
  queue.RunAt(MonoAfter(absl::Milliseconds(30)), [&] { ran = true; });
  EXPECT_TRUE(ran);  // on this thread, at its time
  EXPECT_GE(SecondsSince(start), 0.03);
  queue.Drain();  // nothing to join
}

}  // namespace
}  // namespace internal_io
}  // namespace mlp_offload
