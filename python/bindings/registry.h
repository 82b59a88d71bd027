// Declarations of the per-topic binding registrations of mlp_offload._C.
#ifndef MLP_OFFLOAD_PYTHON_BINDINGS_REGISTRY_H_
#define MLP_OFFLOAD_PYTHON_BINDINGS_REGISTRY_H_

#include "pybind11/pybind11.h"

namespace mlp_offload {
namespace python {

// Each is defined in <topic>_bindings.cc; RegisterAllBindings calls them all.
void RegisterKernelBindings(pybind11::module_& m);
void RegisterIoBindings(pybind11::module_& m);
void RegisterEngineBindings(pybind11::module_& m);
void RegisterCudaBindings(pybind11::module_& m);

inline void RegisterAllBindings(pybind11::module_& m) {
  RegisterKernelBindings(m);
  RegisterIoBindings(m);
  RegisterEngineBindings(m);
  RegisterCudaBindings(m);
}

}  // namespace python
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_PYTHON_BINDINGS_REGISTRY_H_
