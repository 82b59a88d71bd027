#include "io/shared_throttle.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/aligned_buffer.h"
#include "io/file.h"
#include "io/internal/test_util.h"
#include "mlp_offload/base/clock.h"

namespace mlp_offload {
namespace {

using internal_io::FillRandom;
using internal_io::ScratchDir;

constexpr size_t kMiB = 1 << 20;
constexpr size_t kSize = 8 * kMiB;  // per engine
constexpr double kCap = 64e6;       // bytes/s, the whole device

// Pacing gives lower bounds that load cannot break: the last 1 MiB piece of
// `mib` MiB is released no earlier than (mib - 1) MiB of device time.
double MinSeconds(double mib_equivalents) {
  return 0.95 * (mib_equivalents - 1) * kMiB / kCap;
}

class SharedThrottleTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = ScratchDir("shared_throttle");
    state_ = dir_ + "/device";
  }

  std::unique_ptr<IoEngine> Engine(double contention) {
    absl::StatusOr<std::unique_ptr<IoEngine>> engine =
        EngineWith(contention, absl::InfiniteDuration());
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  // An engine capped at kCap each way whose waits for the state file's lock
  // last `lock_timeout` at most.
  absl::StatusOr<std::unique_ptr<IoEngine>> EngineWithLockTimeout(
      absl::Duration lock_timeout) {
    return EngineWith(0, lock_timeout);
  }

  // An engine capped at kCap each way, with `contention`, whose waits for
  // the state file's lock last `lock_timeout` at most; `half_duplex`: one
  // clock for reads and writes.
  absl::StatusOr<std::unique_ptr<IoEngine>> EngineWith(
      double contention, absl::Duration lock_timeout,
      bool half_duplex = false) {
    IoEngineOptions inner;
    inner.kind = IoEngineOptions::Kind::kThreadPool;
    inner.block_size = kMiB;
    SharedThrottleOptions options;
    options.state_path = state_;
    options.read_bytes_per_sec = kCap;
    options.write_bytes_per_sec = kCap;
    options.contention = contention;
    options.lock_timeout = lock_timeout;
    options.half_duplex = half_duplex;
    return MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  }

  std::unique_ptr<File> Open(const std::string& name) {
    FileOptions options;
    options.create = true;
    options.preallocate_bytes = kSize;
    return *File::Open(dir_ + "/" + name, options);
  }

  // Submits a write of kSize on each engine at once and returns the seconds
  // until both are done; a failed write is reported here.
  static double WriteBoth(IoEngine& a, File& fa, AlignedBuffer& buf_a,
                          IoEngine& b, File& fb, AlignedBuffer& buf_b) {
    const MonoTime start = MonoNow();
    IoFuture wa = a.Submit({IoOp::kWrite, &fa, 0, kSize, buf_a.data()});
    IoFuture wb = b.Submit({IoOp::kWrite, &fb, 0, kSize, buf_b.data()});
    const absl::StatusOr<size_t> ra = wa.Wait(), rb = wb.Wait();
    EXPECT_TRUE(ra.ok()) << ra.status();
    EXPECT_TRUE(rb.ok()) << rb.status();
    return SecondsSince(start);
  }

  std::string dir_, state_;
};

TEST_F(SharedThrottleTest, RoundTripsAndNamesItself) {
  std::unique_ptr<IoEngine> engine = Engine(0);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->name(), "shared_throttle(threadpool)");
  std::unique_ptr<File> file = Open("a");
  AlignedBuffer out = *AlignedBuffer::Allocate(kSize);
  AlignedBuffer in = *AlignedBuffer::Allocate(kSize);
  FillRandom(out.data(), kSize, 7);
  ASSERT_TRUE(engine->Submit({IoOp::kWrite, file.get(), 0, kSize, out.data()})
                  .Wait()
                  .ok());
  absl::StatusOr<size_t> read =
      engine->Submit({IoOp::kRead, file.get(), 0, kSize, in.data()}).Wait();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, kSize);
  EXPECT_EQ(std::memcmp(out.data(), in.data(), kSize), 0);
  // A piece's error surfaces with the path.
  absl::StatusOr<size_t> past_end =
      engine->Submit({IoOp::kRead, file.get(), kSize - 4096, 8192, in.data()})
          .Wait();
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kOutOfRange);
  engine->Shutdown();
  EXPECT_EQ(engine->Submit({IoOp::kRead, file.get(), 0, 4096, in.data()})
                .Wait()
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

// Two engines on one state file share one cap: 16 MiB at 64 MB/s takes
// twice as long as either engine's 8 MiB would alone.
TEST_F(SharedThrottleTest, EnginesOnOneStateFileShareTheCap) {
  std::unique_ptr<IoEngine> a = Engine(0), b = Engine(0);
  std::unique_ptr<File> fa = Open("a"), fb = Open("b");
  AlignedBuffer buf_a = *AlignedBuffer::Allocate(kSize);
  AlignedBuffer buf_b = *AlignedBuffer::Allocate(kSize);
  EXPECT_GE(WriteBoth(*a, *fa, buf_a, *b, *fb, buf_b), MinSeconds(16));
  // Reads have their own clock: the writes above did not use it up, and one
  // engine alone is paced at the full cap.
  const MonoTime read_start = MonoNow();
  ASSERT_TRUE(
      a->Submit({IoOp::kRead, fa.get(), 0, kSize, buf_a.data()}).Wait().ok());
  EXPECT_GE(SecondsSince(read_start), MinSeconds(8));
}

// With contention 1, a piece scheduled while two engines stream costs twice
// its size: a's 8 MiB go alone (8), b's while a is still streaming (16).
TEST_F(SharedThrottleTest, ConcurrentStreamsPayTheContention) {
  std::unique_ptr<IoEngine> a = Engine(1.0), b = Engine(1.0);
  std::unique_ptr<File> fa = Open("a"), fb = Open("b");
  AlignedBuffer buf_a = *AlignedBuffer::Allocate(kSize);
  AlignedBuffer buf_b = *AlignedBuffer::Allocate(kSize);
  EXPECT_GE(WriteBoth(*a, *fa, buf_a, *b, *fb, buf_b), MinSeconds(24));
  // Taking turns (the tier lock's way) pays nothing: 16 MiB of device time.
  const MonoTime turns = MonoNow();
  ASSERT_TRUE(
      a->Submit({IoOp::kWrite, fa.get(), 0, kSize, buf_a.data()}).Wait().ok());
  ASSERT_TRUE(
      b->Submit({IoOp::kWrite, fb.get(), 0, kSize, buf_b.data()}).Wait().ok());
  const double took = SecondsSince(turns);
  EXPECT_GE(took, MinSeconds(16));
}

// Half duplex, reads and writes take turns on one clock: a read and a write
// of 8 MiB each, submitted at once, take 16 MiB of device time (the last of
// their 16 pieces is released after the other 15). Full duplex, each
// direction has its own clock: 8 MiB of device time at least.
TEST_F(SharedThrottleTest, AHalfDuplexDeviceMakesReadsAndWritesTakeTurns) {
  std::unique_ptr<File> fr = Open("read"), fw = Open("write");
  AlignedBuffer in = *AlignedBuffer::Allocate(kSize);
  AlignedBuffer out = *AlignedBuffer::Allocate(kSize);
  for (const bool half : {false, true}) {
    SCOPED_TRACE(half ? "half duplex" : "full duplex");
    // A state file of its own: both clocks start free.
    state_ = absl::StrCat(dir_, "/device_", half ? "half" : "full");
    absl::StatusOr<std::unique_ptr<IoEngine>> engine =
        EngineWith(0, absl::InfiniteDuration(), half);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const MonoTime start = MonoNow();
    IoFuture read =
        (*engine)->Submit({IoOp::kRead, fr.get(), 0, kSize, in.data()});
    IoFuture write =
        (*engine)->Submit({IoOp::kWrite, fw.get(), 0, kSize, out.data()});
    const absl::StatusOr<size_t> rr = read.Wait(), rw = write.Wait();
    EXPECT_TRUE(rr.ok()) << rr.status();
    EXPECT_TRUE(rw.ok()) << rw.status();
    EXPECT_GE(SecondsSince(start), MinSeconds(half ? 16 : 8));
    (*engine)->Shutdown();
  }
}

// The clock lives in the file: a child process's engine and ours share it.
TEST_F(SharedThrottleTest, ProcessesShareTheCap) {
  int go[2], ready[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::unique_ptr<IoEngine> engine = Engine(0);
    std::unique_ptr<File> file = Open("child");
    AlignedBuffer buf = *AlignedBuffer::Allocate(kSize);
    char c = 1;
    if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) _exit(3);
    const bool ok =
        engine->Submit({IoOp::kWrite, file.get(), 0, kSize, buf.data()})
            .Wait()
            .ok();
    _exit(ok ? 0 : 4);
  }
  std::unique_ptr<IoEngine> engine = Engine(0);
  std::unique_ptr<File> file = Open("parent");
  AlignedBuffer buf = *AlignedBuffer::Allocate(kSize);
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  const MonoTime start = MonoNow();
  ASSERT_EQ(write(go[1], &c, 1), 1);
  ASSERT_TRUE(engine->Submit({IoOp::kWrite, file.get(), 0, kSize, buf.data()})
                  .Wait()
                  .ok());
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_GE(SecondsSince(start), MinSeconds(16));
}

