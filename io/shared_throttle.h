// A bandwidth cap shared by every engine, in any process, that opens the same
// state file: it emulates one storage device used by several processes (the
// ranks of a node sharing a tier, as in the paper), optionally one that loses
// bandwidth when several of them stream at once.
#ifndef MLP_OFFLOAD_IO_SHARED_THROTTLE_H_
#define MLP_OFFLOAD_IO_SHARED_THROTTLE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "io/io_engine.h"

namespace mlp_offload {

struct SharedThrottleOptions {
  // The file that holds the device's clocks (created 0600 if missing, never
  // through a symlink). Every engine opened on the same file shares the caps.
  std::string state_path;
  // Caps of the whole device, bytes/s, per direction; <= 0: no cap.
  double read_bytes_per_sec = 0;
  double write_bytes_per_sec = 0;
  // With k engines that have I/O outstanding at once, the device delivers
  // cap / (1 + contention * (k - 1)) in total: 0 models a device that shares
  // its bandwidth among streams without loss, > 0 one that thrashes under
  // concurrent streams (seeks, a parallel file system's lock traffic, an
  // SSD's mixed streams). Must be >= 0.
  double contention = 0;
  // One clock for both directions: a device that reads or writes, not both
  // at once (a read of n bytes and a write of m take n / read cap + m /
  // write cap together). false: each direction has its cap to itself (a
  // full-duplex device). Every engine sharing the file should say the same.
  bool half_duplex = false;
  // How long a request waits for the state file's lock, which another
  // process holds only for a read and a write of 32 bytes: a holder that is
  // stopped (SIGSTOP) or hung in I/O fails the waiting request with
  // DeadlineExceeded naming the file once this has passed. Infinite: no
  // limit. Must be > 0.
  absl::Duration lock_timeout = absl::InfiniteDuration();
};

// Wraps `inner` so that its requests are cut into 1 MiB pieces and released
// at the shared, contention-adjusted rate (the virtual scheduling of
// MakeThrottledEngine, with its clock in the shared file). Submit waits for
// nothing but the file's lock, which each piece holds for a read and a write
// of 32 bytes (keep the file on a local file system: the engine puts it
// beside its node-local tier locks). Fails, naming the file, if the state file
// cannot be created, opened or written (a full disk), or is not a throttle
// state file; InvalidArgument for a negative contention or a lock_timeout that
// is not positive. The file is read and
// written under flock, never mapped: if it is truncated or overwritten while in
// use, the requests that need it fail with Unavailable naming it.
//
// An engine counts as streaming from its first outstanding request to its
// last completion. A process killed while streaming leaves its count in the
// file; use a fresh state file per run (the benchmarks do).
absl::StatusOr<std::unique_ptr<IoEngine>> MakeSharedThrottledEngine(
    std::unique_ptr<IoEngine> inner, const SharedThrottleOptions& options);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_SHARED_THROTTLE_H_
