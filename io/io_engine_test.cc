#include "io/io_engine.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "io/aligned_buffer.h"
#include "io/file.h"
#include "io/internal/request.h"
#include "io/internal/test_util.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace {

using internal_io::FillRandom;
using internal_io::ScratchPath;

struct Param {
  IoEngineOptions::Kind kind;
  bool direct;
};

std::string ParamName(const testing::TestParamInfo<Param>& info) {
  return internal_io::KindName(info.param.kind) +
         (info.param.direct ? "Direct" : "Buffered");
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  for (auto kind : internal_io::EngineKinds()) {
    params.push_back({kind, true});
    params.push_back({kind, false});
  }
  return params;
}

class IoEngineTest : public testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    path_ = ScratchPath("engine");
    FileOptions options;
    options.create = true;
    options.try_direct = GetParam().direct;
    options.preallocate_bytes = kFileSize;
    absl::StatusOr<std::unique_ptr<File>> file = File::Open(path_, options);
    ASSERT_TRUE(file.ok()) << file.status();
    file_ = std::move(*file);
    ASSERT_EQ(file_->direct(), GetParam().direct)
        << file_->direct_fallback_reason();
    engine_ = MakeEngine(/*block_size=*/64 << 10, /*queue_depth=*/8);
    ASSERT_NE(engine_, nullptr);
    // Shadow of the file, and a scratch area for I/O.
    shadow_.assign(kFileSize, 0);
    io_ = *AlignedBuffer::Allocate(kFileSize + kDirectIoAlignment);
  }
  void TearDown() override {
    internal_io::SetMaxTransferForTesting(0);
    internal_io::SetEagainEveryForTesting(0);
    internal_io::SetRingSubmitErrorForTesting(0);
    if (engine_) engine_->Shutdown();
    unlink(path_.c_str());
  }

  std::unique_ptr<IoEngine> MakeEngine(size_t block_size,
                                       unsigned queue_depth) {
    IoEngineOptions options;
    options.kind = GetParam().kind;
    options.block_size = block_size;
    options.queue_depth = queue_depth;
    options.num_threads = 4;
    absl::StatusOr<std::unique_ptr<IoEngine>> engine = CreateIoEngine(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  // A random partition of the file into extents (aligned when direct).
  std::vector<std::pair<uint64_t, size_t>> RandomPartition(
      std::mt19937_64& rng) {
    const size_t unit = GetParam().direct ? kDirectIoAlignment : 1;
    std::vector<std::pair<uint64_t, size_t>> extents;
    uint64_t offset = 0;
    while (offset < kFileSize) {
      const size_t max_units =
          std::min<uint64_t>((300 << 10) / unit, (kFileSize - offset) / unit);
      const size_t len =
          unit * std::uniform_int_distribution<size_t>(1, max_units)(rng);
      extents.push_back({offset, len});
      offset += len;
    }
    std::shuffle(extents.begin(), extents.end(), rng);
    return extents;
  }

  // Writes the whole file in random extents, all in flight at once, from the
  // shadow copy (filled with fresh random bytes).
  void WriteEverything(std::mt19937_64& rng) {
    FillRandom(shadow_.data(), shadow_.size(), rng());
    // Buffered requests also get a misaligned buffer address.
    char* base = io_.as<char>() + (GetParam().direct ? 0 : 1);
    std::memcpy(base, shadow_.data(), kFileSize);
    std::vector<IoFuture> futures;
    std::vector<size_t> lengths;
    for (auto [offset, len] : RandomPartition(rng)) {
      IoRequest request{IoOp::kWrite, file_.get(), offset, len, base + offset};
      futures.push_back(engine_->Submit(request));
      lengths.push_back(len);
    }
    for (size_t i = 0; i < futures.size(); ++i) {
      absl::StatusOr<size_t> result = futures[i].Wait();
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(*result, lengths[i]);
    }
  }

  // Reads random extents at random offsets (all in flight) and compares.
  void ReadAndCompare(std::mt19937_64& rng, int count) {
    const size_t unit = GetParam().direct ? kDirectIoAlignment : 1;
    struct Read {
      uint64_t offset;
      size_t len;
      char* dst;
      IoFuture future;
    };
    std::vector<Read> reads;
    // Each read gets its own destination so they can all be in flight.
    std::vector<AlignedBuffer> buffers;
    for (int i = 0; i < count; ++i) {
      const uint64_t offset = unit * std::uniform_int_distribution<uint64_t>(
                                         0, kFileSize / unit - 1)(rng);
      const size_t max_units =
          std::min<uint64_t>((700 << 10) / unit, (kFileSize - offset) / unit);
      const size_t len =
          unit * std::uniform_int_distribution<size_t>(1, max_units)(rng);
      buffers.push_back(*AlignedBuffer::Allocate(len + kDirectIoAlignment));
      char* dst = buffers.back().as<char>() + (GetParam().direct ? 0 : 3);
      std::memset(dst, 0xAB, len);
      Read read{offset, len, dst, IoFuture()};
      read.future = engine_->Submit(
          IoRequest{IoOp::kRead, file_.get(), offset, len, dst});
      reads.push_back(std::move(read));
    }
    for (Read& read : reads) {
      absl::StatusOr<size_t> result = read.future.Wait();
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(*result, read.len);
      ASSERT_EQ(std::memcmp(read.dst, shadow_.data() + read.offset, read.len),
                0)
          << "mismatch reading " << read.len << " bytes at " << read.offset;
    }
  }

  static constexpr uint64_t kFileSize = 4 << 20;
  std::string path_;
  std::unique_ptr<File> file_;
  std::unique_ptr<IoEngine> engine_;
  std::vector<char> shadow_;
  AlignedBuffer io_;
};

TEST_P(IoEngineTest, RandomRoundTrips) {
  std::mt19937_64 rng(1234);
  for (int round = 0; round < 3; ++round) {
    WriteEverything(rng);
    ReadAndCompare(rng, 40);
  }
}

TEST_P(IoEngineTest, ShortTransfersAndEagainAreResubmitted) {
  // Every syscall moves at most 3 pages, and every 3rd result is turned into
  // EAGAIN: the data must still arrive whole and in place.
  internal_io::SetMaxTransferForTesting(3 * kDirectIoAlignment);
  internal_io::SetEagainEveryForTesting(3);
  std::mt19937_64 rng(99);
  WriteEverything(rng);
  ReadAndCompare(rng, 20);
}

// Every transfer reported as EAGAIN for 300 ms (a shortage that lasts):
// before, a piece's kMaxRetries resubmissions went by in milliseconds and
// the request failed; they now back off (RetryDelay), and the request
// completes, whole, once the shortage passes.
TEST_P(IoEngineTest, AnEagainThatLastsIsWaitedOutNotSpunThrough) {
  const size_t len = 256 << 10;
  internal_io::FillRandom(io_.data(), len, 11);
  internal_io::SetEagainEveryForTesting(1);
  IoFuture write =
      engine_->Submit(IoRequest{IoOp::kWrite, file_.get(), 0, len, io_.data()});
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(write.Ready());
  internal_io::SetEagainEveryForTesting(0);
  absl::StatusOr<size_t> written = write.Wait();
  ASSERT_TRUE(written.ok()) << written.status();
  AlignedBuffer back = *AlignedBuffer::Allocate(len);
  ASSERT_TRUE(
      engine_->Submit(IoRequest{IoOp::kRead, file_.get(), 0, len, back.data()})
          .Wait()
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), io_.data(), len), 0);
}

