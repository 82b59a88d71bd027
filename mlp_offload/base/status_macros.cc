// Errno and context helpers for absl::Status.
#include "mlp_offload/base/status_macros.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"

namespace mlp_offload {

absl::Status ErrnoStatus(int errno_value, absl::string_view operation,
                         absl::string_view object) {
  // A path through something that is not a directory does not exist as a
  // path (absl calls ENOTDIR a failed precondition). A directory where a
  // file of a run belongs was planted there (absl: a failed precondition,
  // which the Python layer reads as another model or configuration).
  absl::StatusCode code = errno_value == ENOTDIR ? absl::StatusCode::kNotFound
                          : errno_value == EISDIR
                              ? absl::StatusCode::kDataLoss
                              : absl::ErrnoToStatusCode(errno_value);
  return absl::Status(code, absl::StrCat(operation, " ", object, ": ",
                                         std::strerror(errno_value)));
}

absl::Status CheckRegularFile(int fd, absl::string_view path) {
  struct stat st;
  if (fstat(fd, &st) < 0) return ErrnoStatus(errno, "fstat", path);
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : "a device";
  return absl::DataLossError(
      absl::StrCat(path, " is ", kind, ", not a regular file"));
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

}  // namespace mlp_offload
