#include "mlp_offload/base/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (size_t n : {0u, 1u, 3u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << i;
    }
  }
}

TEST(ThreadPoolTest, ReusableAcrossManyJobs) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  for (int job = 0; job < 200; ++job) {
    pool.ParallelFor(17,
                     [&](size_t i) { sum.fetch_add(static_cast<long>(i)); });
  }
  EXPECT_EQ(sum.load(), 200L * (16 * 17 / 2));
}

TEST(ThreadPoolTest, AWorkerTheSystemRefusesIsAStatusNotAThrow) {
  // The third worker cannot start: the pool keeps the two that did (and the
  // caller's thread) and says why; it still runs every task.
  FailNthThreadStartForTesting(3);
  ThreadPool pool(5);
  FailNthThreadStartForTesting(0);
  EXPECT_EQ(pool.start_status().code(), absl::StatusCode::kResourceExhausted)
      << pool.start_status();
  EXPECT_NE(pool.start_status().message().find(
                "could not start a thread (compute thread)"),
            std::string::npos)
      << pool.start_status();
  EXPECT_TRUE(
      pool.start_status().GetPayload(kSystemResourcePayload).has_value());
  EXPECT_EQ(pool.num_threads(), 3);
  std::vector<std::atomic<int>> hits(100);
  pool.ParallelFor(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
  for (size_t i = 0; i < hits.size(); ++i) EXPECT_EQ(hits[i].load(), 1) << i;
  EXPECT_TRUE(ThreadPool(5).start_status().ok());
}

TEST(ThreadsTest, StartThreadRunsTheFunctionOrSaysWhyNot) {
  std::atomic<int> ran{0};
  absl::StatusOr<std::thread> t = StartThread("test", [&] { ran = 1; });
  ASSERT_TRUE(t.ok()) << t.status();
  t->join();
  EXPECT_EQ(ran.load(), 1);
  FailNthThreadStartForTesting(1);
  t = StartThread("a test thread", [&] { ran = 2; });
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("could not start a thread (a test "
                                      "thread): Resource temporarily"),
            std::string::npos)
      << t.status();
  EXPECT_EQ(ran.load(), 1);
  // One failure only.
  t = StartThread("test", [&] { ran = 3; });
  ASSERT_TRUE(t.ok()) << t.status();
  t->join();
  EXPECT_EQ(ran.load(), 3);
}

}  // namespace
}  // namespace mlp_offload