TEST(RetryDelayTest, ImmediateAtFirstThenDoublingToACapAbout20SecondsInAll) {
  for (int k = 1; k <= 8; ++k)
    EXPECT_EQ(internal_io::RetryDelay(k), absl::ZeroDuration()) << k;
  EXPECT_EQ(internal_io::RetryDelay(9), absl::Microseconds(50));
  EXPECT_EQ(internal_io::RetryDelay(10), absl::Microseconds(100));
  EXPECT_EQ(internal_io::RetryDelay(17), absl::Microseconds(12800));
  EXPECT_EQ(internal_io::RetryDelay(18), absl::Milliseconds(20));  // capped
  EXPECT_EQ(internal_io::RetryDelay(internal_io::kMaxRetries),
            absl::Milliseconds(20));
  EXPECT_EQ(internal_io::RetryDelay(1 << 30), absl::Milliseconds(20));
  absl::Duration total;
  for (int k = 1; k <= internal_io::kMaxRetries; ++k) {
    const absl::Duration d = internal_io::RetryDelay(k);
    if (k > 1) {
      EXPECT_GE(d, internal_io::RetryDelay(k - 1)) << k;
    }
    total += d;
  }
  EXPECT_GT(total, absl::Seconds(15));
  EXPECT_LT(total, absl::Seconds(25));
}

