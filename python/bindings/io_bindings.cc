// Python bindings of the io layer (filled in by its owner).
#include "pybind11/pybind11.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

namespace mlp_offload {
namespace python {

void RegisterIoBindings(pybind11::module_& m) {}

}  // namespace python
}  // namespace mlp_offload
