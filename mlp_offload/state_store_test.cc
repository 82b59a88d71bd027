#include "mlp_offload/state_store.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace mlp_offload {
namespace {

// While set, fsync of a directory fails with EIO: the fsync defined below
// stands in for libc's in this test binary, the only cheap way to reach a
// failing directory fsync (no fault hook covers these syscalls, and the
// tests run as root, so permissions cannot make the directory's open fail).
std::atomic<bool> g_fail_directory_fsync{false};

}  // namespace
}  // namespace mlp_offload

extern "C" int fsync(int fd) {
  struct stat st;
  if (mlp_offload::g_fail_directory_fsync.load() && fstat(fd, &st) == 0 &&
      S_ISDIR(st.st_mode)) {
    errno = EIO;
    return -1;
  }
  return static_cast<int>(syscall(SYS_fsync, fd));
}

namespace mlp_offload {
namespace {

constexpr uint64_t kPinnedFormat2 = 0xc4fa732954feb06aull;

std::string TestDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  mkdir(dir.c_str(), 0700);
  return dir;
}

TEST(StateStoreTest, HeaderRoundTripsAndDetectsEveryFlippedByte) {
  RecordHeader h;
  h.run_id = 0x1234567890ull;
  h.subgroup = 7;
  h.num_arrays = 3;
  h.numel = 1000;
  h.step = 42;
  h.payload_bytes = 12000;
  h.payload_checksum = 99;
  std::vector<unsigned char> page(kRecordHeaderBytes);
  EncodeRecordHeader(h, page.data());
  auto back = DecodeRecordHeader(page.data(), page.size(), "sg_7.state slot 0");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->subgroup, 7u);
  EXPECT_EQ(back->step, 42);
  EXPECT_EQ(back->payload_checksum, 99u);
  for (size_t i = 0; i < 72; ++i) {  // the encoded fields
    auto copy = page;
    copy[i] ^= 0x10;
    auto bad =
        DecodeRecordHeader(copy.data(), copy.size(), "sg_7.state slot 0");
    ASSERT_FALSE(bad.ok()) << "byte " << i;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(bad.status().message().find("sg_7.state slot 0"),
              std::string::npos);
  }
}

TEST(StateStoreTest, ChecksumIsThreadCountIndependentAndSensitive) {
  std::vector<float> data(3'000'001);
  std::mt19937 rng(1);
  for (auto& x : data) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  size_t bytes = data.size() * sizeof(float);
  uint64_t one = PayloadChecksum(data.data(), bytes, nullptr, 2);
  ThreadPool pool(3);
  EXPECT_EQ(PayloadChecksum(data.data(), bytes, &pool, 2), one);
  for (size_t pos : {size_t{0}, size_t{1 << 20}, bytes - 1}) {
    reinterpret_cast<unsigned char*>(data.data())[pos] ^= 1;
    EXPECT_NE(PayloadChecksum(data.data(), bytes, &pool, 2), one) << pos;
    reinterpret_cast<unsigned char*>(data.data())[pos] ^= 1;
  }
}

// A deterministic payload of three 1 MiB chunks and a partial one.
std::vector<unsigned char> PinnedPayload() {
  std::vector<unsigned char> b((size_t{3} << 20) + 123);
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] = static_cast<unsigned char>((i * 131 + 7) ^ (i >> 9));
  }
  return b;
}

TEST(StateStoreTest, EachFormatsPayloadChecksumIsPinned) {
  // Records on disk carry these values: format 1's are what the builds
  // before format 2 computed (the same payload through 312d3f0's
  // PayloadChecksum), format 2's pin StripeHash64's constants.
  const std::vector<unsigned char> b = PinnedPayload();
  ThreadPool pool(2);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    EXPECT_EQ(PayloadChecksum(b.data(), b.size(), p, 1), 0xa7b90bbd4a87654full);
    EXPECT_EQ(PayloadChecksum(b.data(), 100, p, 1), 0xb842ec744093ea68ull);
    EXPECT_EQ(PayloadChecksum(b.data(), b.size(), p, 2), kPinnedFormat2);
    EXPECT_EQ(kStateFormatVersion, 2u);
  }
}