// io_uring only: the ring's own submission (io_uring_enter) failing. A
// passing failure (EAGAIN: the kernel short of memory) only delays; one that
// lasts makes the engine refuse new requests, naming the error, while what is
// already in the ring waits and completes once submissions work again.
TEST_P(IoEngineTest, FailingRingSubmissionsBackOffThenRefuseAndRecover) {
  if (GetParam().kind != IoEngineOptions::Kind::kUring) {
    GTEST_SKIP() << "the thread-pool engine has no ring";
  }
  const size_t len = 256 << 10;
  internal_io::FillRandom(io_.data(), len, 5);
  internal_io::SetRingSubmitErrorForTesting(EAGAIN);
  IoFuture delayed =
      engine_->Submit(IoRequest{IoOp::kWrite, file_.get(), 0, len, io_.data()});
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(delayed.Ready());
  internal_io::SetRingSubmitErrorForTesting(0);
  ASSERT_TRUE(delayed.Wait().ok());

  internal_io::SetRingSubmitErrorForTesting(EBADF);
  IoFuture stuck = engine_->Submit(
      IoRequest{IoOp::kWrite, file_.get(), len, len, io_.data()});
  // Past the engine's patience (2 s of failing submissions).
  absl::SleepFor(absl::Milliseconds(2600));
  absl::StatusOr<size_t> refused =
      engine_
          ->Submit(IoRequest{IoOp::kRead, file_.get(), 2 * len, 4096,
                             io_.as<char>() + 2 * len})
          .Wait();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("io_uring_enter"),
            std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find(
                absl::StrCat("read ", path_, " at offset ", 2 * len)),
            std::string::npos)
      << refused.status();
  EXPECT_FALSE(stuck.Ready());  // in the ring: neither failed nor lost
  internal_io::SetRingSubmitErrorForTesting(0);
  absl::StatusOr<size_t> written = stuck.Wait();
  ASSERT_TRUE(written.ok()) << written.status();
  // Working again: both writes are on disk.
  AlignedBuffer back = *AlignedBuffer::Allocate(2 * len);
  ASSERT_TRUE(
      engine_
          ->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 2 * len, back.data()})
          .Wait()
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), io_.data(), len), 0);
  EXPECT_EQ(std::memcmp(back.as<char>() + len, io_.data(), len), 0);
}

