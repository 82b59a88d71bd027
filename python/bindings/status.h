// The one place where absl::Status becomes a Python exception. Every binding
// calls ThrowIfError / ValueOrThrow; the exception classes are the ones of
// mlp_offload.errors (looked up once when the module is imported).
#ifndef MLP_OFFLOAD_PYTHON_BINDINGS_STATUS_H_
#define MLP_OFFLOAD_PYTHON_BINDINGS_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pybind11/pybind11.h"

namespace mlp_offload {
namespace python {

// Raises the mlp_offload.errors exception that matches `status.code()` (with
// the status message) if `status` is not OK. Must be called with the GIL.
void ThrowIfError(const absl::Status& status);

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}

// Looks up the exception classes; called once from the module init.
void RegisterStatus(pybind11::module_& m);

}  // namespace python
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_PYTHON_BINDINGS_STATUS_H_
