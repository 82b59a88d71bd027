// Python bindings of the io layer: the tier bandwidth probe (used by
// `mlp-offload probe` and the engine's tier setup) and the io_uring check.
#include <cstdint>
#include <string>
#include <vector>

#include "io/bandwidth_probe.h"
#include "io/io_engine.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

namespace mlp_offload {
namespace python {
namespace py = pybind11;

namespace {

ProbeOptions MakeProbeOptions(uint64_t bytes, size_t block_size,
                              unsigned queue_depth) {
  ProbeOptions options;
  options.bytes = bytes;
  options.block_size = block_size;
  options.queue_depth = queue_depth;
  return options;
}

}  // namespace

void RegisterIoBindings(py::module_& m) {
  m.def(
      "probe_bandwidth",
      [](const std::vector<std::string>& dirs, uint64_t bytes,
         size_t block_size, unsigned queue_depth) {
        const ProbeOptions options =
            MakeProbeOptions(bytes, block_size, queue_depth);
        absl::StatusOr<std::vector<PathBandwidth>> result;
        {
          // Seconds of disk I/O: let other Python threads run meanwhile.
          py::gil_scoped_release release;
          result = ProbeBandwidth(dirs, options);
        }
        std::vector<PathBandwidth> paths = ValueOrThrow(std::move(result));
        py::list out;
        for (const PathBandwidth& p : paths) {
          py::dict d;
          d["dir"] = p.dir;
          d["device"] = p.device;
          d["direct"] = p.direct;
          d["direct_fallback_reason"] = p.direct_fallback_reason;
          d["write_alone"] = p.write_alone;
          d["read_alone"] = p.read_alone;
          d["write_together"] = p.write_together;
          d["read_together"] = p.read_together;
          d["shares_device_with"] = p.shares_device_with;
          out.append(std::move(d));
        }
        return out;
      },
      py::arg("dirs"), py::arg("bytes") = uint64_t{256} << 20,
      py::arg("block_size") = size_t{1} << 20, py::arg("queue_depth") = 32u,
      "Measures O_DIRECT sequential write then read bandwidth (bytes/s) of "
      "each "
      "directory alone and all together; returns one dict per directory with "
      "write_alone, read_alone, write_together, read_together, direct, "
      "direct_fallback_reason, device and shares_device_with.");

  m.def(
      "probe_concurrency",
      [](const std::string& dir, int streams, uint64_t bytes, size_t block_size,
         unsigned queue_depth) {
        const ProbeOptions options =
            MakeProbeOptions(bytes, block_size, queue_depth);
        absl::StatusOr<ConcurrencyBandwidth> result;
        {
          py::gil_scoped_release release;
          result = ProbeConcurrency(dir, streams, options);
        }
        ConcurrencyBandwidth r = ValueOrThrow(std::move(result));
        py::dict d;
        d["dir"] = r.dir;
        d["streams"] = r.streams;
        d["one"] = r.one;
        d["many"] = r.many;
        d["contention"] = r.contention;
        return d;
      },
      py::arg("dir"), py::arg("streams"),
      py::arg("bytes") = uint64_t{256} << 20,
      py::arg("block_size") = size_t{1} << 20, py::arg("queue_depth") = 32u,
      "How the directory's device serves `streams` processes at once, each "
      "reading one file while writing another: a dict with one and many "
      "(bytes/s read plus written, one engine alone and `streams` at once) "
      "and contention (c with many = one / (1 + c (streams - 1))).");

  m.def(
      "io_uring_available",
      []() {
        std::string reason;
        const bool ok = IoUringAvailable(&reason);
        return py::make_tuple(ok, reason);
      },
      "(available, reason): whether the io_uring engine can be used here, and "
      "if not, why.");
}

}  // namespace python
}  // namespace mlp_offload