TEST_P(IoEngineTest, ShutdownWithABrokenRingFailsWhatTheKernelNeverTook) {
  if (GetParam().kind != IoEngineOptions::Kind::kUring) {
    GTEST_SKIP() << "the thread-pool engine has no ring";
  }
  // 64 KiB pieces, 8 in the ring: the read's 2 and 6 of the write's 16 go
  // into the ring, the other 10 wait in the engine's queue.
  const size_t read_len = 128 << 10, write_len = 1 << 20;
  char* read_into = io_.as<char>();
  char* write_from = io_.as<char>() + read_len;
  std::memset(read_into, 0x5a, read_len);
  FillRandom(write_from, write_len, 9);
  internal_io::SetRingSubmitErrorForTesting(EBADF);
  IoFuture read = engine_->Submit(
      IoRequest{IoOp::kRead, file_.get(), 0, read_len, read_into});
  IoFuture write = engine_->Submit(
      IoRequest{IoOp::kWrite, file_.get(), read_len, write_len, write_from});
  absl::SleepFor(absl::Milliseconds(2600));  // past the engine's patience
  EXPECT_FALSE(read.Ready());                // in the ring, kept for now

  absl::Notification shut;
  std::thread shutdown([&] {
    engine_->Shutdown();
    shut.Notify();
  });
  const bool bounded = shut.WaitForNotificationWithTimeout(absl::Seconds(20));
  // Unstick a hung Shutdown so the test fails instead of hanging.
  internal_io::SetRingSubmitErrorForTesting(0);
  shutdown.join();
  ASSERT_TRUE(bounded) << "Shutdown waited for a ring that cannot submit";

  ASSERT_TRUE(read.Ready());
  ASSERT_TRUE(write.Ready());
  for (IoFuture* f : {&read, &write}) {
    absl::StatusOr<size_t> r = f->Wait();
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("io_uring_enter"), std::string::npos)
        << r.status();
  }
  EXPECT_NE(read.Wait().status().message().find(
                absl::StrCat("read ", path_, " at offset 0")),
            std::string::npos)
      << read.Wait().status();
  // The kernel never saw them: the read buffer and the file are untouched.
  EXPECT_TRUE(std::all_of(read_into, read_into + read_len,
                          [](char c) { return c == 0x5a; }));
  std::vector<char> on_disk(write_len, 1);
  const int fd = open(path_.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pread(fd, on_disk.data(), write_len, read_len),
            static_cast<ssize_t>(write_len));
  close(fd);
  EXPECT_TRUE(std::all_of(on_disk.begin(), on_disk.end(),
                          [](char c) { return c == 0; }));
  // Shut down for good: new requests are refused, not queued.
  EXPECT_FALSE(
      engine_->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 4096, read_into})
          .Wait()
          .ok());
}

TEST_P(IoEngineTest, ReadPastEndIsAnErrorNeverAShortSuccess) {
  ASSERT_TRUE(file_->Allocate(kFileSize).ok());
  const uint64_t offset = kFileSize - 8192;
  absl::StatusOr<size_t> result =
      engine_
          ->Submit(
              IoRequest{IoOp::kRead, file_.get(), offset, 3 * 8192, io_.data()})
          .Wait();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(result.status().message().find(path_), std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("read"), std::string::npos);
  EXPECT_NE(result.status().message().find(absl::StrCat("offset ", kFileSize)),
            std::string::npos)
      << result.status();
}

TEST_P(IoEngineTest, KernelErrorNamesOperationPathAndOffset) {
  FileOptions ro;
  ro.read_only = true;
  ro.try_direct = GetParam().direct;
  absl::StatusOr<std::unique_ptr<File>> read_only = File::Open(path_, ro);
  ASSERT_TRUE(read_only.ok());
  absl::StatusOr<size_t> result =
      engine_
          ->Submit(
              IoRequest{IoOp::kWrite, read_only->get(), 8192, 4096, io_.data()})
          .Wait();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find(
                absl::StrCat("write ", path_, " at offset 8192")),
            std::string::npos)
      << result.status();
}

