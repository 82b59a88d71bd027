// Small helpers for propagating absl::Status. Abseil 20220623 (Debian 12)
// has neither ABSL_RETURN_IF_ERROR nor ASSIGN_OR_RETURN, so they are defined
// once here for every layer of the project.
#ifndef MLP_OFFLOAD_BASE_STATUS_MACROS_H_
#define MLP_OFFLOAD_BASE_STATUS_MACROS_H_

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// Returns from the current function if `expr` (an absl::Status) is not OK.
#define MLP_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status mlp_status_ = (expr);       \
    if (!mlp_status_.ok()) return mlp_status_; \
  } while (0)

#define MLP_STATUS_CONCAT_INNER_(a, b) a##b
#define MLP_STATUS_CONCAT_(a, b) MLP_STATUS_CONCAT_INNER_(a, b)

// `MLP_ASSIGN_OR_RETURN(auto x, Foo());` assigns the value of an
// absl::StatusOr or returns its status from the current function.
#define MLP_ASSIGN_OR_RETURN(lhs, expr)                                        \
  MLP_ASSIGN_OR_RETURN_IMPL_(MLP_STATUS_CONCAT_(mlp_statusor_, __LINE__), lhs, \
                             expr)
#define MLP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

namespace mlp_offload {

// An absl::Status for `errno_value` that names the failed operation and the
// object it acted on, e.g. "pwrite /nvme/run/sg3.bin at offset 4096: No space
// left on device". The code follows absl::ErrnoToStatus's mapping, but for
// ENOTDIR (NotFound) and EISDIR (DataLoss: a directory where a file belongs).
absl::Status ErrnoStatus(int errno_value, absl::string_view operation,
                         absl::string_view object);

// OK if the open file `fd` is a regular file; else DataLoss naming `path`
// and what it is ("... is a FIFO, not a regular file"): something planted
// where a file of a run belongs. An fstat failure names the path too.
absl::Status CheckRegularFile(int fd, absl::string_view path);

// Adds "context: " in front of a non-OK status's message, keeping its code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_BASE_STATUS_MACROS_H_