TEST_F(SharedThrottleTest, BadInputIsNamed) {
  IoEngineOptions inner;
  inner.kind = IoEngineOptions::Kind::kThreadPool;
  SharedThrottleOptions options;
  options.read_bytes_per_sec = kCap;
  options.state_path = dir_ + "/missing/device";
  absl::StatusOr<std::unique_ptr<IoEngine>> e =
      MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find(options.state_path), std::string::npos)
      << e.status();

  options.state_path = state_;
  options.contention = -0.5;
  e = MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("contention"), std::string::npos);
  options.contention = 0;

  // Somebody else's file, larger than a state file.
  const std::string other = dir_ + "/other";
  { std::unique_ptr<File> f = Open("other"); }
  options.state_path = other;
  e = MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("not a shared throttle state file"),
            std::string::npos);

  // A small file with the wrong contents.
  const std::string junk = dir_ + "/junk";
  {
    const int fd = open(junk.c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, "garbage!", 8), 8);
    close(fd);
  }
  options.state_path = junk;
  e = MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);

  // A symlink planted where the state file goes is not followed.
  const std::string link = dir_ + "/link";
  ASSERT_EQ(symlink(state_.c_str(), link.c_str()), 0);
  options.state_path = link;
  e = MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find(link), std::string::npos);
}

