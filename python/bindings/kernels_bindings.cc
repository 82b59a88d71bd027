// Python bindings of the kernel layer, in the submodule mlp_offload._C.kernels.
// Tensors cross as integer data pointers (tensor.data_ptr()), element counts
// and dtype names, so no torch header is needed; the caller keeps the tensors
// alive and contiguous for the duration of the call. The GIL is released
// around every kernel call.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/memory_probe.h"
#include "kernels/optimizer_kernels.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/thread_pool.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/bindings/registry.h"
#include "python/bindings/status.h"

namespace mlp_offload {
namespace python {
namespace {

namespace py = pybind11;

// The pool for `num_threads` (nullptr for one thread). One per Python thread:
// ParallelFor is not reentrant, and calls from different Python threads run
// concurrently once the GIL is released.
ThreadPool* PoolFor(int num_threads) {
  constexpr int kMaxThreads = 1024;  // more is a typo, not a machine
  thread_local std::unique_ptr<ThreadPool> pool;
  if (num_threads > kMaxThreads) {
    throw py::value_error("num_threads " + std::to_string(num_threads) +
                          " is more than " + std::to_string(kMaxThreads));
  }
  if (num_threads <= 1) return nullptr;
  if (pool == nullptr || pool->num_threads() != num_threads) {
    pool = std::make_unique<ThreadPool>(num_threads);
    if (!pool->start_status().ok()) {
      const absl::Status status = pool->start_status();
      pool.reset();
      ThrowIfError(status);
    }
  }
  return pool.get();
}

template <typename T>
void* AsPointer(T address) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(address));
}

// A null address for a non-empty buffer is a ConfigError naming it, not a
// crash. (The kernels trust the rest: the caller's tensors hold n elements.)
void RequireAddress(absl::string_view what, uint64_t address, uint64_t n) {
  if (address == 0 && n > 0) {
    ThrowIfError(absl::InvalidArgumentError(
        absl::StrCat(what, ": null address for ", n, " elements")));
  }
}

template <typename T>
absl::StatusOr<T> CastField(absl::string_view key, const py::handle& value) {
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    return absl::InvalidArgumentError(
        absl::StrCat("hyperparameter ", key, " has the wrong type (",
                     std::string(py::str(py::type::of(value))), ")"));
  }
}

// Builds the hyperparameters from a dict with the keys of torch.optim's
// param groups ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
// "momentum", "dampening", "nesterov", "lr_decay",
// "initial_accumulator_value") plus "optimizer" (adam, adamw, sgd, adagrad,
// lion), "step", "beta1", "beta2" and "bias_correction". Unknown keys are an
// error, so a misspelt hyperparameter cannot be silently ignored.
absl::StatusOr<OptimizerHyperparams> HyperparamsFromDict(const py::dict& dict) {
  OptimizerHyperparams hp;
  for (const auto& item : dict) {
    const std::string key = py::str(item.first);
    const py::handle value = item.second;
    if (key == "optimizer" || key == "kind") {
      MLP_ASSIGN_OR_RETURN(const std::string name,
                           CastField<std::string>(key, value));
      MLP_ASSIGN_OR_RETURN(hp.kind, ParseOptimizerKind(name));
    } else if (key == "lr") {
      MLP_ASSIGN_OR_RETURN(hp.lr, CastField<double>(key, value));
    } else if (key == "weight_decay") {
      MLP_ASSIGN_OR_RETURN(hp.weight_decay, CastField<double>(key, value));
    } else if (key == "maximize") {
      MLP_ASSIGN_OR_RETURN(hp.maximize, CastField<bool>(key, value));
    } else if (key == "betas") {
      MLP_ASSIGN_OR_RETURN(const auto betas,
                           (CastField<std::pair<double, double>>(key, value)));
      hp.beta1 = betas.first;
      hp.beta2 = betas.second;
    } else if (key == "beta1") {
      MLP_ASSIGN_OR_RETURN(hp.beta1, CastField<double>(key, value));
    } else if (key == "beta2") {
      MLP_ASSIGN_OR_RETURN(hp.beta2, CastField<double>(key, value));
    } else if (key == "eps") {
      MLP_ASSIGN_OR_RETURN(hp.eps, CastField<double>(key, value));
    } else if (key == "amsgrad") {
      MLP_ASSIGN_OR_RETURN(hp.amsgrad, CastField<bool>(key, value));
    } else if (key == "bias_correction") {
      MLP_ASSIGN_OR_RETURN(hp.bias_correction, CastField<bool>(key, value));
    } else if (key == "momentum") {
      MLP_ASSIGN_OR_RETURN(hp.momentum, CastField<double>(key, value));
    } else if (key == "dampening") {
      MLP_ASSIGN_OR_RETURN(hp.dampening, CastField<double>(key, value));
    } else if (key == "nesterov") {
      MLP_ASSIGN_OR_RETURN(hp.nesterov, CastField<bool>(key, value));
    } else if (key == "lr_decay") {
      MLP_ASSIGN_OR_RETURN(hp.lr_decay, CastField<double>(key, value));
    } else if (key == "initial_accumulator_value") {
      MLP_ASSIGN_OR_RETURN(hp.initial_accumulator_value,
                           CastField<double>(key, value));
    } else if (key == "step") {
      MLP_ASSIGN_OR_RETURN(hp.step, CastField<int64_t>(key, value));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown optimizer hyperparameter \"", key, "\""));
    }
  }
  MLP_RETURN_IF_ERROR(ValidateHyperparams(hp));
  return hp;
}

