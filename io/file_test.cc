#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "io/aligned_buffer.h"
#include "io/internal/test_util.h"

namespace mlp_offload {
namespace {

// While set, an O_DIRECT pwrite fails with EINVAL, as on a filesystem that
// accepts O_DIRECT at open and refuses direct transfers (FUSE): a read past
// the end returns 0 there unchecked, so only writes need faking. The pwrite
// below stands in for libc's in this test binary.
std::atomic<bool> g_refuse_direct_writes{false};

}  // namespace
}  // namespace mlp_offload

extern "C" ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  if (mlp_offload::g_refuse_direct_writes.load()) {
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_DIRECT) != 0) {
      errno = EINVAL;
      return -1;
    }
  }
  return syscall(SYS_pwrite64, fd, buf, n, offset);
}

namespace mlp_offload {
namespace {

using internal_io::ScratchPath;

// A file on tmpfs, whose direct I/O support statx does not report (so the
// probe transfers), or "" if /dev/shm is missing or refuses O_DIRECT at open.
std::string TmpfsPath(const std::string& name) {
  const std::string path =
      "/dev/shm/mlp_offload_file_test." + name + "." + std::to_string(getpid());
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd < 0) return "";
  close(fd);
  unlink(path.c_str());
  return path;
}

TEST(FileTest, DirectOnExt4AndPreallocated) {
  const std::string path = ScratchPath("file_direct");
  FileOptions options;
  options.create = true;
  options.preallocate_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, options);
  ASSERT_TRUE(file.ok()) << file.status();
  // TEST_TMPDIR is on ext4 here, which supports O_DIRECT.
  EXPECT_TRUE((*file)->direct()) << (*file)->direct_fallback_reason();
  EXPECT_EQ(*(*file)->Size(), uint64_t{1} << 20);
  EXPECT_TRUE((*file)->Sync().ok());
  // O_DIRECT is really in effect: a misaligned transfer is refused.
  char byte = 0;
  EXPECT_LT(pwrite((*file)->fd(), &byte, 1, 1), 0);
  EXPECT_TRUE((*file)->Allocate(2 << 20).ok());
  EXPECT_EQ(*(*file)->Size(), uint64_t{2} << 20);
  unlink(path.c_str());
}

TEST(FileTest, BufferedWhenNotRequestedSaysWhy) {
  const std::string path = ScratchPath("file_buffered");
  FileOptions options;
  options.create = true;
  options.try_direct = false;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, options);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_FALSE((*file)->direct());
  EXPECT_FALSE((*file)->direct_fallback_reason().empty());
  char byte = 7;
  EXPECT_EQ(pwrite((*file)->fd(), &byte, 1, 1), 1);
  unlink(path.c_str());
}

TEST(FileTest, FallbackAlwaysHasAReason) {
  // tmpfs accepts O_DIRECT on recent kernels and refuses it on older ones;
  // either way the outcome is reported consistently.
  if (access("/dev/shm", W_OK) != 0) GTEST_SKIP() << "no /dev/shm";
  const std::string path =
      "/dev/shm/mlp_offload_file_test." + std::to_string(getpid());
  FileOptions options;
  options.create = true;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, options);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->direct(), (*file)->direct_fallback_reason().empty());
  unlink(path.c_str());
}

TEST(FileTest, NewFileReportsDirectLikeItsReopening) {
  // ext4 answers through statx; tmpfs is probed with a written block.
  std::vector<std::string> paths = {ScratchPath("file_new")};
  if (std::string tmpfs = TmpfsPath("new"); !tmpfs.empty())
    paths.push_back(tmpfs);
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    FileOptions options;
    options.create = true;
    options.truncate = true;
    absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, options);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(*(*file)->Size(), 0u);  // the probe leaves nothing behind
    absl::StatusOr<AlignedBuffer> out = AlignedBuffer::Allocate(8192);
    absl::StatusOr<AlignedBuffer> in = AlignedBuffer::Allocate(8192);
    ASSERT_TRUE(out.ok() && in.ok());
    internal_io::FillRandom(out->data(), out->size(), 7);
    ASSERT_EQ(pwrite((*file)->fd(), out->data(), out->size(), 0), 8192);
    ASSERT_EQ(pread((*file)->fd(), in->data(), in->size(), 0), 8192);
    EXPECT_EQ(std::memcmp(out->data(), in->data(), 8192), 0);
    absl::StatusOr<std::unique_ptr<File>> again =
        File::Open(path, FileOptions());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ((*again)->direct(), (*file)->direct())
        << (*file)->direct_fallback_reason() << " / "
        << (*again)->direct_fallback_reason();
    unlink(path.c_str());
  }
}

