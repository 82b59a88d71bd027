// absl::Status -> mlp_offload.errors.* exceptions.
#include "python/bindings/status.h"

#include <string>

#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace python {
namespace py = pybind11;

namespace {
// Owned references kept for the life of the interpreter.
PyObject* g_errors_module = nullptr;

PyObject* ExceptionFor(const absl::Status& status) {
  const char* name = "OffloadError";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      name = "ConfigError";
      break;
    case absl::StatusCode::kNotFound:
      name = "TierNotFoundError";
      break;
    case absl::StatusCode::kPermissionDenied:
      name = "TierPermissionError";
      break;
    case absl::StatusCode::kResourceExhausted:
      // The system's (threads), else a tier's or the host budget's.
      name = status.GetPayload(kSystemResourcePayload).has_value()
                 ? "SystemResourceError"
                 : "TierFullError";
      break;
    case absl::StatusCode::kDataLoss:
      name = "CorruptStateError";
      break;
    case absl::StatusCode::kFailedPrecondition:
      name = "StateMismatchError";
      break;
    case absl::StatusCode::kAlreadyExists:
      name = "TierInUseError";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      name = "TierLockTimeoutError";
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      name = "TierIOError";
      break;
    case absl::StatusCode::kCancelled:
      name = "CancelledError";
      break;
    default:
      break;
  }
  PyObject* cls = PyObject_GetAttrString(g_errors_module, name);
  if (cls == nullptr) {
    PyErr_Clear();
    cls = PyObject_GetAttrString(g_errors_module, "OffloadError");
  }
  return cls;  // new reference
}
}  // namespace

void RegisterStatus(py::module_& m) {
  py::module_ errors = py::module_::import("mlp_offload.errors");
  g_errors_module = errors.ptr();
  Py_INCREF(g_errors_module);
  m.def("_fail_nth_thread_start_for_testing", &FailNthThreadStartForTesting,
        py::arg("n"),
        "Tests: the n-th thread start from now on fails as if the system had "
        "refused it (0: off).");
}

void ThrowIfError(const absl::Status& status) {
  if (status.ok()) return;
  PyObject* cls = ExceptionFor(status);
  std::string msg(status.message());
  PyErr_SetString(cls, msg.c_str());
  Py_XDECREF(cls);
  throw py::error_already_set();
}

}  // namespace python
}  // namespace mlp_offload
