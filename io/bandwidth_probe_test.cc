#include "io/bandwidth_probe.h"

#include <dirent.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/internal/test_util.h"
#include "io/shared_throttle.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

// fdatasync calls made so far: the fdatasync below stands in for libc's in
// this test binary.
std::atomic<int> g_fdatasyncs{0};

}  // namespace
}  // namespace mlp_offload

extern "C" int fdatasync(int fd) {
  ++mlp_offload::g_fdatasyncs;
  return static_cast<int>(syscall(SYS_fdatasync, fd));
}

namespace mlp_offload {
namespace {

int CountEntries(const std::string& dir) {
  int n = 0;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") ++n;
  }
  closedir(d);
  return n;
}

TEST(BandwidthProbeTest, TwoDirsOnOneDeviceAreReportedAsSharing) {
  const std::string a = internal_io::ScratchDir("probe_a");
  const std::string b = internal_io::ScratchDir("probe_b");
  ProbeOptions options;
  options.bytes = 8 << 20;
  options.block_size = 1 << 20;
  options.queue_depth = 4;
  absl::StatusOr<std::vector<PathBandwidth>> result =
      ProbeBandwidth({a, b}, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->size(), 2u);
  for (const PathBandwidth& r : *result) {
    EXPECT_GT(r.write_alone, 0);
    EXPECT_GT(r.read_alone, 0);
    EXPECT_GT(r.write_together, 0);
    EXPECT_GT(r.read_together, 0);
    EXPECT_TRUE(r.direct) << r.direct_fallback_reason;
  }
  EXPECT_EQ((*result)[0].dir, a);
  EXPECT_EQ((*result)[0].device, (*result)[1].device);
  EXPECT_EQ((*result)[0].shares_device_with, std::vector<std::string>{b});
  EXPECT_EQ((*result)[1].shares_device_with, std::vector<std::string>{a});
  // The temporary files are gone.
  EXPECT_EQ(CountEntries(a), 0);
  EXPECT_EQ(CountEntries(b), 0);
}

TEST(BandwidthProbeTest, WritesAreTimedWithTheirFdatasync) {
  const std::string dir = internal_io::ScratchDir("probe_sync");
  ProbeOptions options;
  options.bytes = 1 << 20;
  options.block_size = 1 << 20;
  options.queue_depth = 1;
  const int before = g_fdatasyncs.load();
  absl::StatusOr<std::vector<PathBandwidth>> result =
      ProbeBandwidth({dir}, options);
  ASSERT_TRUE(result.ok()) << result.status();
  // One directory: one write pass, and (if buffered) one more before the read.
  EXPECT_GE(g_fdatasyncs.load() - before, 1);
}

TEST(BandwidthProbeTest, ErrorsNameTheDirectory) {
  const std::string missing = internal_io::ScratchPath("no_such_dir");
  absl::StatusOr<std::vector<PathBandwidth>> result =
      ProbeBandwidth({missing}, ProbeOptions());
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find(missing), std::string::npos);
  ProbeOptions bad;
  bad.bytes = 1000;
  EXPECT_EQ(ProbeBandwidth({"/tmp"}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// An emulated device: `rate` bytes/s each way, shared by every engine
// made, k streaming engines getting cap / (1 + c (k - 1)) in total; each
// stream moves `bytes` in blocks of `block`.
absl::StatusOr<ConcurrencyBandwidth> ProbeEmulatedDevice(double c, int streams,
                                                         double rate,
                                                         size_t bytes,
                                                         size_t block) {
  const std::string dir = internal_io::ScratchDir("probe_concurrency");
  SharedThrottleOptions device;
  device.state_path = internal_io::ScratchPath("probe_device");
  device.read_bytes_per_sec = device.write_bytes_per_sec = rate;
  device.contention = c;
  ProbeOptions options;
  options.bytes = bytes;
  options.block_size = block;
  options.queue_depth = 4;
  absl::StatusOr<ConcurrencyBandwidth> r = ProbeConcurrency(
      dir, streams, options,
      [&]() -> absl::StatusOr<std::unique_ptr<IoEngine>> {
        IoEngineOptions o;
        o.kind = IoEngineOptions::Kind::kThreadPool;
        o.num_threads = 4;
        MLP_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> inner,
                             CreateIoEngine(o));
        return MakeSharedThrottledEngine(std::move(inner), device);
      });
  EXPECT_EQ(CountEntries(dir), 0);  // the probe's files are gone
  return r;
}

// Sanitized builds run the engines several times slower, on a CI machine
// whose two cores run two tests at once: at the plain build's rates the
// engines' CPU time, not the emulated device, can bound the streams (a
// TSan run measured no contention at c = 0.5: one stream was as slow as
// three). There the device is four times slower and the figures looser.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(BandwidthProbeTest, ConcurrencyProbeMeasuresTheDevicesContention) {
  const double rate = kSanitized ? 5e6 : 20e6;
  const size_t bytes = kSanitized ? (2 << 20) : (8 << 20);
  const size_t block = kSanitized ? (256 << 10) : (1 << 20);
  // One engine reads and writes at once: both caps (less the engines'
  // overhead).
  const double both = 2 * rate;
  const double slack = kSanitized ? 0.5 * both : 0.25 * both;
  const double contention_slack = kSanitized ? 0.3 : 0.2;
  for (double c : {0.0, 0.5}) {
    // Each figure is a fraction of a second of real I/O, which a stall of
    // the machine's disk (other tests' fsyncs) or its CPUs can slow past
    // the bounds: a run within them among three is the check.
    auto within = [&](const ConcurrencyBandwidth& b) {
      return std::abs(b.one - both) <= slack &&
             std::abs(b.many - both / (1 + 2 * c)) <= slack &&
             std::abs(b.contention - c) <= contention_slack;
    };
    absl::StatusOr<ConcurrencyBandwidth> r;
    for (int attempt = 0; attempt < 3; ++attempt) {
      r = ProbeEmulatedDevice(c, 3, rate, bytes, block);
      ASSERT_TRUE(r.ok()) << r.status();
      if (within(*r)) break;
    }
    EXPECT_EQ(r->streams, 3);
    EXPECT_NEAR(r->one, both, slack) << c;
    EXPECT_NEAR(r->many, both / (1 + 2 * c), slack) << c;
    EXPECT_NEAR(r->contention, c, contention_slack) << c;
  }
}

TEST(BandwidthProbeTest, ConcurrencyProbeRefusesBadArguments) {
  const std::string dir = internal_io::ScratchDir("probe_concurrency_args");
  EXPECT_EQ(ProbeConcurrency(dir, 1, ProbeOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string missing = internal_io::ScratchPath("no_such_dir");
  absl::StatusOr<ConcurrencyBandwidth> r =
      ProbeConcurrency(missing, 2, ProbeOptions());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(missing), std::string::npos);
  EXPECT_EQ(CountEntries(dir), 0);
}

TEST(BandwidthProbeTest, ConcurrencyProbeRefusesTooManyStreams) {
  const std::string dir = internal_io::ScratchDir("probe_streams");
  absl::Status s =
      ProbeConcurrency(dir, kMaxProbeStreams + 1, ProbeOptions()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("streams must be in 2..256"), std::string::npos)
      << s;
}

TEST(BandwidthProbeTest, QueueDepthIsBounded) {
  // A thread per slot: 32768 of them aborted the process.
  ProbeOptions options;
  options.bytes = 1 << 20;
  options.queue_depth = kMaxProbeQueueDepth + 1;
  absl::Status s = ProbeBandwidth({"/tmp"}, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("queue depth 1025 is out of range (1..1024)"),
            std::string::npos)
      << s;
  EXPECT_EQ(ProbeConcurrency("/tmp", 2, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BandwidthProbeTest, AFileThatCannotBePreallocatedIsRemoved) {
  // A file-size limit stands in for a full disk: the preallocation fails
  // after the file was created (EFBIG here, ENOSPC there).
  const std::string dir = internal_io::ScratchDir("probe_full");
  ProbeOptions options;
  options.bytes = 8 << 20;
  options.queue_depth = 4;
  absl::Status s;
  {
    internal_io::ScopedFileSizeLimit limit(1 << 20);
    ASSERT_TRUE(limit.ok());
    s = ProbeBandwidth({dir}, options).status();
  }
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(dir), std::string::npos) << s;
  EXPECT_EQ(CountEntries(dir), 0);
}

TEST(BandwidthProbeTest, FilesOfKilledProbesAreRemoved) {
  const std::string dir = internal_io::ScratchDir("probe_stale");
  // A pid that no longer runs: a child that has exited and been reaped.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  char host_buf[256] = {};
  ASSERT_EQ(gethostname(host_buf, sizeof(host_buf) - 1), 0);
  const std::string host = host_buf;
  const std::string dead =
      absl::StrCat(dir, "/.mlp_offload_probe.", host, ".", child, ".0.tmp");
  const std::string alive =  // this process's parent runs
      absl::StrCat(dir, "/.mlp_offload_probe.", host, ".", getppid(), ".0.tmp");
  // Another node's, on a shared file system: its pid means nothing here,
  // though no process of this host has it. A host name may hold dots.
  const std::string remote = absl::StrCat(dir, "/.mlp_offload_probe.", host,
                                          ".other.node.", child, ".0.tmp");
  const std::string other = dir + "/.mlp_offload_probe.notes.tmp";
  for (const std::string& path : {dead, alive, remote, other}) {
    std::ofstream(path) << "x";
  }
  ProbeOptions options;
  options.bytes = 1 << 20;
  options.queue_depth = 4;
  absl::StatusOr<std::vector<PathBandwidth>> r = ProbeBandwidth({dir}, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(access(dead.c_str(), F_OK), 0);
  EXPECT_EQ(access(alive.c_str(), F_OK), 0);
  EXPECT_EQ(access(remote.c_str(), F_OK), 0);
  EXPECT_EQ(access(other.c_str(), F_OK), 0);
  EXPECT_EQ(CountEntries(dir), 3);
}

}  // namespace
}  // namespace mlp_offload