TEST(FileTest, NewFileFallsBackWhereDirectTransfersAreRefused) {
  const std::string path = TmpfsPath("refused");
  if (path.empty()) GTEST_SKIP() << "no tmpfs accepting O_DIRECT at open";
  FileOptions options;
  options.create = true;
  g_refuse_direct_writes = true;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, options);
  g_refuse_direct_writes = false;
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_FALSE((*file)->direct());
  EXPECT_NE((*file)->direct_fallback_reason().find("pwrite (O_DIRECT probe)"),
            std::string::npos)
      << (*file)->direct_fallback_reason();
  EXPECT_EQ(*(*file)->Size(), 0u);
  char byte = 7;
  EXPECT_EQ(pwrite((*file)->fd(), &byte, 1, 1), 1);  // buffered now
  unlink(path.c_str());
}

TEST(FileTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = ScratchPath("does_not_exist");
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, FileOptions());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find(path), std::string::npos);
  EXPECT_NE(file.status().message().find("open"), std::string::npos);
}

// A FIFO, a directory planted where a file belongs: refused at once,
// naming the path and what it is (a FIFO opened for reading waited for a
// writer, and its reads blocked a tier's I/O forever).
TEST(FileTest, RefusesWhatIsNotARegularFile) {
  const std::string fifo = ScratchPath("fifo");
  const std::string dir = ScratchPath("dir");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  for (bool read_only : {true, false}) {
    for (bool direct : {true, false}) {
      FileOptions options;
      options.read_only = read_only;
      options.try_direct = direct;
      absl::StatusOr<std::unique_ptr<File>> file = File::Open(fifo, options);
      EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss)
          << file.status();
      EXPECT_NE(
          file.status().message().find(fifo + " is a FIFO, not a regular file"),
          std::string::npos)
          << file.status();
      options.read_only = true;  // a directory opens for reading only
      file = File::Open(dir, options);
      EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss)
          << file.status();
      EXPECT_NE(file.status().message().find(dir + " is a directory"),
                std::string::npos)
          << file.status();
    }
  }
  unlink(fifo.c_str());
  rmdir(dir.c_str());
}

TEST(FileTest, RefusesSymlink) {
  const std::string target = ScratchPath("target");
  const std::string link = ScratchPath("link");
  FileOptions create;
  create.create = true;
  ASSERT_TRUE(File::Open(target, create).ok());
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(link, FileOptions());
  EXPECT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find(link), std::string::npos);
  FileOptions follow;
  follow.no_follow = false;
  EXPECT_TRUE(File::Open(link, follow).ok());
  unlink(link.c_str());
  unlink(target.c_str());
}

TEST(FileTest, TruncateAndReadOnly) {
  const std::string path = ScratchPath("file_trunc");
  FileOptions options;
  options.create = true;
  options.preallocate_bytes = 8192;
  ASSERT_TRUE(File::Open(path, options).ok());
  FileOptions trunc;
  trunc.truncate = true;
  absl::StatusOr<std::unique_ptr<File>> file = File::Open(path, trunc);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(*(*file)->Size(), 0u);
  FileOptions ro;
  ro.read_only = true;
  absl::StatusOr<std::unique_ptr<File>> read_only = File::Open(path, ro);
  ASSERT_TRUE(read_only.ok());
  absl::Status allocate = (*read_only)->Allocate(4096);
  EXPECT_FALSE(allocate.ok());
  EXPECT_NE(allocate.message().find(path), std::string::npos);
  unlink(path.c_str());
}

}  // namespace
}  // namespace mlp_offload