TEST_P(IoEngineTest, InvalidRequestsAreRejected) {
  absl::StatusOr<size_t> no_buffer =
      engine_->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 4096, nullptr})
          .Wait();
  EXPECT_EQ(no_buffer.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<size_t> no_file =
      engine_->Submit(IoRequest{IoOp::kRead, nullptr, 0, 4096, io_.data()})
          .Wait();
  EXPECT_EQ(no_file.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<size_t> empty =
      engine_->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 0, io_.data()})
          .Wait();
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 0u);
  // Past the largest file offset, also with a length whose own size would
  // wrap the check (before: accepted, then split into ~2^44 pieces).
  const uint64_t huge_lengths[] = {
      uint64_t{1} << 63, (uint64_t{1} << 63) + 4096, UINT64_MAX - 4095};
  for (uint64_t length : huge_lengths) {
    absl::StatusOr<size_t> huge =
        engine_
            ->Submit(
                IoRequest{IoOp::kRead, file_.get(), 4096, length, io_.data()})
            .Wait();
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument)
        << length;
    EXPECT_NE(huge.status().message().find("overflows the file offset"),
              std::string::npos)
        << huge.status();
  }
  absl::StatusOr<size_t> past_end =
      engine_
          ->Submit(IoRequest{IoOp::kRead, file_.get(),
                             uint64_t{INT64_MAX} - 4095, 8192, io_.data()})
          .Wait();
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument);
  if (GetParam().direct) {
    absl::StatusOr<size_t> misaligned =
        engine_
            ->Submit(
                IoRequest{IoOp::kWrite, file_.get(), 100, 4096, io_.data()})
            .Wait();
    EXPECT_EQ(misaligned.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(misaligned.status().message().find(
                  absl::StrCat(path_, " at offset 100")),
              std::string::npos)
        << misaligned.status();
  }
}

TEST_P(IoEngineTest, ManyThreadsSubmitAtOnce) {
  // Each thread owns one slice of the file and round-trips it repeatedly.
  constexpr int kThreads = 8;
  const uint64_t slice = kFileSize / kThreads;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer out = *AlignedBuffer::Allocate(slice);
      AlignedBuffer in = *AlignedBuffer::Allocate(slice);
      for (int iter = 0; iter < 10; ++iter) {
        FillRandom(out.data(), slice, t * 100 + iter);
        // Four requests per slice so pieces of different threads interleave.
        std::vector<IoFuture> writes;
        for (int q = 0; q < 4; ++q) {
          writes.push_back(engine_->Submit(
              IoRequest{IoOp::kWrite, file_.get(), t * slice + q * slice / 4,
                        slice / 4, out.as<char>() + q * slice / 4}));
        }
        for (auto& w : writes) {
          if (!w.Wait().ok())
            failures[t] = std::string(w.Wait().status().message());
        }
        absl::StatusOr<size_t> read =
            engine_
                ->Submit(IoRequest{IoOp::kRead, file_.get(), t * slice, slice,
                                   in.data()})
                .Wait();
        if (!read.ok()) failures[t] = std::string(read.status().message());
        if (std::memcmp(in.data(), out.data(), slice) != 0)
          failures[t] = "data mismatch";
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(failures[t], "") << "thread " << t;
}

TEST_P(IoEngineTest, BatchCompletesEachRequest) {
  FillRandom(io_.data(), kFileSize, 5);
  std::vector<IoRequest> requests;
  std::vector<IoFuture> futures(16);
  std::vector<IoCallback> callbacks;
  for (int i = 0; i < 16; ++i) {
    requests.push_back(IoRequest{IoOp::kWrite, file_.get(), uint64_t(i) * 65536,
                                 65536, io_.as<char>() + i * 65536});
    callbacks.push_back(futures[i].AsCallback());
  }
  // One bad request in the batch fails alone.
  requests[7].buffer = nullptr;
  engine_->SubmitBatch(requests, absl::MakeSpan(callbacks));
  for (int i = 0; i < 16; ++i) {
    absl::StatusOr<size_t> result = futures[i].Wait();
    if (i == 7) {
      EXPECT_FALSE(result.ok());
    } else {
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(*result, 65536u);
    }
  }
}

TEST_P(IoEngineTest, ShutdownDrainsThenRefuses) {
  FillRandom(io_.data(), kFileSize, 6);
  ::mlp_offload::Mutex mu;
  int ok = 0;
  for (int i = 0; i < 64; ++i) {
    engine_->Submit(IoRequest{IoOp::kWrite, file_.get(), uint64_t(i) * 65536,
                              65536, io_.as<char>() + i * 65536},
                    [&](absl::StatusOr<size_t> r) {
                      ::mlp_offload::MutexLock lock(&mu);
                      if (r.ok()) ++ok;
                    });
  }
  engine_->Shutdown();
  {
    ::mlp_offload::MutexLock lock(&mu);
    EXPECT_EQ(ok, 64);  // every callback ran before Shutdown returned
  }
  engine_->Shutdown();  // idempotent
  absl::StatusOr<size_t> after =
      engine_->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 4096, io_.data()})
          .Wait();
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(IoEngineTest, CallbacksMaySubmitMore) {
  // A chain of 20 dependent writes, each submitted from the previous one's
  // completion on the engine thread.
  FillRandom(io_.data(), kFileSize, 8);
  IoFuture last;
  std::function<void(int)> step = [&](int i) {
    engine_->Submit(IoRequest{IoOp::kWrite, file_.get(), uint64_t(i) * 4096,
                              4096, io_.as<char>() + i * 4096},
                    [&, i](absl::StatusOr<size_t> r) {
                      if (!r.ok() || i == 19) {
                        last.Set(r);
                        return;
                      }
                      step(i + 1);
                    });
  };
  step(0);
  ASSERT_TRUE(last.Wait().ok()) << last.Wait().status();
}