TEST(StateStoreTest, HeadersOfEveryReadableFormatDecodeOthersAreRefused) {
  RecordHeader h;
  h.numel = 10;
  h.num_arrays = 3;
  h.payload_bytes = 120;
  h.payload_checksum = 5;
  std::vector<unsigned char> page(kRecordHeaderBytes);
  for (uint32_t version = 0; version <= kStateFormatVersion + 1; ++version) {
    h.format_version = version;
    EncodeRecordHeader(h, page.data());
    auto back = DecodeRecordHeader(page.data(), page.size(), "sg_0.state");
    if (version >= kOldestStateFormatVersion &&
        version <= kStateFormatVersion) {
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->format_version, version);
    } else {
      EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss);
      EXPECT_NE(
          back.status().message().find(absl::StrCat(
              "sg_0.state: unsupported state format version ", version,
              " (this build reads 1 to 2",
              version > 2 ? "; a newer build of MLP-Offload wrote it)" : ")")),
          std::string::npos)
          << back.status();
    }
    Manifest m;
    m.format_version = version;
    m.arrays_per_param = 3;
    auto manifest = ParseManifest(EncodeManifest(m), "MANIFEST");
    EXPECT_EQ(manifest.ok(), back.ok()) << manifest.status();
    if (!manifest.ok()) {
      EXPECT_NE(manifest.status().message().find(
                    absl::StrCat("MANIFEST: unsupported manifest version ",
                                 version, " (this build reads 1 to 2")),
                std::string::npos)
          << manifest.status();
    }
    if (manifest.ok()) EXPECT_EQ(manifest->format_version, version);
  }
}

TEST(StateStoreTest, ManifestRoundTripAndMismatchMessages) {
  Manifest m;
  m.run_id = 5;
  m.arrays_per_param = 3;
  m.subgroup_numel = {10, 20, 30};
  m.tier_of_subgroup = {0, 1, 0};
  std::string text = EncodeManifest(m);
  auto back = ParseManifest(text, "MANIFEST");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->subgroup_numel, m.subgroup_numel);
  EXPECT_EQ(back->tier_of_subgroup, m.tier_of_subgroup);
  EXPECT_TRUE(CheckManifestMatches(m, *back, "x").ok());

  Manifest other = m;
  other.subgroup_numel[1] = 21;
  absl::Status s = CheckManifestMatches(m, other, "/ckpt");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("subgroup 1 has 21 parameters"), std::string::npos)
      << s;
  other = m;
  other.arrays_per_param = 2;
  EXPECT_NE(CheckManifestMatches(m, other, "/ckpt")
                .message()
                .find("arrays per parameter"),
            std::string::npos);

  std::string corrupt = text;
  corrupt[text.find("20")] = '9';
  EXPECT_EQ(ParseManifest(corrupt, "MANIFEST").status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_FALSE(ParseManifest("", "MANIFEST").ok());
  EXPECT_FALSE(ParseManifest("checksum 1\n", "MANIFEST").ok());
}

TEST(StateStoreTest, CommitRecordRoundTrip) {
  CommitRecord c;
  c.id = {12, 9};
  c.subgroup_step = {9, -1, 8};
  c.subgroup_checksum = {0x1234567890abcdefull, 0, 42};
  c.subgroup_slot = {1, 0, 0};
  std::string bytes = EncodeCommitRecord(c);
  auto back = ParseCommitRecord(bytes, "COMMIT");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, (CommitId{12, 9}));
  EXPECT_EQ(back->subgroup_checksum, c.subgroup_checksum);
  EXPECT_EQ(back->subgroup_step, c.subgroup_step);
  EXPECT_EQ(back->subgroup_slot, c.subgroup_slot);
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string copy = bytes;
    copy[i] ^= 4;
    EXPECT_FALSE(ParseCommitRecord(copy, "COMMIT").ok()) << i;
  }
  EXPECT_FALSE(ParseCommitRecord(bytes.substr(0, 20), "COMMIT").ok());
  EXPECT_FALSE(ParseCommitRecord(bytes.substr(0, 36), "COMMIT").ok());
}