std::vector<float*> StatePointers(const std::vector<uint64_t>& state) {
  std::vector<float*> pointers(3, nullptr);
  for (size_t k = 0; k < state.size() && k < 3; ++k) {
    pointers[k] = static_cast<float*>(AsPointer(state[k]));
  }
  return pointers;
}

absl::Status CheckStateCount(const OptimizerHyperparams& hp,
                             const std::vector<uint64_t>& state) {
  if (static_cast<int>(state.size()) != NumStateArrays(hp)) {
    return absl::InvalidArgumentError(absl::StrCat(
        OptimizerKindName(hp.kind), " with these hyperparameters keeps ",
        NumStateArrays(hp), " state arrays, got ", state.size()));
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterKernelBindings(pybind11::module_& m) {
  py::module_ k = m.def_submodule(
      "kernels",
      "SIMD optimizer kernels over raw buffers (pass tensor.data_ptr()).");

  k.def(
      "dtype_size",
      [](const std::string& dtype) {
        return DTypeSize(ValueOrThrow(ParseDType(dtype)));
      },
      py::arg("dtype"), "Bytes per element of a dtype name.");

  k.def(
      "state_array_names",
      [](const py::dict& hyperparams) {
        const OptimizerHyperparams hp =
            ValueOrThrow(HyperparamsFromDict(hyperparams));
        std::vector<std::string> names;
        for (int i = 0; i < NumStateArrays(hp); ++i) {
          names.emplace_back(StateArrayName(hp, i));
        }
        return names;
      },
      py::arg("hyperparams"),
      "torch state-dict keys of the fp32 state arrays the optimizer keeps, "
      "in the order apply_optimizer expects them.");

  k.def(
      "init_state",
      [](const py::dict& hyperparams, const std::vector<uint64_t>& state,
         uint64_t n, int num_threads) {
        const OptimizerHyperparams hp =
            ValueOrThrow(HyperparamsFromDict(hyperparams));
        ThrowIfError(CheckStateCount(hp, state));
        for (uint64_t address : state) RequireAddress("init_state", address, n);
        const std::vector<float*> pointers = StatePointers(state);
        float* const arrays[3] = {pointers[0], pointers[1], pointers[2]};
        // Before the GIL goes: a pool that cannot start raises.
        ThreadPool* const pool = PoolFor(num_threads);
        py::gil_scoped_release release;
        InitState(hp, arrays, n, pool);
      },
      py::arg("hyperparams"), py::arg("state"), py::arg("n"),
      py::arg("num_threads") = 1,
      "Fills the state arrays with their initial values.");

  k.def(
      "apply_optimizer",
      [](const py::dict& hyperparams, uint64_t param,
         const std::vector<uint64_t>& state, uint64_t grad,
         const std::string& grad_dtype, uint64_t n, uint64_t param_out,
         const std::string& param_out_dtype, float grad_scale,
         bool skip_if_nonfinite, int num_threads) {
        const OptimizerHyperparams hp =
            ValueOrThrow(HyperparamsFromDict(hyperparams));
        ThrowIfError(CheckStateCount(hp, state));
        UpdateSpans spans;
        spans.param = static_cast<float*>(AsPointer(param));
        const std::vector<float*> pointers = StatePointers(state);
        for (int i = 0; i < 3; ++i) spans.state[i] = pointers[i];
        spans.grad = AsPointer(grad);
        spans.grad_dtype = ValueOrThrow(ParseDType(grad_dtype));
        spans.param_out = AsPointer(param_out);
        spans.param_out_dtype = ValueOrThrow(ParseDType(param_out_dtype));
        spans.n = n;
        GradTransform transform;
        transform.grad_scale = grad_scale;
        transform.skip_if_nonfinite = skip_if_nonfinite;
        absl::StatusOr<UpdateResult> result;
        {
          // Before the GIL goes: a pool that cannot start raises.
          ThreadPool* const pool = PoolFor(num_threads);
          py::gil_scoped_release release;
          result = ApplyOptimizer(hp, spans, transform, pool);
        }
        const UpdateResult r = ValueOrThrow(std::move(result));
        py::dict out;
        out["nonfinite"] = r.nonfinite;
        out["skipped"] = r.skipped;
        return out;
      },
      py::arg("hyperparams"), py::arg("param"), py::arg("state"),
      py::arg("grad"), py::arg("grad_dtype"), py::arg("n"),
      py::arg("param_out") = 0, py::arg("param_out_dtype") = "float32",
      py::arg("grad_scale") = 1.0f, py::arg("skip_if_nonfinite") = false,
      py::arg("num_threads") = 1,
      "One fused optimizer update of n elements, in place on the fp32 param "
      "and state buffers; param_out (0: none) receives the new parameters in "
      "param_out_dtype. hyperparams must include 'step' (1-based, this update "
      "included). Returns {'nonfinite': bool, 'skipped': bool}.");

  k.def(
      "grad_stats",
      [](uint64_t grad, const std::string& dtype, uint64_t n, float grad_scale,
         int num_threads) {
        const DType parsed = ValueOrThrow(ParseDType(dtype));
        RequireAddress("grad_stats: grad", grad, n);
        GradStats stats;
        {
          // Before the GIL goes: a pool that cannot start raises.
          ThreadPool* const pool = PoolFor(num_threads);
          py::gil_scoped_release release;
          stats =
              ComputeGradStats(AsPointer(grad), parsed, n, grad_scale, pool);
        }
        return py::make_tuple(stats.nonfinite, stats.sum_squares);
      },
      py::arg("grad"), py::arg("dtype"), py::arg("n"),
      py::arg("grad_scale") = 1.0f, py::arg("num_threads") = 1,
      "(nonfinite, sum of squares of the scaled gradient).");

  k.def(
      "any_nonfinite",
      [](uint64_t grad, const std::string& dtype, uint64_t n, float grad_scale,
         int num_threads) {
        const DType parsed = ValueOrThrow(ParseDType(dtype));
        RequireAddress("any_nonfinite: grad", grad, n);
        ThreadPool* const pool = PoolFor(num_threads);
        py::gil_scoped_release release;
        return AnyNonfinite(AsPointer(grad), parsed, n, grad_scale, pool);
      },
      py::arg("grad"), py::arg("dtype"), py::arg("n"),
      py::arg("grad_scale") = 1.0f, py::arg("num_threads") = 1,
      "Whether any element of the scaled gradient is NaN or infinite "
      "(grad_stats's flag, in a cheaper pass).");

  k.def(
      "convert_to_float32",
      [](uint64_t src, const std::string& src_dtype, uint64_t dst, uint64_t n,
         int num_threads) {
        const DType parsed = ValueOrThrow(ParseDType(src_dtype));
        RequireAddress("convert_to_float32: src", src, n);
        RequireAddress("convert_to_float32: dst", dst, n);
        // Before the GIL goes: a pool that cannot start raises.
        ThreadPool* const pool = PoolFor(num_threads);
        py::gil_scoped_release release;
        ConvertToFloat32(AsPointer(src), parsed,
                         static_cast<float*>(AsPointer(dst)), n, pool);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("n"),
      py::arg("num_threads") = 1);

  k.def(
      "convert_from_float32",
      [](uint64_t src, uint64_t dst, const std::string& dst_dtype, uint64_t n,
         int num_threads) {
        const DType parsed = ValueOrThrow(ParseDType(dst_dtype));
        RequireAddress("convert_from_float32: src", src, n);
        RequireAddress("convert_from_float32: dst", dst, n);
        // Before the GIL goes: a pool that cannot start raises.
        ThreadPool* const pool = PoolFor(num_threads);
        py::gil_scoped_release release;
        ConvertFromFloat32(static_cast<const float*>(AsPointer(src)),
                           AsPointer(dst), parsed, n, pool);
      },
      py::arg("src"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"),
      py::arg("num_threads") = 1,
      "Round-to-nearest-even narrowing of fp32 values.");

  k.def(
      "measure_stream_bandwidth",
      [](int update_streams, size_t read_bytes, size_t write_bytes, size_t n,
         int repetitions, int num_threads) {
        StreamPattern pattern{update_streams, read_bytes, write_bytes};
        absl::StatusOr<double> gbps;
        {
          // Before the GIL goes: a pool that cannot start raises.
          ThreadPool* const pool = PoolFor(num_threads);
          py::gil_scoped_release release;
          gbps = MeasureStreamBandwidth(pattern, n, repetitions, pool);
        }
        return ValueOrThrow(std::move(gbps));
      },
      py::arg("update_streams"), py::arg("read_bytes"), py::arg("write_bytes"),
      py::arg("n"), py::arg("repetitions") = 5, py::arg("num_threads") = 1,
      "Best GB/s of a STREAM-like pass with the access pattern of an "
      "optimizer update (in-place fp32 streams, one read-only, one "
      "write-only).");
}

}  // namespace python
}  // namespace mlp_offload
