// Errno and context helpers for absl::Status.
#include "mlp_offload/base/status_macros.h"

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

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

}  // namespace mlp_offload