TEST(StateStoreTest, CommitsAreOrderedByEpochThenStep) {
  // Epoch 1 began with a load of an older step: its step 3 is newer than
  // epoch 0's step 9.
  EXPECT_TRUE((CommitId{0, 9}) < (CommitId{1, 3}));
  EXPECT_FALSE((CommitId{1, 3}) < (CommitId{0, 9}));
  EXPECT_TRUE((CommitId{1, 3}) < (CommitId{1, 4}));
  EXPECT_FALSE((CommitId{1, 3}) < (CommitId{1, 3}));
  EXPECT_NE((CommitId{0, 3}), (CommitId{1, 3}));
  EXPECT_EQ(DescribeCommit({2, 7}), "step 7 (epoch 2)");
}

// The record of step 9 above as the first format (no epoch) wrote it: still
// read, as epoch 0.
TEST(StateStoreTest, CommitRecordOfTheFirstFormat) {
  const std::string v1(
      "MLCOMMIT\x09\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00"
      "\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff\xff\xff"
      "\xff\xff\x08\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\xaf\x0c\xf4"
      "\xfa\x50\x74\x88\xf9",
      59);
  auto back = ParseCommitRecord(v1, "COMMIT");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->id, (CommitId{0, 9}));
  EXPECT_EQ(back->subgroup_checksum, (std::vector<uint64_t>{0, 0, 0}));
  EXPECT_EQ(back->subgroup_step, (std::vector<int64_t>{9, -1, 8}));
  EXPECT_EQ(back->subgroup_slot, (std::vector<uint8_t>{1, 0, 0}));
  std::string damaged = v1;
  damaged[20] ^= 1;
  EXPECT_FALSE(ParseCommitRecord(damaged, "COMMIT").ok());
}

TEST(StateStoreTest, AtomicWriteReplacesWholeFile) {
  std::string dir =
      std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp";
  std::string path = dir + "/atomic_file";
  ASSERT_TRUE(WriteFileAtomically(path, "first version").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  auto read = ReadSmallFile(path);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "second");
  absl::Status s = WriteFileAtomically(dir + "/no/such/dir/f", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("/no/such/dir/f"), std::string::npos);
}

TEST(StateStoreTest, ReadSmallFileRefusesAFifoWithoutWaiting) {
  // A FIFO where COMMIT.prev or a MANIFEST belongs: the open waited for a
  // writer forever.
  const std::string path = TestDir("small_fifo") + "/COMMIT.prev";
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  absl::StatusOr<std::string> read = ReadSmallFile(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_NE(
      read.status().message().find(path + " is a FIFO, not a regular file"),
      std::string::npos)
      << read.status();
  unlink(path.c_str());
}

TEST(StateStoreTest, ReadSmallFileRefusesAFileOverItsCap) {
  const std::string path = TestDir("small_cap") + "/MANIFEST";
  ASSERT_TRUE(WriteFileAtomically(path, std::string(100000, 'x')).ok());
  absl::StatusOr<std::string> whole = ReadSmallFile(path, 100000);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->size(), 100000u);
  absl::StatusOr<std::string> over = ReadSmallFile(path, 99999);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kDataLoss) << over.status();
  EXPECT_NE(over.status().message().find(path + " is larger than 99999 bytes"),
            std::string::npos)
      << over.status();
  // The default cap: a damaged MANIFEST of 1 GiB (sparse) is not read whole.
  const int fd = open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, off_t{1} << 30), 0);
  close(fd);
  EXPECT_EQ(ReadSmallFile(path).status().code(), absl::StatusCode::kDataLoss);
  unlink(path.c_str());
}

TEST(StateStoreTest, AtomicWriteOfABareNameSyncsTheCurrentDirectory) {
  const std::string dir = TestDir("bare_name");
  char cwd[PATH_MAX];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(chdir(dir.c_str()), 0);
  absl::Status s = WriteFileAtomically("bare", "contents");
  absl::StatusOr<std::string> read = ReadSmallFile("bare");
  ASSERT_EQ(chdir(cwd), 0);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "contents");
}

TEST(StateStoreTest, AtomicWriteReportsAFailedDirectoryFsync) {
  const std::string dir = TestDir("dir_fsync_fails");
  g_fail_directory_fsync = true;
  absl::Status s = WriteFileAtomically(dir + "/f", "x");
  g_fail_directory_fsync = false;
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("fsync directory " + dir + ":"), std::string::npos)
      << s;
}

}  // namespace
}  // namespace mlp_offload
