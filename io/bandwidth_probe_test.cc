#include "io/bandwidth_probe.h"

#include <dirent.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "io/internal/test_util.h"

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

}  // namespace
}  // namespace mlp_offload
