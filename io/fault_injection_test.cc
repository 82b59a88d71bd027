#include "io/fault_injection.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/aligned_buffer.h"
#include "io/file.h"
#include "io/internal/test_util.h"
#include "mlp_offload/base/clock.h"

namespace mlp_offload {
namespace {

using internal_io::FillRandom;
using internal_io::ScratchPath;

class FaultInjectionTest
    : public testing::TestWithParam<IoEngineOptions::Kind> {
 protected:
  void SetUp() override {
    path_ = ScratchPath("fault");
    FileOptions options;
    options.create = true;
    options.preallocate_bytes = kSize;
    file_ = *File::Open(path_, options);
    ASSERT_TRUE(file_->direct());
    out_ = *AlignedBuffer::Allocate(kSize);
    in_ = *AlignedBuffer::Allocate(kSize);
    FillRandom(out_.data(), kSize, 3);
  }
  void TearDown() override { unlink(path_.c_str()); }

  std::unique_ptr<IoEngine> Inner() {
    IoEngineOptions options;
    options.kind = GetParam();
    options.block_size = 64 << 10;
    return *CreateIoEngine(options);
  }
  IoRequest Req(IoOp op, uint64_t offset, size_t len) {
    char* base = op == IoOp::kWrite ? out_.as<char>() : in_.as<char>();
    return IoRequest{op, file_.get(), offset, len, base + offset};
  }

  static constexpr size_t kSize = 1 << 20;
  std::string path_;
  std::unique_ptr<File> file_;
  AlignedBuffer out_, in_;
};

TEST_P(FaultInjectionTest, NthRequestFailsWithTheGivenErrno) {
  FaultInjectingEngine engine(Inner());
  EXPECT_EQ(engine.name(), absl::StrCat("fault(", Inner()->name(), ")"));
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kError;
  fault.op = IoOp::kWrite;
  fault.nth = 2;
  fault.error = ENOSPC;
  engine.AddFault(fault);
  std::vector<absl::StatusOr<size_t>> results;
  for (int i = 0; i < 4; ++i)
    results.push_back(engine.Submit(Req(IoOp::kWrite, i * 8192, 8192)).Wait());
  EXPECT_TRUE(results[0].ok());
  EXPECT_TRUE(results[1].ok());
  EXPECT_TRUE(results[3].ok());
  ASSERT_FALSE(results[2].ok());
  EXPECT_EQ(results[2].status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(results[2].status().message().find(
                absl::StrCat(path_, " at offset 16384")),
            std::string::npos)
      << results[2].status();
  EXPECT_NE(results[2].status().message().find("write"), std::string::npos);
  EXPECT_EQ(engine.fired(), 1);
  // Reads are not matched by a write fault.
  EXPECT_TRUE(engine.Submit(Req(IoOp::kRead, 0, 8192)).Wait().ok());
}

TEST_P(FaultInjectionTest, EveryMatchingRequestAndPathFilter) {
  FaultInjectingEngine engine(Inner());
  FaultSpec fault;
  fault.op = IoOp::kRead;
  fault.nth = -1;
  fault.error = EIO;
  fault.path_substring = "no-such-tier";
  engine.AddFault(fault);
  EXPECT_TRUE(engine.Submit(Req(IoOp::kRead, 0, 4096)).Wait().ok());
  fault.path_substring = "fault";
  engine.AddFault(fault);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(engine.Submit(Req(IoOp::kRead, 0, 4096)).Wait().status().code(),
              absl::ErrnoToStatusCode(EIO));
  }
  EXPECT_EQ(engine.fired(), 3);
  engine.ClearFaults();
  EXPECT_TRUE(engine.Submit(Req(IoOp::kRead, 0, 4096)).Wait().ok());
}

TEST_P(FaultInjectionTest, ASyncFaultHitsTheNthSyncOfItsFileOnly) {
  FaultInjectingEngine engine(Inner());
  FaultSpec fault;
  fault.sync = true;
  fault.nth = 1;
  fault.path_substring = "fault";
  engine.AddFault(fault);
  // Requests pass: a sync fault is not a request's.
  EXPECT_TRUE(engine.Submit(Req(IoOp::kWrite, 0, 4096)).Wait().ok());
  EXPECT_TRUE(engine.SyncFault(*file_).ok());
  absl::Status second = engine.SyncFault(*file_);
  EXPECT_EQ(second.code(), absl::ErrnoToStatusCode(EIO)) << second;
  EXPECT_NE(second.message().find("fdatasync (injected)"), std::string::npos)
      << second;
  EXPECT_NE(second.message().find(path_), std::string::npos) << second;
  EXPECT_TRUE(engine.SyncFault(*file_).ok());
  EXPECT_EQ(engine.fired(), 1);
}

TEST_P(FaultInjectionTest, ShortTransferIsNeverASilentShortRead) {
  FaultInjectingEngine engine(Inner());
  ASSERT_TRUE(engine.Submit(Req(IoOp::kWrite, 0, kSize)).Wait().ok());
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kShortTransfer;
  fault.op = IoOp::kRead;
  fault.nth = 0;
  engine.AddFault(fault);
  std::memset(in_.data(), 0, kSize);
  absl::StatusOr<size_t> result =
      engine.Submit(Req(IoOp::kRead, 0, 12288)).Wait();
  ASSERT_FALSE(result.ok()) << "a short read completed as success";
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(result.status().message().find(absl::StrCat(path_, " at offset 0")),
            std::string::npos);
  EXPECT_NE(result.status().message().find("4096 of 12288"), std::string::npos)
      << result.status();
  // The part that did arrive is the file's data: only the length is short.
  EXPECT_EQ(std::memcmp(in_.data(), out_.data(), 4096), 0);
  // The next read is whole.
  ASSERT_TRUE(engine.Submit(Req(IoOp::kRead, 0, kSize)).Wait().ok());
  EXPECT_EQ(std::memcmp(in_.data(), out_.data(), kSize), 0);
}

TEST_P(FaultInjectionTest, DelayedRequestsStillCompleteAndShutdownDrains) {
  FaultInjectingEngine engine(Inner());
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kDelay;
  fault.op = IoOp::kWrite;
  fault.nth = -1;
  fault.delay = absl::Milliseconds(20);
  engine.AddFault(fault);
  std::vector<IoFuture> futures;
  for (int i = 0; i < 8; ++i)
    futures.push_back(engine.Submit(Req(IoOp::kWrite, i * 65536, 65536)));
  engine.Shutdown();
  for (auto& f : futures) {
    ASSERT_TRUE(f.Ready());  // Shutdown drained the delayed requests
    EXPECT_TRUE(f.Wait().ok()) << f.Wait().status();
  }
  EXPECT_EQ(engine.Submit(Req(IoOp::kRead, 0, 4096)).Wait().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(FaultInjectionTest, ManyThreadsWithFaultsEachRequestCompletesOnce) {
  FaultInjectingEngine engine(Inner());
  FaultSpec fault;
  fault.op = IoOp::kWrite;
  fault.nth = -1;
  fault.path_substring = "fault";
  engine.AddFault(fault);
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        if (!engine.Submit(Req(IoOp::kWrite, (t * 25 + i) * 4096, 4096))
                 .Wait()
                 .ok()) {
          ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(4, 25));
  EXPECT_EQ(engine.fired(), 100);
}

TEST_P(FaultInjectionTest, ThrottledEngineRoundTripsAndNamesItself) {
  std::unique_ptr<IoEngine> engine = MakeThrottledEngine(Inner(), 2e9, 2e9);
  EXPECT_EQ(engine->name(), absl::StrCat("throttle(", Inner()->name(), ")"));
  // 2.5 MiB-ish requests are cut into pieces and reassembled.
  ASSERT_TRUE(engine->Submit(Req(IoOp::kWrite, 0, kSize)).Wait().ok());
  absl::StatusOr<size_t> read =
      engine->Submit(Req(IoOp::kRead, 0, kSize)).Wait();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, kSize);
  EXPECT_EQ(std::memcmp(in_.data(), out_.data(), kSize), 0);
  // Errors of a piece surface with path and offset.
  absl::StatusOr<size_t> past_end =
      engine
          ->Submit(IoRequest{IoOp::kRead, file_.get(), kSize - 4096, 8192,
                             in_.data()})
          .Wait();
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kOutOfRange);
  engine->Shutdown();
  EXPECT_EQ(engine->Submit(Req(IoOp::kRead, 0, 4096)).Wait().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A full-duplex throttle paces reads and writes on a clock each; a half-duplex
// one on one clock: a read and a write of 4 pieces each, submitted at once,
// take at least the time of 4 pieces at the cap (full duplex) or of all 8
// (half duplex). (The bound is what the pacing guarantees; the first piece
// of each clock is released at once.)
TEST_P(FaultInjectionTest, AHalfDuplexThrottleMakesReadsAndWritesTakeTurns) {
  constexpr double kRate = 20e6;  // bytes/s: 52 ms per 1 MiB piece
  const double piece = static_cast<double>(kSize) / kRate;
  for (const bool half : {false, true}) {
    std::unique_ptr<IoEngine> engine =
        MakeThrottledEngine(Inner(), kRate, kRate, half);
    ASSERT_TRUE(engine->Submit(Req(IoOp::kWrite, 0, kSize)).Wait().ok());
    // Past the clocks' start: each is free again after a piece's time.
    absl::SleepFor(absl::Seconds(2 * piece));
    const MonoTime start = MonoNow();
    std::vector<IoFuture> futures;
    for (int r = 0; r < 4; ++r) {
      futures.push_back(engine->Submit(Req(IoOp::kRead, 0, kSize)));
      futures.push_back(engine->Submit(Req(IoOp::kWrite, 0, kSize)));
    }
    for (IoFuture& f : futures) ASSERT_TRUE(f.Wait().ok());
    const double elapsed = SecondsSince(start);
    EXPECT_GE(elapsed, (half ? 7 : 3) * piece * 0.99) << "half duplex " << half;
    engine->Shutdown();
  }
}

// Interrupted, a throttle fails the pieces it holds back at once with
// Cancelled (the request whose pieces the device has is completed as usual),
// and new ones too; once the interruption is over, the time the dropped
// pieces had reserved is given back and requests go through at the cap.
// Through the fault-injecting wrapper, which passes the interruption on.
TEST_P(FaultInjectionTest, AnInterruptedThrottleDropsWhatItHoldsBack) {
  constexpr double kRate = 2e6;  // bytes/s: 0.5 s per 1 MiB piece
  FaultInjectingEngine engine(MakeThrottledEngine(Inner(), kRate, kRate));
  std::vector<IoFuture> queued;
  for (int r = 0; r < 8; ++r) {
    queued.push_back(engine.Submit(Req(IoOp::kWrite, 0, kSize)));
  }
  ASSERT_TRUE(queued[0].Wait().ok());  // released at once
  const MonoTime start = MonoNow();
  engine.SetInterrupted(true);
  int cancelled = 0;
  for (int r = 1; r < 8; ++r) {
    const absl::StatusOr<size_t> result = queued[r].Wait();
    if (!result.ok()) {
      EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled)
          << result.status();
      EXPECT_NE(result.status().message().find("interrupted"),
                std::string::npos)
          << result.status();
      ++cancelled;
    }
  }
  // Without the interruption the last would end 3.5 s from now.
  EXPECT_LT(SecondsSince(start), 1.5);
  EXPECT_GE(cancelled, 5);
  EXPECT_EQ(engine.Submit(Req(IoOp::kRead, 0, kSize)).Wait().status().code(),
            absl::StatusCode::kCancelled);

  engine.SetInterrupted(false);
  const MonoTime again = MonoNow();
  absl::StatusOr<size_t> read =
      engine.Submit(Req(IoOp::kRead, 0, kSize)).Wait();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::memcmp(in_.data(), out_.data(), kSize), 0);
  absl::StatusOr<size_t> write =
      engine.Submit(Req(IoOp::kWrite, 0, kSize)).Wait();
  ASSERT_TRUE(write.ok()) << write.status();
  // The dropped pieces' 3 s are not waited out: at most one piece's time.
  EXPECT_LT(SecondsSince(again), 1.5);
}

std::string KindName(
    const testing::TestParamInfo<IoEngineOptions::Kind>& info) {
  return internal_io::KindName(info.param);
}

INSTANTIATE_TEST_SUITE_P(Engines, FaultInjectionTest,
                         testing::ValuesIn(internal_io::EngineKinds()),
                         KindName);

}  // namespace
}  // namespace mlp_offload