// The state file is read and written, never mapped: truncating or
// overwriting it under a running engine fails that engine's requests with
// an error naming it (a mapping would have killed the process with SIGBUS).
TEST_F(SharedThrottleTest, AStateFileChangedInUseFailsRequestsNamingIt) {
  for (const bool truncate_it : {true, false}) {
    SCOPED_TRACE(truncate_it ? "truncated" : "overwritten");
    std::unique_ptr<IoEngine> engine = Engine(0);
    ASSERT_NE(engine, nullptr);
    std::unique_ptr<File> file = Open("a");
    AlignedBuffer buf = *AlignedBuffer::Allocate(2 * kMiB);
    ASSERT_TRUE(
        engine->Submit({IoOp::kWrite, file.get(), 0, 2 * kMiB, buf.data()})
            .Wait()
            .ok());
    if (truncate_it) {
      ASSERT_EQ(truncate(state_.c_str(), 0), 0);
    } else {
      const int fd = open(state_.c_str(), O_WRONLY);
      ASSERT_GE(fd, 0);
      const char junk[32] = "not a throttle state file";
      ASSERT_EQ(pwrite(fd, junk, sizeof(junk), 0), 32);
      close(fd);
    }
    const absl::StatusOr<size_t> write =
        engine->Submit({IoOp::kWrite, file.get(), 0, 2 * kMiB, buf.data()})
            .Wait();
    EXPECT_EQ(write.status().code(), absl::StatusCode::kUnavailable)
        << write.status();
    EXPECT_NE(write.status().message().find(state_), std::string::npos)
        << write.status();
    EXPECT_NE(write.status().message().find("truncated or overwritten"),
              std::string::npos)
        << write.status();
    engine->Shutdown();
    engine.reset();
    // Junk stays somebody else's file; an emptied one is claimed afresh.
    if (!truncate_it) {
      ASSERT_EQ(unlink(state_.c_str()), 0);
    }
    std::unique_ptr<IoEngine> again = Engine(0);
    ASSERT_NE(again, nullptr);
    EXPECT_TRUE(
        again->Submit({IoOp::kWrite, file.get(), 0, 2 * kMiB, buf.data()})
            .Wait()
            .ok());
  }
}

