// Factories of the concrete engines; CreateIoEngine picks one.
#ifndef MLP_OFFLOAD_IO_INTERNAL_ENGINES_H_
#define MLP_OFFLOAD_IO_INTERNAL_ENGINES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "io/io_engine.h"

namespace mlp_offload {
namespace internal_io {

// Unavailable (with the reason) when the ring cannot be set up. Both:
// ResourceExhausted (StartThread's) when a thread cannot be started.
absl::StatusOr<std::unique_ptr<IoEngine>> CreateUringEngine(
    const IoEngineOptions& options);
absl::StatusOr<std::unique_ptr<IoEngine>> CreateThreadPoolEngine(
    const IoEngineOptions& options);

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_ENGINES_H_
