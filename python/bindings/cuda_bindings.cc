// Python bindings of the GPU layer, in the submodule mlp_offload._C.cuda.
//
// Always compiled, so the module has one shape: without --config=cuda
// (MLP_OFFLOAD_WITH_CUDA undefined) `compiled` is False, pinning reports why
// it is unavailable and HostBuffer still hands out aligned (unpinned) host
// memory. Device memory crosses as integer addresses, streams as the integer
// value of a cudaStream_t (torch.cuda.Stream.cuda_stream).
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "io/aligned_buffer.h"
#include "kernels/optimizer_kernels.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

#ifdef MLP_OFFLOAD_WITH_CUDA
#include "gpu/grad_stats.h"
#include "gpu/host_pinning.h"
#endif

namespace mlp_offload {
namespace python {
namespace {

namespace py = pybind11;

constexpr const char* kNotCompiled =
    "this build of mlp_offload has no CUDA support (build with --config=cuda)";

// An io-layer aligned buffer (O_DIRECT-ready), page-locked for DMA when the
// CUDA pinning hooks are installed. Exposes the buffer protocol, so
// torch.frombuffer(buf, dtype=...) views it and keeps it alive.
class HostBuffer {
 public:
  HostBuffer(uint64_t nbytes, bool pin) {
    absl::StatusOr<AlignedBuffer> b =
        pin ? AlignedBuffer::AllocatePinned(nbytes)
            : AlignedBuffer::Allocate(nbytes);
    buffer_ = ValueOrThrow(std::move(b));
  }
  uintptr_t data_ptr() const {
    return reinterpret_cast<uintptr_t>(buffer_.data());
  }
  uint64_t nbytes() const { return buffer_.size(); }
  bool pinned() const { return buffer_.pinned(); }
  void* data() const { return buffer_.data(); }

 private:
  AlignedBuffer buffer_;
};

}  // namespace

void RegisterCudaBindings(py::module_& parent) {
  py::module_ m =
      parent.def_submodule("cuda",
                           "GPU layer: pinned host buffers for DMA, gradient "
                           "statistics on the device.");
#ifdef MLP_OFFLOAD_WITH_CUDA
  m.attr("compiled") = true;
#else
  m.attr("compiled") = false;
#endif

  m.def(
      "device_count",
      []() -> py::tuple {
#ifdef MLP_OFFLOAD_WITH_CUDA
        absl::StatusOr<int> n = CudaDeviceCount();
        if (!n.ok())
          return py::make_tuple(0, std::string(n.status().message()));
        return py::make_tuple(*n, std::string());
#else
        return py::make_tuple(0, std::string(kNotCompiled));
#endif
      },
      "(count, reason): CUDA devices this extension's runtime sees; reason "
      "says "
      "why the count is 0.");

  m.def(
      "enable_host_pinning",
      [](int device) -> py::tuple {
#ifdef MLP_OFFLOAD_WITH_CUDA
        absl::Status s = InstallCudaHostPinning(device);
        return py::make_tuple(s.ok(), std::string(s.message()));
#else
        return py::make_tuple(false, std::string(kNotCompiled));
#endif
      },
      py::arg("device") = 0,
      "(enabled, reason): installs cudaHostRegister (portable, made with "
      "`device` current) as the io layer's pinning hook, so "
      "HostBuffer(pin=True) (the GPU path's staging buffers) is "
      "page-locked. Call after the CUDA context exists (torch initialises it); "
      "never at import, which would initialise CUDA before a fork.");

  m.def("host_pinning_enabled", &HostPinningAvailable,
        "Whether pinning hooks are installed.");

  m.def(
      "registered_host_bytes",
      []() -> py::tuple {
#ifdef MLP_OFFLOAD_WITH_CUDA
        return py::make_tuple(CudaRegisteredHostBytes(),
                              CudaRegisteredHostBuffers());
#else
        return py::make_tuple(uint64_t{0}, int64_t{0});
#endif
      },
      "(bytes, buffers) currently registered with cudaHostRegister by this "
      "extension; both are 0 once every pinned buffer is freed.");

  py::class_<HostBuffer>(
      m, "HostBuffer", py::buffer_protocol(),
      "Aligned host memory (O_DIRECT-ready), pinned when possible.")
      .def(
          py::init<uint64_t, bool>(), py::arg("nbytes"), py::arg("pin") = true,
          "Allocates nbytes rounded up to 4096, zero-filled; pinned if pin and "
          "the hooks are installed (check .pinned).")
      .def_property_readonly("data_ptr", &HostBuffer::data_ptr)
      .def_property_readonly("nbytes", &HostBuffer::nbytes)
      .def_property_readonly("pinned", &HostBuffer::pinned)
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });

  m.def(
      "grad_stats",
      [](uintptr_t grad, const std::string& dtype, uint64_t n, uintptr_t sumsq,
         uintptr_t nonfinite, uintptr_t stream, int device) {
#ifdef MLP_OFFLOAD_WITH_CUDA
        const DType dt = ValueOrThrow(ParseDType(dtype));
        ThrowIfError(EnqueueGradStats(device,
                                      reinterpret_cast<const void*>(grad), dt,
                                      n, reinterpret_cast<float*>(sumsq),
                                      reinterpret_cast<int32_t*>(nonfinite),
                                      reinterpret_cast<void*>(stream)));
#else
        ThrowIfError(absl::FailedPreconditionError(kNotCompiled));
#endif
      },
      py::arg("grad"), py::arg("dtype"), py::arg("n"), py::arg("sumsq"),
      py::arg("nonfinite"), py::arg("stream"), py::arg("device") = 0,
      "Enqueues on `stream` (of CUDA device `device`) the addition of the sum "
      "of squares of n device "
      "elements of dtype at `grad` to the fp32 at device address `sumsq`, and "
      "sets the int32 at `nonfinite` to 1 if one is NaN/Inf. Asynchronous.");
}

}  // namespace python
}  // namespace mlp_offload