// A process that holds the state file's lock and makes no progress (here a
// descriptor of this test holding the flock) fails a request that waits past
// lock_timeout with DeadlineExceeded naming the file; once it lets go, the
// engine's requests go through again. Creating an engine waits the same way.
TEST_F(SharedThrottleTest, AWaitForTheStateFilesLockIsBounded) {
  absl::StatusOr<std::unique_ptr<IoEngine>> engine =
      EngineWithLockTimeout(absl::Milliseconds(150));
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<File> file = Open("a");
  AlignedBuffer buf = *AlignedBuffer::Allocate(2 * kMiB);

  const int holder = open(state_.c_str(), O_RDWR);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(flock(holder, LOCK_EX), 0);
  const MonoTime start = MonoNow();
  const absl::StatusOr<size_t> write =
      (*engine)
          ->Submit({IoOp::kWrite, file.get(), 0, 2 * kMiB, buf.data()})
          .Wait();
  const double waited = SecondsSince(start);
  EXPECT_EQ(write.status().code(), absl::StatusCode::kDeadlineExceeded)
      << write.status();
  EXPECT_NE(write.status().message().find(state_), std::string::npos)
      << write.status();
  EXPECT_GE(waited, 0.14);
  absl::StatusOr<std::unique_ptr<IoEngine>> second =
      EngineWithLockTimeout(absl::Milliseconds(150));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kDeadlineExceeded)
      << second.status();

  ASSERT_EQ(flock(holder, LOCK_UN), 0);
  close(holder);
  absl::Status again;
  // (The engine's stream count may report its failed piece's count once.)
  for (int i = 0; i < 2; ++i) {
    again = (*engine)
                ->Submit({IoOp::kWrite, file.get(), 0, 2 * kMiB, buf.data()})
                .Wait()
                .status();
    if (again.ok()) break;
  }
  EXPECT_TRUE(again.ok()) << again;
  (*engine)->Shutdown();

  EXPECT_EQ(EngineWithLockTimeout(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The count of streaming engines in the state file (its record's int32 at
// byte 24).
int StreamingCount(const std::string& state) {
  const int fd = open(state.c_str(), O_RDONLY);
  int32_t count = -1;
  if (fd >= 0) {
    if (pread(fd, &count, sizeof(count), 24) != sizeof(count)) count = -1;
    close(fd);
  }
  return count;
}

// A stop that cannot be counted in time (another process holds the file's
// lock past lock_timeout when the engine's last request completes) is owed,
// not lost: the engine's next section under the lock takes it off, and the
// request after it is not failed for it. (Lost, every engine sharing the
// device would count one stream too many for good.)
TEST_F(SharedThrottleTest, AStopCountedLateIsNotLost) {
  absl::StatusOr<std::unique_ptr<IoEngine>> engine =
      EngineWithLockTimeout(absl::Milliseconds(100));
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::unique_ptr<File> file = Open("a");
  AlignedBuffer buf = *AlignedBuffer::Allocate(kSize);
  // Every piece is reserved before Submit returns; the stop comes at the
  // end, some 130 ms later, while the lock is held.
  IoFuture write =
      (*engine)->Submit({IoOp::kWrite, file.get(), 0, kSize, buf.data()});
  const int holder = open(state_.c_str(), O_RDWR);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(flock(holder, LOCK_EX), 0);
  const absl::StatusOr<size_t> written = write.Wait();
  EXPECT_TRUE(written.ok()) << written.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  ASSERT_EQ(flock(holder, LOCK_UN), 0);
  close(holder);
  EXPECT_EQ(StreamingCount(state_), 1);  // the stop is still owed
  const absl::StatusOr<size_t> again =
      (*engine)
          ->Submit({IoOp::kWrite, file.get(), 0, kSize, buf.data()})
          .Wait();
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(StreamingCount(state_), 0);
  (*engine)->Shutdown();
}

// A state file that cannot be written when it is created (a full disk; here
// a file-size limit of 16 bytes, in a child process) is an error naming it.
TEST_F(SharedThrottleTest, AnUnwritableNewStateFileIsNamed) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    signal(SIGXFSZ, SIG_IGN);
    const rlimit limit = {16, 16};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(2);
    IoEngineOptions inner;
    inner.kind = IoEngineOptions::Kind::kThreadPool;
    SharedThrottleOptions options;
    options.state_path = state_;
    options.write_bytes_per_sec = kCap;
    const absl::StatusOr<std::unique_ptr<IoEngine>> engine =
        MakeSharedThrottledEngine(*CreateIoEngine(inner), options);
    if (engine.ok()) _exit(3);
    if (engine.status().message().find(state_) == std::string::npos) _exit(4);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The part written is taken back: the next opener claims the file.
  struct stat st;
  ASSERT_EQ(stat(state_.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
  EXPECT_NE(Engine(0), nullptr);
}

}  // namespace
}  // namespace mlp_offload
