// An IoEngine wrapper that injects faults, for tests of error handling.
#ifndef MLP_OFFLOAD_IO_FAULT_INJECTION_H_
#define MLP_OFFLOAD_IO_FAULT_INJECTION_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "io/io_engine.h"

namespace mlp_offload {

struct FaultSpec {
  enum class Kind { kError, kShortTransfer, kDelay };
  Kind kind = Kind::kError;
  IoOp op = IoOp::kRead;
  // Which matching request (0-based, counted from when the fault was added)
  // is hit; -1: every matching request.
  int nth = 0;
  int error = 5;  // errno for kError (EIO)
  std::string path_substring;  // only requests whose path contains this
  absl::Duration delay = absl::ZeroDuration();  // for kDelay
};

class FaultInjectingEngine : public IoEngine {
 public:
  explicit FaultInjectingEngine(std::unique_ptr<IoEngine> inner);
  // Thread-safe; may be called while requests are in flight.
  void AddFault(const FaultSpec& fault);
  void ClearFaults();
  // Number of faults fired so far.
  int fired() const;
  // IoEngine:
  std::string name() const override;
  void Submit(const IoRequest& request, IoCallback done) override;
  void Shutdown() override;
  using IoEngine::Submit;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Caps an engine's read and write bandwidth (bytes/s; <= 0: no cap) with a
// token bucket, to emulate a slower tier on a fast disk.
std::unique_ptr<IoEngine> MakeThrottledEngine(std::unique_ptr<IoEngine> inner,
                                              double read_bytes_per_sec,
                                              double write_bytes_per_sec);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_FAULT_INJECTION_H_
