// Files on a tier: O_DIRECT detection, preallocation, fdatasync.
#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/aligned_buffer.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

// pread or pwrite of all of `block` at offset 0, retried on EINTR; the error
// names the probe's call.
absl::Status ProbeTransfer(bool write, int fd, const AlignedBuffer& block,
                           const std::string& path) {
  ssize_t n;
  do {
    n = write ? pwrite(fd, block.data(), block.size(), 0)
              : pread(fd, block.data(), block.size(), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return ErrnoStatus(
        errno, write ? "pwrite (O_DIRECT probe)" : "pread (O_DIRECT probe)",
        absl::StrCat(path, " at offset 0"));
  }
  return absl::OkStatus();
}

// Some filesystems accept O_DIRECT at open() and only reject it on the first
// transfer (FUSE, some network filesystems), so a successful open is not
// proof. OK if direct transfers of kDirectIoAlignment work on `fd`;
// InvalidArgument if the filesystem refuses them (the caller falls back to
// buffered I/O); another error if the probe itself failed.
absl::Status ProbeDirect(int fd, const std::string& path, bool read_only) {
#ifdef STATX_DIOALIGN
  // Where the filesystem reports its direct I/O alignment (ext4, xfs, btrfs,
  // block devices...), that settles it without a transfer.
  struct statx stx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) != 0) {
    if (stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("statx of ", path, " reports no direct I/O"));
    }
    if (stx.stx_dio_mem_align > kDirectIoAlignment ||
        stx.stx_dio_offset_align > kDirectIoAlignment) {
      return absl::InvalidArgumentError(absl::StrCat(
          "statx of ", path, " reports direct I/O alignments of ",
          stx.stx_dio_mem_align, " (memory) and ", stx.stx_dio_offset_align,
          " (offsets), above ", kDirectIoAlignment));
    }
    return absl::OkStatus();
  }
#endif
  MLP_ASSIGN_OR_RETURN(AlignedBuffer block,
                       AlignedBuffer::Allocate(kDirectIoAlignment));
  struct stat st;
  if (fstat(fd, &st) < 0) return ErrnoStatus(errno, "fstat", path);
  // A read past the end of a file (a new or truncated one) returns 0 without
  // checking anything, so an empty file is probed by writing a block, reading
  // it back and truncating it again. A read-only empty file cannot be written,
  // and nothing can be read from it either.
  if (st.st_size > 0 || read_only) return ProbeTransfer(false, fd, block, path);
  absl::Status probe = ProbeTransfer(true, fd, block, path);
  if (probe.ok()) probe = ProbeTransfer(false, fd, block, path);
  if (ftruncate(fd, 0) < 0) {
    return ErrnoStatus(errno, "ftruncate to 0 bytes (O_DIRECT probe)", path);
  }
  return probe;
}

// OK if `fd` (opened with O_NONBLOCK) is a regular file, which then goes
// back to blocking transfers; else closes it: a FIFO, a device or a
// directory planted where a file of the run belongs would block a read
// forever or fail it oddly (DataLoss, naming the path and what it is).
absl::Status RequireRegular(int fd, const std::string& path) {
  absl::Status regular = CheckRegularFile(fd, path);
  if (!regular.ok()) {
    close(fd);
    return regular;
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0) {
    const int saved = errno;
    close(fd);
    return ErrnoStatus(saved, "fcntl(F_SETFL, ~O_NONBLOCK)", path);
  }
  return absl::OkStatus();
}

}  // namespace

File::File(int fd, std::string path, bool direct, std::string reason)
    : fd_(fd),
      path_(std::move(path)),
      direct_(direct),
      fallback_reason_(std::move(reason)) {}

