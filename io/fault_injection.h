// An IoEngine wrapper that injects faults, for tests of error handling.
#ifndef MLP_OFFLOAD_IO_FAULT_INJECTION_H_
#define MLP_OFFLOAD_IO_FAULT_INJECTION_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "io/io_engine.h"

namespace mlp_offload {

// What a fault does to the request it hits:
// - kError: the request fails with ErrnoStatus(error) naming the operation
//   ("read (injected)"), the path and the offset; nothing is transferred.
// - kShortTransfer: only the first half of the request (rounded down to
//   kDirectIoAlignment for O_DIRECT files) is transferred by the inner engine,
//   then the request fails with DataLoss naming the operation, path, offset
//   and the byte counts: a transfer cut short that could not be completed. It
//   never completes OK with fewer bytes.
// - kDelay: the request reaches the inner engine `delay` later (the
//   submitting thread is not blocked).
struct FaultSpec {
  enum class Kind { kError, kShortTransfer, kDelay };
  Kind kind = Kind::kError;
  IoOp op = IoOp::kRead;
  // Which matching request (0-based, counted from when the fault was added)
  // is hit; -1: every matching request.
  int nth = 0;
  int error = 5;               // errno for kError (EIO)
  std::string path_substring;  // only requests whose path contains this
  absl::Duration delay = absl::ZeroDuration();  // for kDelay
  // A fault of a caller's fdatasync of a file (SyncFault), not of a
  // request (`op` is ignored); kError only.
  bool sync = false;
};

class FaultInjectingEngine : public IoEngine {
 public:
  explicit FaultInjectingEngine(std::unique_ptr<IoEngine> inner);
  ~FaultInjectingEngine() override;  // Shutdown()
  // Thread-safe; may be called while requests are in flight.
  void AddFault(const FaultSpec& fault);
  void ClearFaults();
  // Number of faults fired so far.
  int fired() const;
  // For a caller about to fdatasync `file`: the injected error of a sync
  // fault that hits it, else OK. Nothing is synced when it fails: as on
  // Linux after a writeback error, the file's next fdatasync succeeds
  // although what was written before it may not have reached the disk.
  absl::Status SyncFault(const File& file);
  // IoEngine:
  std::string name() const override;
  void Submit(const IoRequest& request, IoCallback done) override;
  void Shutdown() override;
  absl::Status RegisterBuffers(absl::Span<const iovec> buffers) override;
  void SetInterrupted(bool interrupted) override;  // the inner engine's
  using IoEngine::Submit;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Caps an engine's read and write bandwidth (bytes/s; <= 0: no cap) with a
// token bucket, to emulate a slower tier on a fast disk. Requests are cut into
// 1 MiB pieces released to `inner` at the capped rate (no burst allowance, so
// the cap holds over any window longer than a piece), from a timer thread:
// Submit never blocks. Each direction has its cap to itself (a full-duplex
// device), unless `half_duplex`: then reads and writes take turns on one
// clock (a read of n bytes and a write of m take n / read cap + m / write
// cap together, as on a device that does one at a time).
std::unique_ptr<IoEngine> MakeThrottledEngine(std::unique_ptr<IoEngine> inner,
                                              double read_bytes_per_sec,
                                              double write_bytes_per_sec,
                                              bool half_duplex = false);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_FAULT_INJECTION_H_
