// The one extension module, mlp_offload._C. Each topic registers its
// bindings from its own file (kernels_bindings.cc, io_bindings.cc,
// engine_bindings.cc); this file only wires them and reports build facts.
#include <string>

#include "kernels/target_info.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

#ifndef MLP_OFFLOAD_VERSION
#define MLP_OFFLOAD_VERSION "0.0.0"
#endif

namespace py = pybind11;

namespace {

std::string CompilerName() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MLP-Offload native core (kernels, async I/O, offload engine).";
  mlp_offload::python::RegisterStatus(m);
  m.def(
      "build_info",
      []() {
        py::dict d;
        d["version"] = MLP_OFFLOAD_VERSION;
        d["compiler"] = CompilerName();
        d["simd_target"] = mlp_offload::SimdTargetName();
        d["simd_targets_supported"] = mlp_offload::SupportedSimdTargets();
#ifdef MLP_OFFLOAD_WITH_CUDA
        d["cuda"] = true;
#else
        d["cuda"] = false;
#endif
#ifdef NDEBUG
        d["optimized"] = true;
#else
        d["optimized"] = false;
#endif
        return d;
      },
      "Version, compiler, the SIMD target Highway dispatches to on this "
      "machine, and the targets compiled in.");
  mlp_offload::python::RegisterAllBindings(m);
}
