// The engine behind both bandwidth throttles (MakeThrottledEngine and
// MakeSharedThrottledEngine): requests are cut into 1 MiB pieces and each
// piece goes to the inner engine at the time a PaceClock gives it. The
// throttles differ only in their clocks (one engine's own, or one in a file
// shared by processes).
#ifndef MLP_OFFLOAD_IO_INTERNAL_PACED_ENGINE_H_
#define MLP_OFFLOAD_IO_INTERNAL_PACED_ENGINE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "io/io_engine.h"
#include "mlp_offload/base/clock.h"

namespace mlp_offload {
namespace internal_io {

// Pieces a paced engine releases one at a time: small enough that a cap holds
// over short windows, large enough to keep the inner engine efficient.
inline constexpr size_t kPaceChunk = 1 << 20;

class PaceClock {
 public:
  virtual ~PaceClock() = default;
  // Whether direction `op` is capped at all (if not, requests go straight
  // to the inner engine, whole).
  virtual bool Capped(IoOp op) const = 0;
  // Reserves device time for `bytes` in direction `op` and returns when the
  // piece may be released (monotonic). Thread-safe. An error (a clock kept
  // in a file that went away) fails the piece with it.
  virtual absl::StatusOr<MonoTime> Reserve(IoOp op, size_t bytes) = 0;
  // The engine was interrupted (IoEngine::SetInterrupted): the pieces it
  // had queued will never go to the device. A clock of one engine gives back
  // the time they reserved; the shared clock keeps it (other processes may
  // have reserved after them).
  virtual void Interrupted() {}
  // The engine goes from no request outstanding to one, and back.
  virtual void StreamStarts() {}
  virtual void StreamStops() {}
};

// `name` is the engine's name prefix: "<name>(<inner name>)". Submit waits
// for nothing but the clock's Reserve (a mutex; the shared clock's file lock
// too); Shutdown releases what is queued at its time and drains.
std::unique_ptr<IoEngine> MakePacedEngine(std::unique_ptr<IoEngine> inner,
                                          std::unique_ptr<PaceClock> clock,
                                          std::string name);

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_PACED_ENGINE_H_