File::~File() {
  // close() errors cannot be acted upon here; durability is what Sync() is for.
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::unique_ptr<File>> File::Open(const std::string& path,
                                                 const FileOptions& options) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer
  // (RequireRegular refuses it, and makes transfers blocking again).
  int flags = O_CLOEXEC | O_NONBLOCK | (options.read_only ? O_RDONLY : O_RDWR);
  if (options.create) flags |= O_CREAT;
  if (options.truncate) flags |= O_TRUNC;
  if (options.no_follow) flags |= O_NOFOLLOW;

  bool direct = false;
  std::string reason;
  int fd = -1;
  if (options.try_direct) {
    do {
      fd = open(path.c_str(), flags | O_DIRECT, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
      MLP_RETURN_IF_ERROR(RequireRegular(fd, path));
      absl::Status probe = ProbeDirect(fd, path, options.read_only);
      if (probe.ok()) {
        direct = true;
      } else if (!absl::IsInvalidArgument(probe)) {
        close(fd);
        return probe;
      } else {
        // Keep the descriptor (O_CREAT/O_TRUNC already happened), drop
        // O_DIRECT.
        reason = absl::StrCat(probe.message(),
                              ": filesystem rejects direct transfers");
        const int current = fcntl(fd, F_GETFL);
        if (current < 0 || fcntl(fd, F_SETFL, current & ~O_DIRECT) < 0) {
          const int saved = errno;
          close(fd);
          return ErrnoStatus(saved, "fcntl(F_SETFL, ~O_DIRECT)", path);
        }
      }
    } else if (errno == EINVAL) {
      reason = "EINVAL from open with O_DIRECT: filesystem does not support it";
    } else {
      const int saved = errno;
      if (saved == ELOOP && options.no_follow) {
        return ErrnoStatus(saved, "open (refusing to follow a symlink)", path);
      }
      return ErrnoStatus(saved, "open", path);
    }
  } else {
    reason = "O_DIRECT not requested";
  }
  if (fd < 0) {
    do {
      fd = open(path.c_str(), flags, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      const int saved = errno;
      if (saved == ELOOP && options.no_follow) {
        return ErrnoStatus(saved, "open (refusing to follow a symlink)", path);
      }
      return ErrnoStatus(saved, "open", path);
    }
    MLP_RETURN_IF_ERROR(RequireRegular(fd, path));
  }
  std::unique_ptr<File> file(new File(fd, path, direct, std::move(reason)));
  if (options.preallocate_bytes > 0) {
    MLP_RETURN_IF_ERROR(file->Allocate(options.preallocate_bytes));
  }
  return file;
}

absl::Status CheckOpenFileAtPath(int fd, const std::string& path,
                                 absl::string_view what) {
  struct stat open_st, path_st;
  if (fstat(fd, &open_st) < 0) return ErrnoStatus(errno, "fstat", path);
  const bool gone = lstat(path.c_str(), &path_st) < 0;
  if (gone && errno != ENOENT && errno != ENOTDIR) {
    return ErrnoStatus(errno, "stat", path);
  }
  if (gone || open_st.st_nlink == 0 || open_st.st_dev != path_st.st_dev ||
      open_st.st_ino != path_st.st_ino) {
    const std::string message = absl::StrCat(
        path, " (", what, ") was ", gone ? "deleted or moved away" : "replaced",
        " while in use: what was written to it since is on no file that the "
        "path shows");
    return gone ? absl::NotFoundError(message)
                : absl::FailedPreconditionError(message);
  }
  return absl::OkStatus();
}

absl::Status File::Sync() {
  int rc;
  do {
    rc = fdatasync(fd_);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return ErrnoStatus(errno, "fdatasync", path_);
  return absl::OkStatus();
}

absl::Status File::Allocate(uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  int rc;
  do {
    rc = fallocate(fd_, 0, 0, static_cast<off_t>(bytes));
  } while (rc < 0 && errno == EINTR);
  if (rc == 0) return absl::OkStatus();
  const int saved = errno;
  if (saved != EOPNOTSUPP) {
    return ErrnoStatus(saved, absl::StrCat("fallocate of ", bytes, " bytes"),
                       path_);
  }
  // No fallocate on this filesystem: glibc's posix_fallocate emulation writes
  // through the descriptor, which breaks on O_DIRECT alignment, so only extend
  // the size. Space is then claimed on first write (ENOSPC surfaces there).
  MLP_ASSIGN_OR_RETURN(const uint64_t size, Size());
  if (size >= bytes) return absl::OkStatus();
  if (ftruncate(fd_, static_cast<off_t>(bytes)) < 0) {
    return ErrnoStatus(errno, absl::StrCat("ftruncate to ", bytes, " bytes"),
                       path_);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> File::Size() const {
  struct stat st;
  if (fstat(fd_, &st) < 0) return ErrnoStatus(errno, "fstat", path_);
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace mlp_offload
