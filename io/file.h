// A file on a tier, opened with O_DIRECT where the filesystem allows it.
#ifndef MLP_OFFLOAD_IO_FILE_H_
#define MLP_OFFLOAD_IO_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlp_offload {

struct FileOptions {
  bool create = false;     // O_CREAT (mode 0600)
  bool truncate = false;   // O_TRUNC
  bool read_only = false;  // O_RDONLY instead of O_RDWR
  bool try_direct = true;  // O_DIRECT if the filesystem accepts it
  bool no_follow = true;   // O_NOFOLLOW: refuse a symlink planted in a tier
  uint64_t preallocate_bytes = 0;  // fallocate this many bytes (if > 0)
};

// OK if `path` still names the file open as `fd` (the same inode, linked):
// a file deleted while in use is NotFound, one replaced FailedPrecondition,
// naming it and `what` it held. Writes through `fd` would reach no file that
// the path shows, so nothing may be recorded as durable there.
absl::Status CheckOpenFileAtPath(int fd, const std::string& path,
                                 absl::string_view what);

class File {
 public:
  // Opens `path`. Errors name the path and the failed call (NotFound,
  // PermissionDenied, ResourceExhausted for ENOSPC on preallocation, ...).
  static absl::StatusOr<std::unique_ptr<File>> Open(const std::string& path,
                                                    const FileOptions& options);
  ~File();  // closes the descriptor
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // Whether O_DIRECT is in effect; if not, why (e.g. "EINVAL from open with
  // O_DIRECT: filesystem does not support it").
  bool direct() const { return direct_; }
  const std::string& direct_fallback_reason() const { return fallback_reason_; }

  // fdatasync; the error names the path.
  absl::Status Sync();
  // CheckOpenFileAtPath for this file.
  absl::Status CheckStillAtPath(absl::string_view what) const {
    return CheckOpenFileAtPath(fd_, path_, what);
  }
  // fallocate(0, 0, bytes) (posix_fallocate-like fallback where unsupported).
  absl::Status Allocate(uint64_t bytes);
  absl::StatusOr<uint64_t> Size() const;

 private:
  File(int fd, std::string path, bool direct, std::string reason);
  int fd_;
  std::string path_;
  bool direct_;
  std::string fallback_reason_;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_FILE_H_
