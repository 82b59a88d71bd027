// Python bindings of the kernel layer (filled in by its owner).
#include "pybind11/pybind11.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

namespace mlp_offload {
namespace python {

void RegisterKernelBindings(pybind11::module_& m) {}

}  // namespace python
}  // namespace mlp_offload