TEST_P(IoEngineTest, RegisteredBuffersRoundTrip) {
  AlignedBuffer out = *AlignedBuffer::Allocate(1 << 20);
  AlignedBuffer in = *AlignedBuffer::Allocate(1 << 20);
  const iovec regions[] = {{out.data(), out.size()}, {in.data(), in.size()}};
  ASSERT_TRUE(engine_->RegisterBuffers(regions).ok());
  FillRandom(out.data(), out.size(), 11);
  ASSERT_TRUE(engine_
                  ->Submit(IoRequest{IoOp::kWrite, file_.get(), 1 << 20,
                                     1 << 20, out.data()})
                  .Wait()
                  .ok());
  // A piece inside a registered buffer, not at its start.
  ASSERT_TRUE(engine_
                  ->Submit(IoRequest{IoOp::kRead, file_.get(), (1 << 20) + 8192,
                                     65536, in.as<char>() + 8192})
                  .Wait()
                  .ok());
  EXPECT_EQ(std::memcmp(in.as<char>() + 8192, out.as<char>() + 8192, 65536), 0);
  ASSERT_TRUE(engine_->RegisterBuffers({}).ok());
}

TEST_P(IoEngineTest, ABufferTheKernelCannotRegisterIsLeftOut) {
  // io_uring takes no fixed buffer over 1 GiB (EFAULT): registration is an
  // optimisation, so that one stays unregistered and the call succeeds
  // (before: the whole call failed). Only io_uring registers buffers; the
  // buffer (zeroed on allocation) takes 1 GiB of memory for a moment.
  if (GetParam().kind != IoEngineOptions::Kind::kUring || !GetParam().direct) {
    GTEST_SKIP() << "registration is io_uring's; one variant is enough";
  }
  AlignedBuffer big = *AlignedBuffer::Allocate((size_t{1} << 30) + 4096);
  AlignedBuffer small = *AlignedBuffer::Allocate(1 << 20);
  const iovec regions[] = {{big.data(), big.size()},
                           {small.data(), small.size()}};
  ASSERT_TRUE(engine_->RegisterBuffers(regions).ok());
  FillRandom(big.data(), 4096, 5);
  ASSERT_TRUE(
      engine_->Submit(IoRequest{IoOp::kWrite, file_.get(), 0, 4096, big.data()})
          .Wait()
          .ok());
  ASSERT_TRUE(
      engine_
          ->Submit(IoRequest{IoOp::kRead, file_.get(), 0, 4096, small.data()})
          .Wait()
          .ok());
  EXPECT_EQ(std::memcmp(small.data(), big.data(), 4096), 0);
  ASSERT_TRUE(engine_->RegisterBuffers({}).ok());
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest, testing::ValuesIn(AllParams()),
                         ParamName);

TEST(IoEngineFactoryTest, DisableEnvVarForcesThreadPool) {
  ASSERT_EQ(setenv("MLP_OFFLOAD_DISABLE_IO_URING", "1", 1), 0);
  std::string reason;
  EXPECT_FALSE(IoUringAvailable(&reason));
  EXPECT_NE(reason.find("MLP_OFFLOAD_DISABLE_IO_URING"), std::string::npos)
      << reason;
  IoEngineOptions options;
  absl::StatusOr<std::unique_ptr<IoEngine>> engine = CreateIoEngine(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->name(), "threadpool");
  options.kind = IoEngineOptions::Kind::kUring;
  EXPECT_EQ(CreateIoEngine(options).status().code(),
            absl::StatusCode::kUnavailable);
  ASSERT_EQ(unsetenv("MLP_OFFLOAD_DISABLE_IO_URING"), 0);
  if (IoUringAvailable(&reason)) {
    options.kind = IoEngineOptions::Kind::kAuto;
    EXPECT_EQ((*CreateIoEngine(options))->name(), "io_uring");
  }
}

TEST(IoEngineFactoryTest, RejectsBadOptions) {
  IoEngineOptions options;
  options.block_size = 1000;
  EXPECT_EQ(CreateIoEngine(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.block_size = 4096;
  options.queue_depth = 0;
  EXPECT_EQ(CreateIoEngine(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Junk sizes are refused before a slot or thread is made.
  options.queue_depth = kMaxQueueDepth + 1;
  absl::Status s = CreateIoEngine(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("queue_depth 4097"), absl::string_view::npos) << s;
  options.queue_depth = 8;
  for (int threads : {0, kMaxIoThreads + 1}) {
    options.num_threads = threads;
    s = CreateIoEngine(options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << threads;
    EXPECT_NE(s.message().find("num_threads"), absl::string_view::npos) << s;
  }
  options.num_threads = kMaxIoThreads;
  options.kind = IoEngineOptions::Kind::kThreadPool;
  EXPECT_TRUE(CreateIoEngine(options).ok());
}

TEST(IoEngineFactoryTest, RefusesBlockSizesAboveOneGiB) {
  // liburing takes a transfer's length as an unsigned int (4 GiB would be 0
  // bytes), and near SIZE_MAX splitting a request wraps around.
  IoEngineOptions options;
  options.num_threads = 1;
  for (size_t block_size :
       {size_t{2} << 30, size_t{4} << 30, SIZE_MAX & ~size_t{4095}, SIZE_MAX}) {
    options.block_size = block_size;
    absl::Status s = CreateIoEngine(options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << block_size;
    EXPECT_NE(s.message().find(absl::StrCat("block_size ", block_size)),
              absl::string_view::npos)
        << s;
  }
  options.block_size = size_t{1} << 30;
  options.kind = IoEngineOptions::Kind::kThreadPool;
  EXPECT_TRUE(CreateIoEngine(options).ok());
}

TEST(IoFutureTest, FirstSetWins) {
  IoFuture future;
  EXPECT_FALSE(future.Ready());
  IoFuture copy = future;
  future.Set(size_t{5});
  copy.Set(absl::InternalError("late"));
  EXPECT_TRUE(copy.Ready());
  EXPECT_EQ(*copy.Wait(), 5u);
}

}  // namespace
}  // namespace mlp_offload
